#pragma once
// The stage executor (spec pipeline.md §4.1): one per pipeline stage (one rank of the pp
// group), it runs that stage's instruction list from schedule.hpp — the same lists the
// simulator runs — on real processes. Activations travel forward and gradients backward by
// non-blocking tagged point-to-point messages through the pp group's Communicator; what a
// stage computes is the StageWork's business (the trainer's GPT slice, or a test's synthetic
// stage), so the executor knows nothing of models.
//
// Versions: a stage's weight version is the number of STEPs it has run. Each forward records
// the version it used; each backward (ZB-H1: each B) measures the gap (version now - version
// at its forward). Under ZB-H1 the executor calls StageWork::backward_input for B ops and
// backward_weights for W ops; under the other schedules backward.
//
// Interleaved (v chunks per stage): chunk c of stage s is virtual stage c P + s; activations
// go from virtual stage j to j + 1 and gradients back, so stage s receives activations from
// stage (s - 1) mod P and gradients from (s + 1) mod P, and the last stage's chunk c feeds
// stage 0's chunk c + 1 (P = 1 sends to itself).
#include <cstdint>
#include <span>
#include <vector>

#include "tessel/comm/communicator.hpp"
#include "tessel/core/rng.hpp"
#include "tessel/pipeline/schedule.hpp"
#include "tessel/pipeline/simulator.hpp"

namespace tessel::pipeline {

// What one stage computes. Micro-batch numbers are global (schedule.hpp) and forwards of
// one chunk on a stage run in increasing micro-batch order, so a stage that reads data (the
// first for tokens, the last for targets) can take the next batch of a deterministic loader.
// A stage holds chunks() model chunks (interleaved schedules: v >= 2, else 1); chunk c of
// stage s is virtual stage c * P + s, so the model runs virtual stages 0 .. v P - 1 in order
// and the ops name their chunk first.
class StageWork {
 public:
  virtual ~StageWork() = default;
  // Model chunks this stage holds; the same on every stage (checked once at start).
  virtual int chunks() const { return 1; }
  // f32 elements per message received from the previous stage and sent to the next, the same
  // for every chunk. With one chunk: 0 on the first stage (input) and the last (output).
  // With chunks() > 1 the virtual stages form a ring of messages (the last stage's chunk
  // c < v - 1 sends to stage 0's chunk c + 1), so every stage receives and sends. Checked
  // against the neighbours once at start.
  virtual size_t input_elems() const = 0;
  virtual size_t output_elems() const = 0;
  // Forward of `micro` through `chunk`: reads `input` (empty on virtual stage 0), writes
  // `output` (empty on the last virtual stage), keeps what its backward needs.
  virtual void forward(int chunk, int64_t micro, std::span<const float> input,
                       std::span<float> output) = 0;
  // Backward of `micro` through `chunk`: reads `output_grad` (empty on the last virtual
  // stage), writes `input_grad` (empty on virtual stage 0), ADDS its weight gradients into
  // the stage's accumulation buffer and releases what the forward kept.
  virtual void backward(int chunk, int64_t micro, std::span<const float> output_grad,
                        std::span<float> input_grad) = 0;
  // ZB-H1 splits a backward in two: backward_input (B: the input gradient, plus any weight
  // gradients the stage does not defer) and later backward_weights (W: the deferred weight
  // gradients; releases what the forward kept). Together they must add into each gradient
  // buffer what backward adds, in the same order, so ZB-H1 equals 1F1B bitwise. A stage's Ws
  // run in micro-batch order, each after its B, with no STEP between a B and its W.
  virtual void backward_input(int chunk, int64_t micro, std::span<const float> output_grad,
                              std::span<float> input_grad) = 0;
  virtual void backward_weights(int chunk, int64_t micro) = 0;
  // Optimizer step of this stage's parameters with the accumulated gradients, which it then
  // zeroes. `version` is the number of steps this stage has taken before this one. Flush
  // schedules reach STEP on every stage for the same micro-batches, so it may use
  // collectives over all stages there; PACI's STEP is local and must not.
  virtual void step(int64_t version) = 0;
};

struct ExecutorOptions {
  // Test only: wait a uniform random time in [0, max_random_delay_us] before every op
  // (stream keyed by delay_seed and the stage), to shake out ordering deadlocks.
  double max_random_delay_us = 0;
  uint64_t delay_seed = 0;
  bool record_timeline = false;  // fills StageStats::timeline
};

struct StageStats {
  int chunks = 1;  // v, the model chunks of the stage; the op counts count chunk ops
  int64_t forwards = 0, backwards = 0, steps = 0;  // backwards: ZB-H1's Bs
  int64_t weights = 0;                             // ZB-H1's Ws
  // Most forwards awaiting their backward (ZB-H1: their W) at once; interleaved: chunk
  // forwards, each holding 1/v of a stage's activations.
  int64_t peak_live_activations = 0;
  int64_t max_version_gap = 0;             // over this run's backwards
  int64_t inconsistent_backwards = 0;      // backwards whose gap is not 0
  std::vector<int64_t> gap_histogram;      // [gap] -> backwards
  std::vector<int64_t> backward_versions;  // the weight version each backward ran under
  // Compute; backward_seconds: ZB-H1's Bs alone, weight_seconds its Ws.
  double forward_seconds = 0, backward_seconds = 0, weight_seconds = 0, step_seconds = 0;
  double wait_seconds = 0;   // blocked on messages
  double total_seconds = 0;  // wall time of run()
  // This stage's ops, in seconds since stage 0 left run()'s opening barrier (aligned across
  // stages through the system clock).
  std::vector<OpTiming> timeline;
  // Mean costs per micro-batch, for feeding the simulator with a measured run's profile: the
  // mean op times v (the simulator charges each chunk's op 1/v of them, so the same v
  // predicts the run). After Ws: backward = B + W and weight = W; otherwise weight = 0.
  StageCosts profiled_costs() const;
};

class StageExecutor {
 public:
  // Collective over `pp_group` (stage = rank): agrees the chunk count with every stage and
  // the message sizes with the neighbours (InputError naming both stages on a mismatch).
  // `pp_group` and `work` must outlive it.
  StageExecutor(comm::Communicator& pp_group, StageWork& work, ExecutorOptions options = {});
  // Runs this stage's list for `schedule` (schedule.stages must equal the group size and
  // schedule.chunks the work's chunks(), else InputError),
  // numbering micro-batches from `first_micro`. Collective over `pp_group`: it begins with a
  // barrier (and a broadcast of the timeline origin) and ends with every forward's backward
  // done and every message delivered (flush schedules: after their last STEP; PACI: the
  // drain at the horizon's end). The weight version carries over between calls; PACI's
  // count of backwards towards the next STEP does not, so a PACI horizon must be a multiple
  // of K (InputError otherwise).
  StageStats run(const ScheduleOptions& schedule, int64_t first_micro = 0);
  int64_t version() const { return version_; }

 private:
  comm::Communicator& group_;
  StageWork& work_;
  ExecutorOptions options_;
  int64_t version_ = 0;
  Rng delays_;  // the random-delay stream, continued across runs
};

// Gathers every stage's timeline to stage 0 (collective over `pp_group`): stage by stage,
// each in its execution order (empty on the other stages).
std::vector<OpTiming> gather_timeline(comm::Communicator& pp_group, const StageStats& stats);
// Mean time from the end of the op that produced a message to the start of the op that
// consumed it, over the consumers that were idle when it was produced, or produced it (they
// waited for it):
// the link latency, transfer and wake-up, to feed SimOptions::links (as latency) beside the
// stages' profiled_costs(). `timeline` holds every stage's ops, each stage's in execution
// order (gather_timeline's, or a SimResult's, whose link latency it returns); the producer of
// an op's message is the op of the same kind and micro-batch on the previous (forward) or
// next (backward) virtual stage, chunk c of stage s being virtual stage c P + s (interleaved:
// the message into chunk c of stage 0 comes from chunk c - 1 of the last stage); 0 when no
// consumer waited.
double profiled_link_latency(const std::vector<OpTiming>& timeline, int stages);
// The gathered timelines as a Chrome trace on stage 0 (one track per stage; empty JSON
// elsewhere).
nlohmann::json gather_chrome_trace(comm::Communicator& pp_group, const StageStats& stats);

}  // namespace tessel::pipeline
