#pragma once
// Context-parallel FlashMask attention (spec specs/flashmask.md §5) over the cp group.
//
// The sequence (self-attention, Sq = Sk = S) is cut into the chunks of an attention::CpLayout;
// rank r holds q, k, v of its owned chunks, concatenated in ascending order ("local rows"):
// q, o [B, L, Hq, D], k, v [B, L, Hk, D], lse [B, Hq, L] with L = layout.local_rows(r).
//
// Construction (no communication): every rank localizes the global mask for every rank's rows
// (attention/mask_localization.hpp) and so knows, for each (chunk, rank), which of the chunk's
// keys and values that rank needs: the smallest span of columns outside which every column is
// fully masked for all its rows, batch rows and mask heads (empty: the chunk is pruned). A
// sliding window or a document mask needs only the end of an earlier chunk, and only that
// span travels. Key groups of this rank: group 0 = its own chunks (one attention call over all
// of them), then the needed span of each remote chunk in ascending order, each with the
// localized mask sliced to its columns.
//
// forward: non-blocking sends of each owned chunk's K and V span to exactly the ranks that need
// it and receives of the needed remote spans are started first; group 0 is computed while they
// travel, then each remote group in ascending order, waiting for its span if it has not
// arrived yet (between groups the pending transfers are tested, so that MPI moves them on).
// Every group gives an exact partial (O_p, LSE_p) over its keys, merged into the running
// (O, LSE) pairwise, one group at a time in that fixed order:
//   LSE' = log(e^{LSE} + e^{LSE_p}),  O' = e^{LSE - LSE'} O + e^{LSE_p - LSE'} O_p,
// which is LSE = log(sum_p e^{LSE_p}), O = sum_p e^{LSE_p - LSE} O_p up to rounding; the order
// is fixed, so the result does not depend on arrival order and repeats bitwise.
// backward (adds into dq, dk, dv; needs the final o and lse): the same pruned K/V exchange;
// each group's flash backward with the final O and LSE gives exact partial dQ (added in group
// order) and partial dK/dV of that group's keys; partials of remote spans go back to their
// owner (the same pruning: only ranks that needed a chunk send the gradient of their span),
// which adds them after its own in ascending rank order.
// An exception (on some or every rank) abandons the pending transfers (comm::Request::abandon)
// rather than wait for peers that may never send: the job must then end, as main's abort does.
#include <cstdint>
#include <vector>

#include "tessel/attention/attention_hook.hpp"
#include "tessel/attention/cp_layout.hpp"
#include "tessel/attention/flash_attention.hpp"
#include "tessel/attention/mask_localization.hpp"
#include "tessel/comm/communicator.hpp"

namespace tessel::parallel {

struct CpOptions {
  attention::FlashOptions flash;
  int64_t tile_k = attention::TiledMask::kDefaultTileK;
  bool overlap = true;  // false: wait for every remote chunk before computing (benchmark baseline)
};

// This rank's counts since construction (or reset_stats): chunks and bytes it sent, and the
// seconds it spent waiting for remote chunks (communication not hidden behind compute).
struct CpStats {
  int64_t kv_chunks_sent = 0, kv_bytes_sent = 0;
  int64_t grad_chunks_sent = 0, grad_bytes_sent = 0;
  double wait_seconds = 0;
};

class ContextParallelAttention final : public attention::AttentionHook {
 public:
  // `mask` is the global mask [B, Hm, S, S] (S = layout.seq); layout.ranks() == group.size().
  ContextParallelAttention(comm::Communicator& group, const attention::ColumnMask& mask,
                           attention::CpLayout layout, int64_t Hq, int64_t Hk, int64_t D,
                           CpOptions opt = {});

  const attention::CpLayout& layout() const { return layout_; }
  int64_t local_rows() const { return rows_; }
  // The columns of chunk c whose keys and values rank r needs (r's own chunks included; empty:
  // none), and whether there are any.
  attention::ColumnSpan span(int r, int64_t c) const { return spans_[size_t(r)][size_t(c)]; }
  bool needs(int r, int64_t c) const { return !span(r, c).empty(); }

  void forward(float* o, float* lse, const float* q, const float* k, const float* v) override;
  void backward(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k,
                const float* v, const float* o, const float* lse) override;

  const CpStats& stats() const { return stats_; }
  void reset_stats() { stats_ = {}; }

 private:
  struct Group {
    int64_t chunk;               // the remote chunk, or -1 for the own chunks
    attention::ColumnSpan span;  // its columns (global); the own chunks: [0, local rows)
    attention::TiledMask mask;
  };
  // Started transfers of one exchange (K/V, or the dK/dV partials): receive buffers, send
  // buffers. Destroyed with transfers pending (an exception), it abandons them.
  struct Exchange {
    Exchange() = default;
    Exchange(Exchange&&) = default;
    ~Exchange();
    // Lets MPI move the pending transfers on (between groups' computations).
    void progress();
    std::vector<std::vector<float>> recv, send;
    std::vector<comm::Request> recv_req, send_req;
  };
  Exchange start_kv_exchange(const float* k, const float* v);
  void wait_for(comm::Request& request);
  attention::AttentionShape shape(int64_t cols) const;
  // Elements of K (or V) over a span's columns, and the first local row of an owned span.
  int64_t span_elems(const attention::ColumnSpan& s) const { return B_ * s.size() * Hk_ * D_; }
  int64_t local_row(const attention::ColumnSpan& s) const;

  comm::Communicator& group_;
  attention::CpLayout layout_;
  int64_t B_, Hq_, Hk_, D_, rows_ = 0;
  CpOptions opt_;
  std::vector<std::vector<attention::ColumnSpan>> spans_;  // [rank][chunk]
  std::vector<int64_t> local_offset_;  // [chunk] first local row of an owned chunk
  std::vector<int> owner_;             // [chunk]
  std::vector<Group> groups_;
  CpStats stats_;
};

}  // namespace tessel::parallel
