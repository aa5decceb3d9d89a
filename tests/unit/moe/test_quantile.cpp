// The bf16 order key (exhaustively), the radix-select k-th smallest on one rank against a
// sorted pool, its two all-reduces of E x 256 counters, the QB load property, the partition
// dependence of the averaged-quantile baseline, and the histogram estimate on one rank: its
// bound against a sorted pool, its naive twin (a scan of the edges), its two collectives and
// its refusals.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <vector>

#include "tessel/core/bf16.hpp"
#include "tessel/core/error.hpp"
#include "tessel/core/rng.hpp"
#include "tessel/moe/quantile.hpp"

namespace tessel::moe {
namespace {

bool is_nan_bits(uint32_t u) {
  return (u & 0x7F80) == 0x7F80 && (u & 0x007F) != 0;
}

TEST(OrderKey, MonotoneAndInvertibleOverEveryNonNanPattern) {
  std::vector<uint16_t> patterns;
  for (uint32_t u = 0; u < 0x10000; ++u) {
    if (is_nan_bits(u)) continue;
    const uint16_t key = order_key_from_bits(uint16_t(u));
    ASSERT_EQ(bits_from_order_key(key), u) << "pattern " << u;
    EXPECT_EQ(bf16_order_key(bf16_to_f32(uint16_t(u))), key) << "pattern " << u;
    patterns.push_back(uint16_t(u));
  }
  EXPECT_EQ(patterns.size(), size_t(65536 - 2 * 127));  // 2 * (2^7 - 1) NaN patterns
  // In key order the values rise strictly, except -0 directly before +0.
  std::sort(patterns.begin(), patterns.end(),
            [](uint16_t a, uint16_t b) { return order_key_from_bits(a) < order_key_from_bits(b); });
  for (size_t i = 0; i + 1 < patterns.size(); ++i) {
    const float a = bf16_to_f32(patterns[i]), b = bf16_to_f32(patterns[i + 1]);
    EXPECT_LT(order_key_from_bits(patterns[i]), order_key_from_bits(patterns[i + 1]));
    if (a == 0.0f && b == 0.0f)
      EXPECT_TRUE(std::signbit(a) && !std::signbit(b));
    else
      EXPECT_LT(a, b) << "patterns " << patterns[i] << ", " << patterns[i + 1];
  }
  EXPECT_EQ(bf16_order_key(-0.0f), 0x7FFF);
  EXPECT_EQ(bf16_order_key(0.0f), 0x8000);
  EXPECT_EQ(bf16_order_key(-std::numeric_limits<float>::infinity()), 0x007F);
  EXPECT_EQ(bf16_order_key(std::numeric_limits<float>::infinity()), 0xFF80);
  EXPECT_THROW(bf16_order_key(std::nanf("")), Error);
}

// A one-rank ExpertComm that counts the balancing sums it is asked for.
class CountingComm final : public ExpertComm {
 public:
  int ep_size() const override { return 1; }
  int ep_rank() const override { return 0; }
  void exchange_counts(const int64_t*, int64_t*, size_t) override { FAIL(); }
  void exchange_rows(const float*, std::span<const size_t>, float*,
                     std::span<const size_t>) override {
    FAIL();
  }
  void sum_counters(int32_t*, size_t n) override { calls.push_back(n); }
  void sum_values(double*, size_t) override { FAIL(); }
  void max_values(float*, size_t n) override { max_calls.push_back(n); }
  void sum_micro_batch_counters(int32_t*, size_t) override { FAIL(); }
  void sum_micro_batch_values(double*, size_t) override { FAIL(); }
  std::vector<int32_t> gather_micro_batch(std::span<const int32_t>) override {
    ADD_FAILURE();
    return {};
  }
  std::vector<size_t> calls;      // sum_counters
  std::vector<size_t> max_calls;  // max_values
};

// Column-major keys of values [rows, columns] (row-major input).
std::vector<uint16_t> keys_of(const std::vector<float>& v, int64_t rows, int64_t columns) {
  std::vector<uint16_t> k(v.size());
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t c = 0; c < columns; ++c)
      k[size_t(c * rows + t)] = bf16_order_key(v[size_t(t * columns + c)]);
  return k;
}

TEST(GlobalKthSmallest, OneRankEqualsTheSortedPoolWithTwoSumsOfE256Counters) {
  Rng rng(5);
  const int64_t rows = 301, columns = 5;
  std::vector<float> v(size_t(rows * columns));
  for (int64_t t = 0; t < rows; ++t) {
    v[size_t(t * columns + 0)] = rng.normal();                     // spread
    v[size_t(t * columns + 1)] = float(int(rng.below(3))) - 1.0f;  // heavy ties
    v[size_t(t * columns + 2)] = 2.5f;                             // constant
    v[size_t(t * columns + 3)] = rng.below(2) ? 0.0f : -0.0f;      // +-0
    v[size_t(t * columns + 4)] =
        rng.below(2) ? std::numeric_limits<float>::max() : -std::numeric_limits<float>::max();
  }
  std::vector<uint8_t> valid(static_cast<size_t>(rows));
  for (auto& m : valid) m = rng.below(4) != 0;
  for (bool masked : {false, true}) {
    for (int64_t r : {int64_t(1), int64_t(17), int64_t(150)}) {
      CountingComm comm;
      const auto keys = keys_of(v, rows, columns);
      const auto got = global_kth_smallest(
          keys, columns, masked ? std::span<const uint8_t>(valid) : std::span<const uint8_t>(),
          [&](int64_t) { return r; }, comm);
      EXPECT_EQ(comm.calls, (std::vector<size_t>{size_t(columns * 256), size_t(columns * 256)}));
      EXPECT_TRUE(comm.max_calls.empty());
      for (int64_t c = 0; c < columns; ++c) {
        std::vector<uint16_t> pool;
        for (int64_t t = 0; t < rows; ++t)
          if (!masked || valid[size_t(t)]) pool.push_back(keys[size_t(c * rows + t)]);
        std::sort(pool.begin(), pool.end());
        EXPECT_EQ(got[size_t(c)], pool[size_t(r - 1)]) << "column " << c << " rank " << r;
        // World 1: the bf16 rounding of the fp32 order statistic (rounding is monotone).
        std::vector<float> f;
        for (int64_t t = 0; t < rows; ++t)
          if (!masked || valid[size_t(t)]) f.push_back(v[size_t(t * columns + c)]);
        std::sort(f.begin(), f.end());
        EXPECT_EQ(value_of_order_key(got[size_t(c)]), bf16_to_f32(f32_to_bf16(f[size_t(r - 1)])));
      }
    }
  }
}

TEST(GlobalKthSmallest, QbUpdateGivesEachExpertItsShareWithinTies) {
  // beta_e = (C + 1)-th largest margin: C margins lie above it, up to the threshold's ties.
  Rng rng(9);
  const int64_t n = 200, E = 8, k = 2, C = n * k / E;
  std::vector<float> m(size_t(n * E));
  for (auto& x : m) x = rng.normal() + (rng.below(5) == 0 ? 0.25f : 0.0f);
  LocalExpertComm comm;
  const auto keys = keys_of(m, n, E);
  const auto beta = global_kth_smallest(
      keys, E, {}, [&](int64_t rows) { return qb_rank(rows, k, E); }, comm);
  for (int64_t e = 0; e < E; ++e) {
    int64_t above = 0, at = 0;
    for (int64_t t = 0; t < n; ++t) {
      above += keys[size_t(e * n + t)] > beta[size_t(e)];
      at += keys[size_t(e * n + t)] == beta[size_t(e)];
    }
    EXPECT_LE(above, C);
    EXPECT_GE(above + at, C + 1);
  }
}

TEST(AveragedQuantile, DependsOnHowTokensAreSplit) {
  // One column of 8 values split over two ranks in two ways; the pooled median is one
  // value, the mean of the per-rank medians is not.
  const std::vector<float> pool = {1, 2, 3, 4, 5, 6, 7, 8};
  auto local_kth = [](std::vector<float> shard) {
    LocalExpertComm comm;
    const auto keys = keys_of(shard, int64_t(shard.size()), 1);
    return value_of_order_key(global_kth_smallest(
        keys, 1, {}, [](int64_t n) { return (n + 1) / 2; }, comm)[0]);
  };
  const float split_a = (local_kth({1, 2, 3, 4}) + local_kth({5, 6, 7, 8})) / 2;  // (2 + 6) / 2
  const float split_b = (local_kth({1, 3, 5, 7}) + local_kth({2, 4, 6, 8})) / 2;  // (3 + 4) / 2
  EXPECT_EQ(split_a, 4.0f);
  EXPECT_EQ(split_b, 3.5f);
  EXPECT_EQ(local_kth(pool), 4.0f);  // the exact pooled 4th smallest of 8
}

// Column-major values of [rows, columns] (row-major input).
std::vector<float> columns_of(const std::vector<float>& v, int64_t rows, int64_t columns) {
  std::vector<float> out(v.size());
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t c = 0; c < columns; ++c) out[size_t(c * rows + t)] = v[size_t(t * columns + c)];
  return out;
}

// An f64 edge rounded down to f32, by a scan of the f32 neighbours.
float round_down(double e) {
  float f = float(e);
  while (double(f) > e) f = std::nextafter(f, -1e30f);
  return f;
}

// The histogram answer by its definition, naively: the r-th smallest of the sorted pool, its
// bin by a scan of the edges (edge_j = lo + j w in f64 for j < bins), the bin's upper edge
// rounded down to f32 (hi for the last bin, lo when lo = hi); zeros as +0.
float naive_histogram_quantile(const std::vector<float>& sorted, int64_t bins, int64_t r) {
  const double lo = double(sorted.front()) + 0.0, hi = double(sorted.back()) + 0.0;
  const double w = (hi - lo) / double(bins), x = sorted[size_t(r - 1)];
  if (w == 0) return float(lo);
  int64_t b = 0;
  while (b + 1 < bins && x >= lo + double(b + 1) * w) ++b;
  return b + 1 == bins ? float(hi) : round_down(lo + double(b + 1) * w);
}

TEST(HistogramQuantile, OneRankIsAtMostOneBinAboveTheSortedPoolWithTwoCollectives) {
  Rng rng(17);
  const int64_t rows = 301, columns = 7;
  const float big = std::numeric_limits<float>::max();
  std::vector<float> v(size_t(rows * columns));
  for (int64_t t = 0; t < rows; ++t) {
    float* r = v.data() + t * columns;
    r[0] = rng.normal();                     // spread
    r[1] = float(int(rng.below(3))) - 1.0f;  // heavy ties, on the bin edges
    r[2] = 2.5f;                             // constant
    r[3] = rng.below(2) ? 0.0f : -0.0f;      // +-0: one value
    r[4] = rng.below(2) ? big : -big;        // a range beyond f32
    r[5] = 100.0f + rng.normal() * 1e-4f;    // narrow, far from 0
    // Mostly +-0 at the top of [-3, 0], -0 first: the answer is the last bin's edge, hi.
    r[6] = t > 0 && rng.below(3) == 0 ? -float(1 + rng.below(3))
                                      : (t > 0 && rng.below(2) ? 0.0f : -0.0f);
  }
  std::vector<uint8_t> valid(static_cast<size_t>(rows));
  for (auto& m : valid) m = rng.below(4) != 0;
  const auto values = columns_of(v, rows, columns);
  for (int64_t bins : {int64_t(1000), int64_t(7)}) {
    for (bool masked : {false, true}) {
      for (int64_t r : {int64_t(1), int64_t(17), int64_t(150), int64_t(0)}) {  // 0: the QB rank
        SCOPED_TRACE(std::to_string(bins) + " bins, masked " + std::to_string(masked) + ", rank " +
                     std::to_string(r));
        CountingComm comm;
        auto rank_of = [&](int64_t n) { return r > 0 ? r : qb_rank(n, 2, 8); };
        const auto got = global_histogram_quantile(
            values, columns, masked ? std::span<const uint8_t>(valid) : std::span<const uint8_t>(),
            bins, rank_of, comm);
        // One maximum of 2 E floats (the range), one sum of E B counters.
        EXPECT_EQ(comm.max_calls, (std::vector<size_t>{size_t(2 * columns)}));
        EXPECT_EQ(comm.calls, (std::vector<size_t>{size_t(columns * bins)}));
        for (int64_t c = 0; c < columns; ++c) {
          std::vector<float> pool;
          for (int64_t t = 0; t < rows; ++t)
            if (!masked || valid[size_t(t)]) pool.push_back(v[size_t(t * columns + c)]);
          std::sort(pool.begin(), pool.end());
          const float x = pool[size_t(rank_of(int64_t(pool.size())) - 1)];
          const double w = (double(pool.back()) - double(pool.front())) / double(bins);
          const float q = got[size_t(c)];
          // Never below the order statistic, at most one bin width above it (the spec's bound;
          // the slack covers the f64 rounding of the edges only).
          EXPECT_GE(q, x) << "column " << c;
          EXPECT_LE(double(q) - double(x), w * (1 + 1e-12)) << "column " << c;
          EXPECT_EQ(std::bit_cast<uint32_t>(q), std::bit_cast<uint32_t>(naive_histogram_quantile(
                                                    pool, bins, rank_of(int64_t(pool.size())))))
              << "column " << c;
          if (c == 2) {
            EXPECT_EQ(q, 2.5f);  // lo = hi: exact
          }
          if (c == 3) {
            EXPECT_EQ(q, 0.0f);
          }
          if (q == 0.0f) {
            EXPECT_FALSE(std::signbit(q)) << "column " << c;  // never -0
          }
        }
      }
    }
  }
}

// Bins narrower than the f32 spacing of their values (a range of 3.2e-7 at 5.89, B = 1000),
// every value an edge rounded to f32 or one of its f32 neighbours: there the division's guess
// of a value's bin can miss by one, and the answer still is the bin's by the edges, at every
// rank.
TEST(HistogramQuantile, EqualsItsNaiveTwinBitwiseOnValuesAtTheEdges) {
  const float lo = 5.894250869750977f, hi = 5.894575119018555f;
  const int64_t bins = 1000;
  const double w = (double(hi) - double(lo)) / double(bins);
  std::vector<float> values = {lo, hi};
  for (int64_t j = 1; j < bins; ++j) {
    const float e = float(double(lo) + double(j) * w);
    for (float v : {std::nextafter(e, lo), e, std::nextafter(e, hi)}) values.push_back(v);
  }
  std::vector<float> sorted = values;
  std::sort(sorted.begin(), sorted.end());
  LocalExpertComm comm;
  for (int64_t r = 1; r <= int64_t(values.size()); ++r) {
    const float q = global_histogram_quantile(
        values, 1, {}, bins, [&](int64_t) { return r; }, comm)[0];
    ASSERT_EQ(std::bit_cast<uint32_t>(q),
              std::bit_cast<uint32_t>(naive_histogram_quantile(sorted, bins, r)))
        << "rank " << r;
  }
}

TEST(HistogramQuantile, RefusesNonFiniteValuesFewBinsAndEmptyColumns) {
  LocalExpertComm comm;
  auto median = [](int64_t n) { return (n + 1) / 2; };
  for (float bad : {std::nanf(""), std::numeric_limits<float>::infinity(),
                    -std::numeric_limits<float>::infinity()}) {
    const std::vector<float> values = {1.0f, bad, 2.0f};
    EXPECT_THROW(global_histogram_quantile(values, 1, {}, 1000, median, comm), Error) << bad;
    // A masked-out value takes no part.
    const std::vector<uint8_t> valid = {1, 0, 1};
    EXPECT_EQ(global_histogram_quantile(values, 1, valid, 1000, median, comm)[0],
              round_down(1.0 + 1.0 / 1000));  // the upper edge of the first bin
  }
  const std::vector<float> values = {1.0f, 2.0f};
  EXPECT_THROW(global_histogram_quantile(values, 1, {}, 1, median, comm), Error);
  const std::vector<uint8_t> none = {0, 0};
  EXPECT_THROW(global_histogram_quantile(values, 1, none, 1000, median, comm), Error);
}

}  // namespace
}  // namespace tessel::moe
