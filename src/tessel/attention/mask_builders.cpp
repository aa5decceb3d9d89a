#include "tessel/attention/mask_builders.hpp"

#include <algorithm>

#include "tessel/core/error.hpp"

namespace tessel::attention {

namespace {

int32_t i32(int64_t x) {
  return int32_t(x);
}

// Document index, start and end of every position.
struct Documents {
  int64_t N = 0, count = 0;
  std::vector<int64_t> doc, start, end;  // [N]
  std::vector<int64_t> ends;             // e_d per document
};

Documents documents(const std::vector<int64_t>& lengths, const char* who) {
  if (lengths.empty()) input_error(who, ": needs at least one document");
  Documents d;
  d.count = int64_t(lengths.size());
  for (size_t i = 0; i < lengths.size(); ++i) {
    if (lengths[i] < 1)
      input_error(who, ": document ", i, " has length ", lengths[i], ", expected >= 1");
    d.N += lengths[i];
  }
  if (d.N > INT32_MAX) input_error(who, ": sequence length ", d.N, " exceeds int32");
  int64_t s = 0;
  for (size_t i = 0; i < lengths.size(); ++i) {
    for (int64_t t = 0; t < lengths[i]; ++t) {
      d.doc.push_back(int64_t(i));
      d.start.push_back(s);
      d.end.push_back(s + lengths[i]);
    }
    s += lengths[i];
    d.ends.push_back(s);
  }
  return d;
}

void check_length(int64_t n, const char* what, const char* who) {
  if (n < 1 || n > INT32_MAX) input_error(who, ": ", what, " = ", n, ", expected in [1, 2^31)");
}

}  // namespace

ColumnMask stack_masks(int64_t Sq, int64_t Sk, int64_t B, int64_t Hm,
                       const std::vector<MaskColumns>& rows) {
  if (int64_t(rows.size()) != B * Hm || rows.empty())
    input_error("stack_masks: expected B * Hm = ", B * Hm, " column sets, got ", rows.size());
  std::vector<int32_t> values;
  values.reserve(size_t(B * Hm * Sk * rows[0].V));
  for (const MaskColumns& r : rows) {
    if (r.causal != rows[0].causal || r.V != rows[0].V)
      input_error("stack_masks: every column set must have the same form (causal, V)");
    if (int64_t(r.values.size()) != Sk * r.V)
      input_error("stack_masks: a column set holds ", r.values.size(),
                  " values, expected Sk * V = ", Sk * r.V);
    values.insert(values.end(), r.values.begin(), r.values.end());
  }
  return ColumnMask(B, Hm, Sq, Sk, rows[0].V, rows[0].causal, values);
}

std::vector<int64_t> doc_lengths_from_starts(const std::vector<int32_t>& starts, int64_t T) {
  if (starts.empty() || starts[0] != 0)
    input_error("document starts must begin with 0 (the row's first document)");
  std::vector<int64_t> lengths;
  for (size_t i = 0; i < starts.size(); ++i) {
    const int64_t end = i + 1 < starts.size() ? starts[i + 1] : T;
    if (end <= starts[i] || end > T)
      input_error("document starts must ascend strictly inside [0, T=", T, "), got ", starts[i],
                  " then ", end);
    lengths.push_back(end - starts[i]);
  }
  return lengths;
}

ColumnMask causal_document_batch_mask(const std::vector<std::vector<int32_t>>& doc_starts,
                                      int64_t T) {
  std::vector<MaskColumns> rows;
  for (const auto& starts : doc_starts)
    rows.push_back(causal_document_mask(doc_lengths_from_starts(starts, T)));
  return stack_masks(T, T, int64_t(doc_starts.size()), 1, rows);
}

MaskColumns causal_mask(int64_t Sq, int64_t Sk) {
  check_length(Sq, "Sq", "causal mask");
  check_length(Sk, "Sk", "causal mask");
  return {true, 1, std::vector<int32_t>(size_t(Sk), i32(Sq))};
}

MaskColumns sliding_window_mask(int64_t Sq, int64_t Sk, int64_t w) {
  check_length(Sq, "Sq", "sliding window mask");
  check_length(Sk, "Sk", "sliding window mask");
  if (w < 1) input_error("sliding window mask: window = ", w, ", expected >= 1");
  w = std::min(w, Sk);  // as in restrict_to_window
  MaskColumns m{true, 1, std::vector<int32_t>(size_t(Sk))};
  // Row i sees key j while j > i + (Sk - Sq) - w, i.e. i < j - (Sk - Sq) + w.
  for (int64_t j = 0; j < Sk; ++j)
    m.values[size_t(j)] = i32(std::clamp(j - (Sk - Sq) + w, int64_t(0), Sq));
  return m;
}

ColumnMask restrict_to_window(const ColumnMask& mask, int64_t w) {
  if (w < 1) input_error("sliding window: window = ", w, ", expected >= 1");
  if (!mask.causal()) input_error("sliding window: needs a causal mask");
  const int64_t B = mask.batch(), Hm = mask.mask_heads(), Sq = mask.rows(), Sk = mask.cols();
  w = std::min(w, Sk);  // as wide as the keys: no row is cut, and j + w cannot overflow
  std::vector<int32_t> values(size_t(B * Hm * Sk * 2));
  int32_t* out = values.data();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t hm = 0; hm < Hm; ++hm) {
      const int32_t* lts = mask.vector(b, hm, kLTS);
      const int32_t* lte = mask.vector(b, hm, kLTE);
      for (int64_t j = 0; j < Sk; ++j, out += 2) {
        // The window's first masked row of this column (Sq: none).
        const int64_t first = std::clamp(j - (Sk - Sq) + w, int64_t(0), Sq);
        if (first == Sq) {
          out[0] = lts[j], out[1] = lte[j];
        } else if (lts[j] == lte[j] || first <= lte[j]) {
          out[0] = i32(lts[j] == lte[j] ? first : std::min<int64_t>(lts[j], first));
          out[1] = i32(Sq);
        } else {
          input_error("sliding window: column ", j, " of mask (", b, ", ", hm, ") masks rows [",
                      lts[j], ", ", lte[j], ") and the window rows [", first, ", ", Sq,
                      "): two intervals");
        }
      }
    }
  return ColumnMask(B, Hm, Sq, Sk, 2, true, values);
}

MaskColumns causal_document_mask(const std::vector<int64_t>& doc_lengths) {
  const Documents d = documents(doc_lengths, "causal document mask");
  MaskColumns m{true, 1, std::vector<int32_t>(size_t(d.N))};
  for (int64_t j = 0; j < d.N; ++j) m.values[size_t(j)] = i32(d.end[size_t(j)]);
  return m;
}

MaskColumns document_mask(const std::vector<int64_t>& doc_lengths) {
  const Documents d = documents(doc_lengths, "document mask");
  MaskColumns m{false, 2, std::vector<int32_t>(size_t(2 * d.N))};
  for (int64_t j = 0; j < d.N; ++j) {
    m.values[size_t(2 * j)] = i32(d.end[size_t(j)]);
    m.values[size_t(2 * j + 1)] = i32(d.start[size_t(j)]);
  }
  return m;
}

MaskColumns share_question_mask(const std::vector<int64_t>& doc_lengths) {
  const Documents d = documents(doc_lengths, "share-question mask");
  MaskColumns m{true, 1, std::vector<int32_t>(size_t(d.N))};
  for (int64_t j = 0; j < d.N; ++j)
    m.values[size_t(j)] = i32(d.doc[size_t(j)] == 0 ? d.N : d.end[size_t(j)]);
  return m;
}

MaskColumns global_sliding_window_mask(int64_t N, int64_t global, int64_t w_left, int64_t w_right) {
  check_length(N, "N", "global + sliding window mask");
  if (global < 0 || global > N || w_left < 0 || w_right < 0)
    input_error("global + sliding window mask: need 0 <= global <= N and windows >= 0, got global=",
                global, " w_left=", w_left, " w_right=", w_right, " N=", N);
  // A window of N or more cuts nothing (INT64_MAX for "unbounded"): clamped, the sums below
  // cannot overflow.
  w_left = std::min(w_left, N);
  w_right = std::min(w_right, N);
  MaskColumns m{false, 4, std::vector<int32_t>(size_t(4 * N))};
  for (int64_t j = 0; j < N; ++j) {
    int32_t* v = m.values.data() + 4 * j;
    v[kLTS] = i32(j < global ? N : std::min(j + w_left + 1, N));
    v[kLTE] = i32(N);
    const bool upper = j >= global + w_right + 1;
    v[kUTS] = i32(upper ? global : 0);
    v[kUTE] = i32(upper ? j - w_right : 0);
  }
  return m;
}

MaskColumns causal_blockwise_mask(const std::vector<int64_t>& doc_lengths) {
  const Documents d = documents(doc_lengths, "causal blockwise mask");
  const int64_t n = d.count;
  // With one block the last block is everything: plain causal.
  const int64_t last_start = n >= 2 ? d.ends[size_t(n - 2)] : 0;
  MaskColumns m{true, 2, std::vector<int32_t>(size_t(2 * d.N))};
  for (int64_t j = 0; j < d.N; ++j) {
    const bool in_last = d.doc[size_t(j)] == n - 1;
    m.values[size_t(2 * j)] = i32(in_last ? d.N : d.end[size_t(j)]);
    m.values[size_t(2 * j + 1)] = i32(in_last ? d.N : last_start);
  }
  return m;
}

MaskColumns prefix_lm_causal_mask(int64_t N, int64_t prefix) {
  check_length(N, "N", "prefix-LM causal mask");
  if (prefix < 0 || prefix > N)
    input_error("prefix-LM causal mask: prefix = ", prefix, ", expected in [0, N=", N, "]");
  MaskColumns m{false, 2, std::vector<int32_t>(size_t(2 * N))};
  for (int64_t j = 0; j < N; ++j) {
    m.values[size_t(2 * j)] = i32(N);
    m.values[size_t(2 * j + 1)] = i32(j < prefix ? 0 : j);
  }
  return m;
}

MaskColumns prefix_lm_document_mask(const std::vector<int64_t>& doc_lengths,
                                    const std::vector<int64_t>& prefix_lengths) {
  const Documents d = documents(doc_lengths, "prefix-LM document mask");
  if (prefix_lengths.size() != doc_lengths.size())
    input_error("prefix-LM document mask: ", prefix_lengths.size(), " prefix lengths for ",
                doc_lengths.size(), " documents");
  for (size_t i = 0; i < doc_lengths.size(); ++i)
    if (prefix_lengths[i] < 0 || prefix_lengths[i] > doc_lengths[i])
      input_error("prefix-LM document mask: prefix ", prefix_lengths[i], " of document ", i,
                  " is outside [0, ", doc_lengths[i], "]");
  MaskColumns m{false, 2, std::vector<int32_t>(size_t(2 * d.N))};
  for (int64_t j = 0; j < d.N; ++j) {
    const int64_t s = d.start[size_t(j)];
    const bool in_prefix = j - s < prefix_lengths[size_t(d.doc[size_t(j)])];
    m.values[size_t(2 * j)] = i32(d.end[size_t(j)]);
    m.values[size_t(2 * j + 1)] = i32(in_prefix ? s : j);
  }
  return m;
}

MaskColumns qk_sparse_mask(int64_t N, const std::vector<Span>& spans) {
  check_length(N, "N", "QK-sparse mask");
  MaskColumns m{true, 2, std::vector<int32_t>(size_t(2 * N), i32(N))};
  int64_t prev_end = 0;
  for (const Span& s : spans) {
    if (s.length < 1 || s.offset < prev_end || s.length > N - s.offset)  // no overflow
      input_error("QK-sparse mask: span at ", s.offset, " of length ", s.length,
                  " must be non-empty, after the previous span and inside [0, N=", N, ")");
    for (int64_t j = s.offset; j < s.offset + s.length; ++j) {
      m.values[size_t(2 * j)] = i32(j);
      m.values[size_t(2 * j + 1)] = i32(s.offset + s.length);
    }
    prev_end = s.offset + s.length;
  }
  return m;
}

MaskColumns random_eviction_mask(const std::vector<int64_t>& evict_row) {
  const int64_t N = int64_t(evict_row.size());
  check_length(N, "N", "random eviction mask");
  MaskColumns m{true, 1, std::vector<int32_t>(size_t(N))};
  for (int64_t j = 0; j < N; ++j) {
    const int64_t r = evict_row[size_t(j)];
    if (r <= j || r > N)
      input_error("random eviction mask: key ", j, " evicted at row ", r, ", expected in (", j,
                  ", N=", N, "]");
    m.values[size_t(j)] = i32(r);
  }
  return m;
}

}  // namespace tessel::attention
