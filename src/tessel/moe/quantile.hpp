#pragma once
// Quantiles for quantile balancing (spec moe_balancing.md, sections 2.4 to 2.6).
//
// The 16-bit order key of a float: round to bf16 (nearest even), read its bits u;
//   key = u | 0x8000 for u < 0x8000 (sign bit clear), key = ~u & 0xFFFF otherwise.
// Keys are strictly monotone in the real order of the bf16 values and exactly invertible;
// -0 -> 0x7FFF and +0 -> 0x8000 (distinct, adjacent). NaN is out of the domain
// (TESSEL_CHECK).
//
// The global k-th smallest per column by radix select: pass 1 histograms the high key byte
// of every valid value, one all-reduce (sum) of [columns x 256] int32 counters over the
// balancing group fixes the high byte b1 of the answer; pass 2 histograms the low byte of
// the values whose high byte is b1, a second all-reduce fixes it. Integer sums do not
// depend on how the values are spread over ranks or on reduction order, so the result is
// the rank-r element of the pooled, sorted bf16 values, bitwise, for any sharding.
//
// The histogram baseline (spec 2.6, the "Kimi K3" estimator) answers within one bin width:
// global_histogram_quantile below.
#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "tessel/moe/expert_comm.hpp"

namespace tessel::moe {

uint16_t bf16_order_key(float x);
uint16_t order_key_from_bits(uint16_t bf16_bits);  // the key of a bf16 bit pattern
uint16_t bits_from_order_key(uint16_t key);        // the inverse
float value_of_order_key(uint16_t key);            // the bf16 value of a key, as f32

// The rank to take among n pooled values, 1-based (1 = smallest).
using RankOf = std::function<int64_t(int64_t n)>;

// In place, element-wise sums of int32 counters over a group of ranks.
using SumCounters = std::function<void(int32_t* data, size_t n)>;

// keys: [columns][rows] (column-major: column c is keys[c * rows .. (c + 1) * rows)),
// this rank's share; valid: [rows] or empty (all valid). For each column c, the
// rank_of(n)-th smallest of the valid keys of all ranks together (n counted over all
// ranks, after masking), as a key. Exactly two sum_counters calls of columns * 256
// int32 each. TESSEL_CHECK: every column has n >= 1 and 1 <= rank_of(n) <= n.
std::vector<uint16_t> global_kth_smallest(std::span<const uint16_t> keys, int64_t columns,
                                          std::span<const uint8_t> valid, const RankOf& rank_of,
                                          const SumCounters& sum_counters);
// The same over the balancing group (comm.sum_counters).
std::vector<uint16_t> global_kth_smallest(std::span<const uint16_t> keys, int64_t columns,
                                          std::span<const uint8_t> valid, const RankOf& rank_of,
                                          ExpertComm& comm);

// In place, element-wise maxima of f32 values over a group of ranks.
using MaxValues = std::function<void(float* data, size_t n)>;

// The histogram estimate of the same order statistic, over f32 values: values
// [columns][rows] column-major as `keys` above, valid and rank_of as above. Per column c,
// over the valid values of all ranks: lo and hi are their minimum and maximum (one
// max_values call of 2 * columns floats: the maxima of v and of -v); `bins` uniform bins of
// width w = (hi - lo) / bins have the edges lo + j w (j < bins, in f64) and hi, bin j holds
// edge_j <= v < edge_j+1 (the last one hi too); one sum_counters call of columns * bins int32
// counts finds the bin b that holds the rank_of(n)-th smallest valid value x_r, and the
// answer is its upper edge rounded down to f32 (hi for the last bin; lo when lo = hi). Hence
//   x_r <= answer <= x_r + w
// (x_r is an f32 below the edge, so the largest f32 at or below the edge is at least x_r):
// never below the order statistic, at most one bin width above (up to the f64 rounding of the
// edges). Two collectives in all: the spec (2.6) names
// one, which holds for a range known in advance; the global [min, max] costs this second,
// 2E-float one. The range is exact
// (-0 counts as +0, so its bits do not depend on the reduction order) and the counts are
// integers, so the answer is bitwise the same for any sharding. TESSEL_CHECK: every value
// finite (NaN and +-inf have no place in uniform bins), bins >= 2, and the rank rules of
// global_kth_smallest.
std::vector<float> global_histogram_quantile(std::span<const float> values, int64_t columns,
                                             std::span<const uint8_t> valid, int64_t bins,
                                             const RankOf& rank_of, const MaxValues& max_values,
                                             const SumCounters& sum_counters);
// The same over the balancing group (comm.max_values, comm.sum_counters).
std::vector<float> global_histogram_quantile(std::span<const float> values, int64_t columns,
                                             std::span<const uint8_t> valid, int64_t bins,
                                             const RankOf& rank_of, ExpertComm& comm);

// Quantile balancing's rank (spec 2.2): beta_e is the (C + 1)-th largest of n margins,
// C = floor(n * k / E), i.e. the (n - C)-th smallest (at least 1).
int64_t qb_rank(int64_t n, int64_t top_k, int64_t experts);

}  // namespace tessel::moe
