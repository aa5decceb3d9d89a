#include "tessel/kernels/cpu/norms.hpp"

#include <cmath>

#include "tessel/kernels/cpu/column_sums.hpp"

namespace tessel::kernels {

void rmsnorm_forward(float* y, float* rstd, const float* x, const float* w, int64_t N, int64_t C,
                     float eps) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = x + n * C;
    float* yr = y + n * C;
    float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
    for (int64_t j = 0; j < C; ++j) ss += xr[j] * xr[j];
    const float r = 1.0f / std::sqrt(ss / float(C) + eps);
    rstd[n] = r;
#pragma omp simd
    for (int64_t j = 0; j < C; ++j) yr[j] = xr[j] * r * w[j];
  }
}

// dx = rstd * (dxhat - xhat * mean(dxhat * xhat)), dxhat = dy * w, xhat = x * rstd.
void rmsnorm_backward(float* dx, float* dw, const float* dy, const float* x, const float* w,
                      const float* rstd, int64_t N, int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = x + n * C;
    const float* dyr = dy + n * C;
    float* dxr = dx + n * C;
    const float r = rstd[n];
    float dot = 0.0f;  // sum_j dxhat_j * xhat_j
#pragma omp simd reduction(+ : dot)
    for (int64_t j = 0; j < C; ++j) dot += dyr[j] * w[j] * xr[j];
    const float c = dot * r / float(C);
#pragma omp simd
    for (int64_t j = 0; j < C; ++j) dxr[j] += r * (dyr[j] * w[j] - xr[j] * r * c);
  }
  detail::add_column_sums(
      dw, N, C, [=](int64_t n, int64_t j) { return dy[n * C + j] * x[n * C + j] * rstd[n]; });
}

void layernorm_forward(float* y, float* mean, float* rstd, const float* x, const float* w,
                       const float* b, int64_t N, int64_t C, float eps) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = x + n * C;
    float* yr = y + n * C;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < C; ++j) sum += xr[j];
    const float m = sum / float(C);
    float var = 0.0f;  // two passes: stable when |mean| >> std
#pragma omp simd reduction(+ : var)
    for (int64_t j = 0; j < C; ++j) var += (xr[j] - m) * (xr[j] - m);
    const float r = 1.0f / std::sqrt(var / float(C) + eps);
    mean[n] = m;
    rstd[n] = r;
#pragma omp simd
    for (int64_t j = 0; j < C; ++j) yr[j] = (xr[j] - m) * r * w[j] + b[j];
  }
}

// dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), dxhat = dy * w.
void layernorm_backward(float* dx, float* dw, float* db, const float* dy, const float* x,
                        const float* w, const float* mean, const float* rstd, int64_t N,
                        int64_t C) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* xr = x + n * C;
    const float* dyr = dy + n * C;
    float* dxr = dx + n * C;
    const float m = mean[n];
    const float r = rstd[n];
    float sum_g = 0.0f, sum_gx = 0.0f;
#pragma omp simd reduction(+ : sum_g, sum_gx)
    for (int64_t j = 0; j < C; ++j) {
      const float g = dyr[j] * w[j];
      sum_g += g;
      sum_gx += g * (xr[j] - m) * r;
    }
    const float mg = sum_g / float(C);
    const float mgx = sum_gx / float(C);
#pragma omp simd
    for (int64_t j = 0; j < C; ++j) dxr[j] += r * (dyr[j] * w[j] - mg - (xr[j] - m) * r * mgx);
  }
  detail::add_column_sums(dw, N, C, [=](int64_t n, int64_t j) {
    return dy[n * C + j] * (x[n * C + j] - mean[n]) * rstd[n];
  });
  detail::add_column_sums(db, N, C, [=](int64_t n, int64_t j) { return dy[n * C + j]; });
}

}  // namespace tessel::kernels
