#pragma once
// The model inputs of one loader batch: tokens, targets and loss mask from the batch, plus the
// attention mask and positions that data.attention_mask asks for (causal_document: a
// causal-document ColumnMask from the batch's document starts, positions restarting at each
// document; causal: no mask, positions 0..T-1).
#include <optional>
#include <vector>

#include "tessel/attention/mask.hpp"
#include "tessel/data/loader.hpp"
#include "tessel/model/gpt.hpp"
#include "tessel/train/config.hpp"

namespace tessel::train {

class BatchInputs {
 public:
  // `batch` must outlive this object (its arrays are referenced, not copied).
  BatchInputs(const data::Batch& batch, AttentionMaskKind kind);
  BatchInputs(const BatchInputs&) = delete;
  BatchInputs& operator=(const BatchInputs&) = delete;

  const model::ModelInputs& inputs() const { return inputs_; }

 private:
  std::optional<attention::ColumnMask> mask_;
  std::vector<int32_t> positions_;
  model::ModelInputs inputs_;
};

}  // namespace tessel::train
