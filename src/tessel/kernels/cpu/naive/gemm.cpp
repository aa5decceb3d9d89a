#include "tessel/kernels/cpu/gemm.hpp"

namespace tessel::kernels::naive {

template <class T>
void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, T alpha, const T* A,
          int64_t lda, const T* B, int64_t ldb, T beta, T* C, int64_t ldc) {
  for (int64_t i = 0; i < M; ++i) {
    for (int64_t j = 0; j < N; ++j) {
      T acc = 0;
      for (int64_t p = 0; p < K; ++p) {
        const T a = trans_a ? A[p * lda + i] : A[i * lda + p];
        const T b = trans_b ? B[j * ldb + p] : B[p * ldb + j];
        acc += a * b;
      }
      // beta == 0 overwrites C without reading it, as BLAS does.
      C[i * ldc + j] = alpha * acc + (beta == T(0) ? T(0) : beta * C[i * ldc + j]);
    }
  }
}

template <class T>
void linear_forward(T* y, const T* x, const T* W, const T* b, int64_t N, int64_t in, int64_t out) {
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t o = 0; o < out; ++o) {
      T acc = b ? b[o] : T(0);
      for (int64_t i = 0; i < in; ++i) acc += x[n * in + i] * W[o * in + i];
      y[n * out + o] = acc;
    }
  }
}

template <class T>
void linear_backward(T* dx, T* dW, T* db, const T* dy, const T* x, const T* W, int64_t N,
                     int64_t in, int64_t out) {
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t o = 0; o < out; ++o) {
      const T g = dy[n * out + o];
      for (int64_t i = 0; i < in; ++i) {
        dx[n * in + i] += g * W[o * in + i];
        dW[o * in + i] += g * x[n * in + i];
      }
      if (db) db[o] += g;
    }
  }
}

#define TESSEL_INSTANTIATE(T)                                                                   \
  template void gemm<T>(bool, bool, int64_t, int64_t, int64_t, T, const T*, int64_t, const T*,  \
                        int64_t, T, T*, int64_t);                                               \
  template void linear_forward<T>(T*, const T*, const T*, const T*, int64_t, int64_t, int64_t); \
  template void linear_backward<T>(T*, T*, T*, const T*, const T*, const T*, int64_t, int64_t,  \
                                   int64_t);
TESSEL_INSTANTIATE(float)
TESSEL_INSTANTIATE(double)
#undef TESSEL_INSTANTIATE

}  // namespace tessel::kernels::naive
