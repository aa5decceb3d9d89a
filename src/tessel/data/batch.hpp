#pragma once
// What the data loader hands the trainer: one micro-batch of token rows (data/loader.hpp
// cuts them from a text data set, data/packing.hpp packs them from SFT samples).
#include <cstdint>
#include <vector>

namespace tessel::data {

// One micro-batch of B rows of T positions; flat arrays are row-major [B*T].
struct Batch {
  int64_t B = 0, T = 0;
  std::vector<int32_t> tokens;                   // [B*T] input ids
  std::vector<int32_t> targets;                  // [B*T] the next token of each input
  std::vector<float> loss_mask;                  // [B*T] 1 = counts in the loss, 0 = ignored
  std::vector<int32_t> positions;                // [B*T] t, 0..T-1 within each row
  std::vector<std::vector<int32_t>> doc_starts;  // [B][k] ascending, doc_starts[b][0] = 0
  std::vector<uint8_t> padding;  // [B*T] 1 = no token (packed SFT rows); empty = none
};

// B rows of T positions: tokens and targets 0, every loss weight 1, positions 0..T-1 and no
// document starts yet (the caller fills the rows).
Batch make_batch(int64_t B, int64_t T);

// Row `from_row` of `from` as row `to_row` of `to` (the same T): its tokens, targets, loss
// weights, positions, document starts and padding (`to` gets padding when `from` has some).
void copy_row(const Batch& from, int64_t from_row, Batch& to, int64_t to_row);

}  // namespace tessel::data
