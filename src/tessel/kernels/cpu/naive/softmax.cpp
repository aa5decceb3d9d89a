#include "tessel/kernels/cpu/softmax.hpp"

#include <algorithm>
#include <cmath>

namespace tessel::kernels::naive {

template <class T>
void softmax_forward(T* y, const T* x, int64_t N, int64_t C) {
  for (int64_t n = 0; n < N; ++n) {
    const T m = *std::max_element(x + n * C, x + (n + 1) * C);
    T sum = 0;
    for (int64_t j = 0; j < C; ++j) sum += std::exp(x[n * C + j] - m);
    for (int64_t j = 0; j < C; ++j) y[n * C + j] = std::exp(x[n * C + j] - m) / sum;
  }
}

// Full Jacobian: dy_i/dx_j = y_i (delta_ij - y_j).
template <class T>
void softmax_backward(T* dx, const T* dy, const T* y, int64_t N, int64_t C) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < C; ++j)
      for (int64_t i = 0; i < C; ++i)
        dx[n * C + j] += dy[n * C + i] * y[n * C + i] * ((i == j ? T(1) : T(0)) - y[n * C + j]);
}

#define TESSEL_INSTANTIATE(T)                                       \
  template void softmax_forward<T>(T*, const T*, int64_t, int64_t); \
  template void softmax_backward<T>(T*, const T*, const T*, int64_t, int64_t);
TESSEL_INSTANTIATE(float)
TESSEL_INSTANTIATE(double)
#undef TESSEL_INSTANTIATE

}  // namespace tessel::kernels::naive
