#include "tessel/kernels/cpu/gemm.hpp"

#include <cblas.h>

#include <algorithm>

#include "tessel/core/error.hpp"
#include "tessel/kernels/cpu/blas.hpp"
#include "tessel/kernels/cpu/column_sums.hpp"

namespace tessel::kernels {

namespace detail {

void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
           int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  if (M == 1) {
    // One row (a decoding step's linear layers): a matrix-vector product. sgemm would first
    // pack all of B, which costs more than the product itself. C is zeroed for beta = 0 so
    // that no NaN in it survives (BLAS need not skip reading y then).
    if (beta == 0.0f) std::fill(C, C + N, 0.0f);
    const int64_t inc_a = trans_a ? lda : 1;
    if (trans_b)  // C = alpha B a + beta C, B [N, K]
      cblas_sgemv(CblasRowMajor, CblasNoTrans, int(N), int(K), alpha, B, int(ldb), A, int(inc_a),
                  beta, C, 1);
    else  // C = alpha B^T a + beta C, B [K, N]
      cblas_sgemv(CblasRowMajor, CblasTrans, int(K), int(N), alpha, B, int(ldb), A, int(inc_a),
                  beta, C, 1);
    return;
  }
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, int(M), int(N), int(K), alpha, A, int(lda), B,
              int(ldb), beta, C, int(ldc));
}

void ssyrk_lower(int64_t N, int64_t K, float alpha, const float* A, int64_t lda, float beta,
                 float* C, int64_t ldc) {
  cblas_ssyrk(CblasRowMajor, CblasLower, CblasNoTrans, int(N), int(K), alpha, A, int(lda), beta, C,
              int(ldc));
}

}  // namespace detail

void transpose(const float* src, int64_t rows, int64_t cols, float* dst) {
  constexpr int64_t kMaxInt = 0x7fffffff;
  TESSEL_CHECK(rows >= 0 && cols >= 0 && rows <= kMaxInt && cols <= kMaxInt, "transpose sizes ",
               rows, "x", cols);
  if (rows == 0 || cols == 0) return;
  cblas_somatcopy(CblasRowMajor, CblasTrans, int(rows), int(cols), 1.0f, src, int(cols), dst,
                  int(rows));
}

// OpenBLAS is its OpenMP build (see CMakeLists.txt): called here, outside any parallel
// region, it splits the product over tessel's OpenMP threads; its partition depends only
// on the sizes and the thread count, so results are deterministic for a fixed count.
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
          int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  TESSEL_CHECK(M >= 0 && N >= 0 && K >= 0, "gemm sizes ", M, "x", N, "x", K);
  TESSEL_CHECK(lda >= (trans_a ? M : K) && ldb >= (trans_b ? K : N) && ldc >= N,
               "gemm leading dimensions lda=", lda, " ldb=", ldb, " ldc=", ldc);
  if (M == 0 || N == 0) return;
  if (K == 0) {  // C = beta * C; BLAS rejects the zero leading dimensions this case allows
    for (int64_t i = 0; i < M; ++i)
      for (int64_t j = 0; j < N; ++j) C[i * ldc + j] = beta == 0.0f ? 0.0f : beta * C[i * ldc + j];
    return;
  }
  detail::sgemm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
}

void linear_forward(float* y, const float* x, const float* W, const float* b, int64_t N, int64_t in,
                    int64_t out) {
  if (b) {  // y = b broadcast, then y += x W^T
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) std::copy(b, b + out, y + n * out);
  }
  gemm(false, true, N, out, in, 1.0f, x, in, W, in, b ? 1.0f : 0.0f, y, out);
}

void linear_backward(float* dx, float* dW, float* db, const float* dy, const float* x,
                     const float* W, int64_t N, int64_t in, int64_t out) {
  linear_backward_input(dx, dy, W, N, in, out);
  linear_backward_weights(dW, db, dy, x, N, in, out);
}

void linear_backward_input(float* dx, const float* dy, const float* W, int64_t N, int64_t in,
                           int64_t out) {
  gemm(false, false, N, in, out, 1.0f, dy, out, W, in, 1.0f, dx, in);
}

void linear_backward_weights(float* dW, float* db, const float* dy, const float* x, int64_t N,
                             int64_t in, int64_t out) {
  gemm(true, false, out, in, N, 1.0f, dy, out, x, in, 1.0f, dW, in);
  if (db)
    detail::add_column_sums(db, N, out, [=](int64_t n, int64_t j) { return dy[n * out + j]; });
}

}  // namespace tessel::kernels
