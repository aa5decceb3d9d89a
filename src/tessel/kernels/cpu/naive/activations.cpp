#include "tessel/kernels/cpu/activations.hpp"

#include <cmath>

namespace tessel::kernels::naive {

namespace {
template <class T>
T gelu_inner(T x) {  // u(x) = sqrt(2/pi) (x + 0.044715 x^3)
  return std::sqrt(T(2) / T(M_PI)) * (x + T(0.044715) * x * x * x);
}
template <class T>
T sigmoid(T g) {
  return T(1) / (T(1) + std::exp(-g));
}
}  // namespace

template <class T>
void gelu_forward(T* y, const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) y[i] = T(0.5) * x[i] * (T(1) + std::tanh(gelu_inner(x[i])));
}

// d/dx [0.5 x (1 + tanh u)] = 0.5 (1 + tanh u) + 0.5 x (1 - tanh^2 u) u'(x).
template <class T>
void gelu_backward(T* dx, const T* dy, const T* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const T t = std::tanh(gelu_inner(x[i]));
    const T du = std::sqrt(T(2) / T(M_PI)) * (T(1) + T(3) * T(0.044715) * x[i] * x[i]);
    dx[i] += dy[i] * (T(0.5) * (T(1) + t) + T(0.5) * x[i] * (T(1) - t * t) * du);
  }
}

template <class T>
void swiglu_forward(T* y, const T* x, int64_t N, int64_t H) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < H; ++i) {
      const T g = x[n * 2 * H + i], u = x[n * 2 * H + H + i];
      y[n * H + i] = g * sigmoid(g) * u;
    }
}

// d/dg [g sigmoid(g)] = sigmoid(g) + g sigmoid(g) (1 - sigmoid(g)).
template <class T>
void swiglu_backward(T* dx, const T* dy, const T* x, int64_t N, int64_t H) {
  for (int64_t n = 0; n < N; ++n)
    for (int64_t i = 0; i < H; ++i) {
      const T g = x[n * 2 * H + i], u = x[n * 2 * H + H + i];
      const T s = sigmoid(g);
      dx[n * 2 * H + i] += dy[n * H + i] * u * (s + g * s * (T(1) - s));
      dx[n * 2 * H + H + i] += dy[n * H + i] * g * s;
    }
}

#define TESSEL_INSTANTIATE(T)                                      \
  template void gelu_forward<T>(T*, const T*, int64_t);            \
  template void gelu_backward<T>(T*, const T*, const T*, int64_t); \
  template void swiglu_forward<T>(T*, const T*, int64_t, int64_t); \
  template void swiglu_backward<T>(T*, const T*, const T*, int64_t, int64_t);
TESSEL_INSTANTIATE(float)
TESSEL_INSTANTIATE(double)
#undef TESSEL_INSTANTIATE

}  // namespace tessel::kernels::naive
