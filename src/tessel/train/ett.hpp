#pragma once
// The effective-training-time (ETT) ledger (spec ett_checkpoint.md sections 1-2).
//
// Every wall-clock second of a job, across all its attempts, belongs to exactly one leaf
// phase. An attempt (one launch of the MPI job) has its own append-only log
//   <run.dir>/ett/attempt-NNNN.jsonl
// of JSON lines, each written with one write(2) and never rewritten, so a crash loses
// nothing already written:
//   {"event": "attempt", "attempt": k, "t": ns}     the attempt begins (first line)
//   {"phase": "comm_init", "t": ns}                 leaf `comm_init` begins at t; the
//                                                   previous leaf ends there
//   {"phase": "productive", "t": ns, "step": s}     training step s (1-based) begins
//   {"phase": "checkpoint_blocking", "t": ns, "step": s}   step s waits for a checkpoint's
//                                                   staging copy (untagged: a save between steps)
//   {"event": "resume", "step": c, "t": ns}         the attempt continues from checkpoint c
//   {"event": "fault", "t": ns, "rank": r, "step": s, "kind": "..."}   injected failure
//   {"event": "exit", "t": ns, "status": code}      the attempt ended (last line); a job
//                                                   the supervisor ended adds "cause":
//                                                   "hang" (and "progress_t": when it last
//                                                   saw the log change) or "stop"
// Times are CLOCK_MONOTONIC nanoseconds, one clock for every process of this machine
// (the supervisor and the ranks). A leaf lasts from its line to the next phase line, the
// fault, or the exit. The supervisor (`tessel run`) writes the attempt and exit lines and
// the `scheduling` leaf; rank 0 of the job writes the rest; a rank that injects a fault
// writes its fault line.
//
// The analysis turns the logs into the spec's decomposition: steps of a failed attempt
// after the checkpoint the next attempt resumed from are `wasted`, the time from a fault
// (or, for a hang the supervisor found, from when it last saw progress) to the attempt's exit
// is `failure_detection`; TTS, NoF (also by cause), TTR per failure, ETT% and goodput = MFU x
// ETT% follow. An attempt failed when it exited with a nonzero status or was killed as hung,
// has a fault line, or has no exit line and a later attempt exists (it died without writing
// one: killed, machine lost). The last attempt without an exit line is `open`: still
// running, or died with no later attempt yet; it counts up to its last line, not as a
// failure.
#include <array>
#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace tessel::train {

// The leaves of the phase tree (spec 1.2). TTS and TTR_i are the start-up leaves of the
// first and of later attempts; `wasted` and `failure_detection` belong to TTR_i.
enum class Phase : uint8_t {
  scheduling,           // launcher start (or relaunch decision) until the process runs
  comm_init,            // MPI initialization
  model_build,          // mesh, model, optimizer, gradient buckets
  data_warmup,          // data loader and validation batches
  checkpoint_load,      // choosing, reading, verifying and restoring a checkpoint
  warmup,               // synthetic-batch warm-up, GEMM peak measurement
  productive,           // training steps that count
  wasted,               // training steps lost at a failure (analysis only)
  checkpoint_blocking,  // training waits for a checkpoint (staging, backpressure)
  eval,                 // validation
  failure_detection,    // a failure until the supervisor sees the job end (analysis)
  shutdown,             // final checkpoint, sample, teardown
  other,                // config parsing and anything else
};
constexpr int kNumPhases = 13;
const char* phase_name(Phase phase);
std::optional<Phase> phase_from_name(std::string_view name);

// CLOCK_MONOTONIC in nanoseconds.
int64_t monotonic_ns();

// Appends `record` as one line to `path` with a single write(2) on an O_APPEND
// descriptor, so lines of several processes never interleave. InputError on failure.
void append_json_line(const std::string& path, const nlohmann::json& record);

std::string ett_dir(const std::string& run_dir);
// Creates <run.dir>/ett when missing. InputError naming it when it is no directory (a file
// in its place) or cannot be created.
void create_ett_dir(const std::string& run_dir);
std::string attempt_path(const std::string& run_dir, int attempt);
// One past the highest attempt log's index in the run directory: the next attempt's index
// (the number of attempts, when none is missing); 0 without <run.dir>/ett. InputError naming
// <run.dir>/ett when it exists but cannot be listed (a file in its place).
int count_attempts(const std::string& run_dir);
// Whether the attempt log at `path` holds a {"event": "withdrawn"} line: the trainer found
// the start to be no attempt of the job (refused for bad input, or nothing to train) in a
// supervised attempt; `tessel run` then removes the log.
bool attempt_withdrawn(const std::string& path);
// Removes the log of a start that is no attempt of the job, and ett/ when that empties it.
void remove_attempt(const std::string& path);

// The run directory's locks, each an exclusive flock(2) on a file of it that is never removed.
// The kernel releases one when its holder dies, and O_CLOEXEC keeps the processes the holder
// starts from holding it on after that.
//   supervisor.lock  whoever picks attempt indices and writes the attempts' first and exit
//                    lines: `tessel run` for its whole life (its job's trainer does not take
//                    it), or rank 0 of a plain `tessel train`
//   lock             rank 0 of the training job, supervised or not (also one that runs on
//                    after its supervisor was killed)
// A plain `tessel train` takes supervisor.lock first, so a start it refuses never held the
// job's lock that the running job's trainer could have needed.
constexpr const char* kSupervisorLock = "supervisor.lock";
constexpr const char* kJobLock = "lock";
class RunDirLock {
 public:
  RunDirLock() = default;  // holds nothing (the ranks other than 0)
  // Creates `run_dir` and takes <run_dir>/<name> without waiting: InputError naming the
  // directory when another process holds it, naming run.dir when it cannot be created.
  RunDirLock(const std::string& run_dir, const char* name);
  ~RunDirLock();
  RunDirLock(const RunDirLock&) = delete;
  RunDirLock& operator=(const RunDirLock&) = delete;

 private:
  int fd_ = -1;
};

// Rank 0's writer of one attempt log; a default-constructed ledger records nothing
// (the other ranks). Entering a leaf closes the previous one.
class EttLedger {
 public:
  EttLedger() = default;
  // Opens attempt `attempt` of `run_dir` (appending); with `begin`, writes the attempt
  // line at `t0` (an attempt not started by the supervisor).
  EttLedger(const std::string& run_dir, int attempt, bool begin, int64_t t0 = monotonic_ns());
  bool active() const { return !path_.empty(); }
  int attempt() const { return attempt_; }
  const std::string& path() const { return path_; }
  // Leaf `phase` begins at `t` (training steps carry their 1-based number).
  void enter(Phase phase, int64_t step = -1, int64_t t = monotonic_ns());
  // Any other line (resume, fault, exit); "t" is added when missing.
  void event(nlohmann::json record);
  // Progress inside a leaf that may outlast `tessel run --hang-timeout` (a validation batch, a
  // second of fault.init_delay_seconds): touches the log's modification time, the liveness
  // signal the supervisor watches, without writing a line. Every line written is progress too.
  void beat() const;

 private:
  std::string path_;
  int attempt_ = 0;
};

// One contiguous piece of an attempt in one leaf.
struct EttSegment {
  Phase phase;
  int64_t t0, t1;     // ns
  int64_t step = -1;  // training step, for productive and wasted segments (and a mid-step wait)
};

struct EttAttempt {
  int index = 0;
  int64_t t0 = 0, t1 = 0;  // ns: first line, exit (or last line)
  std::vector<EttSegment> segments;
  std::array<int64_t, kNumPhases> leaf_ns{};
  bool failed = false;    // nonzero exit status, a fault, or no exit line but a later attempt
  bool exited = false;    // has its exit line
  bool open = false;      // the last attempt, without an exit line: running, or killed
  bool injected = false;  // a fault line: the failure was injected
  bool cut_line = false;  // its log's last line was cut short (a crash while writing it): left out
  // Why a failed attempt ended: "hang" (the supervisor killed it, --hang-timeout), "stop" (a
  // stop signal it forwarded), "exit_status" (the job exited nonzero by itself),
  // "no_exit_record" (it died without an exit line); empty when it did not fail.
  std::string cause;
  // Checkpoint step this attempt started from (0 = fresh); -1 when it ended before it got
  // there (no resume line and no training step).
  int64_t resumed_from = -1;
  int64_t failure_step = -1;  // steps completed when it failed
  // The checkpoint the first later attempt that got to its start resumed from (without one:
  // the run's newest checkpoint, which no later attempt can have written).
  int64_t durable_step = -1;
  int64_t wasted_steps = 0;    // failure_step - durable_step
  int64_t first_step_ns = -1;  // when its first training step began
  // The step its last boundary began or paused inside (a productive one, or a checkpoint wait
  // within a step); -1 when that boundary came between steps. Without a later line the step
  // did not complete.
  int64_t step_in_progress = -1;
  double seconds() const { return double(t1 - t0) * 1e-9; }
};

struct EttReport {
  std::vector<EttAttempt> attempts;
  double wall = 0;        // W: sum of attempt durations, seconds
  double productive = 0;  // T_prod
  double ett = 0;         // T_prod / W
  // Each attempt that no failure preceded (the first, and one continuing a finished run): its
  // start until its first step (failed before one: to its end less its detection, which is in
  // its TTR). After a failure the start-up is in that failure's TTR.
  double tts = 0;
  std::array<double, kNumPhases> tts_by_phase{};
  int nof = 0;                              // failed attempts
  int injected = 0;                         // of which injected
  std::map<std::string, int> nof_by_cause;  // failed attempts by EttAttempt::cause
  // per failure: wasted + detection + the next attempt's start-up (all of it when that one
  // never got to a step, less its own detection time when it failed too)
  std::vector<double> ttr;
  std::vector<int> failed_attempts;  // per failure: the index of its attempt log
  double ttr_bound = 0;              // seconds; 0 = no bound
  std::vector<double> ckpt_block;    // each checkpoint_blocking segment, seconds
  // The step records' MFU in metrics.jsonl, weighted by their step_seconds; nullopt (and
  // goodput too) when it holds none.
  std::optional<double> mfu;
  std::optional<double> goodput;            // mfu * ett
  std::array<double, kNumPhases> leaves{};  // seconds, whole job
};

// Reads <run_dir>/ett/*.jsonl (and metrics.jsonl for MFU). InputError naming the file for a
// missing or empty attempt log (one up to the highest index), and naming file:line for a
// malformed line of a log or of metrics.jsonl other than a last line cut short by a crash, a
// log whose first line is not its own attempt line, a second exit line, a time before an
// earlier line's (a fault line's: before the attempt line's), a field of the wrong type or
// out of range (times integers, the attempt line's >= 0; steps integers in [0, kMaxSteps]; a
// hang's progress_t within its attempt) and a training step not after the checkpoint its
// attempt resumed from. A metrics step record whose mfu or step_seconds is no number >= 0 is
// left out of the MFU with a warning. Only withdrawn logs: no attempt (an empty report).
EttReport analyze_ett(const std::string& run_dir);

// The mean time between failures seen so far: W over the failed attempts that a stop signal
// did not end (a user's stop is no interruption of the infrastructure, the spec's NoF);
// nullopt without such a failure.
std::optional<double> observed_mtbf(const EttReport& report);
nlohmann::json ett_json(const EttReport& report);
// Chrome trace (chrome://tracing, Perfetto): one row per attempt, one slice per segment.
nlohmann::json ett_chrome_trace(const EttReport& report);
// A self-contained HTML page: summary table, stacked bar of leaves per attempt, timeline;
// `title` and the other text it shows are HTML-escaped.
std::string ett_html(const EttReport& report, const std::string& title);
// "exit_status 2, hang 1": NoF by cause.
std::string nof_by_cause_text(const EttReport& report);
// "12.34 %" of a fraction (MFU, goodput), or "n/a (no step records in metrics.jsonl)".
std::string mfu_percent_text(const std::optional<double>& fraction);
// The failures (0-based) whose TTR exceeds report.ttr_bound (none when the bound is 0).
std::vector<int> ttr_over_bound(const EttReport& report);
// Writes ett.json, ett.html and ett_trace.json into `run_dir`, all or none
// (write_files_atomically); returns the report. InputError, writing nothing, without an
// attempt to report: no log, or only withdrawn starts' logs.
// `ttr_bound` (seconds, 0 = none) is the recovery-time objective each TTR is checked against.
EttReport write_ett_report(const std::string& run_dir, double ttr_bound = 0);

}  // namespace tessel::train
