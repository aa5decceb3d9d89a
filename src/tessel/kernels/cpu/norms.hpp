#pragma once
// RMSNorm and LayerNorm over the last dimension C of x [N, C].
//   rmsnorm:   y = x / sqrt(mean(x^2) + eps) * w;          saves rstd [N]
//   layernorm: y = (x - mean) / sqrt(var + eps) * w + b;   saves mean [N], rstd [N]
#include <cstdint>

namespace tessel::kernels {

void rmsnorm_forward(float* y, float* rstd, const float* x, const float* w, int64_t N, int64_t C,
                     float eps);
void rmsnorm_backward(float* dx, float* dw, const float* dy, const float* x, const float* w,
                      const float* rstd, int64_t N, int64_t C);
void layernorm_forward(float* y, float* mean, float* rstd, const float* x, const float* w,
                       const float* b, int64_t N, int64_t C, float eps);
void layernorm_backward(float* dx, float* dw, float* db, const float* dy, const float* x,
                        const float* w, const float* mean, const float* rstd, int64_t N, int64_t C);

namespace naive {
template <class T>
void rmsnorm_forward(T* y, T* rstd, const T* x, const T* w, int64_t N, int64_t C, T eps);
template <class T>
void rmsnorm_backward(T* dx, T* dw, const T* dy, const T* x, const T* w, const T* rstd, int64_t N,
                      int64_t C);
template <class T>
void layernorm_forward(T* y, T* mean, T* rstd, const T* x, const T* w, const T* b, int64_t N,
                       int64_t C, T eps);
template <class T>
void layernorm_backward(T* dx, T* dw, T* db, const T* dy, const T* x, const T* w, const T* mean,
                        const T* rstd, int64_t N, int64_t C);
}  // namespace naive

}  // namespace tessel::kernels
