// Context-parallel layouts, mask localisation and KV-chunk pruning (spec §5.1-§5.3), against
// brute force: exhaustive partitions for the balanced layout, the dense global mask for
// localisation and pruning.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

#include "support/expect_input_error.hpp"
#include "tessel/attention/mask_localization.hpp"
#include "unit/attention/attention_test_util.hpp"

namespace tessel::attention {
namespace {

using test::random_mask;
using test::standard_masks;
using test::uniform_int;

// A random assignment of the chunks of `layout` to its ranks, K each, sorted.
CpLayout random_layout(Rng& rng, int64_t seq, int64_t chunk, int P) {
  CpLayout l = contiguous_layout(seq, chunk, P);
  std::vector<int64_t> perm(size_t(l.num_chunks()));
  std::iota(perm.begin(), perm.end(), 0);
  for (size_t i = perm.size(); i > 1; --i) std::swap(perm[i - 1], perm[rng.below(i)]);
  const size_t K = perm.size() / size_t(P);
  for (int r = 0; r < P; ++r) {
    l.owned[size_t(r)].assign(perm.begin() + long(r * K), perm.begin() + long((r + 1) * K));
    std::sort(l.owned[size_t(r)].begin(), l.owned[size_t(r)].end());
  }
  l.check();
  return l;
}

// Global rows of `chunks` in order.
std::vector<int64_t> rows_of(const CpLayout& l, const std::vector<int64_t>& chunks) {
  std::vector<int64_t> rows;
  for (int64_t c : chunks)
    for (int64_t i = l.chunk_begin(c); i < l.chunk_end(c); ++i) rows.push_back(i);
  return rows;
}

// The localized mask (owned rows, a random permutation of all column chunks) against the global
// dense mask restricted to those rows and permuted columns; and each chunk's needed span against
// the first and last of its columns that some owned row sees (empty when none is seen).
void expect_localizes(const ColumnMask& mask, const CpLayout& l, Rng& rng) {
  const std::vector<uint8_t> global = naive::dense_mask(mask);
  const int64_t S = mask.rows();
  std::vector<int64_t> col_chunks(size_t(l.num_chunks()));
  std::iota(col_chunks.begin(), col_chunks.end(), 0);
  for (size_t i = col_chunks.size(); i > 1; --i)
    std::swap(col_chunks[i - 1], col_chunks[rng.below(i)]);
  const std::vector<int64_t> cols = rows_of(l, col_chunks);
  for (int r = 0; r < l.ranks(); ++r) {
    const std::vector<int64_t> rows = rows_of(l, l.owned[size_t(r)]);
    const ColumnMask local = localize_rows(mask, l, l.owned[size_t(r)]);
    ASSERT_FALSE(local.causal());
    ASSERT_EQ(local.rows(), int64_t(rows.size()));
    const std::vector<uint8_t> dense = naive::dense_mask(select_columns(local, l, col_chunks));
    const std::vector<ColumnSpan> needed = needed_spans(local, l);
    std::vector<int64_t> first_seen(size_t(l.num_chunks()), S),
        last_seen(size_t(l.num_chunks()), -1);
    for (int64_t b = 0; b < mask.batch(); ++b)
      for (int64_t hm = 0; hm < mask.mask_heads(); ++hm)
        for (size_t i = 0; i < rows.size(); ++i)
          for (size_t j = 0; j < cols.size(); ++j) {
            const uint8_t want =
                global[size_t(((b * mask.mask_heads() + hm) * S + rows[i]) * S + cols[j])];
            ASSERT_EQ(
                dense[((size_t(b * mask.mask_heads() + hm)) * rows.size() + i) * cols.size() + j],
                want)
                << "rank " << r << " b " << b << " head " << hm << " row " << rows[i] << " col "
                << cols[j];
            if (!want) continue;
            const auto c = size_t(cols[j] / l.chunk);
            first_seen[c] = std::min(first_seen[c], cols[j]);
            last_seen[c] = std::max(last_seen[c], cols[j]);
          }
    ASSERT_EQ(needed.size(), size_t(l.num_chunks()));
    for (size_t c = 0; c < needed.size(); ++c) {
      SCOPED_TRACE("rank " + std::to_string(r) + " chunk " + std::to_string(c));
      if (last_seen[c] < 0) {
        EXPECT_TRUE(needed[c].empty());
      } else {
        EXPECT_EQ(needed[c], (ColumnSpan{first_seen[c], last_seen[c] + 1}));
      }
    }
  }
}

TEST(MaskLocalization, StandardMasksMatchTheGlobalMaskOnOwnedRows) {
  Rng rng(11);
  for (int64_t N : {48, 61}) {  // 61: a short last chunk
    for (const auto& mc : standard_masks(N, rng)) {
      SCOPED_TRACE(mc.name + " N=" + std::to_string(N));
      const ColumnMask mask = stack_masks(N, N, 1, 1, {mc.columns});
      for (int P : {1, 2, 4}) expect_localizes(mask, random_layout(rng, N, 4, P), rng);
    }
  }
}

TEST(MaskLocalization, RandomFourVectorAndCausalMasks) {
  Rng rng(12);
  for (int trial = 0; trial < 20; ++trial) {
    const bool causal = trial % 2 == 1;
    const int64_t N = uniform_int(rng, 8, 40), B = 2, Hm = 2;
    std::vector<MaskColumns> cols;
    for (int64_t i = 0; i < B * Hm; ++i) cols.push_back(random_mask(rng, N, N, causal));
    const ColumnMask mask = stack_masks(N, N, B, Hm, cols);
    const int64_t chunk = uniform_int(rng, 1, 5);
    const int64_t n = (N + chunk - 1) / chunk;
    const int P = n % 2 == 0 ? 2 : 1;
    expect_localizes(mask, random_layout(rng, N, chunk, P), rng);
  }
}

// Unions that only cover the rows together (and the pitfall: LTE/UTS matter, not only LTS/UTE).
TEST(MaskLocalization, FullUnionTest) {
  EXPECT_TRUE(column_fully_masked(3, 8, 0, 3, 8));   // [3, 8) u [0, 3)
  EXPECT_TRUE(column_fully_masked(0, 5, 4, 8, 8));   // overlapping
  EXPECT_FALSE(column_fully_masked(4, 8, 0, 3, 8));  // row 3 visible
  EXPECT_FALSE(column_fully_masked(0, 8, 0, 8, 9));
  EXPECT_FALSE(column_fully_masked(0, 4, 2, 6, 8));  // LTE and UTE short of 8
  EXPECT_TRUE(column_fully_masked(0, 8, 0, 0, 8));
}

TEST(CpLayout, ContiguousAndZigzag) {
  const CpLayout c = contiguous_layout(100, 10, 5);
  EXPECT_EQ(c.owned[1], (std::vector<int64_t>{2, 3}));
  const CpLayout z = zigzag_layout(64, 4);
  EXPECT_EQ(z.chunk, 8);
  EXPECT_EQ(z.owned[1], (std::vector<int64_t>{1, 6}));
  z.check();
  fixture::expect_input_error([] { contiguous_layout(100, 10, 3); }, {"do not split evenly"});
}

// With two ranks the pairwise refinement is exhaustive: the balanced layout reaches the optimum
// of every K-of-2K split, found here by brute force.
TEST(CpLayout, BalancedIsOptimalForTwoRanks) {
  Rng rng(13);
  for (int trial = 0; trial < 30; ++trial) {
    const int64_t n = 2 * uniform_int(rng, 1, 6);
    std::vector<int64_t> work(static_cast<size_t>(n));
    for (auto& w : work) w = uniform_int(rng, 0, 100);
    const CpLayout l = balanced_layout(n * 3, 3, 2, work);
    const std::vector<int64_t> loads = rank_work(l, work);
    const int64_t got = *std::max_element(loads.begin(), loads.end());
    const int64_t total = std::accumulate(work.begin(), work.end(), int64_t(0));
    int64_t best = total;
    for (uint32_t set = 0; set < (1u << n); ++set) {
      if (__builtin_popcount(set) != n / 2) continue;
      int64_t s = 0;
      for (int64_t i = 0; i < n; ++i)
        if (set >> i & 1) s += work[size_t(i)];
      best = std::min(best, std::max(s, total - s));
    }
    EXPECT_EQ(got, best) << "trial " << trial;
  }
}

// Causal and causal-document work with 16 and 8 chunks per rank (P = 2 and 4; P = 2 runs the
// best-swap path of K > 8): balanced within 5 %, and never worse than contiguous.
TEST(CpLayout, BalancedEvensCausalWork) {
  Rng rng(14);
  const int64_t N = 2048, chunk = 64;
  for (int P : {2, 4}) {
    for (const MaskColumns& cols :
         {causal_mask(N, N), causal_document_mask(test::random_documents(rng, N, 700))}) {
      const TiledMask tm(stack_masks(N, N, 1, 1, {cols}), 64);
      const std::vector<int64_t> work = chunk_work(tm, chunk, 1, 1, 64);
      const double bal = imbalance(balanced_layout(N, chunk, P, work), work);
      EXPECT_LE(bal, 1.05);
      EXPECT_LE(bal, imbalance(contiguous_layout(N, chunk, P), work));
    }
  }
}

// chunk_work equals the per-chunk sum of count_tiles over the chunk's query tiles.
TEST(CpLayout, ChunkWorkCountsNonSkippedTiles) {
  const TiledMask tm(stack_masks(256, 256, 1, 1, {causal_document_mask({128, 128})}), 64);
  // 64-row chunks, 64-row query tiles: chunk 0 sees tile 0, chunk 1 tiles 0-1, chunk 2 tile 2,
  // chunk 3 tiles 2-3.
  EXPECT_EQ(chunk_work(tm, 64, 1, 1, 64), (std::vector<int64_t>{1, 2, 1, 2}));
  EXPECT_EQ(chunk_work(tm, 64, 2, 2, 64), (std::vector<int64_t>{2, 4, 2, 4}));
}

TEST(CpLayout, TakeAndAddChunkRowsAreInverse) {
  const CpLayout l = contiguous_layout(10, 3, 2);  // chunks 0-3, the last of 1 row
  std::vector<float> x(2 * 10 * 2);
  std::iota(x.begin(), x.end(), 0.0f);
  const std::vector<int64_t> chunks{3, 1};
  const std::vector<float> rows = take_chunk_rows(x.data(), 2, 2, l, chunks);
  ASSERT_EQ(rows.size(), size_t(2 * 4 * 2));
  EXPECT_EQ(rows[0], x[9 * 2]);         // b 0, row 9
  EXPECT_EQ(rows[2], x[3 * 2]);         // b 0, row 3
  EXPECT_EQ(rows[8], x[(10 + 9) * 2]);  // b 1, row 9
  std::vector<float> y(x.size(), 0.0f);
  add_chunk_rows(y.data(), rows.data(), 2, 2, l, chunks);
  for (int64_t b = 0; b < 2; ++b)
    for (int64_t i = 0; i < 10; ++i)
      for (int d = 0; d < 2; ++d) {
        const size_t at = size_t((b * 10 + i) * 2 + d);
        EXPECT_EQ(y[at], (i == 9 || (i >= 3 && i < 6)) ? x[at] : 0.0f);
      }
}

}  // namespace
}  // namespace tessel::attention
