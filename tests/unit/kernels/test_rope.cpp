#include <gtest/gtest.h>

#include "kernel_test_util.hpp"
#include "tessel/kernels/cpu/rope.hpp"

using namespace tessel;
using namespace tessel::kernels;
using namespace tessel::kernels::test;

namespace {
std::vector<int32_t> random_positions(Rng& rng, int64_t N) {
  std::vector<int32_t> pos(N);
  for (int32_t& p : pos) p = int32_t(rng.below(2048));
  return pos;
}
constexpr float kTheta = 10000.0f;
}  // namespace

// The fixed shapes, then random ones with N <= 40, H <= 4, D even <= 64.
TEST(Rope, FastMatchesNaive) {
  for (auto [N, H, D] : with_random({{1, 1, 2}, {13, 3, 8}, {40, 4, 64}}, [](Rng& rng) {
         return std::tuple{uniform_int(rng, 1, 40), uniform_int(rng, 1, 4),
                           2 * uniform_int(rng, 1, 32)};
       })) {
    SCOPED_TRACE(::testing::Message() << "N=" << N << " H=" << H << " D=" << D);
    Rng rng(1);
    const std::vector<int32_t> pos = random_positions(rng, N);
    VecF x = randn(rng, N * H * D), dy = randn(rng, N * H * D), dx0 = randn(rng, N * H * D);
    VecD xd = to_f64(x), dyd = to_f64(dy);
    VecF y(x.size()), dx = dx0;
    VecD yd(x.size()), dxd = to_f64(dx0);
    rope_forward(y.data(), x.data(), pos.data(), N, H, D, kTheta);
    naive::rope_forward<double>(yd.data(), xd.data(), pos.data(), N, H, D, kTheta);
    EXPECT_LT(rel_error(y, yd), kFastVsNaive);
    VecF inplace = x;  // y may equal x
    rope_forward(inplace.data(), inplace.data(), pos.data(), N, H, D, kTheta);
    EXPECT_TRUE(bitwise_equal(inplace, y));
    rope_backward(dx.data(), dy.data(), pos.data(), N, H, D, kTheta);
    naive::rope_backward<double>(dxd.data(), dyd.data(), pos.data(), N, H, D, kTheta);
    EXPECT_LT(rel_error(added(dx, dx0), added(dxd, to_f64(dx0))), kFastVsNaive);
  }
}

// N = 3, H = 2, D = 6, then random shapes with N <= 4, H <= 3, D even <= 8.
TEST(Rope, NaiveBackwardMatchesFiniteDifferences) {
  for (auto [N, H, D] : with_random({{3, 2, 6}}, [](Rng& rng) {
         return std::tuple{uniform_int(rng, 1, 4), uniform_int(rng, 1, 3),
                           2 * uniform_int(rng, 1, 4)};
       })) {
    SCOPED_TRACE(::testing::Message() << "N=" << N << " H=" << H << " D=" << D);
    Rng rng(2);
    const std::vector<int32_t> pos = random_positions(rng, N);
    VecD x = to_f64(randn(rng, N * H * D));
    const VecD r = to_f64(randn(rng, N * H * D));
    const auto loss = [&] {
      VecD y(x.size());
      naive::rope_forward<double>(y.data(), x.data(), pos.data(), N, H, D, kTheta);
      return dot(r, y);
    };
    VecD dx(x.size(), 0.0);
    naive::rope_backward<double>(dx.data(), r.data(), pos.data(), N, H, D, kTheta);
    EXPECT_LT(rel_error(dx, numeric_grad(x, loss)), kFiniteDiff);
  }
}

TEST(Rope, PositionZeroIsIdentity) {
  const int64_t H = 2, D = 8;
  Rng rng(3);
  VecF x = randn(rng, H * D), y(H * D);
  const int32_t pos = 0;
  rope_forward(y.data(), x.data(), &pos, 1, H, D, kTheta);
  EXPECT_TRUE(bitwise_equal(x, y));
}
