#include "tessel/train/batch_inputs.hpp"

#include "tessel/attention/cp_layout.hpp"
#include "tessel/attention/mask_builders.hpp"
#include "tessel/core/error.hpp"

namespace tessel::train {

BatchInputs::BatchInputs(const data::Batch& b, AttentionMaskKind kind)
    : inputs_{b.B, b.T, b.tokens.data(), b.positions.data(), b.targets.data(), b.loss_mask.data()} {
  if (kind != AttentionMaskKind::causal_document) return;
  mask_ = attention::causal_document_batch_mask(b.doc_starts, b.T);
  positions_.resize(size_t(b.B * b.T));
  for (int64_t r = 0; r < b.B; ++r) {
    const auto& starts = b.doc_starts[size_t(r)];
    size_t d = 0;
    for (int64_t t = 0; t < b.T; ++t) {
      if (d + 1 < starts.size() && t == starts[d + 1]) ++d;
      positions_[size_t(r * b.T + t)] = int32_t(t - starts[d]);
    }
  }
  inputs_.positions = positions_.data();
  inputs_.mask = &*mask_;
}

namespace {

attention::ColumnMask mask_or_causal(const model::ModelInputs& in) {
  return in.mask ? *in.mask : attention::ColumnMask::causal_only(in.B, in.T, in.T);
}

// Work per chunk in square tiles no larger than a chunk, so that short training sequences
// still see the shape of the mask inside each chunk.
std::vector<int64_t> work_per_chunk(const attention::ColumnMask& mask, int64_t chunk,
                                    const model::GptConfig& model) {
  const int64_t tile = std::min(chunk, attention::TiledMask::kDefaultTileK);
  return attention::chunk_work(attention::TiledMask(mask, tile), chunk, model.heads,
                               model.num_kv_heads(), tile);
}

}  // namespace

attention::CpLayout micro_batch_layout(const model::ModelInputs& full, int P,
                                       const ParallelConfig& parallel,
                                       const model::GptConfig& model) {
  const int64_t chunk = full.T / (parallel.cp_chunks * P);
  switch (parallel.cp_layout) {
    case CpLayoutKind::zigzag:
      return attention::zigzag_layout(full.T, P);
    case CpLayoutKind::contiguous:
      return attention::contiguous_layout(full.T, chunk, P);
    case CpLayoutKind::balanced:
      return attention::balanced_layout(full.T, chunk, P,
                                        work_per_chunk(mask_or_causal(full), chunk, model));
  }
  throw Error("unknown cp layout");
}

CpBatchInputs::CpBatchInputs(const BatchInputs& full, comm::Communicator& cp_group,
                             const ParallelConfig& parallel, const model::GptConfig& model) {
  const model::ModelInputs& in = full.inputs();
  const int64_t B = in.B;
  TESSEL_CHECK(in.positions && in.targets && in.loss_weight, "a training batch without targets");
  const attention::ColumnMask mask = mask_or_causal(in);
  const attention::CpLayout layout = micro_batch_layout(in, cp_group.size(), parallel, model);
  imbalance_ = attention::imbalance(layout, work_per_chunk(mask, layout.chunk, model));
  const std::vector<int64_t>& mine = layout.owned[size_t(cp_group.rank())];
  tokens_ = attention::take_chunk_rows(in.tokens, B, 1, layout, mine);
  targets_ = attention::take_chunk_rows(in.targets, B, 1, layout, mine);
  loss_weight_ = attention::take_chunk_rows(in.loss_weight, B, 1, layout, mine);
  positions_ = attention::take_chunk_rows(in.positions, B, 1, layout, mine);
  attention_.emplace(cp_group, mask, layout, model.heads, model.num_kv_heads(), model.head_dim());
  inputs_ = {B,
             attention_->local_rows(),
             tokens_.data(),
             positions_.data(),
             targets_.data(),
             loss_weight_.data(),
             nullptr,
             &*attention_};
}

double CpBatchInputs::loss_weight_sum() const {
  double n = 0;
  for (float w : loss_weight_) n += w;
  return n;
}

}  // namespace tessel::train
