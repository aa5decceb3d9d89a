#pragma once
// The deterministic fault injector (spec section 5), configured by the `fault.*` keys.
// Attempt k of a job (the k-th launch by `tessel run`, or the k-th `tessel train` in the
// run directory) fires the k-th entry of `fault.kill_steps` / `fault.kill_seconds` /
// `fault.hang_steps`:
//   kill_steps    rank `kill_rank` kills itself with SIGKILL right after its update of
//                 that step (kill_in = "step"), or inside the checkpoint writer of that
//                 step after its files are durable and before its done record and the
//                 manifest, so the save is lost (kill_in = "checkpoint_write");
//   kill_seconds  rank `kill_rank` kills itself that many seconds after the attempt began
//                 (its process start, before MPI start-up). The timer is armed when the
//                 trainer is built, so a deadline that passed during start-up fires then;
//   hang_steps    rank `kill_rank` blocks forever (sleeping) right after its update of that
//                 step: a hang, which its peers join in their next collective and which only
//                 `tessel run --hang-timeout` ends;
//   init_delay_seconds  every rank of every attempt sleeps that long while building the
//                 model: a synthetic slow cold start, which the ETT ledger charges to
//                 model_build once per attempt (W grows by (1 + NoF) * delay);
//   corrupt_step  after the checkpoint of that step is committed, one byte of rank 0's
//                 model shard is flipped (storage corruption; found by the load's CRC).
// Before dying or hanging, the rank appends a fault line to the attempt's ETT log, so the
// ledger knows when the failure happened.
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace tessel::train {

struct FaultConfig {
  int64_t kill_rank = 0;
  std::string kill_steps;         // comma-separated, one per attempt ("" = none; "0" = none)
  std::string kill_seconds;       // comma-separated seconds, one per attempt
  std::string hang_steps;         // comma-separated steps, one per attempt ("" or "0" = none)
  std::string kill_in = "step";   // "step" | "checkpoint_write"
  int64_t corrupt_step = 0;       // 0 = none
  int64_t spike_step = 0;         // gradients of this step x kSpikeScale (0 = none)
  double init_delay_seconds = 0;  // synthetic cold-start delay per attempt
};

// Checks the lists and kill_in; InputError naming the `fault.*` key.
void validate(const FaultConfig& config);

class FaultInjector {
 public:
  // `ledger_path`: the attempt's ETT log (empty: none); `t0_ns`: when the attempt began.
  FaultInjector(const FaultConfig& config, int attempt, int rank, std::string ledger_path,
                int64_t t0_ns);
  ~FaultInjector();  // stops the timer
  FaultInjector(const FaultInjector&) = delete;
  FaultInjector& operator=(const FaultInjector&) = delete;

  // The attempt resumed from the checkpoint of `step`: what a fault before its first update
  // reports as done (one while the checkpoint still loads reports 0).
  void starts_from(int64_t step) { completed_ = step; }
  // The training thread finished the update of `step`.
  void after_step(int64_t step);
  // The checkpoint writer made the files of `step` durable (writer thread).
  void in_checkpoint_write(int64_t step);
  // Rank 0 committed the checkpoint `dir` of `step` (writer thread).
  void after_commit(const std::string& dir, int64_t step);
  // The factor on the reduced gradients of `step` (every rank): kSpikeScale at
  // fault.spike_step, a synthetic gradient spike; else 1.
  float gradient_scale(int64_t step) const { return step == spike_step_ ? kSpikeScale : 1.0f; }
  static constexpr float kSpikeScale = 1000.0f;

 private:
  // Appends the fault line and says on stderr what the rank does (`what`: "kills itself").
  void announce(const char* kind, const char* what);
  [[noreturn]] void kill(const char* kind);
  [[noreturn]] void hang();

  bool armed_ = false;  // this rank kills in this attempt
  int rank_;
  int64_t kill_step_ = -1;
  int64_t hang_step_ = -1;
  double kill_seconds_ = -1;
  bool in_write_ = false;
  int64_t corrupt_step_;
  int64_t spike_step_;
  std::string ledger_;
  std::atomic<int64_t> completed_{0};  // the run's last completed step

  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread timer_;
};

}  // namespace tessel::train
