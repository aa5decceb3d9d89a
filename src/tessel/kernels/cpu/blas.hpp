#pragma once
// The one call into OpenBLAS. tessel links OpenBLAS's OpenMP build, so BLAS threads are
// tessel's OpenMP threads (no second pool competing for the cores): outside a parallel
// region a call uses the whole pool, inside one (e.g. per attention block) it runs
// single-threaded on the calling thread.
#include <cstdint>

namespace tessel::kernels::detail {

// Row-major cblas_sgemm (see gemm.hpp for the argument convention); sizes must be > 0.
void sgemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
           int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

}  // namespace tessel::kernels::detail
