#pragma once
// A ColumnMask with its per-key-tile summaries (spec §4.1-§4.2), computed once per mask and
// shared by every layer and by forward and backward: for key tile n (columns
// [n * tile_k, min((n + 1) * tile_k, Sk))) the min and max of each canonical vector, 8 int32
// per (batch, mask head, key tile).
//
// classify(rows [r0, r1), key tile n) is conservative: `skip` only when every element of the
// tile is masked, `unmasked` only when none is (interval mask and causal bound together).
#include <cstdint>
#include <vector>

#include "tessel/attention/block_mask.hpp"
#include "tessel/attention/mask.hpp"

namespace tessel::attention {

enum class TileKind : uint8_t { skip, partial, unmasked };

class TiledMask {
 public:
  static constexpr int64_t kDefaultTileK = 64;

  TiledMask() = default;
  explicit TiledMask(ColumnMask mask, int64_t tile_k = kDefaultTileK);

  const ColumnMask& mask() const { return mask_; }
  int64_t tile_k() const { return tile_k_; }
  int64_t num_key_tiles() const { return tiles_; }
  TileKind classify(int64_t b, int64_t hm, int64_t r0, int64_t r1, int64_t n) const;
  // Whether an interval (not the causal bound) may mask an element of the tile; false means
  // only the causal bound can (the kernel then masks each row's tail without reading vectors).
  bool intervals_touch(int64_t b, int64_t hm, int64_t r0, int64_t r1, int64_t n) const;
  // Bytes of the mask vectors plus the tile summaries.
  int64_t bytes() const;

 private:
  ColumnMask mask_;
  int64_t tile_k_ = kDefaultTileK, tiles_ = 0;
  std::vector<int32_t> minmax_;  // [B, Hm, tiles, 4 vectors, {min, max}]
};

// The tile's kind under the column mask (head hm) ANDed with head hb of a block mask (nullptr:
// m.classify itself): skipped when every block it touches is off, at least partial when some
// is, the column mask's kind when all are on. Still conservative.
TileKind classify_tile(const TiledMask& m, const BlockMask* block, int64_t b, int64_t hm,
                       int64_t hb, int64_t r0, int64_t r1, int64_t n);

// How many (batch, query head, query tile, key tile) tiles of an attention call fall in each
// class, and the query x key elements of the computed (non-skipped) tiles. Query tiles of tile_q
// rows start at row_begin and cover [row_begin, row_end) (row_end < 0: every row).
struct TileCounts {
  int64_t skipped = 0, partial = 0, unmasked = 0;
  int64_t computed_elements = 0;
  int64_t total() const { return skipped + partial + unmasked; }
  double computed_fraction() const { return total() ? double(partial + unmasked) / total() : 0; }
};
TileCounts count_tiles(const TiledMask& mask, int64_t Hq, int64_t Hk, int64_t tile_q,
                       int64_t row_begin = 0, int64_t row_end = -1,
                       const BlockMask* block = nullptr);

}  // namespace tessel::attention
