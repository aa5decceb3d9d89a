#pragma once
// The eleven standard masks of specs/flashmask.md §3 for the attention tests, each with an
// independent visibility predicate written from the mask's definition (not from its interval
// encoding), random documents, and random valid 4-vector masks.
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "tessel/attention/block_mask.hpp"
#include "tessel/attention/mask_builders.hpp"
#include "tessel/core/rng.hpp"
#include "unit/kernels/kernel_test_util.hpp"

namespace tessel::attention::test {

using kernels::test::uniform_int;

// Relative error of lse with -inf rows: the infinities must coincide (else inf), the finite
// entries compare as max |got - want| / max |want|.
inline double lse_error(const kernels::test::VecF& got, const kernels::test::VecD& want) {
  double err = 0, scale = 1e-30;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isinf(want[i]) || std::isinf(got[i])) {
      if (!(double(got[i]) == want[i])) return INFINITY;
      continue;
    }
    err = std::max(err, std::abs(double(got[i]) - want[i]));
    scale = std::max(scale, std::abs(want[i]));
  }
  return err / scale;
}

struct MaskCase {
  std::string name;
  MaskColumns columns;
  std::function<bool(int64_t i, int64_t j)> visible;  // the definition, for Sq = Sk = N
};

// Random document lengths summing to N, each in [1, max_len].
inline std::vector<int64_t> random_documents(Rng& rng, int64_t N, int64_t max_len) {
  std::vector<int64_t> lengths;
  for (int64_t left = N; left > 0;) {
    const int64_t len = std::min(left, uniform_int(rng, 1, std::max<int64_t>(1, max_len)));
    lengths.push_back(len);
    left -= len;
  }
  return lengths;
}

// Document index of every position.
inline std::vector<int64_t> doc_of(const std::vector<int64_t>& lengths) {
  std::vector<int64_t> d;
  for (size_t i = 0; i < lengths.size(); ++i) d.insert(d.end(), size_t(lengths[i]), int64_t(i));
  return d;
}

inline std::vector<int64_t> doc_starts_of(const std::vector<int64_t>& lengths) {
  std::vector<int64_t> s{0};
  for (size_t i = 0; i + 1 < lengths.size(); ++i) s.push_back(s.back() + lengths[i]);
  return s;
}

// All eleven masks for sequence length N, with documents and parameters drawn from rng.
inline std::vector<MaskCase> standard_masks(int64_t N, Rng& rng) {
  const auto docs = random_documents(rng, N, std::max<int64_t>(1, N / 3));
  const auto doc = doc_of(docs);
  const auto start = doc_starts_of(docs);
  const int64_t last = int64_t(docs.size()) - 1;
  std::vector<MaskCase> cases;
  cases.push_back({"causal", causal_mask(N, N), [](int64_t i, int64_t j) { return j <= i; }});
  const int64_t w = N / 8 + 1;
  cases.push_back({"sliding_window", sliding_window_mask(N, N, w),
                   [w](int64_t i, int64_t j) { return j <= i && j > i - w; }});
  cases.push_back({"causal_document", causal_document_mask(docs),
                   [doc](int64_t i, int64_t j) { return j <= i && doc[i] == doc[j]; }});
  cases.push_back(
      {"document", document_mask(docs), [doc](int64_t i, int64_t j) { return doc[i] == doc[j]; }});
  cases.push_back({"share_question", share_question_mask(docs), [doc](int64_t i, int64_t j) {
                     return j <= i && (doc[j] == 0 || doc[j] == doc[i]);
                   }});
  const int64_t G = std::min<int64_t>(N, 3), wl = N / 10, wr = N / 12;
  cases.push_back({"global_sliding_window", global_sliding_window_mask(N, G, wl, wr),
                   [G, wl, wr](int64_t i, int64_t j) {
                     return i < G || j < G || (j >= i - wl && j <= i + wr);
                   }});
  cases.push_back(
      {"causal_blockwise", causal_blockwise_mask(docs), [doc, last](int64_t i, int64_t j) {
         return j <= i && (doc[i] == doc[j] || doc[i] == last);
       }});
  const int64_t P = N / 3;
  cases.push_back({"prefix_lm_causal", prefix_lm_causal_mask(N, P),
                   [P](int64_t i, int64_t j) { return j < P || j <= i; }});
  std::vector<int64_t> prefix;
  for (int64_t len : docs) prefix.push_back(uniform_int(rng, 0, len));
  cases.push_back({"prefix_lm_document", prefix_lm_document_mask(docs, prefix),
                   [doc, start, prefix](int64_t i, int64_t j) {
                     const size_t d = size_t(doc[j]);
                     return doc[i] == doc[j] && (j - start[d] < prefix[d] || j <= i);
                   }});
  std::vector<Span> spans;
  std::vector<int64_t> span_end(size_t(N), -1);  // end of the span holding j, -1 outside
  for (int64_t o = uniform_int(rng, 0, N / 4); o < N; o += uniform_int(rng, 1, N / 4 + 1)) {
    const int64_t len = std::min(N - o, uniform_int(rng, 1, N / 6 + 1));
    spans.push_back({o, len});
    for (int64_t j = o; j < o + len; ++j) span_end[size_t(j)] = o + len;
    o += len;
  }
  cases.push_back({"qk_sparse", qk_sparse_mask(N, spans), [span_end](int64_t i, int64_t j) {
                     return j <= i && !(span_end[size_t(j)] >= 0 && i < span_end[size_t(j)]);
                   }});
  std::vector<int64_t> evict(static_cast<size_t>(N));
  for (int64_t j = 0; j < N; ++j)
    evict[size_t(j)] = rng.below(4) == 0 ? N : uniform_int(rng, j + 1, N);
  cases.push_back({"random_eviction", random_eviction_mask(evict),
                   [evict](int64_t i, int64_t j) { return j <= i && i < evict[size_t(j)]; }});
  return cases;
}

// A random valid mask in the 4-vector (non-causal) or causal 2-vector form; intervals are
// random sub-ranges of [0, Sq], empty ones included.
inline MaskColumns random_mask(Rng& rng, int64_t Sq, int64_t Sk, bool causal) {
  const int V = causal ? 2 : 4;
  MaskColumns m{causal, V, std::vector<int32_t>(size_t(Sk * V))};
  for (int64_t j = 0; j < Sk; ++j)
    for (int iv = 0; iv < V; iv += 2) {
      int64_t a = uniform_int(rng, 0, Sq), b = uniform_int(rng, 0, Sq);
      if (a > b) std::swap(a, b);
      if (rng.below(5) == 0) a = b;  // empty interval
      m.values[size_t(j * V + iv)] = int32_t(a);
      m.values[size_t(j * V + iv + 1)] = int32_t(b);
    }
  return m;
}

// A random block mask [B, Hm, ceil(Sq / 128), ceil(Sk / 128)], each block on with probability
// percent_on / 100.
inline BlockMask random_block_mask(Rng& rng, int64_t B, int64_t Hm, int64_t Sq, int64_t Sk,
                                   uint64_t percent_on) {
  std::vector<uint8_t> on(size_t(B * Hm * BlockMask::blocks(Sq) * BlockMask::blocks(Sk)));
  for (auto& x : on) x = rng.below(100) < percent_on ? 1 : 0;
  return BlockMask(B, Hm, Sq, Sk, std::move(on));
}

}  // namespace tessel::attention::test
