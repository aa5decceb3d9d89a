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

CpBatchInputs::CpBatchInputs(const BatchInputs& full, comm::Communicator& cp_group,
                             const model::GptConfig& model) {
  const model::ModelInputs& in = full.inputs();
  const int64_t B = in.B, T = in.T;
  TESSEL_CHECK(in.positions && in.targets && in.loss_weight, "a training batch without targets");
  const attention::CpLayout layout = attention::zigzag_layout(T, cp_group.size());
  const std::vector<int64_t>& mine = layout.owned[size_t(cp_group.rank())];
  tokens_ = attention::take_chunk_rows(in.tokens, B, 1, layout, mine);
  targets_ = attention::take_chunk_rows(in.targets, B, 1, layout, mine);
  loss_weight_ = attention::take_chunk_rows(in.loss_weight, B, 1, layout, mine);
  positions_ = attention::take_chunk_rows(in.positions, B, 1, layout, mine);
  attention_.emplace(cp_group, in.mask ? *in.mask : attention::ColumnMask::causal_only(B, T, T),
                     layout, model.heads, model.num_kv_heads(), model.head_dim());
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
