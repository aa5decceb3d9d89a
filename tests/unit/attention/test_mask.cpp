#include <gtest/gtest.h>

#include <limits>

#include "support/expect_input_error.hpp"
#include "tessel/attention/mask.hpp"
#include "tessel/attention/mask_builders.hpp"
#include "tessel/attention/tiled_mask.hpp"
#include "unit/attention/attention_test_util.hpp"

namespace tessel::attention {
namespace {

using fixture::expect_input_error;

// Rows of the dense oracle as strings of 0/1, for readable expectations.
std::vector<std::string> dense_rows(const ColumnMask& m) {
  const auto dense = naive::dense_mask(m);
  std::vector<std::string> rows;
  for (int64_t i = 0; i < m.rows(); ++i) {
    std::string r;
    for (int64_t j = 0; j < m.cols(); ++j) r += dense[size_t(i * m.cols() + j)] ? '1' : '0';
    rows.push_back(r);
  }
  return rows;
}

ColumnMask single(const MaskColumns& c, int64_t Sq, int64_t Sk) {
  return stack_masks(Sq, Sk, 1, 1, {c});
}

// The worked examples of spec §3 (Sq = Sk = 6, documents [3, 3]).
TEST(ColumnMask, SpecWorkedExamples) {
  const MaskColumns cd = causal_document_mask({3, 3});
  EXPECT_EQ(cd.values, (std::vector<int32_t>{3, 3, 3, 6, 6, 6}));
  EXPECT_EQ(dense_rows(single(cd, 6, 6)),
            (std::vector<std::string>{"100000", "110000", "111000", "000100", "000110", "000111"}));
  const MaskColumns doc = document_mask({3, 3});
  EXPECT_EQ(doc.values, (std::vector<int32_t>{3, 0, 3, 0, 3, 0, 6, 3, 6, 3, 6, 3}));
  const auto doc_rows = dense_rows(single(doc, 6, 6));
  EXPECT_EQ(doc_rows[1], "111000");
  EXPECT_EQ(doc_rows[4], "000111");
  const MaskColumns sw = sliding_window_mask(6, 6, 2);
  EXPECT_EQ(sw.values, (std::vector<int32_t>{2, 3, 4, 5, 6, 6}));
  EXPECT_EQ(dense_rows(single(sw, 6, 6))[4], "000110");
}

// Every builder against its definition, over several lengths and random documents.
TEST(ColumnMask, BuildersMatchTheirDefinitions) {
  Rng rng(7);
  for (int64_t N : {1, 2, 7, 33, 130}) {
    for (const auto& c : test::standard_masks(N, rng)) {
      SCOPED_TRACE(c.name + " N=" + std::to_string(N));
      const ColumnMask m = single(c.columns, N, N);
      const auto dense = naive::dense_mask(m);
      int64_t wrong = 0;
      for (int64_t i = 0; i < N; ++i)
        for (int64_t j = 0; j < N; ++j) wrong += bool(dense[size_t(i * N + j)]) != c.visible(i, j);
      EXPECT_EQ(wrong, 0);
    }
  }
}

// Sq != Sk: causal is bottom-right aligned (row i sees j <= i + Sk - Sq).
TEST(ColumnMask, CausalIsBottomRightAligned) {
  EXPECT_EQ(dense_rows(single(causal_mask(2, 4), 2, 4)),
            (std::vector<std::string>{"1110", "1111"}));
  // More queries than keys: the first rows see nothing.
  EXPECT_EQ(dense_rows(single(causal_mask(4, 2), 4, 2)),
            (std::vector<std::string>{"00", "00", "10", "11"}));
  // Window of 2 keys ending at the aligned diagonal.
  EXPECT_EQ(dense_rows(single(sliding_window_mask(2, 4, 2), 2, 4)),
            (std::vector<std::string>{"0110", "0011"}));
}

// restrict_to_window keeps exactly the visible keys of the given mask that lie in the causal
// window (i + Sk - Sq - j < w): plain causal (square and bottom-right), causal documents over
// two rows of random documents, and a causal [LTS, LTE] mask whose interval reaches the window;
// a window as wide as the keys, or the largest int64, cuts nothing.
TEST(ColumnMask, AWindowRestrictsACausalMaskToItsLastKeys) {
  Rng rng(11);
  std::vector<ColumnMask> masks = {
      ColumnMask::causal_only(1, 9, 9), ColumnMask::causal_only(2, 3, 9),
      ColumnMask(1, 1, 6, 6, 2, true, {1, 5, 5, 6, 3, 3, 6, 6, 6, 6, 6, 6})};
  for (int64_t T : {7, 40}) {
    std::vector<std::vector<int32_t>> starts(2, {0});
    for (auto& row : starts)
      for (int32_t t = 1; t < T; ++t)
        if (rng.below(5) == 0) row.push_back(t);
    masks.push_back(causal_document_batch_mask(starts, T));
  }
  for (const ColumnMask& m : masks)
    for (int64_t w : {1, 2, 5, 64}) {
      SCOPED_TRACE("Sq=" + std::to_string(m.rows()) + " Sk=" + std::to_string(m.cols()) +
                   " w=" + std::to_string(w));
      const ColumnMask r = restrict_to_window(m, w);
      const auto base = naive::dense_mask(m), got = naive::dense_mask(r);
      ASSERT_EQ(got.size(), base.size());
      int64_t wrong = 0, shift = m.cols() - m.rows();
      for (int64_t b = 0; b < m.batch(); ++b)
        for (int64_t i = 0; i < m.rows(); ++i)
          for (int64_t j = 0; j < m.cols(); ++j) {
            const size_t at = size_t((b * m.rows() + i) * m.cols() + j);
            wrong += bool(got[at]) != (base[at] && i + shift - j < w);
          }
      EXPECT_EQ(wrong, 0);
    }
  // Column 0 masks rows [1, 2) and a window of 3 masks [3, 4): two intervals.
  expect_input_error(
      [] {
        restrict_to_window(ColumnMask(1, 1, 4, 4, 2, true, {1, 2, 4, 4, 4, 4, 4, 4}), 3);
      },
      {"column 0", "two intervals"});
  expect_input_error(
      [] {
        restrict_to_window(single(document_mask({2, 2}), 4, 4), 2);
      },
      {"needs a causal mask"});
  expect_input_error([] { restrict_to_window(ColumnMask::causal_only(1, 4, 4), 0); },
                     {"window = 0"});
  // A window as wide as the keys or wider cuts nothing, up to the largest int64 (whose sum
  // with a column index would overflow).
  for (const ColumnMask& m : masks)
    for (int64_t w : {m.cols(), std::numeric_limits<int64_t>::max()})
      EXPECT_EQ(naive::dense_mask(restrict_to_window(m, w)), naive::dense_mask(m)) << w;
}

TEST(ColumnMask, CanonicalFormFillsAbsentVectors) {
  const ColumnMask causal1(1, 1, 5, 2, 1, true, {1, 3});
  EXPECT_EQ(causal1.vector(0, 0, kLTE)[0], 5);
  EXPECT_EQ(causal1.vector(0, 0, kUTS)[1], 0);
  EXPECT_EQ(causal1.vector(0, 0, kUTE)[1], 0);
  const ColumnMask nc2(1, 1, 5, 2, 2, false, {4, 1, 5, 2});
  EXPECT_EQ(nc2.vector(0, 0, kLTS)[1], 5);
  EXPECT_EQ(nc2.vector(0, 0, kLTE)[0], 5);
  EXPECT_EQ(nc2.vector(0, 0, kUTS)[0], 0);
  EXPECT_EQ(nc2.vector(0, 0, kUTE)[1], 2);
  EXPECT_EQ(nc2.bytes(), 2 * 4 * 4);  // 16 bytes per column
}

TEST(ColumnMask, RejectsInvalidMasks) {
  expect_input_error(
      [] {
        ColumnMask(1, 1, 4, 2, 1, true, {1, 5});
      },
      {"LTS", "col=1", "5", "outside [0, Sq=4]"});
  expect_input_error([] { ColumnMask(1, 1, 4, 2, 1, true, {-1, 2}); }, {"LTS", "-1"});
  expect_input_error(
      [] {
        ColumnMask(1, 1, 4, 1, 2, true, {3, 2});
      },
      {"LTS > LTE", "col=0", "start must not exceed its end"});
  expect_input_error([] { ColumnMask(1, 1, 4, 1, 4, false, {0, 4, 3, 1}); }, {"UTS > UTE"});
  expect_input_error([] { ColumnMask(1, 1, 4, 2, 1, true, {1}); },
                     {"expected int32 [B=1, Hm=1, Sk=2, V=1]", "got 1"});
  expect_input_error(
      [] {
        ColumnMask(1, 1, 4, 1, 4, true, {0, 0, 0, 0});
      },
      {"causal mask has V = 1", "got V = 4"});
  expect_input_error([] { ColumnMask(1, 1, 4, 1, 1, false, {0}); },
                     {"non-causal mask has V = 2", "got V = 1"});
  expect_input_error([] { ColumnMask(0, 1, 4, 1, 1, true, {}); }, {"must be >= 1"});
  const ColumnMask m(1, 3, 4, 1, 1, true, {4, 4, 4});
  expect_input_error([&] { m.check_heads(4, 2); }, {"Hm = 3", "1, Hq = 4 or Hk = 2"});
}

// Windows of N or more cut nothing, up to the largest int64, whose sums with a key index
// once overflowed: row 5 lost its own key and rows [2, 10) key 9.
TEST(MaskBuilders, GlobalSlidingWindowsBeyondTheKeysCutNothing) {
  const int64_t N = 10, global = 2, big = std::numeric_limits<int64_t>::max();
  const auto rows = [&](int64_t w_left, int64_t w_right) {
    return dense_rows(single(global_sliding_window_mask(N, global, w_left, w_right), N, N));
  };
  const auto full = rows(N, N);
  EXPECT_EQ(full, std::vector<std::string>(size_t(N), std::string(size_t(N), '1')));
  EXPECT_EQ(rows(big, big), full);
  EXPECT_EQ(rows(big, 1), rows(N, 1));
  EXPECT_EQ(rows(1, big), rows(1, N));
}

TEST(MaskBuilders, RejectBadArguments) {
  expect_input_error([] { causal_document_mask({2, 0}); }, {"document 1 has length 0"});
  expect_input_error([] { causal_document_mask({}); }, {"at least one document"});
  expect_input_error([] { sliding_window_mask(4, 4, 0); }, {"window = 0"});
  expect_input_error([] { prefix_lm_causal_mask(4, 5); }, {"prefix = 5"});
  expect_input_error([] { prefix_lm_document_mask({2, 2}, {3, 0}); }, {"prefix 3 of document 0"});
  expect_input_error([] { qk_sparse_mask(8, {{4, 2}, {5, 1}}); }, {"span at 5 of length 1"});
  // Past N by far: offset + length would overflow int64 and pass the bound.
  expect_input_error(
      [] {
        qk_sparse_mask(10, {{1, std::numeric_limits<int64_t>::max()}});
      },
      {"span at 1 of length 9223372036854775807", "inside [0, N=10)"});
  expect_input_error([] { random_eviction_mask({0, 2}); }, {"key 0 evicted at row 0"});
  expect_input_error([] { global_sliding_window_mask(4, 5, 1, 1); }, {"global=5"});
  expect_input_error([] { doc_lengths_from_starts({0, 3, 3}, 5); }, {"ascend strictly"});
  EXPECT_EQ(doc_lengths_from_starts({0, 3}, 5), (std::vector<int64_t>{3, 2}));
}

// Mask memory is O(Sk) per (batch, head): 16 bytes per column plus 8 int32 per key tile.
TEST(TiledMask, MemoryIsLinearInSk) {
  const int64_t Sk = 4096;
  const TiledMask m(single(causal_document_mask({1000, 3096}), Sk, Sk), 64);
  EXPECT_EQ(m.bytes(), 16 * Sk + 8 * 4 * (Sk / 64));
}

}  // namespace
}  // namespace tessel::attention
