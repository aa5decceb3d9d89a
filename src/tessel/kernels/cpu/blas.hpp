#pragma once
// The calls into OpenBLAS (GEMM and SYRK). tessel links OpenBLAS's OpenMP build, so BLAS threads
// are tessel's OpenMP threads (no second pool competing for the cores): outside a parallel region a
// call uses the whole pool, inside one (e.g. per attention block) it runs single-threaded on the
// calling thread.
#include <cstdint>

namespace tessel::kernels::detail {

// Row-major cblas_sgemm (see gemm.hpp for the argument convention); sizes must be > 0. One row
// (M = 1) runs as cblas_sgemv.
void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
           int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// Row-major cblas_ssyrk, lower triangle, no transpose: C[N,N] = alpha * A A^T + beta * C with
// A [N,K] (lda >= K); only the lower triangle of C (diagonal included) is read and written.
// Sizes must be > 0.
void ssyrk_lower(int64_t N, int64_t K, float alpha, const float* A, int64_t lda, float beta,
                 float* C, int64_t ldc);

}  // namespace tessel::kernels::detail
