#include "tessel/kernels/cpu/symmetric.hpp"

#include <algorithm>

#include "tessel/core/error.hpp"
#include "tessel/kernels/cpu/blas.hpp"
#include "tessel/kernels/cpu/gemm.hpp"

namespace tessel::kernels {

// Blocked: each 64 x 64 tile below the diagonal is transposed through a small contiguous
// buffer, so both the reads and the writes of C run along rows. A direct strided write
// (C[j * n + i]) touches one cache line per row of the tile, and at power-of-two n those
// lines map to the same L1 sets and evict each other; the buffer avoids that.
void mirror_lower(int64_t n, float* C) {
  constexpr int64_t kB = 64;
  const int64_t tiles = (n + kB - 1) / kB;
#pragma omp parallel for schedule(dynamic) if (n >= 512)
  for (int64_t bi = 0; bi < tiles; ++bi) {
    float buf[kB * kB];
    const int64_t i0 = bi * kB, i1 = std::min(n, i0 + kB), h = i1 - i0;
    for (int64_t j0 = 0; j0 < i0; j0 += kB) {
      for (int64_t i = 0; i < h; ++i) {
        const float* src = C + (i0 + i) * n + j0;
        for (int64_t j = 0; j < kB; ++j) buf[j * kB + i] = src[j];
      }
      for (int64_t j = 0; j < kB; ++j)
        std::copy(buf + j * kB, buf + j * kB + h, C + (j0 + j) * n + i0);
    }
    for (int64_t i = i0; i < i1; ++i) {
      for (int64_t j = i0; j < i; ++j) C[j * n + i] = C[i * n + j];
    }
  }
}

void syrk(int64_t n, int64_t k, float alpha, const float* A, float beta, float* C) {
  TESSEL_CHECK(n >= 0 && k >= 0, "syrk sizes ", n, "x", k);
  if (n == 0) return;
  if (k == 0) {
    for (int64_t i = 0; i < n * n; ++i) C[i] = beta == 0.0f ? 0.0f : beta * C[i];
    return;
  }
  detail::ssyrk_lower(n, k, alpha, A, k, beta, C, n);
  mirror_lower(n, C);
}

void commuting_product(int64_t n, float alpha, const float* A, const float* B, float beta,
                       float* C) {
  TESSEL_CHECK(n >= 0, "commuting_product size ", n);
  if (n < 2 * kSymmetricTile) {
    gemm(false, false, n, n, n, alpha, A, n, B, n, beta, C, n);
  } else {
    // Panel i: rows [r0, r1) of C, columns [0, r1): A[r0:r1, :] * B[:, 0:r1].
    for (int64_t r0 = 0; r0 < n; r0 += kSymmetricTile) {
      const int64_t r1 = std::min(n, r0 + kSymmetricTile);
      gemm(false, false, r1 - r0, r1, n, alpha, A + r0 * n, n, B, n, beta, C + r0 * n, n);
    }
  }
  mirror_lower(n, C);
}

}  // namespace tessel::kernels
