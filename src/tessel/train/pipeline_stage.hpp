#pragma once
// One pipeline stage of the GPT as the stage executor sees it (pipeline/stage_executor.hpp):
// the blocks [first, last) of a stage_partition.hpp split, plus the embedding on the first
// stage and the head + loss on the last. The residual stream crosses the stage boundaries:
// `output` is x_last, `input_grad` is d loss / d x_first.
//
// Every stage reads the same micro-batches from its own copy of the deterministic loader
// (forwards run in micro-batch order), because every stage needs the attention mask and
// positions, the first the tokens and the last the targets; every stage also counts the
// loss tokens, so each can scale its gradients by 1 / (global loss tokens) at its STEP.
// Backwards add the gradients of the loss SUM (loss_scale 1) into the model's gradients.
//
// Context parallelism (parallel.cp > 1): each stage runs this cp rank's chunks of every
// micro-batch (RankBatchInputs, as the trainer without pipeline does), so the residual stream
// between stages holds seq_len / cp rows per sequence; the context-parallel attention of a
// micro-batch lives with it until its backward. The cp ranks of a stage run the same
// instruction list, so their attention exchanges pair up.
//
// Activations live in a pool, one set per micro-batch between its forward and its
// backward (ZB-H1: its W), at most `max_live` at once (1F1B / PACI: P - s; GPipe: M; ZB-H1: P).
//
// PACI's stale micro-batches (StaleWeights): a forward that runs g STEPs before its backward
// sees weights g versions older than the backward will.
// - Stash (pipeline.paci_stash, PipeDream-2BW's two versions): the stage keeps a copy of its
//   weights from before its last STEP, and a backward whose forward ran before that STEP
//   swaps it in, so its gradient is consistent with its activations (then applied to the
//   newest weights). One version back only: the schedule must keep every gap at most 1.
// - Prediction (pipeline.paci_predict = a, SpecTrain / PipeMare's weight prediction): such a
//   forward runs on the weights extrapolated along the last STEP, w + g·a·(w − w_before);
//   a = 1 is where the backward's weights will be if the next steps repeat the last one, a
//   below 1 trusts the repetition less. The stage's own weights are put back right after. g is
//   known at the forward: PACI runs the backward of micro-batch m after (m − first) / K STEPs of a
//   drained run that began at micro-batch `first`. Only the last STEP of the same run counts, so a
//   run that resumes from a checkpoint (saved at a drain) predicts as the uninterrupted one.
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "tessel/data/loader.hpp"
#include "tessel/model/gpt.hpp"
#include "tessel/pipeline/stage_executor.hpp"
#include "tessel/train/batch_inputs.hpp"
#include "tessel/train/config.hpp"

namespace tessel::train {

// What the backwards since the last take_window() contributed, or one evaluate() computed.
struct StageWindow {
  double loss_sum = 0;     // last stage only (0 elsewhere)
  double loss_tokens = 0;  // every stage
  int64_t micro_batches = 0;
  const model::Activations* activations = nullptr;  // evaluate(): its forward's, until the next
};

// w <- w + factor * (w - previous), element by element.
void extrapolate_weights(std::span<float> w, std::span<const float> previous, float factor);

// What a stage does about PACI's stale forwards (see above).
struct StaleWeights {
  enum class Mode { plain, stash, predict };
  Mode mode = Mode::plain;
  Tensor weights;      // stash / predict: this stage's parameters, one view of the flat values
  int64_t window = 1;  // predict: K, the micro-batches per STEP
  double share = 1;    // predict: a, the share of the last step per STEP of gap
};

class GptStage final : public pipeline::StageWork {
 public:
  // `boundaries` is stage_boundaries() of the layout; `model`, `loader`, `config` (its
  // data.attention_mask and parallel.cp*) and `cp_group` (used when parallel.cp > 1) must
  // outlive the stage. `on_step(version)` runs at every STEP of the schedule,
  // `on_forward(micro, activations)` (if set) after every training forward (the MoE
  // statistics read the routing there).
  using ForwardHook = std::function<void(int64_t micro, const model::Activations&)>;
  GptStage(model::Gpt& model, const std::vector<int64_t>& boundaries, int stage,
           data::DataLoader& loader, const Config& config, comm::Communicator& cp_group,
           int64_t max_live, std::function<void(int64_t version)> on_step, StaleWeights stale = {},
           ForwardHook on_forward = {});

  size_t input_elems() const override { return first_stage() ? 0 : boundary_elems_; }
  size_t output_elems() const override { return last_stage() ? 0 : boundary_elems_; }
  void forward(int chunk, int64_t micro, std::span<const float> input,
               std::span<float> output) override;
  void backward(int chunk, int64_t micro, std::span<const float> output_grad,
                std::span<float> input_grad) override;
  // ZB-H1: the model's split backward (Activations::defer_weight_grads); the micro-batch's
  // activations stay in flight until its backward_weights.
  void backward_input(int chunk, int64_t micro, std::span<const float> output_grad,
                      std::span<float> input_grad) override;
  void backward_weights(int chunk, int64_t micro) override;
  void step(int64_t version) override;

  // Before each executor run: its first micro-batch (the run starts drained).
  void begin_run(int64_t first_micro);
  StageWindow take_window();
  // Validation forward of `batch` (forward only, on activations of its own; the training's
  // in-flight micro-batches are untouched): reads `input` (first stage: empty), writes
  // `output` (last stage: empty); the loss sum on the last stage (0 elsewhere), the batch's
  // loss tokens and the activations of the forward.
  StageWindow evaluate(const data::Batch& batch, std::span<const float> input,
                       std::span<float> output);
  // Inference forward of one sequence (every token of `window`, no cp), on activations of
  // its own: reads `input`, writes `output` as evaluate(); the last stage returns the logits
  // [V] of the last position (empty elsewhere).
  std::vector<float> next_token_logits(std::span<const int32_t> window,
                                       std::span<const float> input, std::span<float> output);
  // f32 elements of `batch`'s residual stream on this rank: B x (T / cp) x width.
  size_t boundary_elems(const data::Batch& batch) const;
  int64_t live() const { return int64_t(live_.size()); }
  bool first_stage() const { return stage_ == 0; }
  bool last_stage() const { return stage_ == stages_ - 1; }
  // Bytes of the training activations allocated so far (one set per micro-batch the schedule
  // has had in flight at once; the scratch, and under recomputation the block cache, once for
  // all of them) plus, under ZB-H1, the most bytes the queued Ws' copies have held at once
  // (Activations::deferred_bytes), MoE caches not counted.
  int64_t activation_bytes() const;

 private:
  struct Live {
    size_t slot;
    double loss_sum, loss_tokens;
    int64_t steps;  // STEPs taken before the forward
    // The micro-batch and its inputs, kept until the backward: a context-parallel
    // attention runs the backward's exchanges too.
    std::unique_ptr<data::Batch> batch;
    std::unique_ptr<RankBatchInputs> inputs;
  };
  // load_inputs, the stage's pieces of the forward, `output` from its last boundary; the
  // loss sum on the last stage.
  double forward_stage(model::Activations& acts, const model::ModelInputs& in,
                       std::span<const float> input, std::span<float> output) const;
  model::BlockRange range() const { return {first_, last_, first_stage(), last_stage()}; }
  Live& in_flight(int64_t micro);  // the micro-batch between its forward and its end (checked)
  void run_backward(int64_t micro, std::span<const float> output_grad, std::span<float> input_grad,
                    bool defer_weight_grads);
  void finish(int64_t micro);  // its loss into the window, its activations freed
  void swap_stashed();
  // Prediction: how many STEPs will run between micro-batch `micro`'s forward (now) and its
  // backward; 0 when there is no last STEP of this run to extrapolate along.
  int64_t predicted_gap(int64_t micro) const;
  model::Gpt& model_;
  int stage_, stages_;
  int64_t first_, last_;  // blocks [first_, last_)
  data::DataLoader& loader_;
  const Config& config_;
  comm::Communicator& cp_group_;
  size_t boundary_elems_;  // micro_batch * (seq_len / cp) * width
  std::function<void(int64_t)> on_step_;
  ForwardHook on_forward_;
  std::vector<std::unique_ptr<model::Activations>> slots_;  // [max_live], made on first use
  std::map<std::pair<int64_t, int64_t>, std::unique_ptr<model::Activations>> eval_;  // by B, T
  std::vector<size_t> free_;
  std::map<int64_t, Live> live_;  // by micro-batch
  StageWindow window_;
  int64_t steps_ = 0;
  int64_t peak_deferred_bytes_ = 0;                   // ZB-H1: see activation_bytes()
  int64_t run_first_micro_ = 0, run_first_step_ = 0;  // of the current executor run
  StaleWeights stale_;
  std::vector<float> previous_;  // stash, predict: the weights before the last STEP
  std::vector<float> current_;   // predict: the weights while a forward runs on the prediction
};

}  // namespace tessel::train
