#include "tessel/kernels/cpu/symmetric.hpp"

#include "tessel/kernels/cpu/gemm.hpp"

namespace tessel::kernels::naive {

template <class T>
void syrk(int64_t n, int64_t k, T alpha, const T* A, T beta, T* C) {
  gemm<T>(false, true, n, n, k, alpha, A, k, A, k, beta, C, n);
}

template <class T>
void commuting_product(int64_t n, T alpha, const T* A, const T* B, T beta, T* C) {
  gemm<T>(false, false, n, n, n, alpha, A, n, B, n, beta, C, n);
}

#define TESSEL_INSTANTIATE(T)                                  \
  template void syrk<T>(int64_t, int64_t, T, const T*, T, T*); \
  template void commuting_product<T>(int64_t, T, const T*, const T*, T, T*);
TESSEL_INSTANTIATE(float)
TESSEL_INSTANTIATE(double)
#undef TESSEL_INSTANTIATE

}  // namespace tessel::kernels::naive
