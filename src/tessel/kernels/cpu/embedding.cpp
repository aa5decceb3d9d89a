#include "tessel/kernels/cpu/embedding.hpp"

#include <algorithm>

#include "tessel/kernels/cpu/embedding_ids.hpp"

namespace tessel::kernels {

void embedding_forward(float* y, const int32_t* ids, const float* table, int64_t N, int64_t V,
                       int64_t C) {
  detail::check_embedding_ids(ids, N, V);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) std::copy_n(table + int64_t(ids[n]) * C, C, y + n * C);
}

// Threads own column ranges of the table; each walks the tokens in order, so repeated
// ids accumulate in token order whatever the thread count.
void embedding_backward(float* dtable, const float* dy, const int32_t* ids, int64_t N, int64_t V,
                        int64_t C) {
  detail::check_embedding_ids(ids, N, V);
  constexpr int64_t kChunk = 64;
  const int64_t chunks = (C + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t j0 = c * kChunk;
    const int64_t width = std::min(kChunk, C - j0);
    for (int64_t n = 0; n < N; ++n) {
      float* row = dtable + int64_t(ids[n]) * C + j0;
      const float* g = dy + n * C + j0;
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) row[j] += g[j];
    }
  }
}

}  // namespace tessel::kernels
