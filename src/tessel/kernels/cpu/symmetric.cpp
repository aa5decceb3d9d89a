#include "tessel/kernels/cpu/symmetric.hpp"

#include <algorithm>

#include "tessel/core/error.hpp"
#include "tessel/kernels/cpu/blas.hpp"
#include "tessel/kernels/cpu/gemm.hpp"

namespace tessel::kernels {

void mirror_lower(int64_t n, float* C) {
#pragma omp parallel for schedule(static) if (n >= 256)
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < i; ++j) C[j * n + i] = C[i * n + j];
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
