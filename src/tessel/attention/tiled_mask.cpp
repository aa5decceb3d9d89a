#include "tessel/attention/tiled_mask.hpp"

#include <algorithm>

#include "tessel/core/error.hpp"

namespace tessel::attention {

TiledMask::TiledMask(ColumnMask mask, int64_t tile_k) : mask_(std::move(mask)), tile_k_(tile_k) {
  if (tile_k < 1) input_error("attention key tile = ", tile_k, ", expected >= 1");
  const int64_t B = mask_.batch(), Hm = mask_.mask_heads(), Sk = mask_.cols();
  tiles_ = (Sk + tile_k - 1) / tile_k;
  minmax_.resize(size_t(B * Hm * tiles_ * 8));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t hm = 0; hm < Hm; ++hm)
      for (int v = 0; v < 4; ++v) {
        const int32_t* x = mask_.vector(b, hm, v);
        for (int64_t n = 0; n < tiles_; ++n) {
          const int64_t c0 = n * tile_k, c1 = std::min(Sk, c0 + tile_k);
          const auto [lo, hi] = std::minmax_element(x + c0, x + c1);
          int32_t* out = minmax_.data() + ((b * Hm + hm) * tiles_ + n) * 8 + 2 * v;
          out[0] = *lo;
          out[1] = *hi;
        }
      }
}

TileKind TiledMask::classify(int64_t b, int64_t hm, int64_t r0, int64_t r1, int64_t n) const {
  const int32_t* t = minmax_.data() + ((b * mask_.mask_heads() + hm) * tiles_ + n) * 8;
  const int32_t lts_max = t[1], lte_min = t[2], uts_max = t[5], ute_min = t[6];
  const int64_t c0 = n * tile_k_, c1 = std::min(mask_.cols(), c0 + tile_k_);
  // Causal bound: row i sees key j only if j <= i + off.
  const int64_t off = mask_.cols() - mask_.rows();
  bool causal_partial = false;
  if (mask_.causal()) {
    if (c0 > r1 - 1 + off) return TileKind::skip;  // even the last row sees no key of the tile
    causal_partial = c1 - 1 > r0 + off;            // the first row misses the tile's last key
  }
  if ((r0 >= lts_max && r1 <= lte_min) || (r0 >= uts_max && r1 <= ute_min)) return TileKind::skip;
  if (causal_partial || intervals_touch(b, hm, r0, r1, n)) return TileKind::partial;
  return TileKind::unmasked;
}

bool TiledMask::intervals_touch(int64_t b, int64_t hm, int64_t r0, int64_t r1, int64_t n) const {
  const int32_t* t = minmax_.data() + ((b * mask_.mask_heads() + hm) * tiles_ + n) * 8;
  return (r0 < t[3] && r1 > t[0]) || (r0 < t[7] && r1 > t[4]);
}

TileKind classify_tile(const TiledMask& m, const BlockMask* block, int64_t b, int64_t hm,
                       int64_t hb, int64_t r0, int64_t r1, int64_t n) {
  const TileKind kind = m.classify(b, hm, r0, r1, n);
  if (block == nullptr || kind == TileKind::skip) return kind;
  const int64_t c0 = n * m.tile_k(), c1 = std::min(m.mask().cols(), c0 + m.tile_k());
  switch (block->cover(b, hb, r0, r1, c0, c1)) {
    case BlockCover::none:
      return TileKind::skip;
    case BlockCover::some:
      return TileKind::partial;
    case BlockCover::all:
      break;
  }
  return kind;
}

int64_t TiledMask::bytes() const {
  return mask_.bytes() + int64_t(minmax_.size() * sizeof(int32_t));
}

TileCounts count_tiles(const TiledMask& m, int64_t Hq, int64_t Hk, int64_t tile_q,
                       int64_t row_begin, int64_t row_end, const BlockMask* block) {
  m.mask().check_heads(Hq, Hk);
  if (block) block->check_fits(m.mask(), Hq, Hk);
  TESSEL_CHECK(tile_q >= 1, "tile_q = ", tile_q);  // the row loop would never advance
  const int64_t Sq = row_end < 0 ? m.mask().rows() : row_end, Sk = m.mask().cols();
  TESSEL_CHECK(0 <= row_begin && row_begin <= Sq && Sq <= m.mask().rows(), "rows [", row_begin,
               ", ", Sq, ")");
  TileCounts c;
  for (int64_t b = 0; b < m.mask().batch(); ++b)
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t hm = m.mask().head_for(h, Hq, Hk), hb = block ? block->head_for(h, Hq, Hk) : 0;
      for (int64_t r0 = row_begin; r0 < Sq; r0 += tile_q) {
        const int64_t r1 = std::min(Sq, r0 + tile_q);
        for (int64_t n = 0; n < m.num_key_tiles(); ++n) {
          const TileKind kind = classify_tile(m, block, b, hm, hb, r0, r1, n);
          if (kind == TileKind::skip) {
            ++c.skipped;
            continue;
          }
          ++(kind == TileKind::partial ? c.partial : c.unmasked);
          c.computed_elements += (r1 - r0) * (std::min(Sk, (n + 1) * m.tile_k()) - n * m.tile_k());
        }
      }
    }
  return c;
}

}  // namespace tessel::attention
