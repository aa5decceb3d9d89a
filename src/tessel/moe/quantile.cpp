#include "tessel/moe/quantile.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "tessel/core/bf16.hpp"
#include "tessel/core/error.hpp"

namespace tessel::moe {

uint16_t order_key_from_bits(uint16_t u) {
  return u < 0x8000 ? uint16_t(u | 0x8000) : uint16_t(~u & 0xFFFF);
}

uint16_t bits_from_order_key(uint16_t key) {
  return key >= 0x8000 ? uint16_t(key & 0x7FFF) : uint16_t(~key & 0xFFFF);
}

uint16_t bf16_order_key(float x) {
  TESSEL_CHECK(!std::isnan(x), "NaN has no order key");
  return order_key_from_bits(f32_to_bf16(x));
}

float value_of_order_key(uint16_t key) {
  return bf16_to_f32(bits_from_order_key(key));
}

int64_t qb_rank(int64_t n, int64_t top_k, int64_t experts) {
  return std::max<int64_t>(1, n - n * top_k / experts);
}

namespace {
// r (1-based) inside the histogram row h[bins]: the bin b with cum(b-1) < r <= cum(b); r
// becomes the rank inside that bin.
int64_t select_bin(const int32_t* h, int64_t bins, int64_t& r) {
  for (int64_t b = 0; b < bins; ++b) {
    if (r <= h[b]) return b;
    r -= h[b];
  }
  TESSEL_CHECK(false, "rank beyond the histogram");
}

// The rows of `size` column-major values in `columns` columns, checked against the mask.
int64_t rows_of(size_t size, int64_t columns, std::span<const uint8_t> valid) {
  TESSEL_CHECK(columns > 0 && int64_t(size) % columns == 0, "values of ", size, " for ", columns,
               " columns");
  const int64_t rows = int64_t(size) / columns;
  TESSEL_CHECK(valid.empty() || int64_t(valid.size()) == rows, "valid mask of ", valid.size(),
               " for ", rows, " rows");
  return rows;
}

// Whether row t takes part (an empty mask: every row).
bool is_valid(std::span<const uint8_t> valid, int64_t t) {
  return valid.empty() || valid[size_t(t)] != 0;
}

// The largest f32 at or below e: an upper bin edge rounded this way stays at or above every
// f32 value of its bin (they lie below the edge) and never passes the edge itself, which keeps
// the answer within one bin width of the order statistic (the spec's bound).
float f32_at_or_below(double e) {
  const float f = float(e);
  return double(f) > e ? std::nextafter(f, -std::numeric_limits<float>::infinity()) : f;
}

// The rank r (1-based) of n values, checked.
int64_t checked_rank(const RankOf& rank_of, int64_t n, int64_t column) {
  TESSEL_CHECK(n >= 1, "column ", column, " has no valid value");
  const int64_t r = rank_of(n);
  TESSEL_CHECK(r >= 1 && r <= n, "rank ", r, " of ", n, " values");
  return r;
}
}  // namespace

std::vector<uint16_t> global_kth_smallest(std::span<const uint16_t> keys, int64_t columns,
                                          std::span<const uint8_t> valid, const RankOf& rank_of,
                                          const SumCounters& sum_counters) {
  const int64_t rows = rows_of(keys.size(), columns, valid);
  std::vector<int32_t> h(size_t(columns * 256), 0);
  for (int64_t c = 0; c < columns; ++c) {
    const uint16_t* col = keys.data() + c * rows;
    int32_t* hc = h.data() + c * 256;
    for (int64_t t = 0; t < rows; ++t)
      if (is_valid(valid, t)) ++hc[col[t] >> 8];
  }
  sum_counters(h.data(), h.size());
  std::vector<int64_t> rank(static_cast<size_t>(columns));
  std::vector<int> high(static_cast<size_t>(columns));
  for (int64_t c = 0; c < columns; ++c) {
    const int32_t* hc = h.data() + c * 256;
    int64_t n = 0;
    for (int b = 0; b < 256; ++b) n += hc[b];
    int64_t r = checked_rank(rank_of, n, c);
    high[size_t(c)] = int(select_bin(hc, 256, r));
    rank[size_t(c)] = r;
  }
  std::fill(h.begin(), h.end(), 0);
  for (int64_t c = 0; c < columns; ++c) {
    const uint16_t* col = keys.data() + c * rows;
    int32_t* hc = h.data() + c * 256;
    const int b1 = high[size_t(c)];
    for (int64_t t = 0; t < rows; ++t)
      if (is_valid(valid, t) && (col[t] >> 8) == b1) ++hc[col[t] & 0xFF];
  }
  sum_counters(h.data(), h.size());
  std::vector<uint16_t> out(static_cast<size_t>(columns));
  for (int64_t c = 0; c < columns; ++c) {
    int64_t r = rank[size_t(c)];
    const int64_t low = select_bin(h.data() + c * 256, 256, r);
    out[size_t(c)] = uint16_t((high[size_t(c)] << 8) | low);
  }
  return out;
}

std::vector<uint16_t> global_kth_smallest(std::span<const uint16_t> keys, int64_t columns,
                                          std::span<const uint8_t> valid, const RankOf& rank_of,
                                          ExpertComm& comm) {
  return global_kth_smallest(keys, columns, valid, rank_of,
                             [&comm](int32_t* data, size_t n) { comm.sum_counters(data, n); });
}

std::vector<float> global_histogram_quantile(std::span<const float> values, int64_t columns,
                                             std::span<const uint8_t> valid, int64_t bins,
                                             const RankOf& rank_of, const MaxValues& max_values,
                                             const SumCounters& sum_counters) {
  const int64_t rows = rows_of(values.size(), columns, valid);
  TESSEL_CHECK(bins >= 2, "a histogram of ", bins, " bins");
  // range[c] = max, range[columns + c] = -min; -inf where a rank has no valid value.
  std::vector<float> range(size_t(2 * columns), -std::numeric_limits<float>::infinity());
  for (int64_t c = 0; c < columns; ++c) {
    const float* col = values.data() + c * rows;
    for (int64_t t = 0; t < rows; ++t) {
      if (!is_valid(valid, t)) continue;
      TESSEL_CHECK(std::isfinite(col[t]), "a histogram quantile of ", col[t]);
      const float v = col[t] + 0.0f;  // -0 -> +0
      range[size_t(c)] = std::max(range[size_t(c)], v);
      range[size_t(columns + c)] = std::max(range[size_t(columns + c)], -v + 0.0f);
    }
  }
  max_values(range.data(), range.size());
  std::vector<double> lo(static_cast<size_t>(columns)), width(static_cast<size_t>(columns));
  for (int64_t c = 0; c < columns; ++c) {
    TESSEL_CHECK(range[size_t(c)] > -std::numeric_limits<float>::infinity(), "column ", c,
                 " has no valid value");
    lo[size_t(c)] = -double(range[size_t(columns + c)]) + 0.0;  // never -0
    width[size_t(c)] = (double(range[size_t(c)]) - lo[size_t(c)]) / double(bins);
  }
  // Edge j of column c: lo + j w below the top, hi at it (f64, the same on every rank).
  auto edge = [&](int64_t c, int64_t j) {
    return j == bins ? double(range[size_t(c)]) : lo[size_t(c)] + double(j) * width[size_t(c)];
  };
  std::vector<int32_t> h(size_t(columns * bins), 0);
  for (int64_t c = 0; c < columns; ++c) {
    const float* col = values.data() + c * rows;
    int32_t* hc = h.data() + c * bins;
    const double w = width[size_t(c)];
    for (int64_t t = 0; t < rows; ++t) {
      if (!is_valid(valid, t)) continue;
      const double v = col[t];
      // A guess by division, then settled against the edges themselves, so that bin b holds
      // exactly edge_b <= v < edge_b+1 (the header's bound rests on it).
      int64_t b = w > 0 ? std::clamp<int64_t>(int64_t((v - lo[size_t(c)]) / w), 0, bins - 1) : 0;
      while (b > 0 && v < edge(c, b)) --b;
      while (b < bins - 1 && v >= edge(c, b + 1)) ++b;
      ++hc[b];
    }
  }
  sum_counters(h.data(), h.size());
  std::vector<float> out(static_cast<size_t>(columns));
  for (int64_t c = 0; c < columns; ++c) {
    const int32_t* hc = h.data() + c * bins;
    int64_t r = checked_rank(rank_of, std::accumulate(hc, hc + bins, int64_t(0)), c);
    const int64_t b = select_bin(hc, bins, r);
    out[size_t(c)] = width[size_t(c)] > 0 ? f32_at_or_below(edge(c, b + 1)) : float(lo[size_t(c)]);
  }
  return out;
}

std::vector<float> global_histogram_quantile(std::span<const float> values, int64_t columns,
                                             std::span<const uint8_t> valid, int64_t bins,
                                             const RankOf& rank_of, ExpertComm& comm) {
  return global_histogram_quantile(
      values, columns, valid, bins, rank_of,
      [&comm](float* data, size_t n) { comm.max_values(data, n); },
      [&comm](int32_t* data, size_t n) { comm.sum_counters(data, n); });
}

}  // namespace tessel::moe
