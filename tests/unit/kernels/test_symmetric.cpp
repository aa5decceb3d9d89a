#include <gtest/gtest.h>

#include "kernel_test_util.hpp"
#include "tessel/kernels/cpu/gemm.hpp"
#include "tessel/kernels/cpu/symmetric.hpp"

namespace tessel::kernels {
namespace {

using test::randn;
using test::rel_error;
using test::to_f64;
using test::VecD;
using test::VecF;

// Fast f32 against the naive f64 full product: summation in f32 over k terms.
constexpr double kTol = 1e-5;

bool exactly_symmetric(const VecF& C, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < i; ++j)
      if (C[i * n + j] != C[j * n + i]) return false;
  return true;
}

// A symmetric matrix and a polynomial in it (which commutes with it), from one random M.
void commuting_pair(Rng& rng, int64_t n, VecF& A, VecF& B) {
  VecF M = randn(rng, size_t(n * n), 1.0f / float(n));
  A.assign(size_t(n * n), 0.0f);
  naive::syrk<float>(n, n, 1.0f, M.data(), 0.0f, A.data());  // A = M M^T
  B.assign(size_t(n * n), 0.0f);
  naive::syrk<float>(n, n, 1.0f, A.data(), 0.0f, B.data());  // B = A^2
  for (int64_t i = 0; i < n * n; ++i) B[i] = 0.5f * B[i] - 2.0f * A[i];
}

TEST(Symmetric, SyrkMatchesGemm) {
  Rng rng(1);
  for (auto [n, k] :
       {std::pair<int64_t, int64_t>{1, 1}, {7, 3}, {64, 200}, {300, 130}, {517, 40}}) {
    SCOPED_TRACE(testing::Message() << n << "x" << k);
    VecF A = randn(rng, size_t(n * k));
    VecF C = randn(rng, size_t(n * n));
    for (int64_t i = 0; i < n; ++i)  // beta != 0 needs a symmetric C
      for (int64_t j = 0; j < i; ++j) C[j * n + i] = C[i * n + j];
    VecD want = to_f64(C), Ad = to_f64(A);
    naive::syrk<double>(n, k, 0.5, Ad.data(), 2.0, want.data());
    VecF via_gemm = C;
    gemm(false, true, n, n, k, 0.5f, A.data(), k, A.data(), k, 2.0f, via_gemm.data(), n);
    syrk(n, k, 0.5f, A.data(), 2.0f, C.data());
    EXPECT_LT(rel_error(C, want), kTol);
    EXPECT_LT(rel_error(via_gemm, want), kTol);
    EXPECT_TRUE(exactly_symmetric(C, n));
  }
}

TEST(Symmetric, CommutingProductMatchesGemm) {
  Rng rng(2);
  // Below 2 tiles one GEMM; above, the lower-tile panels (ragged last tile at 300 and 517).
  for (int64_t n : {1, 5, 255, 256, 300, 517}) {
    SCOPED_TRACE(testing::Message() << "n=" << n);
    VecF A, B;
    commuting_pair(rng, n, A, B);
    VecD want(size_t(n * n), 0.0), Ad = to_f64(A), Bd = to_f64(B);
    naive::commuting_product<double>(n, 1.5, Ad.data(), Bd.data(), 0.0, want.data());
    VecF C(size_t(n * n), 0.0f);
    commuting_product(n, 1.5f, A.data(), B.data(), 0.0f, C.data());
    EXPECT_LT(rel_error(C, want), kTol);
    EXPECT_TRUE(exactly_symmetric(C, n));
    // beta = 1 accumulates onto a symmetric C.
    VecD want2 = want;
    naive::commuting_product<double>(n, 1.0, Ad.data(), Bd.data(), 1.0, want2.data());
    commuting_product(n, 1.0f, A.data(), B.data(), 1.0f, C.data());
    EXPECT_LT(rel_error(C, want2), kTol);
    EXPECT_TRUE(exactly_symmetric(C, n));
  }
}

}  // namespace
}  // namespace tessel::kernels
