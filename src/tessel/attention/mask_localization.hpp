#pragma once
// Zero-communication mask localisation for context parallelism (spec specs/flashmask.md
// §5.2-§5.3). Every rank holds the global O(S) column vectors and rewrites them for its own
// rows; nothing is exchanged.
//
//   explicit_form:  implicit (bottom-right) causal -> an explicit upper interval. A causal
//                   mask has no upper interval of its own (UTS = UTE = 0), so
//                   UTS = 0, UTE_j = clamp(j - (Sk - Sq), 0, Sq) and the result is non-causal.
//   localize_rows:  keep the query rows of ascending `chunks` (a CpLayout's chunking of the
//                   rows), renumbered 0.. in order. Each value v of all four vectors becomes
//                   v' = the number of kept rows with global position < v
//                      = sum over kept chunks [c0, c1) of clamp(v - c0, 0, c1 - c0)
//                   (the spec's clip-shift-max, written as a sum: the kept-row map is strictly
//                   increasing, so i >= v <=> local(i) >= v' for every kept row i).
//   select_columns: the key columns of `chunks` (or of column spans) in the given order (any
//                   order); values unchanged (they index rows).
//   needed_spans:   for a localized (non-causal) mask, the columns of each key chunk that
//                   some row sees, as the smallest span holding them all: a column is prunable
//                   iff the union of its two intervals covers all rows [0, Sq), for every
//                   batch row and mask head; the chunk is prunable when its span is empty.
//                   Finer than the spec's 256/512-column sub-chunks: exact to the column.
#include <cstdint>
#include <vector>

#include "tessel/attention/cp_layout.hpp"
#include "tessel/attention/mask.hpp"

namespace tessel::attention {

ColumnMask explicit_form(const ColumnMask& mask);
// `layout` chunks the mask's rows (layout.seq == mask.rows()); the result is non-causal.
ColumnMask localize_rows(const ColumnMask& mask, const CpLayout& layout,
                         const std::vector<int64_t>& chunks);
// Columns [begin, end) of a mask.
struct ColumnSpan {
  int64_t begin = 0, end = 0;
  int64_t size() const { return end - begin; }
  bool empty() const { return end <= begin; }
  bool operator==(const ColumnSpan&) const = default;
};

// The columns of `spans` in order; mask must be non-causal.
ColumnMask select_columns(const ColumnMask& mask, const std::vector<ColumnSpan>& spans);
// The columns of `chunks` of `layout` (layout.seq == mask.cols()) in order.
ColumnMask select_columns(const ColumnMask& mask, const CpLayout& layout,
                          const std::vector<int64_t>& chunks);
// Whether rows [0, rows) are all masked in a column with intervals [lts, lte) and [uts, ute).
bool column_fully_masked(int32_t lts, int32_t lte, int32_t uts, int32_t ute, int64_t rows);
// Per key chunk of `layout` (over mask.cols()): the smallest span of its columns outside which
// no row sees any column (empty: no row sees the chunk).
std::vector<ColumnSpan> needed_spans(const ColumnMask& localized, const CpLayout& layout);

}  // namespace tessel::attention
