#include <gtest/gtest.h>

#include "kernel_test_util.hpp"
#include "tessel/kernels/cpu/activations.hpp"

using namespace tessel;
using namespace tessel::kernels;
using namespace tessel::kernels::test;

// The fixed sizes, then random ones up to 2000.
TEST(Gelu, FastMatchesNaive) {
  for (int64_t n : with_random({1, 7, 1000}, [](Rng& rng) { return uniform_int(rng, 1, 2000); })) {
    SCOPED_TRACE(::testing::Message() << "n=" << n);
    Rng rng(1);
    VecF x = randn(rng, n, 3.0f), dy = randn(rng, n), dx0 = randn(rng, n);
    x[0] = -30.0f;  // deep in the tail, where exp(-2u) overflows to inf
    VecD xd = to_f64(x), dyd = to_f64(dy);
    VecF y(n), dx = dx0;
    VecD yd(n), dxd = to_f64(dx0);
    gelu_forward(y.data(), x.data(), n);
    naive::gelu_forward(yd.data(), xd.data(), n);
    EXPECT_LT(rel_error(y, yd), kFastVsNaive);
    gelu_backward(dx.data(), dy.data(), x.data(), n);
    naive::gelu_backward(dxd.data(), dyd.data(), xd.data(), n);
    EXPECT_LT(rel_error(added(dx, dx0), added(dxd, to_f64(dx0))), kFastVsNaive);
  }
}

// n = 11, then random sizes up to 30.
TEST(Gelu, NaiveBackwardMatchesFiniteDifferences) {
  for (int64_t n : with_random({11}, [](Rng& rng) { return uniform_int(rng, 1, 30); })) {
    SCOPED_TRACE(::testing::Message() << "n=" << n);
    Rng rng(2);
    VecD x = to_f64(randn(rng, n, 2.0f));
    const VecD r = to_f64(randn(rng, n));
    const auto loss = [&] {
      VecD y(n);
      naive::gelu_forward(y.data(), x.data(), n);
      return dot(r, y);
    };
    VecD dx(n, 0.0);
    naive::gelu_backward(dx.data(), r.data(), x.data(), n);
    EXPECT_LT(rel_error(dx, numeric_grad(x, loss)), kFiniteDiff);
  }
}

// The fixed shapes, then random ones with N <= 40, H <= 100.
TEST(SwiGlu, FastMatchesNaive) {
  for (auto [N, H] : with_random({{1, 7}, {13, 1}, {40, 96}}, [](Rng& rng) {
         return std::pair{uniform_int(rng, 1, 40), uniform_int(rng, 1, 100)};
       })) {
    SCOPED_TRACE(::testing::Message() << "N=" << N << " H=" << H);
    Rng rng(3);
    VecF x = randn(rng, N * 2 * H, 3.0f), dy = randn(rng, N * H), dx0 = randn(rng, N * 2 * H);
    VecD xd = to_f64(x), dyd = to_f64(dy);
    VecF y(N * H), dx = dx0;
    VecD yd(N * H), dxd = to_f64(dx0);
    swiglu_forward(y.data(), x.data(), N, H);
    naive::swiglu_forward(yd.data(), xd.data(), N, H);
    EXPECT_LT(rel_error(y, yd), kFastVsNaive);
    swiglu_backward(dx.data(), dy.data(), x.data(), N, H);
    naive::swiglu_backward(dxd.data(), dyd.data(), xd.data(), N, H);
    EXPECT_LT(rel_error(added(dx, dx0), added(dxd, to_f64(dx0))), kFastVsNaive);
  }
}

// N = 3, H = 5, then random shapes with N <= 4, H <= 8.
TEST(SwiGlu, NaiveBackwardMatchesFiniteDifferences) {
  for (auto [N, H] : with_random({{3, 5}}, [](Rng& rng) {
         return std::pair{uniform_int(rng, 1, 4), uniform_int(rng, 1, 8)};
       })) {
    SCOPED_TRACE(::testing::Message() << "N=" << N << " H=" << H);
    Rng rng(4);
    VecD x = to_f64(randn(rng, N * 2 * H, 2.0f));
    const VecD r = to_f64(randn(rng, N * H));
    const auto loss = [&] {
      VecD y(N * H);
      naive::swiglu_forward(y.data(), x.data(), N, H);
      return dot(r, y);
    };
    VecD dx(N * 2 * H, 0.0);
    naive::swiglu_backward(dx.data(), r.data(), x.data(), N, H);
    EXPECT_LT(rel_error(dx, numeric_grad(x, loss)), kFiniteDiff);
  }
}

TEST(Activations, BackwardIsDeterministic) {
  const int64_t N = 64, H = 200;
  Rng rng(5);
  VecF x = randn(rng, N * 2 * H), dy = randn(rng, N * 2 * H);
  VecF dx[2];
  for (VecF& d : dx) {
    d.assign(N * 2 * H, 0.0f);
    gelu_backward(d.data(), dy.data(), x.data(), N * 2 * H);
    swiglu_backward(d.data(), dy.data(), x.data(), N, H);
  }
  EXPECT_TRUE(bitwise_equal(dx[0], dx[1]));
}
