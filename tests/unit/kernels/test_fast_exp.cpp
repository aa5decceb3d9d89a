#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "tessel/kernels/cpu/fast_exp.hpp"

using tessel::kernels::detail::fast_expf;

// Within 2 ulp of the correctly rounded f32 exp over the finite normal range (2^20
// evenly spaced points) and for tiny arguments, and the documented special values.
TEST(FastExp, WithinTwoUlpOfExp) {
  const auto check = [](float x) {
    const float want = float(std::exp(double(x)));
    const float ulp = std::nextafter(want, INFINITY) - want;
    ASSERT_LE(std::abs(fast_expf(x) - want), 2.0f * ulp) << "x=" << x;
  };
  constexpr int kPoints = 1 << 20;
  for (int i = 0; i <= kPoints; ++i) check(-87.0f + 175.7f * float(i) / float(kPoints));
  for (int e = -40; e <= 0; ++e) {
    check(std::ldexp(1.3f, e));
    check(-std::ldexp(1.3f, e));
  }
}

TEST(FastExp, SpecialValues) {
  EXPECT_EQ(fast_expf(0.0f), 1.0f);
  EXPECT_EQ(fast_expf(-INFINITY), 0.0f);
  EXPECT_EQ(fast_expf(-200.0f), 0.0f);
  EXPECT_EQ(fast_expf(INFINITY), INFINITY);
  EXPECT_EQ(fast_expf(100.0f), INFINITY);
  EXPECT_TRUE(std::isnan(fast_expf(NAN)));
  // Subnormal results are kept, not flushed (to within one subnormal step).
  EXPECT_NEAR(fast_expf(-100.0f), std::exp(-100.0), std::numeric_limits<float>::denorm_min());
}
