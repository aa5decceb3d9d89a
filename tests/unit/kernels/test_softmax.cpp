#include <gtest/gtest.h>

#include "kernel_test_util.hpp"
#include "tessel/kernels/cpu/softmax.hpp"

using namespace tessel;
using namespace tessel::kernels;
using namespace tessel::kernels::test;

// The fixed shapes, then random ones with N <= 40, C <= 150.
TEST(Softmax, FastMatchesNaive) {
  for (auto [N, C] : with_random({{1, 7}, {5, 1}, {33, 130}}, [](Rng& rng) {
         return std::pair{uniform_int(rng, 1, 40), uniform_int(rng, 1, 150)};
       })) {
    SCOPED_TRACE(::testing::Message() << "N=" << N << " C=" << C);
    Rng rng(1);
    VecF x = randn(rng, N * C, 3.0f), dy = randn(rng, N * C), dx0 = randn(rng, N * C);
    x[0] += 80.0f;  // large logits must not overflow (max subtraction)
    VecD xd = to_f64(x), dyd = to_f64(dy);
    VecF y(N * C);
    VecD yd(N * C);
    softmax_forward(y.data(), x.data(), N, C);
    naive::softmax_forward(yd.data(), xd.data(), N, C);
    EXPECT_LT(rel_error(y, yd), kFastVsNaive);

    VecF dx = dx0;
    VecD dxd = to_f64(dx0);
    softmax_backward(dx.data(), dy.data(), y.data(), N, C);
    naive::softmax_backward(dxd.data(), dyd.data(), yd.data(), N, C);
    EXPECT_LT(rel_error(added(dx, dx0), added(dxd, to_f64(dx0))), kFastVsNaive);
  }
}

// N = 3, C = 7, then random shapes with N <= 4, C <= 10.
TEST(Softmax, NaiveBackwardMatchesFiniteDifferences) {
  for (auto [N, C] : with_random({{3, 7}}, [](Rng& rng) {
         return std::pair{uniform_int(rng, 1, 4), uniform_int(rng, 1, 10)};
       })) {
    SCOPED_TRACE(::testing::Message() << "N=" << N << " C=" << C);
    Rng rng(2);
    VecD x = to_f64(randn(rng, N * C));
    const VecD r = to_f64(randn(rng, N * C));
    VecD y(N * C);
    const auto loss = [&] {
      naive::softmax_forward(y.data(), x.data(), N, C);
      return dot(r, y);
    };
    loss();
    VecD dx(N * C, 0.0);
    naive::softmax_backward(dx.data(), r.data(), y.data(), N, C);
    EXPECT_LT(rel_error(dx, numeric_grad(x, loss)), kFiniteDiff);
  }
}

TEST(Softmax, BackwardIsDeterministic) {
  const int64_t N = 64, C = 257;
  Rng rng(3);
  VecF x = randn(rng, N * C), dy = randn(rng, N * C), y(N * C);
  softmax_forward(y.data(), x.data(), N, C);
  VecF dx[2];
  for (VecF& d : dx) {
    d.assign(N * C, 0.0f);
    softmax_backward(d.data(), dy.data(), y.data(), N, C);
  }
  EXPECT_TRUE(bitwise_equal(dx[0], dx[1]));
}
