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
#include "tessel/parallel/context_parallel.hpp"
#include "tessel/train/config.hpp"

namespace tessel::train {

class BatchInputs {
 public:
  // `batch` must outlive this object (its arrays are referenced, not copied).
  BatchInputs(const data::Batch& batch, AttentionMaskKind kind);
  BatchInputs(const BatchInputs&) = delete;
  BatchInputs& operator=(const BatchInputs&) = delete;

  const model::ModelInputs& inputs() const { return inputs_; }
  double loss_weight_sum() const { return loss_weight_sum_; }  // the batch's loss tokens

 private:
  double loss_weight_sum_ = 0;
  std::optional<attention::ColumnMask> mask_;
  std::vector<int32_t> positions_;
  model::ModelInputs inputs_;
};

// InputError unless `kind` is causal_document: the packed samples of the SFT data set `where`
// (one with loss-mask shards) would attend to each other under a plain causal mask.
void check_packed_samples_mask(const std::string& where, AttentionMaskKind kind);

// One sequence of T tokens without loss tokens: a forward that only keeps an ep group's
// token exchanges in step (validation, where the ep ranks hold different batch counts).
data::Batch idle_batch(int64_t T);

// The chunk layout of one micro-batch over P cp ranks (parallel.cp_layout). Balanced counts each
// chunk's attention work from the micro-batch's own mask; every cp rank holds that whole mask,
// so all of them compute the same layout without communicating.
attention::CpLayout micro_batch_layout(const model::ModelInputs& full, int P,
                                       const ParallelConfig& parallel,
                                       const model::GptConfig& model);

// This cp rank's part of a micro-batch under context parallelism (parallel.cp > 1): the rows of
// its chunks (micro_batch_layout) of every sequence, with their global positions, targets and
// loss weights, and the context-parallel attention over the cp group that every layer of the
// model runs for this micro-batch. Each cp rank reads the same micro-batch from its own loader,
// so placing tokens needs no exchange, and the loss of the owned rows sums over dp x cp.
class CpBatchInputs {
 public:
  // `full` is the whole micro-batch (every cp rank loads the same one).
  CpBatchInputs(const BatchInputs& full, comm::Communicator& cp_group,
                const ParallelConfig& parallel, const model::GptConfig& model);
  CpBatchInputs(const CpBatchInputs&) = delete;
  CpBatchInputs& operator=(const CpBatchInputs&) = delete;

  const model::ModelInputs& inputs() const { return inputs_; }
  double loss_weight_sum() const;  // over this rank's tokens
  // Max / mean attention work (non-skipped tiles) over the cp ranks; 1 = perfect balance.
  double imbalance() const { return imbalance_; }

 private:
  std::vector<int32_t> tokens_, positions_, targets_;
  std::vector<float> loss_weight_;
  std::vector<uint8_t> padding_;      // SFT rows' padding marks, when the batch has them
  std::vector<int32_t> token_index_;  // each row's index in the whole micro-batch
  std::optional<parallel::ContextParallelAttention> attention_;
  double imbalance_ = 1;
  model::ModelInputs inputs_;
};

// One loader batch as this rank's model inputs: the whole batch, or under context parallelism
// (parallel.cp > 1) this rank's chunks of it. Training and validation both use it.
class RankBatchInputs {
 public:
  // `batch` must outlive this object; `cp_group` is used only when parallel.cp > 1.
  RankBatchInputs(const data::Batch& batch, const Config& config, comm::Communicator& cp_group);

  const model::ModelInputs& inputs() const { return part_ ? part_->inputs() : full_.inputs(); }
  double loss_weight_sum() const {  // over this rank's tokens
    return part_ ? part_->loss_weight_sum() : full_.loss_weight_sum();
  }
  double cp_imbalance() const { return part_ ? part_->imbalance() : 1.0; }

 private:
  BatchInputs full_;
  std::optional<CpBatchInputs> part_;
};

}  // namespace tessel::train
