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
// Interleaved schedules (boundaries of v x P virtual stages): the stage holds v chunks, chunk c
// being virtual stage c P + s with its blocks, the embedding on virtual stage 0 and the head on
// the last. Each chunk has its own activation pool (at most `max_live` sets each). A
// micro-batch is read from the loader at its chunk-0 forward (those run in micro-batch order)
// and kept until its last chunk's backward; its loss tokens count once.
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
#include <tuple>
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
  // `boundaries` is stage_boundaries() of the layout over `stages` x chunks virtual stages
  // (pipeline_boundaries); `model`, `loader`, `config` (its
  // data.attention_mask and parallel.cp*) and `cp_group` (used when parallel.cp > 1) must
  // outlive the stage. `on_step(version)` runs at every STEP of the schedule,
  // `on_forward(micro, activations)` (if set) after every training forward (the MoE
  // statistics read the routing there).
  using ForwardHook = std::function<void(int64_t micro, const model::Activations&)>;
  GptStage(model::Gpt& model, const std::vector<int64_t>& boundaries, int stage, int stages,
           data::DataLoader& loader, const Config& config, comm::Communicator& cp_group,
           int64_t max_live, std::function<void(int64_t version)> on_step, StaleWeights stale = {},
           ForwardHook on_forward = {});

  int chunks() const override { return int(ranges_.size()); }
  size_t input_elems() const override {
    return chunks() > 1 || !first_stage() ? boundary_elems_ : 0;
  }
  size_t output_elems() const override {
    return chunks() > 1 || !last_stage() ? boundary_elems_ : 0;
  }
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
  // Validation forward of `batch` through `chunk` (forward only, on activations of its own;
  // the training's in-flight micro-batches are untouched): reads `input` (virtual stage 0:
  // empty), writes `output` (the last virtual stage: empty); the loss sum on the last virtual
  // stage (0 elsewhere), the batch's loss tokens and the activations of the forward.
  StageWindow evaluate(int chunk, const data::Batch& batch, std::span<const float> input,
                       std::span<float> output);
  // Inference forward of one sequence (every token of `window`, no cp) through `chunk`, on
  // activations of its own: reads `input`, writes `output` as evaluate(); the last virtual
  // stage returns the logits [V] of the last position (empty elsewhere).
  std::vector<float> next_token_logits(int chunk, std::span<const int32_t> window,
                                       std::span<const float> input, std::span<float> output);
  // f32 elements of `batch`'s residual stream on this rank: B x (T / cp) x width.
  size_t boundary_elems(const data::Batch& batch) const;
  // Nothing in flight: no activations and no micro-batch's inputs kept.
  bool drained() const { return live_.empty() && micro_batches_.empty(); }
  bool first_stage() const { return stage_ == 0; }           // holds the embedding
  bool last_stage() const { return stage_ == stages_ - 1; }  // holds the head
  bool first_virtual(int chunk) const { return ranges_.at(size_t(chunk)).embedding; }
  bool last_virtual(int chunk) const { return ranges_.at(size_t(chunk)).head; }
  // Bytes of the training activations allocated so far (one set per micro-batch the schedule
  // has had in flight at once; the scratch, and under recomputation the block cache, once for
  // all of them) plus, under ZB-H1, the most bytes the queued Ws' copies have held at once
  // (Activations::deferred_bytes), MoE caches not counted.
  int64_t activation_bytes() const;

 private:
  // A micro-batch on this stage, from its first chunk's forward to its last chunk's end.
  struct MicroBatch {
    // Kept until the backwards: a context-parallel attention runs their exchanges too.
    std::unique_ptr<data::Batch> batch;
    std::unique_ptr<RankBatchInputs> inputs;
    double loss_tokens;
    int chunks_left;  // chunks whose backward (ZB-H1: W) has not finished
  };
  // A micro-batch's chunk between its forward and its backward (ZB-H1: its W).
  struct Live {
    size_t slot;
    double loss_sum;
    int64_t steps;  // STEPs taken before the forward
  };
  // load_inputs, the chunk's pieces of the forward, `output` from its last boundary; the
  // loss sum on the last virtual stage.
  double forward_stage(int chunk, model::Activations& acts, const model::ModelInputs& in,
                       std::span<const float> input, std::span<float> output) const;
  // The chunk's activations between its forward and its end (checked).
  Live& in_flight(int chunk, int64_t micro);
  void run_backward(int chunk, int64_t micro, std::span<const float> output_grad,
                    std::span<float> input_grad, bool defer_weight_grads);
  void finish(int chunk, int64_t micro);  // its loss into the window, its activations freed
  void swap_stashed();
  // Prediction: how many STEPs will run between micro-batch `micro`'s forward (now) and its
  // backward; 0 when there is no last STEP of this run to extrapolate along.
  int64_t predicted_gap(int64_t micro) const;
  model::Gpt& model_;
  int stage_, stages_;
  std::vector<model::BlockRange> ranges_;  // per chunk
  data::DataLoader& loader_;
  const Config& config_;
  comm::Communicator& cp_group_;
  size_t boundary_elems_;  // micro_batch * (seq_len / cp) * width
  std::function<void(int64_t)> on_step_;
  ForwardHook on_forward_;
  // Per chunk: [max_live] activations, made on first use, and the free ones.
  std::vector<std::vector<std::unique_ptr<model::Activations>>> slots_;
  std::vector<std::vector<size_t>> free_;
  // Validation and inference activations by chunk, B, T.
  std::map<std::tuple<int, int64_t, int64_t>, std::unique_ptr<model::Activations>> eval_;
  std::map<int64_t, MicroBatch> micro_batches_;   // by micro-batch
  std::map<std::pair<int64_t, int>, Live> live_;  // by micro-batch and chunk
  StageWindow window_;
  int64_t steps_ = 0;
  int64_t peak_deferred_bytes_ = 0;                   // ZB-H1: see activation_bytes()
  int64_t run_first_micro_ = 0, run_first_step_ = 0;  // of the current executor run
  StaleWeights stale_;
  std::vector<float> previous_;  // stash, predict: the weights before the last STEP
  std::vector<float> current_;   // predict: the weights while a forward runs on the prediction
};

}  // namespace tessel::train
