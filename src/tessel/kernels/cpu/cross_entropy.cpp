#include "tessel/kernels/cpu/cross_entropy.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include "tessel/kernels/cpu/cross_entropy_targets.hpp"
#include "tessel/kernels/cpu/fast_exp.hpp"

namespace tessel::kernels {

double cross_entropy_forward(float* lse, const float* logits, const int32_t* targets,
                             const float* weight, int64_t N, int64_t V) {
  detail::check_targets(targets, weight, N, V);
  std::vector<double> loss(N, 0.0);  // per-token terms, summed in token order below
  // One pass over each row in L1-sized blocks: the block max, then the block's exp-sum
  // rescaled onto the running max (a two-pass row would stream V floats from memory twice).
  constexpr int64_t kBlock = 2048;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* x = logits + n * V;
    float m = -INFINITY, sum = 0.0f;
    for (int64_t j0 = 0; j0 < V; j0 += kBlock) {
      const int64_t j1 = std::min(V, j0 + kBlock);
      float bm = -INFINITY;
#pragma omp simd reduction(max : bm)
      for (int64_t j = j0; j < j1; ++j) bm = x[j] > bm ? x[j] : bm;
      if (bm > m) {
        sum *= detail::fast_expf(m - bm);
        m = bm;
      }
      float bsum = 0.0f;
#pragma omp simd reduction(+ : bsum)
      for (int64_t j = j0; j < j1; ++j) bsum += detail::fast_expf(x[j] - m);
      sum += bsum;
    }
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
    for (int64_t j = 0; j < V; ++j) dx[j] += g * detail::fast_expf(x[j] - l);
    dx[targets[n]] -= g;
  }
}

}  // namespace tessel::kernels
