#include "tessel/parallel/context_parallel.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "tessel/attention/mask_localization.hpp"
#include "tessel/core/error.hpp"
#include "tessel/core/timer.hpp"

namespace tessel::parallel {

namespace at = attention;

namespace {

// Rows [row0, row0 + n) of x [B, rows, width] <-> dst [B, n, width].
void copy_rows(float* dst, const float* x, int64_t B, int64_t rows, int64_t row0, int64_t n,
               int64_t width) {
  for (int64_t b = 0; b < B; ++b)
    std::memcpy(dst + b * n * width, x + (b * rows + row0) * width,
                size_t(n * width) * sizeof(float));
}
void add_rows(float* x, const float* src, int64_t B, int64_t rows, int64_t row0, int64_t n,
              int64_t width) {
  for (int64_t b = 0; b < B; ++b) {
    float* dst = x + (b * rows + row0) * width;
    const float* s = src + b * n * width;
    for (int64_t i = 0; i < n * width; ++i) dst[i] += s[i];
  }
}

// (o, lse) <- merge of (o, lse) and the partial (op, lp) over disjoint key sets.
void merge_partial(float* o, float* lse, const float* op, const float* lp,
                   const at::AttentionShape& s) {
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.Hq; ++h)
      for (int64_t r = 0; r < s.Sq; ++r) {
        const int64_t li = (b * s.Hq + h) * s.Sq + r;
        const float la = lse[li], lb = lp[li], m = std::max(la, lb);
        if (m == -INFINITY) continue;  // neither part sees a key: o stays 0
        const float wa = std::exp(la - m), wb = std::exp(lb - m), sum = wa + wb;
        lse[li] = m + std::log(sum);
        const float ca = wa / sum, cb = wb / sum;
        float* out = o + ((b * s.Sq + r) * s.Hq + h) * s.D;
        const float* part = op + ((b * s.Sq + r) * s.Hq + h) * s.D;
        for (int64_t d = 0; d < s.D; ++d) out[d] = ca * out[d] + cb * part[d];
      }
}

int tag_of(int64_t chunk) {
  TESSEL_CHECK(chunk < (1 << 14), "chunk index ", chunk, " beyond the MPI tag range");
  return int(chunk);
}

}  // namespace

ContextParallelAttention::ContextParallelAttention(comm::Communicator& group,
                                                   const at::ColumnMask& mask, at::CpLayout layout,
                                                   int64_t Hq, int64_t Hk, int64_t D, CpOptions opt)
    : group_(group),
      layout_(std::move(layout)),
      B_(mask.batch()),
      Hq_(Hq),
      Hk_(Hk),
      D_(D),
      opt_(opt) {
  layout_.check();
  if (layout_.ranks() != group.size())
    input_error("context parallelism: a layout for ", layout_.ranks(), " ranks on a cp group of ",
                group.size());
  if (mask.rows() != layout_.seq || mask.cols() != layout_.seq)
    input_error("context parallelism: the mask is ", mask.rows(), " x ", mask.cols(),
                ", expected self-attention over the layout's ", layout_.seq, " positions");
  mask.check_heads(Hq, Hk);
  const int me = group.rank();
  owner_ = layout_.owners();
  at::ColumnMask mine;
  for (int r = 0; r < layout_.ranks(); ++r) {
    at::ColumnMask local = at::localize_rows(mask, layout_, layout_.owned[size_t(r)]);
    spans_.push_back(at::needed_spans(local, layout_));
    if (r == me) mine = std::move(local);
  }
  local_offset_.assign(size_t(layout_.num_chunks()), -1);
  for (int64_t c : layout_.owned[size_t(me)]) {
    local_offset_[size_t(c)] = rows_;
    rows_ += layout_.chunk_rows(c);
  }
  groups_.push_back(
      {-1,
       {0, rows_},
       at::TiledMask(at::select_columns(mine, layout_, layout_.owned[size_t(me)]), opt.tile_k)});
  for (int64_t c = 0; c < layout_.num_chunks(); ++c)
    if (owner_[size_t(c)] != me && needs(me, c))
      groups_.push_back(
          {c, span(me, c), at::TiledMask(at::select_columns(mine, {span(me, c)}), opt.tile_k)});
}

at::AttentionShape ContextParallelAttention::shape(int64_t cols) const {
  return {B_, rows_, cols, Hq_, Hk_, D_};
}

int64_t ContextParallelAttention::local_row(const at::ColumnSpan& s) const {
  const int64_t c = s.begin / layout_.chunk;
  return local_offset_[size_t(c)] + s.begin - layout_.chunk_begin(c);
}

ContextParallelAttention::Exchange::~Exchange() {
  // Left pending only when unwinding from an error, maybe on every rank: peers may never send,
  // receive or match what is pending, so waiting could deadlock the job before main aborts it.
  const bool recv_over = comm::abandon_all(recv_req);
  const bool send_over = comm::abandon_all(send_req);
  // A transfer left in flight may still read or write its buffer: keep the buffers to the
  // process's end, which the error is on its way to (main aborts the job).
  if (!recv_over || !send_over) {
    (void)new std::vector<std::vector<float>>(std::move(recv));
    (void)new std::vector<std::vector<float>>(std::move(send));
  }
}

void ContextParallelAttention::Exchange::progress() {
  // One pending request's test moves all on (GradientReducer::start_from does the same).
  if (comm::test_all(recv_req)) comm::test_all(send_req);
}

ContextParallelAttention::Exchange ContextParallelAttention::start_kv_exchange(const float* k,
                                                                               const float* v) {
  Exchange ex;
  const int me = group_.rank();
  for (size_t g = 1; g < groups_.size(); ++g) {
    const int64_t c = groups_[g].chunk;
    ex.recv.emplace_back(size_t(2 * span_elems(groups_[g].span)));
    ex.recv_req.push_back(group_.irecv(ex.recv.back(), owner_[size_t(c)], tag_of(c)));
  }
  const int64_t width = Hk_ * D_;
  for (int64_t c : layout_.owned[size_t(me)])
    for (int t = 0; t < group_.size(); ++t) {
      if (t == me || !needs(t, c)) continue;
      const at::ColumnSpan s = span(t, c);
      const int64_t n = span_elems(s);
      std::vector<float> buf(size_t(2 * n));
      copy_rows(buf.data(), k, B_, rows_, local_row(s), s.size(), width);
      copy_rows(buf.data() + n, v, B_, rows_, local_row(s), s.size(), width);
      ex.send.push_back(std::move(buf));
      ex.send_req.push_back(group_.isend(ex.send.back(), t, tag_of(c)));
      ++stats_.kv_chunks_sent;
      stats_.kv_bytes_sent += 2 * n * int64_t(sizeof(float));
    }
  if (!opt_.overlap)
    for (comm::Request& r : ex.recv_req) wait_for(r);
  return ex;
}

void ContextParallelAttention::wait_for(comm::Request& request) {
  const Timer t;
  request.wait();
  stats_.wait_seconds += t.seconds();
}

void ContextParallelAttention::forward(float* o, float* lse, const float* q, const float* k,
                                       const float* v) {
  Exchange ex = start_kv_exchange(k, v);
  at::flash_attention_forward(o, lse, q, k, v, shape(rows_), groups_[0].mask, opt_.flash);
  std::vector<float> op, lp;
  if (groups_.size() > 1) {
    op.resize(size_t(B_ * rows_ * Hq_ * D_));
    lp.resize(size_t(B_ * Hq_ * rows_));
  }
  for (size_t g = 1; g < groups_.size(); ++g) {
    ex.progress();
    wait_for(ex.recv_req[g - 1]);
    const float* kv = ex.recv[g - 1].data();
    const at::AttentionShape s = shape(groups_[g].span.size());
    at::flash_attention_forward(op.data(), lp.data(), q, kv, kv + span_elems(groups_[g].span), s,
                                groups_[g].mask, opt_.flash);
    merge_partial(o, lse, op.data(), lp.data(), s);
  }
  comm::wait_all(ex.send_req);
}

void ContextParallelAttention::backward(float* dq, float* dk, float* dv, const float* dout,
                                        const float* q, const float* k, const float* v,
                                        const float* o, const float* lse) {
  const int me = group_.rank();
  Exchange ex = start_kv_exchange(k, v);
  // Partial dK/dV: received for the owned chunks' spans from every rank that needed them, in
  // (chunk, rank) order, of `incoming` spans; sent for each remote group to its owner.
  Exchange grads;
  std::vector<at::ColumnSpan> incoming;
  const int grad_tag = tag_of(layout_.num_chunks());
  for (int64_t c : layout_.owned[size_t(me)])
    for (int t = 0; t < group_.size(); ++t)
      if (t != me && needs(t, c)) {
        incoming.push_back(span(t, c));
        grads.recv.emplace_back(size_t(2 * span_elems(span(t, c))));
        grads.recv_req.push_back(group_.irecv(grads.recv.back(), t, grad_tag + tag_of(c)));
      }
  at::flash_attention_backward(dq, dk, dv, dout, q, k, v, o, lse, shape(rows_), groups_[0].mask,
                               opt_.flash);
  for (size_t g = 1; g < groups_.size(); ++g) {
    ex.progress();
    grads.progress();
    wait_for(ex.recv_req[g - 1]);
    const int64_t c = groups_[g].chunk, n = span_elems(groups_[g].span);
    const float* kv = ex.recv[g - 1].data();
    grads.send.emplace_back(size_t(2 * n), 0.0f);
    float* grad = grads.send.back().data();
    at::flash_attention_backward(dq, grad, grad + n, dout, q, kv, kv + n, o, lse,
                                 shape(groups_[g].span.size()), groups_[g].mask, opt_.flash);
    grads.send_req.push_back(
        group_.isend(grads.send.back(), owner_[size_t(c)], grad_tag + tag_of(c)));
    ++stats_.grad_chunks_sent;
    stats_.grad_bytes_sent += 2 * n * int64_t(sizeof(float));
  }
  const int64_t width = Hk_ * D_;
  for (size_t i = 0; i < incoming.size(); ++i) {
    wait_for(grads.recv_req[i]);
    const at::ColumnSpan& s = incoming[i];
    const int64_t n = span_elems(s);
    add_rows(dk, grads.recv[i].data(), B_, rows_, local_row(s), s.size(), width);
    add_rows(dv, grads.recv[i].data() + n, B_, rows_, local_row(s), s.size(), width);
  }
  comm::wait_all(ex.send_req);
  comm::wait_all(grads.send_req);
}

}  // namespace tessel::parallel
