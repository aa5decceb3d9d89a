#include "tessel/train/batch_inputs.hpp"

#include <numeric>

#include "tessel/attention/cp_layout.hpp"
#include "tessel/attention/mask_builders.hpp"
#include "tessel/core/error.hpp"

namespace tessel::train {

BatchInputs::BatchInputs(const data::Batch& b, AttentionMaskKind kind)
    : inputs_{b.B, b.T, b.tokens.data(), b.positions.data(), b.targets.data(), b.loss_mask.data()} {
  for (float w : b.loss_mask) loss_weight_sum_ += w;
  if (!b.padding.empty()) inputs_.padding = b.padding.data();
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

void check_packed_samples_mask(const std::string& where, AttentionMaskKind kind) {
  if (kind != AttentionMaskKind::causal_document)
    input_error(where,
                " is an SFT data set (it has loss-mask shards): its packed samples need "
                "data.attention_mask = \"causal_document\"; under \"causal\" they would "
                "attend to each other");
}

namespace {

// The mask the model attends with (model.attention_window included), which context-parallel
// attention takes over from it.
attention::ColumnMask model_mask(const model::ModelInputs& in, const model::GptConfig& model) {
  return model::attention_mask(model, in.mask, in.B, in.T, in.T);
}

// Work per chunk in square tiles no larger than a chunk, so that short training sequences
// still see the shape of the mask inside each chunk.
std::vector<int64_t> work_per_chunk(const attention::ColumnMask& mask, int64_t chunk,
                                    const model::GptConfig& model) {
  const int64_t tile = std::min(chunk, attention::TiledMask::kDefaultTileK);
  return attention::chunk_work(attention::TiledMask(mask, tile), chunk, model.heads,
                               model.num_kv_heads(), tile);
}

// Rows per chunk of the configured layout over T rows and P ranks.
int64_t layout_chunk(int64_t T, int P, const ParallelConfig& parallel) {
  return parallel.cp_layout == CpLayoutKind::zigzag ? attention::zigzag_layout(T, P).chunk
                                                    : T / (parallel.cp_chunks * P);
}

// The configured layout, given the work of each of its chunks (used by balanced only).
attention::CpLayout layout_from_work(int64_t T, int P, int64_t chunk,
                                     const ParallelConfig& parallel,
                                     const std::vector<int64_t>& work) {
  switch (parallel.cp_layout) {
    case CpLayoutKind::zigzag:
      return attention::zigzag_layout(T, P);
    case CpLayoutKind::contiguous:
      return attention::contiguous_layout(T, chunk, P);
    case CpLayoutKind::balanced:
      return attention::balanced_layout(T, chunk, P, work);
  }
  throw Error("unknown cp layout");
}

}  // namespace

data::Batch idle_batch(int64_t T) {
  data::Batch b;
  b.B = 1;
  b.T = T;
  b.tokens.assign(size_t(T), 0);
  b.targets.assign(size_t(T), 0);
  b.loss_mask.assign(size_t(T), 0.0f);
  for (int64_t t = 0; t < T; ++t) b.positions.push_back(int32_t(t));
  b.doc_starts = {{0}};
  return b;
}

attention::CpLayout micro_batch_layout(const model::ModelInputs& full, int P,
                                       const ParallelConfig& parallel,
                                       const model::GptConfig& model) {
  const int64_t chunk = layout_chunk(full.T, P, parallel);
  return layout_from_work(full.T, P, chunk, parallel,
                          work_per_chunk(model_mask(full, model), chunk, model));
}

CpBatchInputs::CpBatchInputs(const BatchInputs& full, comm::Communicator& cp_group,
                             const ParallelConfig& parallel, const model::GptConfig& model) {
  const model::ModelInputs& in = full.inputs();
  const int64_t B = in.B;
  TESSEL_CHECK(in.positions && in.targets && in.loss_weight, "a training batch without targets");
  const int P = cp_group.size();
  const attention::ColumnMask mask = model_mask(in, model);
  const int64_t chunk = layout_chunk(in.T, P, parallel);
  const std::vector<int64_t> work = work_per_chunk(mask, chunk, model);
  const attention::CpLayout layout = layout_from_work(in.T, P, chunk, parallel, work);
  imbalance_ = attention::imbalance(layout, work);
  const std::vector<int64_t>& mine = layout.owned[size_t(cp_group.rank())];
  tokens_ = attention::take_chunk_rows(in.tokens, B, 1, layout, mine);
  targets_ = attention::take_chunk_rows(in.targets, B, 1, layout, mine);
  loss_weight_ = attention::take_chunk_rows(in.loss_weight, B, 1, layout, mine);
  positions_ = attention::take_chunk_rows(in.positions, B, 1, layout, mine);
  if (in.padding) padding_ = attention::take_chunk_rows(in.padding, B, 1, layout, mine);
  std::vector<int32_t> index(size_t(B * in.T));
  std::iota(index.begin(), index.end(), 0);
  token_index_ = attention::take_chunk_rows(index.data(), B, 1, layout, mine);
  attention_.emplace(cp_group, mask, layout, model.heads, model.num_kv_heads(), model.head_dim());
  inputs_ = {B,
             attention_->local_rows(),
             tokens_.data(),
             positions_.data(),
             targets_.data(),
             loss_weight_.data(),
             nullptr,
             &*attention_};
  if (in.padding) inputs_.padding = padding_.data();  // MoE routes only the other rows
  inputs_.token_index = token_index_.data();          // MoE capacity counts the whole micro-batch
}

double CpBatchInputs::loss_weight_sum() const {
  double n = 0;
  for (float w : loss_weight_) n += w;
  return n;
}

RankBatchInputs::RankBatchInputs(const data::Batch& batch, const Config& config,
                                 comm::Communicator& cp_group)
    : full_(batch, config.data.attention_mask) {
  if (config.parallel.cp > 1) part_.emplace(full_, cp_group, config.parallel, config.model);
}

}  // namespace tessel::train
