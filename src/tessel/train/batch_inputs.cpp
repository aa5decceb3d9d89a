#include "tessel/train/batch_inputs.hpp"

#include "tessel/attention/mask_builders.hpp"

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

}  // namespace tessel::train
