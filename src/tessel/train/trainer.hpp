#pragma once
// The training loop: data parallel over the dp axis of the mesh, gradient
// accumulation over micro-batches, warm-up and the learning-rate schedule, global-norm
// clipping, periodic validation, metrics.jsonl, asynchronous checkpoints and resume, the
// ETT ledger of the attempt, fault injection.
//
// One step, on every rank:
//   zero grads; for each of `accum` micro-batches: forward, backward (loss-sum grads)
//   all-reduce [loss sum, loss tokens] over dp; bucketed all-reduce of the gradients,
//   scaled by 1 / global loss tokens; clip; optimizer step; log; maybe validate/save.
// The model itself knows nothing of this (DESIGN principle 3).
#include <memory>
#include <string>
#include <vector>

#include "tessel/comm/communicator.hpp"
#include "tessel/comm/mesh.hpp"
#include "tessel/train/config.hpp"

namespace tessel::train {

struct StepRecord {
  int64_t step = 0;  // updates done after this step (1-based)
  double loss = 0, lr = 0, grad_norm = 0, tokens_per_s = 0, mfu = 0;
  double tflops_per_rank = 0;  // model FLOPs (the MFU numerator) per second per rank, / 1e12
  double hfu = 0;              // MFU with recomputation's FLOPs counted (= mfu without it)
  bool skipped = false;        // a gradient spike: no update (train.spike_factor)
};

struct TrainResult {
  int64_t resumed_from = -1;      // checkpoint step the run continued from; -1 = fresh start
  std::vector<StepRecord> steps;  // the steps this run took
  std::vector<std::pair<int64_t, double>> validation;  // (step, loss in nats per token)
  // Per validation: each data set's loss, in data.path's order; `validation` has their
  // mixture's, weighted by data.weights (one data set: the same loss).
  std::vector<std::vector<double>> data_set_validation;
  std::string sample;               // final text sample (rank 0)
  double peak_gflops = 0;           // per-rank MFU denominator
  int64_t peak_resident_bytes = 0;  // the largest rank's peak resident set size
};

// When the process started and when MPI was ready (monotonic_ns of ett.hpp; -1 = not
// known): the first leaves of the attempt's ETT log. The CLI passes them.
struct ProcessTimes {
  int64_t started_ns = -1;
  int64_t comm_ready_ns = -1;
};

class Trainer {
 public:
  // Builds the mesh (InputError when the world does not match parallel.*), the model,
  // optimizer and data, and resumes from the run directory's latest checkpoint when
  // train.resume is set. Collective over `world`. Rank 0 records the attempt in
  // <run.dir>/ett/ (ett.hpp); a start rejected for bad input (InputError) or with nothing to
  // train removes its record again, since it is no attempt of the job.
  Trainer(Config config, comm::Communicator& world, ProcessTimes times = {});
  ~Trainer();
  TrainResult run();

 private:
  TrainResult run_steps();
  struct Attempt;  // the run directory's locks and this attempt's ETT log
  struct State;
  std::unique_ptr<Attempt> attempt_;
  std::unique_ptr<State> s_;  // destroyed before the attempt, which writes the exit line
};

// The job's mesh on `world_size` processes (parallel.dp = 0: world / (pp x cp)); an InputError
// when the world cannot hold it or fault.kill_rank is outside it. The trainer asks it before it
// locks run.dir, and `tessel run` before it creates run.dir for --np ranks.
comm::MeshShape job_mesh(const Config& config, int world_size);

// Threads per rank when run.threads = 0: OMP_NUM_THREADS if set, else the cores of
// this machine divided by the ranks running on it (at least 1).
int auto_threads_per_rank(int world_size);

// A duration for the progress line (elapsed, ETA): "12m05s", from an hour on "3h07m"; a
// negative one as 0, and one of a million hours or more (or infinite) as ">1000000h".
std::string format_duration(double seconds);

// The name, in a checkpoint's compatibility record, of a fact about data set d's training shard
// (e.g. " tokens": "data.path/train.tok tokens", "data.path[1]/train.tok tokens"), after
// `prefix`.
std::string data_set_key(const std::string& prefix, int64_t d, const std::string& fact);

}  // namespace tessel::train
