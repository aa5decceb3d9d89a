#pragma once
// Products with a symmetric result, computing one triangle and mirroring it (the result is
// exactly symmetric). All matrices are row-major with leading dimension = their column count.
//
//   syrk:               C[n,n] = alpha * A A^T + beta * C           A [n,k]
//                       (R^2 of a symmetric R is syrk(R): R R^T = R R)
//   commuting_product:  C[n,n] = alpha * A B + beta * C             A, B [n,n] symmetric
//                       and commuting (A B = B A), so A B is symmetric
//
// syrk is one OpenBLAS SYRK call (half the flops of the GEMM A A^T). commuting_product is a
// blocked kernel: for each tile-row panel i of `kSymmetricTile` rows it computes only the
// lower tiles C[i, 0..i] with one GEMM (K = n), about half the flops of the full product;
// below two tiles it is one full GEMM (then mirrored too). With beta != 0, C must be symmetric on
// entry. Both call `gemm`/SYRK outside any parallel region (the whole OpenMP pool); results are
// deterministic for a fixed thread count.
#include <cstdint>

namespace tessel::kernels {

inline constexpr int64_t kSymmetricTile = 256;  // at n = 2048, 256 beat 128, 512 and 1024

void syrk(int64_t n, int64_t k, float alpha, const float* A, float beta, float* C);
void commuting_product(int64_t n, float alpha, const float* A, const float* B, float beta,
                       float* C);
// Copies the strict lower triangle of C [n,n] onto the upper one.
void mirror_lower(int64_t n, float* C);

namespace naive {
// The full products, term by term (the naive twins: no triangle, no mirroring).
template <class T>
void syrk(int64_t n, int64_t k, T alpha, const T* A, T beta, T* C);
template <class T>
void commuting_product(int64_t n, T alpha, const T* A, const T* B, T beta, T* C);
}  // namespace naive

}  // namespace tessel::kernels
