#pragma once
// Builders for the eleven standard masks of specs/flashmask.md §3. Each returns the column
// vectors of ONE sequence and mask head (`MaskColumns`, int32 [Sk, V]); `stack_masks` puts
// B * Hm of them into a ColumnMask. Documents are given by their lengths (each >= 1, summing
// to the sequence length N); s_d / e_d are the first / one-past-last position of document d.
// Bad arguments throw InputError.
#include <cstdint>
#include <vector>

#include "tessel/attention/mask.hpp"

namespace tessel::attention {

struct MaskColumns {
  bool causal = true;
  int V = 1;
  std::vector<int32_t> values;  // [Sk, V]
};

// B * Hm columns sets in (b, hm) order, all of the same form, into one mask.
ColumnMask stack_masks(int64_t Sq, int64_t Sk, int64_t B, int64_t Hm,
                       const std::vector<MaskColumns>& rows);

// Document lengths of a row of length T whose documents start at `starts` (ascending, first 0).
std::vector<int64_t> doc_lengths_from_starts(const std::vector<int32_t>& starts, int64_t T);

// The causal-document mask of a packed batch: row b of length T holds documents starting at
// doc_starts[b] (ascending, first 0); Hm = 1.
ColumnMask causal_document_batch_mask(const std::vector<std::vector<int32_t>>& doc_starts,
                                      int64_t T);

// A causal `mask` restricted to a causal sliding window of w >= 1 keys including the diagonal
// (as sliding_window_mask): row i also loses the keys j <= i + Sk - Sq - w. The window's
// masked rows of column j, [j - (Sk - Sq) + w, Sq), join the column's lower interval, so the
// result keeps one lower interval per column ([LTS, LTE] form, V = 2). InputError for a
// non-causal mask, or a column whose lower interval ends before the window begins (that
// would take two intervals).
ColumnMask restrict_to_window(const ColumnMask& mask, int64_t w);

// 1. Plain causal (bottom-right aligned when Sq != Sk).
MaskColumns causal_mask(int64_t Sq, int64_t Sk);
// 2. Causal sliding window of w keys including the diagonal: row i sees keys
//    (i + Sk - Sq - w, i + Sk - Sq].
MaskColumns sliding_window_mask(int64_t Sq, int64_t Sk, int64_t w);
// 3. Causal document: block-diagonal causal, no attention across documents.
MaskColumns causal_document_mask(const std::vector<int64_t>& doc_lengths);
// 4. Document, bidirectional inside each document.
MaskColumns document_mask(const std::vector<int64_t>& doc_lengths);
// 5. Share-question: document 0 is the question, every row sees it; answers 1..n see only
//    themselves (causally) and the question.
MaskColumns share_question_mask(const std::vector<int64_t>& doc_lengths);
// 6. G global tokens (seen by and seeing everything) plus a bidirectional window: row i sees
//    key j when |window| i - w_left <= j <= i + w_right.
MaskColumns global_sliding_window_mask(int64_t N, int64_t global, int64_t w_left, int64_t w_right);
// 7. Causal blockwise: each block sees itself causally; the last block sees all blocks.
MaskColumns causal_blockwise_mask(const std::vector<int64_t>& doc_lengths);
// 8. Prefix-LM causal: the first `prefix` keys are visible to every row, the rest causal.
MaskColumns prefix_lm_causal_mask(int64_t N, int64_t prefix);
// 9. Prefix-LM document: per document, its prefix is bidirectional inside the document and
//    the rest causal; nothing crosses documents. prefix_lengths[d] in [0, doc_lengths[d]].
MaskColumns prefix_lm_document_mask(const std::vector<int64_t>& doc_lengths,
                                    const std::vector<int64_t>& prefix_lengths);
// 10. QK-sparse: causal, and the queries of each span [offset, offset + length) see none of the
//     span's keys (not even their own); spans are disjoint and ascending.
struct Span {
  int64_t offset, length;
};
MaskColumns qk_sparse_mask(int64_t N, const std::vector<Span>& spans);
// 11. Random eviction: causal, key j invisible from row evict_row[j] on (> j; N = never).
MaskColumns random_eviction_mask(const std::vector<int64_t>& evict_row);

}  // namespace tessel::attention
