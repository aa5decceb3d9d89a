#pragma once
// Pipeline parallelism in the trainer (issue #7, spec pipeline.md; docs/training.md): the
// GPT split over the pp axis of the mesh (stage_partition.hpp), each rank one stage of its
// dp replica, run by the stage executor with a GptStage (pipeline_stage.hpp).
//
// Flush schedules (gpipe, 1f1b, zb-h1): one trainer step is one executor run over train.accum
// micro-batches, ending in a STEP on every stage: a tied embedding's two gradient parts
// (lookups on the first stage, head on the last) summed over pp; [loss sum, loss tokens]
// and this stage's gradients all-reduced over dp and scaled by 1 / global loss tokens; the
// global gradient norm from per-parameter sums of squares summed over pp and added in
// registry order (bitwise the single-process norm); clipping; the optimizer step of this
// stage's parameters; a tied embedding broadcast from the first stage.
// PACI: no flush. A trainer step is one window of K micro-batches. The executor runs over a
// horizon that ends at the next validation, checkpoint or the run's end (the only drains);
// inside it each stage steps alone after every K-th backward, clipping with its own
// gradient norm (no cross-stage collective, spec section 5). The last stage reports each
// window's loss as it finishes (on_window); the windows' step records come once the horizon
// is done.
//
// Every rank holds only its stage: the model is built with the stage's blocks
// (pipeline_block_range), so weights, gradients, optimizer state and activations are the
// stage's alone (a tied embedding also on the last stage, for the head). Validation runs
// through the stages (validation_sums); checkpoints write each stage's dense parameters from
// its lead (own_dense_parameters) and its experts from each ep index's first edp x cp rank; the
// sample's forwards run through the stages too (next_token_logits). MoE blocks: the stage's
// experts sharded over ep as without pipeline (dense gradients over dp x cp, experts over
// edp x cp).
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "tessel/comm/mesh.hpp"
#include "tessel/core/timer.hpp"
#include "tessel/data/loader.hpp"
#include "tessel/model/gpt.hpp"
#include "tessel/optim/lr_schedule.hpp"
#include "tessel/optim/optimizer.hpp"
#include "tessel/parallel/data_parallel.hpp"
#include "tessel/parallel/expert_sharding.hpp"
#include "tessel/pipeline/stage_executor.hpp"
#include "tessel/train/config.hpp"
#include "tessel/train/moe_metrics.hpp"
#include "tessel/train/pipeline_stage.hpp"

namespace tessel::train {

// parallel.pp > 1, or a pipeline.schedule set (pp = 1 through the executor).
bool pipeline_enabled(const Config& config);
pipeline::ScheduleKind pipeline_schedule(const Config& config);
// Micro-batches per trainer step (and per loader step): PACI's K, else train.accum.
int64_t micro_batches_per_step(const Config& config);
// Model chunks per stage: pipeline.chunks under the interleaved schedule (0 = 2), else 1.
int64_t pipeline_chunks(const Config& config);
// The first block of each virtual stage and the end (stage_boundaries) for parallel.pp x
// pipeline_chunks() virtual stages and pipeline.layout; InputError for a bad layout. Virtual
// stage j runs on stage j % pp (without interleaving, j is the stage).
std::vector<int64_t> pipeline_boundaries(const Config& config);
// InputError naming the keys for what the pipeline path does not support (PACI with a tied
// head or an adaptive checkpoint policy; interleaving at pp = 1, with one chunk, or with
// train.accum not divisible by pp) and for a bad schedule or layout.
void validate_pipeline(const Config& config);

// What this rank's stage holds (the model's chunks, one BlockRange per virtual stage s,
// s + pp, ...): blocks [boundaries[j], boundaries[j + 1]) of each, the embeddings on the first
// virtual stage, the final norm and head on the last (either may hold no blocks); the whole
// model without a pipeline.
std::vector<model::BlockRange> pipeline_block_ranges(const Config& config, const comm::Mesh& mesh);

// The stage of every parameter of `model`, in registry order, for `stages` stages and the
// virtual stages' `boundaries`: the embeddings on the first stage, each block's on the stage
// running the virtual stage holding it, the final norm and the head on the last stage; a tied
// head's weight is the embedding, trained on the first.
std::vector<int> parameter_stages(const model::Gpt& model, const std::vector<int64_t>& boundaries,
                                  int stages);

// The optimizer of the pipeline path: this rank's stage's parameters only (its dense ones
// over dp, its experts over edp), its state named "stage<s>/..." and held by that stage's
// ranks alone (checkpoints write it as their own tensors, ZeRO-1 row shards by each dp or edp
// rank). The prefix keeps each stage's step counters apart in a checkpoint (older tessel
// reads them back by these names); a resume matches state without it (stage_free_name), so
// any stage split, or none, continues it.
std::unique_ptr<parallel::ExpertShardedOptimizer> make_stage_optimizer(
    const Config& config, const model::Gpt& model, const comm::Mesh& mesh,
    const std::map<std::string, std::vector<int64_t>>& row_blocks);

struct PipelineStep {
  double loss_sum = 0, loss_tokens = 0;  // over the global batch
  double grad_norm = 0;    // pre-clip norm over all stages (PACI: of the stages' own norms)
  double seconds = 0;      // wall time (PACI: the horizon's, shared by its windows)
  nlohmann::json metrics;  // schedule, per-stage busy / wait time, version gaps, ...
  // MoE models: every MoE block's statistics over the global batch (summed over dp x cp, each
  // block from its stage); PACI: the all-to-all bytes are the horizon's mean per window.
  std::optional<MoeMetrics> moe;
};

class PipelineTrainer {
 public:
  // Collective over the pp group. Every reference must outlive this object; `optimizer`
  // comes from make_stage_optimizer.
  PipelineTrainer(const Config& config, const comm::Mesh& mesh, model::Gpt& model,
                  data::DataLoader& loader, optim::Optimizer& optimizer,
                  const optim::LrSchedule& schedule);
  // What the trainer decides around each optimizer step. `gradient_scale(update)` multiplies
  // the reduced gradients of update `update` (from 1; fault.spike_step). `before_update(update,
  // grad_norm)` runs before every optimizer step (the trainer waits for a checkpoint's staging
  // copy there) and returns whether to apply it: under a flush schedule a gradient spike
  // (train.spike_factor) is not applied, and the optimizer and MoE balancing do not step. The
  // norm is the same on every rank, so all stages decide alike; PACI must apply every update.
  struct UpdateHooks {
    std::function<float(int64_t)> gradient_scale;
    std::function<bool(int64_t, double)> before_update;
    // Before a non-finite gradient norm stops the run: the hint of its error. `every_rank`:
    // all ranks stop here (a flush schedule's norm is global; PACI's is the stage's own).
    std::function<std::string(bool every_rank)> diverged;
    // After this stage applied update `update`: PACI's stages step inside a horizon that can
    // outlast tessel run --hang-timeout, and a fault of step N must strike at update N there.
    std::function<void(int64_t update)> after_update;
  };
  // Trainer step `step` (0-based, consecutive): flush schedules run it; PACI returns its
  // window, running the horizon that starts there first.
  PipelineStep step(int64_t step, const UpdateHooks& hooks);
  // Validation through the stages, forward only: the first stage embeds, each runs its
  // blocks on what the previous one sent, the last computes the loss. [loss sum, loss tokens]
  // of each data set d < data_sets, at [2d, 2d + 1], over `batches` (this dp rank's; batch i
  // from data set source[i]), summed in batch order as one process sums them, on every rank
  // of the pp group. MoE models: `moe` gets every batch's forward of the stage's blocks,
  // summed over dp x cp and joined over pp. Collective over pp, ep, cp and dp x cp; call
  // between steps (no message in flight). `on_batch` runs after each batch's forward (progress).
  std::vector<double> validation_sums(const std::vector<data::Batch>& batches,
                                      std::span<const int64_t> source, int64_t data_sets,
                                      MoeMetrics& moe, const std::function<void()>& on_batch);
  // Logits [V] of the token after `window` (one sequence, all of it on every cp rank), its
  // forward run through the stages and the last stage's logits broadcast, so every rank of
  // the pp group returns them (and can draw the same token). Collective over pp; call
  // between steps.
  std::vector<float> next_token_logits(std::span<const int32_t> window);
  // The dense parameters this stage trains (and its lead writes to checkpoints): the model's
  // less its experts (all the stage's too) and less a tied embedding on the last stage (the
  // first stage's).
  const ParameterList& own_dense_parameters() const { return own_dense_; }
  // PACI, on the last stage: called at each of its local steps (step counted from 1) with the
  // window's loss over the global batch, the last stage's gradient norm and the seconds since
  // its previous window (or the horizon's start), as it happens (the trainer's step records
  // of a horizon come only once it drains).
  std::function<void(int64_t step, double loss, double grad_norm, double seconds)> on_window;

 private:
  void on_step(int64_t version);
  // pipeline.paci_stash / paci_predict: what GptStage needs for them; else plain.
  StaleWeights own_stale_weights(const Config& config) const;
  int64_t max_live_activations() const;  // micro-batches this stage holds at once (GptStage)
  // A forward outside the executor (validation, sampling) through `chunk`: its input of
  // `elems` received from the previous virtual stage (none on virtual stage 0), `forward(input,
  // output)` run, its output sent to the next (none from the last); forward's result.
  template <class Forward>
  auto through_chunk(int chunk, size_t elems, Forward forward);

  const Config& config_;
  comm::Communicator& pp_;
  comm::Communicator& ep_;
  comm::Communicator& grad_group_;  // dp x cp: the ranks holding this stage
  model::Gpt& model_;
  optim::Optimizer& optimizer_;
  const optim::LrSchedule& schedule_;
  pipeline::ScheduleKind kind_;
  int stage_, stages_;
  int64_t micro_per_step_;
  std::vector<int> param_stage_;
  ParameterList own_params_;
  ParameterList own_dense_, own_experts_;  // own_params_ in two
  std::vector<bool> own_is_expert_;        // [own_params_]
  std::vector<int64_t> own_positions_;     // [own_params_] whole-registry positions
  std::pair<int64_t, int64_t> own_range_;  // own_dense_'s flat element range
  bool tied_;                              // the embedding lives on the first and the last stage
  // Tied: the first and the last stage (ranks 0 and 1 in it), which share the embedding.
  std::unique_ptr<comm::Communicator> ends_;
  std::optional<parallel::GradientReducer> reducer_;  // this stage's dense range, over dp (x cp)
  std::optional<parallel::GradientReducer> expert_reducer_;  // its experts, over edp x cp
  GptStage work_;
  pipeline::StageExecutor executor_;
  // The run in progress: its first trainer step, the executor version then, the hook.
  int64_t run_step_ = 0, run_version_ = 0;
  UpdateHooks hooks_;                      // of the current step() call
  std::vector<PipelineStep> run_windows_;  // this stage's view of each STEP of the run
  std::vector<MoeMetrics> run_moe_;        // MoE models: each window's forwards on this rank
  std::deque<PipelineStep> pending_;       // PACI: windows done, not yet returned
  int64_t next_step_ = -1;                 // the step pending_.front() belongs to
  Timer window_timer_;                     // PACI: since the previous window (on_window)
  double sync_seconds_ = 0;                // this run's STEPs: in cross-stage collectives
};

}  // namespace tessel::train
