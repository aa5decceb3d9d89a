#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "tessel/core/bf16.hpp"
#include "tessel/core/error.hpp"
#include "tessel/core/rng.hpp"
#include "tessel/core/tensor.hpp"

using namespace tessel;

TEST(Tensor, ZeroFilledAlignedStorage) {
  Tensor t({3, 5});
  EXPECT_EQ(t.numel(), 15);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(t.raw()) % Storage::kAlignment, 0u);
  for (int i = 0; i < 15; ++i) EXPECT_EQ(t.f32()[i], 0.0f);
}

TEST(Tensor, SliceAndReshapeAreViews) {
  Tensor t({4, 3});
  for (int i = 0; i < 12; ++i) t.f32()[i] = float(i);
  Tensor s = t.slice(1, 3);
  EXPECT_EQ(s.shape(), (Shape{2, 3}));
  EXPECT_EQ(s.f32()[0], 3.0f);
  s.f32()[0] = -1.0f;
  EXPECT_EQ(t.f32()[3], -1.0f);
  EXPECT_TRUE(s.shares_storage(t));
  Tensor r = t.reshape({12});
  EXPECT_EQ(r.f32()[3], -1.0f);
  EXPECT_THROW(t.reshape({5}), Error);
  EXPECT_THROW(t.slice(2, 5), Error);
}

TEST(Tensor, DtypeIsChecked) {
  Tensor t({2}, DType::i32);
  EXPECT_THROW(t.f32(), Error);
  EXPECT_NO_THROW(t.i32());
}

TEST(Tensor, CheckNamesFileAndLine) {
  try {
    TESSEL_CHECK(1 == 2, "value ", 7);
    FAIL();
  } catch (const Error& e) {
    std::string what = e.what();
    EXPECT_NE(what.find("test_tensor.cpp:"), std::string::npos) << what;
    EXPECT_NE(what.find("value 7"), std::string::npos) << what;
  }
}

TEST(Bf16, RoundTripAndRoundToNearestEven) {
  // Every bf16 pattern that is not NaN converts to f32 and back unchanged.
  for (uint32_t b = 0; b < 65536; ++b) {
    float f = bf16_to_f32(uint16_t(b));
    if (std::isnan(f)) {
      EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(f))));
      continue;
    }
    EXPECT_EQ(f32_to_bf16(f), uint16_t(b));
  }
  // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 0x1.0p-8f)), 1.0f);
  // 1 + 3*2^-8 is halfway between 1 + 2^-7 and 1 + 2^-6: rounds up to the even one.
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.0f + 3 * 0x1.0p-8f)), 1.0f + 0x1.0p-6f);
  Tensor t({3});
  t.f32()[0] = 1.5f;
  t.f32()[1] = -2.0f;
  t.f32()[2] = 3.140625f;
  Tensor back = t.to(DType::bf16).to(DType::f32);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(back.f32()[i], t.f32()[i]);
}

TEST(Rng, DeterministicAndCopyable) {
  Rng a(42), b(42), c(43);
  EXPECT_EQ(a.next_u64(), b.next_u64());
  EXPECT_NE(a.next_u64(), c.next_u64());
  Rng copy = a;  // the copy continues the same stream
  const float x = a.normal();
  EXPECT_EQ(copy.normal(), x);
}

TEST(Rng, NormalMoments) {
  Rng r(7);
  const int n = 200000;
  double sum = 0, sq = 0;
  for (int i = 0; i < n; ++i) {
    double x = r.normal();
    sum += x;
    sq += x * x;
  }
  // Standard error of the mean is 1/sqrt(n) ~ 0.0022; allow 5 sigma.
  EXPECT_NEAR(sum / n, 0.0, 0.011);
  EXPECT_NEAR(sq / n, 1.0, 0.02);
  for (int i = 0; i < 1000; ++i) {
    uint64_t v = r.below(7);
    EXPECT_LT(v, 7u);
  }
}
