#include "tessel/kernels/cpu/cross_entropy.hpp"

#include <algorithm>
#include <cmath>

#include "tessel/kernels/cpu/cross_entropy_targets.hpp"

namespace tessel::kernels::naive {

template <class T>
double cross_entropy_forward(T* lse, const T* logits, const int32_t* targets, const T* weight,
                             int64_t N, int64_t V) {
  detail::check_targets(targets, weight, N, V);
  double total = 0;
  for (int64_t n = 0; n < N; ++n) {
    const T m = *std::max_element(logits + n * V, logits + (n + 1) * V);
    T sum = 0;
    for (int64_t j = 0; j < V; ++j) sum += std::exp(logits[n * V + j] - m);
    lse[n] = m + std::log(sum);
    if (weight[n] != T(0)) total += double(weight[n] * (lse[n] - logits[n * V + targets[n]]));
  }
  return total;
}

template <class T>
void cross_entropy_backward(T* dlogits, const T* logits, const T* lse, const int32_t* targets,
                            const T* weight, T scale, int64_t N, int64_t V) {
  detail::check_targets(targets, weight, N, V);
  for (int64_t n = 0; n < N; ++n) {
    if (weight[n] == T(0)) continue;
    for (int64_t j = 0; j < V; ++j) {
      const T onehot = j == targets[n] ? T(1) : T(0);
      dlogits[n * V + j] += scale * weight[n] * (std::exp(logits[n * V + j] - lse[n]) - onehot);
    }
  }
}

#define TESSEL_INSTANTIATE(T)                                                                  \
  template double cross_entropy_forward<T>(T*, const T*, const int32_t*, const T*, int64_t,    \
                                           int64_t);                                           \
  template void cross_entropy_backward<T>(T*, const T*, const T*, const int32_t*, const T*, T, \
                                          int64_t, int64_t);
TESSEL_INSTANTIATE(float)
TESSEL_INSTANTIATE(double)
#undef TESSEL_INSTANTIATE

}  // namespace tessel::kernels::naive
