#include "tessel/train/pipeline_stage.hpp"

#include <algorithm>
#include <optional>

#include "tessel/core/error.hpp"
#include "tessel/train/batch_inputs.hpp"

namespace tessel::train {

GptStage::GptStage(model::Gpt& model, const std::vector<int64_t>& boundaries, int stage, int stages,
                   data::DataLoader& loader, const Config& config, comm::Communicator& cp_group,
                   int64_t max_live, std::function<void(int64_t version)> on_step,
                   StaleWeights stale, ForwardHook on_forward)
    : model_(model),
      stage_(stage),
      stages_(stages),
      loader_(loader),
      config_(config),
      cp_group_(cp_group),
      boundary_elems_(
          size_t(loader.options().micro_batch * (loader.options().seq_len / config.parallel.cp) *
                 model.config().width)),
      on_step_(std::move(on_step)),
      on_forward_(std::move(on_forward)),
      stale_(std::move(stale)),
      previous_(stale_.weights.defined() ? size_t(stale_.weights.numel()) : 0),
      current_(stale_.mode == StaleWeights::Mode::predict ? previous_.size() : 0) {
  const auto virtual_stages = int64_t(boundaries.size()) - 1;
  TESSEL_CHECK(max_live >= 1 && stages >= 1 && virtual_stages % stages == 0 &&
                   boundaries.back() == model.config().layers,
               "stage ", stage, " of ", stages, " over ", virtual_stages, " virtual stages");
  for (int64_t j = stage; j < virtual_stages; j += stages)
    ranges_.push_back(
        {boundaries[size_t(j)], boundaries[size_t(j) + 1], j == 0, j == virtual_stages - 1});
  TESSEL_CHECK(
      (stale_.mode == StaleWeights::Mode::plain) != stale_.weights.defined() && stale_.window >= 1,
      "stage ", stage, ": stale-weight options");
  TESSEL_CHECK(stale_.mode == StaleWeights::Mode::plain || ranges_.size() == 1, "stage ", stage,
               ": stale-weight options need one chunk");
  slots_.resize(ranges_.size());
  free_.resize(ranges_.size());
  for (size_t c = 0; c < ranges_.size(); ++c) {
    slots_[c].resize(size_t(max_live));
    for (size_t i = size_t(max_live); i-- > 0;) free_[c].push_back(i);
  }
}

size_t GptStage::boundary_elems(const data::Batch& batch) const {
  return size_t(batch.B * (batch.T / config_.parallel.cp) * model_.config().width);
}

double GptStage::forward_stage(int chunk, model::Activations& acts, const model::ModelInputs& in,
                               std::span<const float> input, std::span<float> output) const {
  const model::BlockRange& r = ranges_.at(size_t(chunk));
  model_.load_inputs(acts, in);
  if (r.embedding)
    model_.forward_embedding(acts);
  else
    std::copy(input.begin(), input.end(), acts.residual(r.first).f32());
  model_.forward_blocks(acts, r.first, r.last);
  if (r.head) return model_.forward_head(acts);
  const float* x = acts.residual(r.last).f32();
  std::copy(x, x + output.size(), output.begin());
  return 0.0;
}

int64_t GptStage::activation_bytes() const {
  int64_t bytes = peak_deferred_bytes_;
  for (const auto& chunk : slots_)
    for (const auto& acts : chunk)
      if (acts) bytes += acts->tensor_bytes;
  return bytes;
}

void GptStage::forward(int chunk, int64_t micro, std::span<const float> input,
                       std::span<float> output) {
  TESSEL_CHECK(chunk >= 0 && chunk < chunks(), "stage ", stage_, ": chunk ", chunk, " of ",
               chunks());
  auto& free = free_[size_t(chunk)];
  auto& slots = slots_[size_t(chunk)];
  TESSEL_CHECK(!free.empty(), "stage ", stage_, " chunk ", chunk, ": more than ", slots.size(),
               " micro-batches in flight");
  if (chunk == 0) {  // chunk 0's forwards run in micro-batch order: the loader's next batch
    auto batch = std::make_unique<data::Batch>(loader_.next());
    auto in = std::make_unique<RankBatchInputs>(*batch, config_, cp_group_);
    const double tokens = in->loss_weight_sum();
    micro_batches_.emplace(micro, MicroBatch{std::move(batch), std::move(in), tokens, chunks()});
  }
  const auto it = micro_batches_.find(micro);
  TESSEL_CHECK(it != micro_batches_.end(), "stage ", stage_, ": forward of micro-batch ", micro,
               " through chunk ", chunk, " before chunk 0's");
  const model::ModelInputs& rows = it->second.inputs->inputs();
  const size_t slot = free.back();
  free.pop_back();
  auto& acts = slots[slot];
  if (!acts) {
    // The micro-batches in flight, of every chunk, share what no forward leaves for its
    // backward (one op runs whole before the next): the scratch, and under recomputation the
    // block cache. A lender of the same chunk first: it has every buffer of the same shape
    // (the logits' gradient on the head's chunk).
    const model::Activations* lender = nullptr;
    for (size_t i = 0; i < slots_.size() && !lender; ++i)
      for (const auto& other : slots_[(size_t(chunk) + i) % slots_.size()])
        if (other && other->B == rows.B && other->T == rows.T) lender = other.get();
    acts = model_.make_activations(rows.B, rows.T, ranges_[size_t(chunk)], config_.train.recompute,
                                   lender);
  }
  struct Restore {  // the stage's own weights come back even if the forward throws
    float* w;
    const std::vector<float>& saved;
    ~Restore() { std::copy(saved.begin(), saved.end(), w); }
  };
  std::optional<Restore> restore;
  if (const int64_t gap = predicted_gap(micro); gap > 0) {
    float* w = stale_.weights.f32();
    std::copy_n(w, current_.size(), current_.data());
    restore.emplace(w, current_);
    extrapolate_weights({w, current_.size()}, previous_, float(double(gap) * stale_.share));
  }
  const double loss = forward_stage(chunk, *acts, rows, input, output);
  restore.reset();
  if (on_forward_) on_forward_(micro, *acts);
  live_.emplace(std::pair{micro, chunk}, Live{slot, loss, steps_});
}

StageWindow GptStage::evaluate(int chunk, const data::Batch& batch, std::span<const float> input,
                               std::span<float> output) {
  const RankBatchInputs in(batch, config_, cp_group_);
  const model::ModelInputs& rows = in.inputs();
  auto& acts = eval_[{chunk, rows.B, rows.T}];
  // No backward: one block's cache, whatever train.recompute says.
  if (!acts)
    acts = model_.make_activations(rows.B, rows.T, ranges_.at(size_t(chunk)),
                                   model::Recompute::blocks);
  const double loss = forward_stage(chunk, *acts, rows, input, output);
  return {loss, in.loss_weight_sum(), 1, acts.get()};
}

std::vector<float> GptStage::next_token_logits(int chunk, std::span<const int32_t> window,
                                               std::span<const float> input,
                                               std::span<float> output) {
  model::ModelInputs in;
  in.B = 1;
  in.T = int64_t(window.size());
  in.tokens = window.data();
  // No backward: one block's cache, whatever train.recompute says.
  auto acts = model_.make_activations(1, in.T, ranges_.at(size_t(chunk)), model::Recompute::blocks);
  forward_stage(chunk, *acts, in, input, output);
  if (!last_virtual(chunk)) return {};
  const int64_t V = model_.config().vocab;
  const float* last = acts->logits.f32() + (in.T - 1) * V;
  return std::vector<float>(last, last + V);
}

void GptStage::backward(int chunk, int64_t micro, std::span<const float> output_grad,
                        std::span<float> input_grad) {
  run_backward(chunk, micro, output_grad, input_grad, false);
  finish(chunk, micro);
}

void GptStage::backward_input(int chunk, int64_t micro, std::span<const float> output_grad,
                              std::span<float> input_grad) {
  run_backward(chunk, micro, output_grad, input_grad, true);
  int64_t deferred = 0;
  for (const auto& slots : slots_)
    for (const auto& acts : slots)
      if (acts) deferred += acts->deferred_bytes;
  peak_deferred_bytes_ = std::max(peak_deferred_bytes_, deferred);
}

void GptStage::backward_weights(int chunk, int64_t micro) {
  model_.backward_weights(*slots_[size_t(chunk)][in_flight(chunk, micro).slot]);
  finish(chunk, micro);
}

GptStage::Live& GptStage::in_flight(int chunk, int64_t micro) {
  auto it = live_.find({micro, chunk});
  TESSEL_CHECK(it != live_.end(), "stage ", stage_, ": backward or W of micro-batch ", micro,
               " through chunk ", chunk, " without its forward");
  return it->second;
}

void GptStage::run_backward(int chunk, int64_t micro, std::span<const float> output_grad,
                            std::span<float> input_grad, bool defer_weight_grads) {
  const Live& started = in_flight(chunk, micro);
  const model::BlockRange& r = ranges_[size_t(chunk)];
  model::Activations& acts = *slots_[size_t(chunk)][started.slot];
  const int64_t gap = steps_ - started.steps;
  const bool stashed = stale_.mode == StaleWeights::Mode::stash && gap > 0;
  TESSEL_CHECK(!stashed || gap == 1, "stage ", stage_, ": micro-batch ", micro, " is ", gap,
               " steps old; the stash keeps one version");
  if (stashed) swap_stashed();
  acts.defer_weight_grads = defer_weight_grads;
  if (r.head)
    model_.backward_head(acts, 1.0f);
  else
    std::copy(output_grad.begin(), output_grad.end(), acts.residual_grad(r.last).f32());
  model_.backward_blocks(acts, r.first, r.last);
  if (r.embedding) {
    model_.backward_embedding(acts);
  } else {
    const float* dx = acts.residual_grad(r.first).f32();
    std::copy(dx, dx + input_grad.size(), input_grad.begin());
  }
  if (stashed) swap_stashed();
}

void GptStage::finish(int chunk, int64_t micro) {
  const Live& done = in_flight(chunk, micro);
  window_.loss_sum += done.loss_sum;
  free_[size_t(chunk)].push_back(done.slot);
  live_.erase({micro, chunk});
  const auto it = micro_batches_.find(micro);
  if (--it->second.chunks_left > 0) return;
  window_.loss_tokens += it->second.loss_tokens;
  ++window_.micro_batches;
  micro_batches_.erase(it);
}

void GptStage::step(int64_t version) {
  if (!previous_.empty()) std::copy_n(stale_.weights.f32(), previous_.size(), previous_.data());
  on_step_(version);
  ++steps_;
}

void GptStage::begin_run(int64_t first_micro) {
  run_first_micro_ = first_micro;
  run_first_step_ = steps_;
}

int64_t GptStage::predicted_gap(int64_t micro) const {
  if (stale_.mode != StaleWeights::Mode::predict || steps_ == run_first_step_) return 0;
  return (micro - run_first_micro_) / stale_.window - (steps_ - run_first_step_);
}

void GptStage::swap_stashed() {
  std::swap_ranges(previous_.begin(), previous_.end(), stale_.weights.f32());
}

void extrapolate_weights(std::span<float> w, std::span<const float> previous, float factor) {
  TESSEL_CHECK(w.size() == previous.size(), "extrapolate_weights: ", w.size(), " weights, ",
               previous.size(), " previous values");
  for (size_t i = 0; i < w.size(); ++i) w[i] += factor * (w[i] - previous[i]);
}

StageWindow GptStage::take_window() {
  return std::exchange(window_, StageWindow{});
}

}  // namespace tessel::train
