#include "tessel/kernels/cpu/softmax.hpp"

#include <cmath>

#include "tessel/kernels/cpu/fast_exp.hpp"

namespace tessel::kernels {

void softmax_forward(float* y, const float* x, int64_t N, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = x + n * C;
    float* yr = y + n * C;
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < C; ++j) m = xr[j] > m ? xr[j] : m;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < C; ++j) {
      yr[j] = detail::fast_expf(xr[j] - m);
      sum += yr[j];
    }
    const float inv = 1.0f / sum;
#pragma omp simd
    for (int64_t j = 0; j < C; ++j) yr[j] *= inv;
  }
}

void softmax_backward(float* dx, const float* dy, const float* y, int64_t N, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* dyr = dy + n * C;
    const float* yr = y + n * C;
    float* dxr = dx + n * C;
    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
    for (int64_t j = 0; j < C; ++j) dot += dyr[j] * yr[j];
#pragma omp simd
    for (int64_t j = 0; j < C; ++j) dxr[j] += yr[j] * (dyr[j] - dot);
  }
}

}  // namespace tessel::kernels
