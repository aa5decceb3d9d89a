#pragma once
// GEMM through OpenBLAS, row-major: C[M,N] = alpha * op(A) * op(B) + beta * C,
// op(A) is [M,K], op(B) is [K,N]. A is stored [M,K] (lda >= K) when !trans_a and
// [K,M] (lda >= M) when trans_a; likewise B.
#include <cstdint>

namespace tessel::kernels {

void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const float* A,
          int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc);

// Linear layer y = x W^T (+ b): x [N, in], W [out, in], b [out] or null, y [N, out].
void linear_forward(float* y, const float* x, const float* W, const float* b, int64_t N, int64_t in,
                    int64_t out);
// Adds dx += dy W, dW += dy^T x, db += sum_n dy (db may be null): linear_backward_input,
// then linear_backward_weights (the halves a split backward runs apart, e.g. ZB-H1's B and W).
void linear_backward(float* dx, float* dW, float* db, const float* dy, const float* x,
                     const float* W, int64_t N, int64_t in, int64_t out);
void linear_backward_input(float* dx, const float* dy, const float* W, int64_t N, int64_t in,
                           int64_t out);
void linear_backward_weights(float* dW, float* db, const float* dy, const float* x, int64_t N,
                             int64_t in, int64_t out);

// dst [cols, rows] = src [rows, cols] transposed, exactly (OpenBLAS's cache-blocked somatcopy:
// a plain double loop strides its stores by a whole row and was 15-30x slower at 768 x 256
// to 3072 x 768). src and dst must not overlap.
void transpose(const float* src, int64_t rows, int64_t cols, float* dst);

namespace naive {
template <class T>
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
          int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc);
template <class T>
void linear_forward(T* y, const T* x, const T* W, const T* b, int64_t N, int64_t in, int64_t out);
template <class T>
void linear_backward(T* dx, T* dW, T* db, const T* dy, const T* x, const T* W, int64_t N,
                     int64_t in, int64_t out);
}  // namespace naive

}  // namespace tessel::kernels
