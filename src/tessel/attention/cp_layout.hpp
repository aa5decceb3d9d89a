#pragma once
// Context-parallel chunk layouts (spec specs/flashmask.md §5.1). A sequence of S positions is
// cut into chunks of `chunk` rows (the last one may be shorter); each of the P ranks of the cp
// group owns exactly K = num_chunks / P of them, kept sorted by global position. Queries, keys
// and values of a rank are its owned chunks concatenated in that order ("local rows").
//
//   contiguous: rank r owns chunks [r K, (r + 1) K);
//   zigzag:     2 P chunks, rank r owns r and 2 P - 1 - r;
//   balanced:   per-chunk work = non-skipped (batch, query head, query tile, key tile) tiles of
//               the chunk's query rows (chunk_work, from the mask's tile summaries); longest-
//               processing-time greedy with K chunks per rank, then exact pairwise
//               re-partition of the heaviest rank with each partner while the maximum drops
//               (exhaustive over the 2K chunks of the pair for K <= 8, best single swap above).
// Everything here is pure and deterministic (ties go to the lower index): every rank computes
// the same layout from the same global mask, with no communication.
#include <cstdint>
#include <vector>

#include "tessel/attention/tiled_mask.hpp"

namespace tessel::attention {

struct CpLayout {
  int64_t seq = 0, chunk = 0;               // S and rows per chunk
  std::vector<std::vector<int64_t>> owned;  // [rank] ascending chunk indices

  int ranks() const { return int(owned.size()); }
  int64_t num_chunks() const { return (seq + chunk - 1) / chunk; }
  int64_t chunk_begin(int64_t c) const { return c * chunk; }
  int64_t chunk_end(int64_t c) const { return std::min(seq, (c + 1) * chunk); }
  int64_t chunk_rows(int64_t c) const { return chunk_end(c) - chunk_begin(c); }
  // The rank owning each chunk.
  std::vector<int> owners() const;
  // Rows of rank r (the sum of its chunks' lengths).
  int64_t local_rows(int r) const;
  // TESSEL_CHECK: every chunk owned exactly once, each rank K ascending chunks.
  void check() const;
};

// InputError unless seq >= 1, chunk >= 1 and ceil(seq / chunk) is a multiple of P >= 1.
CpLayout contiguous_layout(int64_t seq, int64_t chunk, int P);
// chunk = ceil(seq / (2 P)); InputError when that leaves fewer than 2 P chunks.
CpLayout zigzag_layout(int64_t seq, int P);
// work[c] for every chunk c of ceil(seq / chunk).
CpLayout balanced_layout(int64_t seq, int64_t chunk, int P, const std::vector<int64_t>& work);

// Per-chunk work of self-attention (Sq = Sk = seq) under `mask`: the non-skipped tiles of the
// chunk's query rows, query tiles of tile_q rows starting at the chunk's first row.
std::vector<int64_t> chunk_work(const TiledMask& mask, int64_t chunk, int64_t Hq, int64_t Hk,
                                int64_t tile_q);
// Work of each rank and max / mean of it (1 = perfect balance).
std::vector<int64_t> rank_work(const CpLayout& layout, const std::vector<int64_t>& work);
double imbalance(const CpLayout& layout, const std::vector<int64_t>& work);

// Rows of `chunks` (in the given order) of x [B, layout.seq, width], concatenated:
// out [B, sum of their lengths, width]. `add_chunk_rows` is the inverse scatter, adding.
template <class T>
std::vector<T> take_chunk_rows(const T* x, int64_t B, int64_t width, const CpLayout& layout,
                               const std::vector<int64_t>& chunks) {
  std::vector<T> out;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t c : chunks) {
      const T* src = x + (b * layout.seq + layout.chunk_begin(c)) * width;
      out.insert(out.end(), src, src + layout.chunk_rows(c) * width);
    }
  return out;
}
void add_chunk_rows(float* x, const float* rows, int64_t B, int64_t width, const CpLayout& layout,
                    const std::vector<int64_t>& chunks);

}  // namespace tessel::attention
