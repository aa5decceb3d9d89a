#include "tessel/moe/quantile.hpp"

#include <algorithm>
#include <cmath>

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
// r (1-based) inside the histogram row h[256]: the bin b with cum(b-1) < r <= cum(b); r
// becomes the rank inside that bin.
int select_bin(const int32_t* h, int64_t& r) {
  for (int b = 0; b < 256; ++b) {
    if (r <= h[b]) return b;
    r -= h[b];
  }
  TESSEL_CHECK(false, "rank beyond the histogram");
}
}  // namespace

std::vector<uint16_t> global_kth_smallest(std::span<const uint16_t> keys, int64_t columns,
                                          std::span<const uint8_t> valid, const RankOf& rank_of,
                                          const SumCounters& sum_counters) {
  TESSEL_CHECK(columns > 0 && int64_t(keys.size()) % columns == 0, "keys of ", keys.size(), " for ",
               columns, " columns");
  const int64_t rows = int64_t(keys.size()) / columns;
  TESSEL_CHECK(valid.empty() || int64_t(valid.size()) == rows, "valid mask of ", valid.size(),
               " for ", rows, " rows");
  auto is_valid = [&](int64_t t) { return valid.empty() || valid[size_t(t)] != 0; };
  std::vector<int32_t> h(size_t(columns * 256), 0);
  for (int64_t c = 0; c < columns; ++c) {
    const uint16_t* col = keys.data() + c * rows;
    int32_t* hc = h.data() + c * 256;
    for (int64_t t = 0; t < rows; ++t)
      if (is_valid(t)) ++hc[col[t] >> 8];
  }
  sum_counters(h.data(), h.size());
  std::vector<int64_t> rank(static_cast<size_t>(columns));
  std::vector<int> high(static_cast<size_t>(columns));
  for (int64_t c = 0; c < columns; ++c) {
    const int32_t* hc = h.data() + c * 256;
    int64_t n = 0;
    for (int b = 0; b < 256; ++b) n += hc[b];
    TESSEL_CHECK(n >= 1, "column ", c, " has no valid value");
    int64_t r = rank_of(n);
    TESSEL_CHECK(r >= 1 && r <= n, "rank ", r, " of ", n, " values");
    high[size_t(c)] = select_bin(hc, r);
    rank[size_t(c)] = r;
  }
  std::fill(h.begin(), h.end(), 0);
  for (int64_t c = 0; c < columns; ++c) {
    const uint16_t* col = keys.data() + c * rows;
    int32_t* hc = h.data() + c * 256;
    const int b1 = high[size_t(c)];
    for (int64_t t = 0; t < rows; ++t)
      if (is_valid(t) && (col[t] >> 8) == b1) ++hc[col[t] & 0xFF];
  }
  sum_counters(h.data(), h.size());
  std::vector<uint16_t> out(static_cast<size_t>(columns));
  for (int64_t c = 0; c < columns; ++c) {
    int64_t r = rank[size_t(c)];
    const int low = select_bin(h.data() + c * 256, r);
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

}  // namespace tessel::moe
