#include <gtest/gtest.h>

#include "kernel_test_util.hpp"
#include "tessel/kernels/cpu/norms.hpp"

using namespace tessel;
using namespace tessel::kernels;
using namespace tessel::kernels::test;

namespace {
struct Shape2 {
  int64_t N, C;
};
// The fixed shapes, then random ones with N <= 40, C <= 150.
std::vector<Shape2> shapes() {
  return with_random({{1, 7}, {5, 13}, {37, 130}}, [](Rng& rng) {
    return Shape2{uniform_int(rng, 1, 40), uniform_int(rng, 1, 150)};
  });
}
// For finite differences in every coordinate: random ones with N <= 5, 2 <= C <= 12.
std::vector<Shape2> small_shapes() {
  return with_random({{1, 7}, {4, 9}}, [](Rng& rng) {
    return Shape2{uniform_int(rng, 1, 5), uniform_int(rng, 2, 12)};
  });
}
constexpr float kEps = 1e-5f;
}  // namespace

TEST(RmsNorm, FastMatchesNaive) {
  for (auto [N, C] : shapes()) {
    SCOPED_TRACE(::testing::Message() << "N=" << N << " C=" << C);
    Rng rng(1);
    VecF x = randn(rng, N * C), w = randn(rng, C), dy = randn(rng, N * C);
    VecF dx0 = randn(rng, N * C), dw0 = randn(rng, C);
    VecD xd = to_f64(x), wd = to_f64(w), dyd = to_f64(dy);
    VecF y(N * C), rstd(N);
    VecD yd(N * C), rstdd(N);
    rmsnorm_forward(y.data(), rstd.data(), x.data(), w.data(), N, C, kEps);
    naive::rmsnorm_forward<double>(yd.data(), rstdd.data(), xd.data(), wd.data(), N, C, kEps);
    EXPECT_LT(rel_error(y, yd), kFastVsNaive);
    EXPECT_LT(rel_error(rstd, rstdd), kFastVsNaive);

    VecF dx = dx0, dw = dw0;
    VecD dxd = to_f64(dx0), dwd = to_f64(dw0);
    rmsnorm_backward(dx.data(), dw.data(), dy.data(), x.data(), w.data(), rstd.data(), N, C);
    naive::rmsnorm_backward(dxd.data(), dwd.data(), dyd.data(), xd.data(), wd.data(), rstdd.data(),
                            N, C);
    EXPECT_LT(rel_error(added(dx, dx0), added(dxd, to_f64(dx0))), kFastVsNaive);
    EXPECT_LT(rel_error(added(dw, dw0), added(dwd, to_f64(dw0))), kFastVsNaive);
  }
}

TEST(RmsNorm, NaiveBackwardMatchesFiniteDifferences) {
  for (auto [N, C] : small_shapes()) {
    SCOPED_TRACE(::testing::Message() << "N=" << N << " C=" << C);
    Rng rng(2);
    VecD x = to_f64(randn(rng, N * C)), w = to_f64(randn(rng, C));
    const VecD r = to_f64(randn(rng, N * C));
    VecD y(N * C), rstd(N);
    const auto loss = [&] {
      naive::rmsnorm_forward<double>(y.data(), rstd.data(), x.data(), w.data(), N, C, kEps);
      return dot(r, y);
    };
    loss();
    VecD dx(N * C, 0.0), dw(C, 0.0);
    naive::rmsnorm_backward(dx.data(), dw.data(), r.data(), x.data(), w.data(), rstd.data(), N, C);
    EXPECT_LT(rel_error(dx, numeric_grad(x, loss)), kFiniteDiff);
    EXPECT_LT(rel_error(dw, numeric_grad(w, loss)), kFiniteDiff);
  }
}

TEST(LayerNorm, FastMatchesNaive) {
  for (auto [N, C] : shapes()) {
    SCOPED_TRACE(::testing::Message() << "N=" << N << " C=" << C);
    Rng rng(3);
    VecF x = randn(rng, N * C), w = randn(rng, C), b = randn(rng, C), dy = randn(rng, N * C);
    for (float& v : x) v += 3.0f;  // a mean far from zero exercises the two-pass variance
    VecF dx0 = randn(rng, N * C), dw0 = randn(rng, C), db0 = randn(rng, C);
    VecD xd = to_f64(x), wd = to_f64(w), bd = to_f64(b), dyd = to_f64(dy);
    VecF y(N * C), mean(N), rstd(N);
    VecD yd(N * C), meand(N), rstdd(N);
    layernorm_forward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C, kEps);
    naive::layernorm_forward<double>(yd.data(), meand.data(), rstdd.data(), xd.data(), wd.data(),
                                     bd.data(), N, C, kEps);
    EXPECT_LT(rel_error(y, yd), kFastVsNaive);
    EXPECT_LT(rel_error(mean, meand), kFastVsNaive);
    EXPECT_LT(rel_error(rstd, rstdd), kFastVsNaive);

    VecF dx = dx0, dw = dw0, db = db0;
    VecD dxd = to_f64(dx0), dwd = to_f64(dw0), dbd = to_f64(db0);
    layernorm_backward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(), mean.data(),
                       rstd.data(), N, C);
    naive::layernorm_backward(dxd.data(), dwd.data(), dbd.data(), dyd.data(), xd.data(), wd.data(),
                              meand.data(), rstdd.data(), N, C);
    EXPECT_LT(rel_error(added(dx, dx0), added(dxd, to_f64(dx0))), kFastVsNaive);
    EXPECT_LT(rel_error(added(dw, dw0), added(dwd, to_f64(dw0))), kFastVsNaive);
    EXPECT_LT(rel_error(added(db, db0), added(dbd, to_f64(db0))), kFastVsNaive);
  }
}

TEST(LayerNorm, NaiveBackwardMatchesFiniteDifferences) {
  for (auto [N, C] : small_shapes()) {
    SCOPED_TRACE(::testing::Message() << "N=" << N << " C=" << C);
    Rng rng(4);
    VecD x = to_f64(randn(rng, N * C)), w = to_f64(randn(rng, C)), b = to_f64(randn(rng, C));
    const VecD r = to_f64(randn(rng, N * C));
    VecD y(N * C), mean(N), rstd(N);
    const auto loss = [&] {
      naive::layernorm_forward<double>(y.data(), mean.data(), rstd.data(), x.data(), w.data(),
                                       b.data(), N, C, kEps);
      return dot(r, y);
    };
    loss();
    VecD dx(N * C, 0.0), dw(C, 0.0), db(C, 0.0);
    naive::layernorm_backward(dx.data(), dw.data(), db.data(), r.data(), x.data(), w.data(),
                              mean.data(), rstd.data(), N, C);
    EXPECT_LT(rel_error(dx, numeric_grad(x, loss)), kFiniteDiff);
    EXPECT_LT(rel_error(dw, numeric_grad(w, loss)), kFiniteDiff);
    EXPECT_LT(rel_error(db, numeric_grad(b, loss)), kFiniteDiff);
  }
}

TEST(Norms, BackwardIsDeterministic) {
  const int64_t N = 97, C = 300;
  Rng rng(5);
  VecF x = randn(rng, N * C), w = randn(rng, C), b = randn(rng, C), dy = randn(rng, N * C);
  VecF y(N * C), mean(N), rstd(N);
  VecF dx[2], dw[2], db[2];
  layernorm_forward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(), N, C, kEps);
  for (int run = 0; run < 2; ++run) {
    dx[run].assign(N * C, 0.0f);
    dw[run].assign(C, 0.0f);
    db[run].assign(C, 0.0f);
    layernorm_backward(dx[run].data(), dw[run].data(), db[run].data(), dy.data(), x.data(),
                       w.data(), mean.data(), rstd.data(), N, C);
    rmsnorm_backward(dx[run].data(), dw[run].data(), dy.data(), x.data(), w.data(), rstd.data(), N,
                     C);
  }
  EXPECT_TRUE(bitwise_equal(dx[0], dx[1]));
  EXPECT_TRUE(bitwise_equal(dw[0], dw[1]));
  EXPECT_TRUE(bitwise_equal(db[0], db[1]));
}
