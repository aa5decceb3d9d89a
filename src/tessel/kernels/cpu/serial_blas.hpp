#pragma once
// Single-threaded OpenBLAS for use on the OpenMP pool. The OpenBLAS here is the pthreads
// build: its own worker pool and the OpenMP pool would compete for the same cores (each
// spins while the other works), so every kernel runs OpenBLAS with one thread per caller.
#include <cstdint>

namespace tessel::kernels::detail {

// Sets OpenBLAS to one thread if something (e.g. tessel::set_num_threads) raised it.
// Call outside parallel regions, before sgemm_serial.
void use_serial_blas();

// Row-major cblas_sgemm (see gemm.hpp for the argument convention); sizes must be > 0.
void sgemm_serial(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                  const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C,
                  int64_t ldc);

}  // namespace tessel::kernels::detail
