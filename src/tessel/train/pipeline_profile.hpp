#pragma once
// The schedule simulator (pipeline/simulator.hpp) fed the per-stage costs a pipeline training
// run measured (`tessel simulate RUN_DIR`): what GPipe, 1F1B and PACI would take per step on
// this model, these stages and this machine (and interleaved 1F1B with its stages cut into v
// chunks of equal cost), from one run of any of them, and ZB-H1 from a
// run that measured its W ops. A run's step records carry each stage's forward, backward and
// optimizer seconds (docs/training.md), a ZB-H1 run's also `weight_seconds`, the part of its
// `backward_seconds` (the whole backward, B + W) spent in its Ws;
// the forward and backward are divided by the micro-batches they covered, so the costs
// apply to any M or K at the run's micro-batch size (another M means another global batch).
#include <cstdint>
#include <string>
#include <vector>

#include "tessel/pipeline/simulator.hpp"

namespace tessel::train {

struct PipelineProfile {
  std::string schedule;                   // the run's: gpipe, 1f1b, interleaved, paci or zb-h1
  int64_t micro_batches = 0;              // the run's per step: train.accum, or PACI's K
  int chunks = 1;                         // the run's model chunks per stage (interleaved: v)
  int64_t first_step = 0, last_step = 0;  // the steps averaged
  double step_seconds = 0;                // measured: their mean
  // Seconds, per stage: forward and whole backward of one micro-batch, one optimizer step, and
  // of the backward the W (0 unless the run measured Ws).
  std::vector<pipeline::StageCosts> costs;
  // Bytes of one activation (or gradient) message between stages: the f32 residual stream of
  // a micro-batch's rows on one cp rank, micro_batch x (seq_len / cp) x width x 4 (config.toml).
  double message_bytes = 0;
};

// Averages the step records of the run's last attempt that wrote any (`run_dir`/metrics.jsonl
// after a start record: a resumed run may have changed schedule or accum) after its first
// `skip` steps (their warm-up: allocation, first touch); the micro-batches per step come from
// the records (`pipeline.micro_batches`; older records: `run_dir`/config.toml). A PACI run's
// records are per horizon (one executor run between drains); only horizons that begin after
// the skip count. InputError for a run that is not a pipeline run, or when there are no such
// records; naming metrics.jsonl:line for a malformed line (read_json_lines), a record that
// lacks the stage costs, and a time in it that is negative or not finite.
PipelineProfile read_pipeline_profile(const std::string& run_dir, int64_t skip);

struct SimulatedSchedule {
  std::string name;  // "gpipe", "1f1b", "interleaved", "paci", "zb-h1"
  double step_seconds = 0;
  double bubble = 0;
  std::vector<int64_t> peak_activations;  // per stage
};

// GPipe, 1F1B, interleaved with `chunks` model chunks per stage (with 2 stages or more, when M
// is divisible by them; each chunk 1/v of its stage's costs, v times the messages), PACI(K = M)
// and, when some stage's costs have a weight (a run that measured ZB-H1's Ws), ZB-H1, in that
// order, over `steps` steps of M = `micro_batches` micro-batches, each stage with `costs`, every
// boundary (interleaved: and the wrap from the last stage to the first) with `link`
// (default: free); PACI's step is a window (its fill and drain once). InputError for
// chunks < 2 when interleaved is simulated, and, before any is simulated, when one of them
// would run more than pipeline::kMaxSimulatedOps ops.
std::vector<SimulatedSchedule> simulate_schedules(const std::vector<pipeline::StageCosts>& costs,
                                                  int64_t micro_batches, int64_t steps,
                                                  const pipeline::LinkCosts& link = {},
                                                  int chunks = 2);

}  // namespace tessel::train
