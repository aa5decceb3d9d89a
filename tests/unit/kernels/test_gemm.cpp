#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "kernel_test_util.hpp"
#include "tessel/core/threading.hpp"
#include "tessel/kernels/cpu/gemm.hpp"
#include "tessel/kernels/cpu/gemm_peak.hpp"

using namespace tessel;
using namespace tessel::kernels;
using namespace tessel::kernels::test;

namespace {

struct GemmCase {
  bool ta, tb;
  int64_t M, N, K;
  float alpha, beta;
};

// Fast sgemm vs naive f64 gemm with padded leading dimensions (lda, ldb, ldc larger than the
// rows), so reading or writing outside the logical matrices shows up as a mismatch.
void check_gemm(const GemmCase& c) {
  SCOPED_TRACE(::testing::Message() << "ta=" << c.ta << " tb=" << c.tb << " M=" << c.M
                                    << " N=" << c.N << " K=" << c.K << " beta=" << c.beta);
  Rng rng(11);
  const int64_t a_rows = c.ta ? c.K : c.M, a_cols = c.ta ? c.M : c.K;
  const int64_t b_rows = c.tb ? c.N : c.K, b_cols = c.tb ? c.K : c.N;
  const int64_t lda = a_cols + 3, ldb = b_cols + 2, ldc = c.N + 5;
  VecF A = randn(rng, size_t(a_rows * lda)), B = randn(rng, size_t(b_rows * ldb));
  VecF C = randn(rng, size_t(c.M * ldc));
  VecD Cd = to_f64(C);
  if (c.beta == 0.0f) {  // beta = 0 must not read C: NaN in C must not leak into the result
    for (int64_t i = 0; i < c.M; ++i)
      for (int64_t j = 0; j < c.N; ++j) C[i * ldc + j] = Cd[i * ldc + j] = std::nan("");
  }
  const VecD Ad = to_f64(A), Bd = to_f64(B);
  gemm(c.ta, c.tb, c.M, c.N, c.K, c.alpha, A.data(), lda, B.data(), ldb, c.beta, C.data(), ldc);
  naive::gemm<double>(c.ta, c.tb, c.M, c.N, c.K, c.alpha, Ad.data(), lda, Bd.data(), ldb, c.beta,
                      Cd.data(), ldc);
  // Covers the padding columns too: both start equal there and must stay so.
  EXPECT_LT(rel_error(C, Cd), kFastVsNaive);
}

// M, N, K in [1, 100], alpha in [-2, 2), beta in {0, 1, 0.3}.
GemmCase random_gemm(Rng& rng, bool ta, bool tb) {
  const int64_t M = uniform_int(rng, 1, 100), N = uniform_int(rng, 1, 100);
  const int64_t K = uniform_int(rng, 1, 100);
  const float alpha = 4.0f * rng.uniform() - 2.0f;
  const float betas[] = {0.0f, 1.0f, 0.3f};
  return {ta, tb, M, N, K, alpha, betas[rng.below(3)]};
}

}  // namespace

// The fixed cases (the last two large enough for OpenBLAS to use several threads), then
// random ones.
TEST(Gemm, AllTransposeCasesWithLeadingDimensions) {
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (const GemmCase& c : with_random({{ta, tb, 7, 5, 9, 0.7f, 0.3f},
                                            {ta, tb, 1, 13, 4, 1.0f, 0.0f},
                                            {ta, tb, 1, 768, 256, -0.5f, 0.3f},  // gemv
                                            {ta, tb, 1, 8, 4096, 1.0f, 0.0f},    // long sums
                                            {ta, tb, 33, 1, 17, -1.5f, 1.0f},
                                            {ta, tb, 64, 48, 70, 1.0f, 0.0f},
                                            {ta, tb, 97, 130, 66, 0.5f, 1.0f},
                                            {ta, tb, 150, 41, 90, 1.0f, 0.0f}},
                                           [&](Rng& rng) { return random_gemm(rng, ta, tb); }))
        check_gemm(c);
}

TEST(Gemm, ZeroInnerDimensionScalesC) {
  VecF C = {1, 2, 3, 4, 5, 6};
  gemm(false, false, 2, 3, 0, 1.0f, nullptr, 0, nullptr, 3, 0.5f, C.data(), 3);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(C[i], 0.5f * float(i + 1));
}

// Every element lands at its transposed place, bitwise (NaN and signed zero included: a copy,
// not arithmetic), for shapes around OpenBLAS's blocking, one row or column, and empty ones.
TEST(Transpose, EqualsTheDefinitionBitwise) {
  for (auto [rows, cols] : std::vector<std::pair<int64_t, int64_t>>{
           {1, 1}, {1, 9}, {9, 1}, {3, 5}, {37, 53}, {256, 1024}, {1024, 256}, {0, 4}, {4, 0}}) {
    SCOPED_TRACE(::testing::Message() << rows << " x " << cols);
    Rng rng(uint64_t(rows * 1000 + cols));
    VecF src = randn(rng, rows * cols);
    if (!src.empty()) src[0] = -0.0f, src.back() = std::numeric_limits<float>::quiet_NaN();
    VecF dst(src.size(), 7.0f);
    transpose(src.data(), rows, cols, dst.data());
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j)
        ASSERT_EQ(std::bit_cast<uint32_t>(dst[size_t(j * rows + i)]),
                  std::bit_cast<uint32_t>(src[size_t(i * cols + j)]))
            << i << ", " << j;
  }
}

namespace {
struct LinearCase {
  int64_t N, in, out;
  bool bias;
};
}  // namespace

// The fixed cases, then random ones with N <= 50, in, out <= 80, with or without bias.
TEST(Linear, FastMatchesNaiveForwardAndBackward) {
  for (const LinearCase& c :
       with_random({{1, 7, 5, true}, {13, 16, 9, false}, {40, 33, 70, true}}, [](Rng& rng) {
         const int64_t N = uniform_int(rng, 1, 50), in = uniform_int(rng, 1, 80);
         return LinearCase{N, in, uniform_int(rng, 1, 80), rng.below(2) == 1};
       })) {
    SCOPED_TRACE(::testing::Message() << "N=" << c.N << " in=" << c.in << " out=" << c.out);
    Rng rng(3);
    VecF x = randn(rng, c.N * c.in), W = randn(rng, c.out * c.in), b = randn(rng, c.out);
    VecF dy = randn(rng, c.N * c.out);
    VecF dx0 = randn(rng, c.N * c.in), dW0 = randn(rng, c.out * c.in), db0 = randn(rng, c.out);
    const float* bp = c.bias ? b.data() : nullptr;
    VecD xd = to_f64(x), Wd = to_f64(W), bd = to_f64(b), dyd = to_f64(dy);
    const double* bdp = c.bias ? bd.data() : nullptr;

    VecF y(c.N * c.out);
    VecD yd(y.size());
    linear_forward(y.data(), x.data(), W.data(), bp, c.N, c.in, c.out);
    naive::linear_forward(yd.data(), xd.data(), Wd.data(), bdp, c.N, c.in, c.out);
    EXPECT_LT(rel_error(y, yd), kFastVsNaive);

    VecF dx = dx0, dW = dW0, db = db0;
    VecD dxd = to_f64(dx0), dWd = to_f64(dW0), dbd = to_f64(db0);
    linear_backward(dx.data(), dW.data(), c.bias ? db.data() : nullptr, dy.data(), x.data(),
                    W.data(), c.N, c.in, c.out);
    naive::linear_backward(dxd.data(), dWd.data(), c.bias ? dbd.data() : nullptr, dyd.data(),
                           xd.data(), Wd.data(), c.N, c.in, c.out);
    EXPECT_LT(rel_error(added(dx, dx0), added(dxd, to_f64(dx0))), kFastVsNaive);
    EXPECT_LT(rel_error(added(dW, dW0), added(dWd, to_f64(dW0))), kFastVsNaive);
    EXPECT_LT(rel_error(added(db, db0), added(dbd, to_f64(db0))), kFastVsNaive);
    if (!c.bias) {
      EXPECT_TRUE(bitwise_equal(db, db0));
    }
  }
}

// N = 3, in = 5, out = 4 with bias, then random cases with N <= 4, in <= 6, out <= 5.
TEST(Linear, NaiveBackwardMatchesFiniteDifferences) {
  for (const LinearCase& c : with_random({{3, 5, 4, true}}, [](Rng& rng) {
         const int64_t N = uniform_int(rng, 1, 4), in = uniform_int(rng, 1, 6);
         return LinearCase{N, in, uniform_int(rng, 1, 5), rng.below(2) == 1};
       })) {
    SCOPED_TRACE(::testing::Message() << "N=" << c.N << " in=" << c.in << " out=" << c.out);
    const int64_t N = c.N, in = c.in, out = c.out;
    Rng rng(5);
    VecD x = to_f64(randn(rng, N * in)), W = to_f64(randn(rng, out * in)),
         b = to_f64(randn(rng, out));
    const double* bp = c.bias ? b.data() : nullptr;
    const VecD r = to_f64(randn(rng, N * out));  // loss = r . y
    const auto loss = [&] {
      VecD y(N * out);
      naive::linear_forward(y.data(), x.data(), W.data(), bp, N, in, out);
      return dot(r, y);
    };
    VecD dx(N * in, 0.0), dW(out * in, 0.0), db(out, 0.0);
    naive::linear_backward(dx.data(), dW.data(), c.bias ? db.data() : nullptr, r.data(), x.data(),
                           W.data(), N, in, out);
    EXPECT_LT(rel_error(dx, numeric_grad(x, loss)), kFiniteDiff);
    EXPECT_LT(rel_error(dW, numeric_grad(W, loss)), kFiniteDiff);
    if (c.bias) {
      EXPECT_LT(rel_error(db, numeric_grad(b, loss)), kFiniteDiff);
    }
  }
}

TEST(Linear, BackwardIsDeterministic) {
  const int64_t N = 96, in = 80, out = 130;
  Rng rng(8);
  VecF x = randn(rng, N * in), W = randn(rng, out * in), dy = randn(rng, N * out);
  VecF dx[2], dW[2], db[2];
  for (int run = 0; run < 2; ++run) {
    dx[run].assign(N * in, 0.0f);
    dW[run].assign(out * in, 0.0f);
    db[run].assign(out, 0.0f);
    linear_backward(dx[run].data(), dW[run].data(), db[run].data(), dy.data(), x.data(), W.data(),
                    N, in, out);
  }
  EXPECT_TRUE(bitwise_equal(dx[0], dx[1]));
  EXPECT_TRUE(bitwise_equal(dW[0], dW[1]));
  EXPECT_TRUE(bitwise_equal(db[0], db[1]));
}

TEST(GemmPeak, ReturnsAPositiveRate) {
  const double gflops = measure_gemm_peak_gflops(64, 0.01);
  EXPECT_GT(gflops, 0.0);
  EXPECT_TRUE(std::isfinite(gflops));
}

// A BLAS call must not change tessel's thread count (an OpenBLAS thread setting in the
// OpenMP build resets OpenMP's, which once left every kernel single-threaded).
TEST(Gemm, LeavesTheThreadCountAsSet) {
  const int before = tessel::num_threads();
  tessel::set_num_threads(2);
  VecF A(size_t(128 * 128), 1.0f), B(size_t(128 * 128), 1.0f), C(size_t(128 * 128), 0.0f);
  gemm(false, false, 128, 128, 128, 1.0f, A.data(), 128, B.data(), 128, 0.0f, C.data(), 128);
  EXPECT_EQ(C[0], 128.0f);
  EXPECT_EQ(tessel::num_threads(), 2);
  tessel::set_num_threads(before);
}
