#include "tessel/kernels/cpu/norms.hpp"

#include <cmath>

namespace tessel::kernels::naive {

template <class T>
void rmsnorm_forward(T* y, T* rstd, const T* x, const T* w, int64_t N, int64_t C, T eps) {
  for (int64_t n = 0; n < N; ++n) {
    T ss = 0;
    for (int64_t j = 0; j < C; ++j) ss += x[n * C + j] * x[n * C + j];
    rstd[n] = T(1) / std::sqrt(ss / T(C) + eps);
    for (int64_t j = 0; j < C; ++j) y[n * C + j] = x[n * C + j] * rstd[n] * w[j];
  }
}

// y_j = x_j r w_j with r = (mean(x^2) + eps)^(-1/2), dr/dx_k = -r^3 x_k / C.
template <class T>
void rmsnorm_backward(T* dx, T* dw, const T* dy, const T* x, const T* w, const T* rstd, int64_t N,
                      int64_t C) {
  for (int64_t n = 0; n < N; ++n) {
    const T r = rstd[n];
    T dr = 0;  // dL/dr
    for (int64_t j = 0; j < C; ++j) dr += dy[n * C + j] * x[n * C + j] * w[j];
    for (int64_t k = 0; k < C; ++k) {
      dx[n * C + k] += dy[n * C + k] * r * w[k] - dr * r * r * r * x[n * C + k] / T(C);
      dw[k] += dy[n * C + k] * x[n * C + k] * r;
    }
  }
}

template <class T>
void layernorm_forward(T* y, T* mean, T* rstd, const T* x, const T* w, const T* b, int64_t N,
                       int64_t C, T eps) {
  for (int64_t n = 0; n < N; ++n) {
    T m = 0;
    for (int64_t j = 0; j < C; ++j) m += x[n * C + j];
    m /= T(C);
    T var = 0;
    for (int64_t j = 0; j < C; ++j) var += (x[n * C + j] - m) * (x[n * C + j] - m);
    mean[n] = m;
    rstd[n] = T(1) / std::sqrt(var / T(C) + eps);
    for (int64_t j = 0; j < C; ++j) y[n * C + j] = (x[n * C + j] - m) * rstd[n] * w[j] + b[j];
  }
}

// Chain rule through xhat = (x - m) r: dxhat -> dx via dm/dx = 1/C and dr/dx_k = -r^3 (x_k - m)/C.
template <class T>
void layernorm_backward(T* dx, T* dw, T* db, const T* dy, const T* x, const T* w, const T* mean,
                        const T* rstd, int64_t N, int64_t C) {
  for (int64_t n = 0; n < N; ++n) {
    const T m = mean[n], r = rstd[n];
    T dr = 0, dxhat_sum = 0;
    for (int64_t j = 0; j < C; ++j) {
      const T dxhat = dy[n * C + j] * w[j];
      dr += dxhat * (x[n * C + j] - m);
      dxhat_sum += dxhat;
    }
    for (int64_t k = 0; k < C; ++k) {
      const T xc = x[n * C + k] - m;
      // direct term, the mean's term (sum over j of -r dxhat_j / C), the rstd's term
      dx[n * C + k] += dy[n * C + k] * w[k] * r - r * dxhat_sum / T(C) - dr * r * r * r * xc / T(C);
      dw[k] += dy[n * C + k] * xc * r;
      db[k] += dy[n * C + k];
    }
  }
}

#define TESSEL_INSTANTIATE(T)                                                                    \
  template void rmsnorm_forward<T>(T*, T*, const T*, const T*, int64_t, int64_t, T);             \
  template void rmsnorm_backward<T>(T*, T*, const T*, const T*, const T*, const T*, int64_t,     \
                                    int64_t);                                                    \
  template void layernorm_forward<T>(T*, T*, T*, const T*, const T*, const T*, int64_t, int64_t, \
                                     T);                                                         \
  template void layernorm_backward<T>(T*, T*, T*, const T*, const T*, const T*, const T*,        \
                                      const T*, int64_t, int64_t);
TESSEL_INSTANTIATE(float)
TESSEL_INSTANTIATE(double)
#undef TESSEL_INSTANTIATE

}  // namespace tessel::kernels::naive
