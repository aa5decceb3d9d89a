#include "tessel/data/batch.hpp"

#include <cstddef>
#include <numeric>

namespace tessel::data {

Batch make_batch(int64_t B, int64_t T) {
  Batch b;
  b.B = B;
  b.T = T;
  b.tokens.resize(size_t(B * T));
  b.targets.resize(size_t(B * T));
  b.loss_mask.assign(size_t(B * T), 1.0f);
  b.positions.resize(size_t(B * T));
  for (int64_t r = 0; r < B; ++r)
    std::iota(b.positions.begin() + r * T, b.positions.begin() + (r + 1) * T, 0);
  b.doc_starts.resize(size_t(B));
  return b;
}

}  // namespace tessel::data
