#include "tessel/data/batch.hpp"

#include <algorithm>
#include <cstddef>
#include <numeric>

#include "tessel/core/error.hpp"

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

void copy_row(const Batch& from, int64_t from_row, Batch& to, int64_t to_row) {
  const int64_t T = from.T;
  TESSEL_CHECK(to.T == T && from_row >= 0 && from_row < from.B && to_row >= 0 && to_row < to.B,
               "copy_row: row ", from_row, " of [", from.B, ", ", T, "] to row ", to_row, " of [",
               to.B, ", ", to.T, "]");
  auto copy = [&](const auto& src, auto& dst) {
    std::copy_n(src.begin() + from_row * T, T, dst.begin() + to_row * T);
  };
  copy(from.tokens, to.tokens);
  copy(from.targets, to.targets);
  copy(from.loss_mask, to.loss_mask);
  copy(from.positions, to.positions);
  to.doc_starts[size_t(to_row)] = from.doc_starts[size_t(from_row)];
  if (from.padding.empty()) return;
  to.padding.resize(size_t(to.B * T));
  copy(from.padding, to.padding);
}

}  // namespace tessel::data
