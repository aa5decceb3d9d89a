#include <gtest/gtest.h>

#include "tessel/attention/tiled_mask.hpp"
#include "tessel/core/error.hpp"
#include "unit/attention/attention_test_util.hpp"

namespace tessel::attention {
namespace {

using kernels::test::uniform_int;

struct TileTally {
  int64_t skipped = 0, partial = 0, unmasked = 0, skipped_by_blocks = 0;
};

// Brute force over every tile of `tm` (tile_q rows) with `block` ANDed in when set: a skipped
// tile holds no visible element, an unmasked tile no masked one.
void expect_conservative(const TiledMask& tm, const BlockMask* block, int64_t tile_q, int trial,
                         TileTally& tally) {
  const int64_t Sq = tm.mask().rows(), Sk = tm.mask().cols();
  const auto dense = naive::dense_mask(tm.mask());
  for (int64_t r0 = 0; r0 < Sq; r0 += tile_q) {
    const int64_t r1 = std::min(Sq, r0 + tile_q);
    for (int64_t n = 0; n < tm.num_key_tiles(); ++n) {
      const int64_t c0 = n * tm.tile_k(), c1 = std::min(Sk, c0 + tm.tile_k());
      int64_t visible = 0;
      for (int64_t i = r0; i < r1; ++i)
        for (int64_t j = c0; j < c1; ++j)
          visible += dense[size_t(i * Sk + j)] && (!block || block->allows(0, 0, i, j));
      const TileKind kind = classify_tile(tm, block, 0, 0, 0, r0, r1, n);
      if (kind == TileKind::skip) {
        ++tally.skipped;
        tally.skipped_by_blocks += tm.classify(0, 0, r0, r1, n) != TileKind::skip;
        ASSERT_EQ(visible, 0) << "skipped tile with visible elements, trial " << trial;
      } else if (kind == TileKind::unmasked) {
        ++tally.unmasked;
        ASSERT_EQ(visible, (r1 - r0) * (c1 - c0)) << "unmasked tile with masked elements";
      } else {
        ++tally.partial;
      }
    }
  }
}

// Random valid masks (4-vector and causal forms, Sq = Sk and Sq != Sk) and random tile sizes.
TEST(TiledMask, ClassificationIsConservative) {
  Rng rng(11);
  TileTally tally;
  for (int trial = 0; trial < 60; ++trial) {
    const int64_t Sq = uniform_int(rng, 1, 512);
    const int64_t Sk = trial % 3 == 0 ? uniform_int(rng, 1, 512) : Sq;
    const bool causal = trial % 2 == 0;
    const TiledMask tm(stack_masks(Sq, Sk, 1, 1, {test::random_mask(rng, Sq, Sk, causal)}),
                       uniform_int(rng, 1, 96));
    expect_conservative(tm, nullptr, uniform_int(rng, 1, 96), trial, tally);
  }
  // The masks exercise every class.
  EXPECT_GT(tally.skipped, 0);
  EXPECT_GT(tally.partial, 0);
  EXPECT_GT(tally.unmasked, 0);
}

// The same with a random block mask ANDed in: tile sizes from 1 to 300, so a tile may lie
// inside one 128-block or span several. Some tiles are skipped only for the block mask.
TEST(TiledMask, ClassificationWithBlockMaskIsConservative) {
  Rng rng(12);
  TileTally tally;
  for (int trial = 0; trial < 80; ++trial) {
    const int64_t Sq = uniform_int(rng, 1, 512);
    const int64_t Sk = trial % 3 == 0 ? uniform_int(rng, 1, 512) : Sq;
    const bool causal = trial % 2 == 0;
    const TiledMask tm(stack_masks(Sq, Sk, 1, 1, {test::random_mask(rng, Sq, Sk, causal)}),
                       uniform_int(rng, 1, trial % 4 == 0 ? 300 : 96));
    const BlockMask block = test::random_block_mask(rng, 1, 1, Sq, Sk, 20 + 20 * (trial % 4));
    expect_conservative(tm, &block, uniform_int(rng, 1, trial % 4 == 1 ? 300 : 96), trial, tally);
  }
  EXPECT_GT(tally.skipped_by_blocks, 0);
  EXPECT_GT(tally.partial, 0);
  EXPECT_GT(tally.unmasked, 0);
  EXPECT_GT(tally.skipped, tally.skipped_by_blocks);
}

// A row tile of no rows would never advance the row loop: refused, not a hang.
TEST(TiledMask, CountTilesRefusesRowTilesOfNoRows) {
  const TiledMask tm(ColumnMask::causal_only(1, 8, 8), 4);
  for (int64_t tile_q : {0, -3}) EXPECT_THROW(count_tiles(tm, 1, 1, tile_q), Error) << tile_q;
  EXPECT_EQ(count_tiles(tm, 1, 1, 4).total(), 4);
}

// Causal-document with 64-row tiles: the block structure is found exactly.
TEST(TiledMask, CausalDocumentSkipsOffDiagonalBlocks) {
  const TiledMask tm(stack_masks(256, 256, 1, 1, {causal_document_mask({128, 128})}), 64);
  const TileCounts c = count_tiles(tm, 1, 1, 64);
  // 4 x 4 tiles; per 128-document: 2 diagonal (partial) + 1 below-diagonal (unmasked).
  EXPECT_EQ(c.total(), 16);
  EXPECT_EQ(c.partial, 4);
  EXPECT_EQ(c.unmasked, 2);
  EXPECT_EQ(c.skipped, 10);
  EXPECT_EQ(c.computed_elements, 6 * 64 * 64);
}

// Causal 256 x 256 with the block below the diagonal off: the same tiles as the two-document
// mask above, counted through count_tiles' block mask.
TEST(TiledMask, BlockMaskSkipsItsOffBlocks) {
  const TiledMask tm(ColumnMask::causal_only(1, 256, 256), 64);
  const BlockMask block(1, 1, 256, 256, {1, 0, 0, 1});
  const TileCounts c = count_tiles(tm, 1, 1, 64, 0, -1, &block);
  EXPECT_EQ(c.partial, 4);
  EXPECT_EQ(c.unmasked, 2);
  EXPECT_EQ(c.skipped, 10);
  EXPECT_EQ(count_tiles(tm, 1, 1, 64).skipped, 6);
  // A 96-row tile across the block border (rows 96-191) is partial where it meets block (1, 0).
  EXPECT_EQ(classify_tile(tm, &block, 0, 0, 0, 96, 192, 0), TileKind::partial);
  EXPECT_EQ(classify_tile(tm, &block, 0, 0, 0, 128, 192, 0), TileKind::skip);
}

}  // namespace
}  // namespace tessel::attention
