#include "tessel/kernels/cpu/gemm.hpp"

#include <cblas.h>
#include <omp.h>

#include <algorithm>

#include "tessel/core/error.hpp"
#include "tessel/kernels/cpu/column_sums.hpp"
#include "tessel/kernels/cpu/serial_blas.hpp"

namespace tessel::kernels {

namespace detail {

void use_serial_blas() {
  if (openblas_get_num_threads() != 1) openblas_set_num_threads(1);
}

void sgemm_serial(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                  const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                  int64_t ldc) {
  cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
              trans_b ? CblasTrans : CblasNoTrans, int(M), int(N), int(K), alpha, A, int(lda), B,
              int(ldb), beta, C, int(ldc));
}

}  // namespace detail

namespace {

// Below this many multiply-adds per thread, waking another thread costs more than it saves.
constexpr int64_t kMinWorkPerThread = int64_t(1) << 18;
// Column/row blocks of C handed to threads are multiples of this (whole micro-kernel tiles).
constexpr int64_t kBlockAlign = 16;

}  // namespace

// OpenBLAS runs single-threaded (serial_blas.hpp says why) and the OpenMP threads each
// compute one block of C, split along its larger dimension. The split depends only on the
// sizes and the thread count, so results are deterministic for a fixed thread count.
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
  detail::use_serial_blas();
  const bool split_n = N >= M;
  const int64_t dim = split_n ? N : M;
  int64_t threads = omp_in_parallel() ? 1 : omp_get_max_threads();
  threads = std::min({threads, M * N * K / kMinWorkPerThread, dim / kBlockAlign});
  if (threads <= 1) {
    detail::sgemm_serial(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, beta, C, ldc);
    return;
  }
  const int64_t block =
      ((dim + threads - 1) / threads + kBlockAlign - 1) / kBlockAlign * kBlockAlign;
#pragma omp parallel num_threads(int(threads))
  {
    const int64_t lo = std::min(dim, omp_get_thread_num() * block);
    const int64_t hi = std::min(dim, lo + block);
    if (hi > lo && split_n)
      detail::sgemm_serial(trans_a, trans_b, M, hi - lo, K, alpha, A, lda,
                           trans_b ? B + lo * ldb : B + lo, ldb, beta, C + lo, ldc);
    else if (hi > lo)
      detail::sgemm_serial(trans_a, trans_b, hi - lo, N, K, alpha, trans_a ? A + lo : A + lo * lda,
                           lda, B, ldb, beta, C + lo * ldc, ldc);
  }
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
  gemm(false, false, N, in, out, 1.0f, dy, out, W, in, 1.0f, dx, in);
  gemm(true, false, out, in, N, 1.0f, dy, out, x, in, 1.0f, dW, in);
  if (db)
    detail::add_column_sums(db, N, out, [=](int64_t n, int64_t j) { return dy[n * out + j]; });
}

}  // namespace tessel::kernels
