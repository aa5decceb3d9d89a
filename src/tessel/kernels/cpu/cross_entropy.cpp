#include "tessel/kernels/cpu/cross_entropy.hpp"

#include <cmath>
#include <vector>

#include "tessel/kernels/cpu/cross_entropy_targets.hpp"

namespace tessel::kernels {

double cross_entropy_forward(float* lse, const float* logits, const int32_t* targets,
                             const float* weight, int64_t N, int64_t V) {
  detail::check_targets(targets, weight, N, V);
  std::vector<double> loss(N, 0.0);  // per-token terms, summed in token order below
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = logits + n * V;
    float m = -INFINITY;
#pragma omp simd reduction(max : m)
    for (int64_t j = 0; j < V; ++j) m = std::fmax(m, x[j]);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < V; ++j) sum += expf(x[j] - m);
    lse[n] = m + logf(sum);
    if (weight[n] != 0.0f) loss[n] = double(weight[n]) * (double(lse[n]) - double(x[targets[n]]));
  }
  double total = 0.0;
  for (double l : loss) total += l;
  return total;
}

void cross_entropy_backward(float* dlogits, const float* logits, const float* lse,
                            const int32_t* targets, const float* weight, float scale, int64_t N,
                            int64_t V) {
  detail::check_targets(targets, weight, N, V);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    if (weight[n] == 0.0f) continue;
    const float* x = logits + n * V;
    float* dx = dlogits + n * V;
    const float g = scale * weight[n];
    const float l = lse[n];
#pragma omp simd
    for (int64_t j = 0; j < V; ++j) dx[j] += g * expf(x[j] - l);
    dx[targets[n]] -= g;
  }
}

}  // namespace tessel::kernels
