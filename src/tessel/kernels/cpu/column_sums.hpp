#pragma once
// Parameter-gradient reductions over rows, deterministic for any thread count:
// threads split the columns, and every column is summed over rows 0..N-1 in order.
#include <algorithm>
#include <cstdint>

namespace tessel::kernels::detail {

// out[j] += sum_{n < N} f(n, j) for j < C. f must be cheap and inlinable.
template <class F>
inline void add_column_sums(float* out, int64_t N, int64_t C, F f) {
  constexpr int64_t kChunk = 64;
  const int64_t chunks = (C + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t j0 = c * kChunk;
    const int64_t width = std::min(kChunk, C - j0);
    float acc[kChunk] = {};
    for (int64_t n = 0; n < N; ++n) {
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) acc[j] += f(n, j0 + j);
    }
    for (int64_t j = 0; j < width; ++j) out[j0 + j] += acc[j];
  }
}

}  // namespace tessel::kernels::detail
