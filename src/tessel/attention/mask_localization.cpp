#include "tessel/attention/mask_localization.hpp"

#include <algorithm>
#include <utility>

#include "tessel/core/error.hpp"

namespace tessel::attention {

namespace {

// A non-causal 4-vector mask [B, Hm, Sq, Sk] whose value (b, hm, v, j) is f(b, hm, v, j).
template <class F>
ColumnMask build(int64_t B, int64_t Hm, int64_t Sq, int64_t Sk, F f) {
  std::vector<int32_t> values(size_t(B * Hm * Sk * 4));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t hm = 0; hm < Hm; ++hm)
      for (int64_t j = 0; j < Sk; ++j)
        for (int v = 0; v < 4; ++v)
          values[size_t(((b * Hm + hm) * Sk + j) * 4 + v)] = f(b, hm, v, j);
  return ColumnMask(B, Hm, Sq, Sk, 4, false, values);
}

}  // namespace

ColumnMask explicit_form(const ColumnMask& m) {
  const int64_t Sq = m.rows(), Sk = m.cols(), off = Sk - Sq;
  return build(m.batch(), m.mask_heads(), Sq, Sk, [&](int64_t b, int64_t hm, int v, int64_t j) {
    if (!m.causal() || v == kLTS || v == kLTE) return m.vector(b, hm, v)[j];
    TESSEL_CHECK(m.vector(b, hm, kUTS)[j] == 0 && m.vector(b, hm, kUTE)[j] == 0,
                 "a causal mask with an upper interval");
    return v == kUTS ? int32_t(0) : int32_t(std::clamp<int64_t>(j - off, 0, Sq));
  });
}

ColumnMask localize_rows(const ColumnMask& mask, const CpLayout& layout,
                         const std::vector<int64_t>& chunks) {
  TESSEL_CHECK(layout.seq == mask.rows(), "layout of ", layout.seq, " rows for a mask of ",
               mask.rows());
  TESSEL_CHECK(std::is_sorted(chunks.begin(), chunks.end()), "kept chunks must ascend");
  const ColumnMask m = mask.causal() ? explicit_form(mask) : mask;
  std::vector<std::pair<int64_t, int64_t>> kept;  // [c0, c1) of each chunk
  int64_t rows = 0;
  for (int64_t c : chunks) {
    kept.emplace_back(layout.chunk_begin(c), layout.chunk_end(c));
    rows += layout.chunk_rows(c);
  }
  return build(m.batch(), m.mask_heads(), rows, m.cols(),
               [&](int64_t b, int64_t hm, int v, int64_t j) {
                 const int64_t x = m.vector(b, hm, v)[j];
                 int64_t below = 0;
                 for (const auto& [c0, c1] : kept) below += std::clamp(x - c0, int64_t(0), c1 - c0);
                 return int32_t(below);
               });
}

ColumnMask select_columns(const ColumnMask& mask, const std::vector<ColumnSpan>& spans) {
  TESSEL_CHECK(!mask.causal(), "select_columns needs an explicit (non-causal) mask");
  std::vector<int64_t> cols;
  for (const ColumnSpan& span : spans) {
    TESSEL_CHECK(span.begin >= 0 && span.end <= mask.cols(), "columns [", span.begin, ", ",
                 span.end, ") of a mask of ", mask.cols());
    for (int64_t j = span.begin; j < span.end; ++j) cols.push_back(j);
  }
  return build(mask.batch(), mask.mask_heads(), mask.rows(), int64_t(cols.size()),
               [&](int64_t b, int64_t hm, int v, int64_t j) {
                 return mask.vector(b, hm, v)[cols[size_t(j)]];
               });
}

ColumnMask select_columns(const ColumnMask& mask, const CpLayout& layout,
                          const std::vector<int64_t>& chunks) {
  TESSEL_CHECK(layout.seq == mask.cols(), "layout of ", layout.seq, " columns for a mask of ",
               mask.cols());
  std::vector<ColumnSpan> spans;
  for (int64_t c : chunks) spans.push_back({layout.chunk_begin(c), layout.chunk_end(c)});
  return select_columns(mask, spans);
}

bool column_fully_masked(int32_t lts, int32_t lte, int32_t uts, int32_t ute, int64_t rows) {
  // The two intervals, empty ones dropped, ordered by start.
  std::pair<int64_t, int64_t> iv[2];
  int n = 0;
  if (lts < lte) iv[n++] = {lts, lte};
  if (uts < ute) iv[n++] = {uts, ute};
  if (n == 0) return rows == 0;
  if (n == 2 && iv[1].first < iv[0].first) std::swap(iv[0], iv[1]);
  int64_t covered = 0;  // rows [0, covered) are masked
  for (int i = 0; i < n; ++i)
    if (iv[i].first <= covered) covered = std::max(covered, iv[i].second);
  return covered >= rows;
}

std::vector<ColumnSpan> needed_spans(const ColumnMask& m, const CpLayout& layout) {
  TESSEL_CHECK(!m.causal(), "needed_spans needs an explicit (non-causal) mask");
  TESSEL_CHECK(layout.seq == m.cols(), "layout of ", layout.seq, " columns for a mask of ",
               m.cols());
  auto seen = [&m](int64_t j) {  // whether some row sees column j
    for (int64_t b = 0; b < m.batch(); ++b)
      for (int64_t hm = 0; hm < m.mask_heads(); ++hm)
        if (!column_fully_masked(m.vector(b, hm, kLTS)[j], m.vector(b, hm, kLTE)[j],
                                 m.vector(b, hm, kUTS)[j], m.vector(b, hm, kUTE)[j], m.rows()))
          return true;
    return false;
  };
  std::vector<ColumnSpan> spans(size_t(layout.num_chunks()));
  for (int64_t c = 0; c < layout.num_chunks(); ++c) {
    int64_t first = layout.chunk_begin(c), last = layout.chunk_end(c);
    while (first < last && !seen(first)) ++first;
    while (last > first && !seen(last - 1)) --last;
    spans[size_t(c)] = {first, last};
  }
  return spans;
}

}  // namespace tessel::attention
