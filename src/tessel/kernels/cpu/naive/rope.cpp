#include "tessel/kernels/cpu/rope.hpp"

#include <cmath>

namespace tessel::kernels::naive {

template <class T>
void rope_forward(T* y, const T* x, const int32_t* pos, int64_t N, int64_t H, int64_t D, T theta) {
  const int64_t half = D / 2;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < half; ++i) {
        const T angle = T(pos[n]) * std::pow(theta, -T(2 * i) / T(D));
        const T a = x[(n * H + h) * D + i], b = x[(n * H + h) * D + i + half];
        y[(n * H + h) * D + i] = a * std::cos(angle) - b * std::sin(angle);
        y[(n * H + h) * D + i + half] = a * std::sin(angle) + b * std::cos(angle);
      }
}

// The transpose of the rotation [[c, -s], [s, c]] is [[c, s], [-s, c]].
template <class T>
void rope_backward(T* dx, const T* dy, const int32_t* pos, int64_t N, int64_t H, int64_t D,
                   T theta) {
  const int64_t half = D / 2;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < half; ++i) {
        const T angle = T(pos[n]) * std::pow(theta, -T(2 * i) / T(D));
        const T a = dy[(n * H + h) * D + i], b = dy[(n * H + h) * D + i + half];
        dx[(n * H + h) * D + i] += a * std::cos(angle) + b * std::sin(angle);
        dx[(n * H + h) * D + i + half] += -a * std::sin(angle) + b * std::cos(angle);
      }
}

#define TESSEL_INSTANTIATE(T)                                                                \
  template void rope_forward<T>(T*, const T*, const int32_t*, int64_t, int64_t, int64_t, T); \
  template void rope_backward<T>(T*, const T*, const int32_t*, int64_t, int64_t, int64_t, T);
TESSEL_INSTANTIATE(float)
TESSEL_INSTANTIATE(double)
#undef TESSEL_INSTANTIATE

}  // namespace tessel::kernels::naive
