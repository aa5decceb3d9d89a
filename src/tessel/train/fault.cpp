#include "tessel/train/fault.hpp"

#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>

#include "tessel/core/error.hpp"
#include "tessel/core/number_list.hpp"
#include "tessel/train/ett.hpp"

namespace tessel::train {

void validate(const FaultConfig& c) {
  if (c.kill_rank < 0)
    input_error("config key 'fault.kill_rank' must not be negative, got ", c.kill_rank);
  parse_int_list("fault.kill_steps", c.kill_steps, 0);
  parse_int_list("fault.hang_steps", c.hang_steps, 0);
  parse_real_list("fault.kill_seconds", c.kill_seconds, 0);
  if (c.kill_in != "step" && c.kill_in != "checkpoint_write")
    input_error("config key 'fault.kill_in': expected step or checkpoint_write, got '", c.kill_in,
                "'");
  if (c.corrupt_step < 0)
    input_error("config key 'fault.corrupt_step' must not be negative, got ", c.corrupt_step);
  if (c.spike_step < 0)
    input_error("config key 'fault.spike_step' must not be negative, got ", c.spike_step);
  if (!(c.init_delay_seconds >= 0 && c.init_delay_seconds <= 3600))
    input_error("config key 'fault.init_delay_seconds' must be in [0, 3600], got ",
                c.init_delay_seconds);
}

FaultInjector::FaultInjector(const FaultConfig& c, int attempt, int rank, std::string ledger_path,
                             int64_t t0_ns)
    : rank_(rank),
      corrupt_step_(c.corrupt_step),
      spike_step_(c.spike_step > 0 ? c.spike_step : -1),
      ledger_(std::move(ledger_path)) {
  const auto steps = parse_int_list("fault.kill_steps", c.kill_steps, 0);
  const auto secs = parse_real_list("fault.kill_seconds", c.kill_seconds, 0);
  const auto hangs = parse_int_list("fault.hang_steps", c.hang_steps, 0);
  if (rank != int(c.kill_rank)) return;
  if (size_t(attempt) < steps.size()) kill_step_ = steps[size_t(attempt)];
  if (size_t(attempt) < hangs.size() && hangs[size_t(attempt)] > 0)
    hang_step_ = hangs[size_t(attempt)];
  if (size_t(attempt) < secs.size() && secs[size_t(attempt)] > 0)  // 0 spares the attempt
    kill_seconds_ = secs[size_t(attempt)];
  in_write_ = c.kill_in == "checkpoint_write";
  if (kill_step_ == 0) kill_step_ = -1;
  armed_ = kill_step_ > 0 || kill_seconds_ >= 0;
  if (kill_seconds_ < 0) return;
  // A deadline past what int64 nanoseconds of the clock hold (about 292 years) is never
  // reached: no timer, where the conversion would have wrapped to a deadline already passed.
  const double deadline_ns = double(t0_ns) + kill_seconds_ * 1e9;
  if (deadline_ns >= 0x1p63) return;
  const int64_t deadline = int64_t(deadline_ns);
  // Passed during start-up: kill now, not when a loaded machine first schedules the timer
  // thread (a short attempt may end before that).
  if (monotonic_ns() >= deadline) kill("kill_after_seconds");
  timer_ = std::thread([this, deadline] {
    // monotonic_ns is CLOCK_MONOTONIC, steady_clock's clock: waiting until the time point
    // adds nothing to a deadline near the largest one.
    const std::chrono::steady_clock::time_point until{std::chrono::nanoseconds(deadline)};
    std::unique_lock lock(mu_);
    while (!stop_) {
      if (monotonic_ns() >= deadline) kill("kill_after_seconds");
      cv_.wait_until(lock, until);
    }
  });
}

FaultInjector::~FaultInjector() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (timer_.joinable()) timer_.join();
}

void FaultInjector::announce(const char* kind, const char* what) {
  if (!ledger_.empty()) {
    try {
      append_json_line(ledger_, {{"event", "fault"},
                                 {"t", monotonic_ns()},
                                 {"rank", rank_},
                                 {"step", completed_.load()},
                                 {"kind", kind}});
    } catch (const std::exception&) {
    }
  }
  // A kill in a checkpoint write happens while training runs on: name the checkpoint's step.
  const std::string of = std::string(kind) == "kill_in_checkpoint_write"
                             ? " of step " + std::to_string(kill_step_)
                             : "";
  std::fprintf(stderr, "tessel: fault injection: rank %d %s (%s%s, %lld steps done)\n", rank_, what,
               kind, of.c_str(), static_cast<long long>(completed_.load()));
  std::fflush(stderr);
}

void FaultInjector::kill(const char* kind) {
  announce(kind, "kills itself");
  std::raise(SIGKILL);
  std::abort();  // not reached
}

void FaultInjector::hang() {
  announce("hang_at_step", "hangs");
  // Asleep, not spinning: a stuck rank holds no core (its peers spin in MPI's wait), and
  // SIGTERM, as from mpirun's teardown, ends it.
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}

void FaultInjector::after_step(int64_t step) {
  completed_ = step;
  if (armed_ && !in_write_ && step == kill_step_) kill("kill_at_step");
  if (step == hang_step_) hang();
}

void FaultInjector::in_checkpoint_write(int64_t step) {
  if (armed_ && in_write_ && step == kill_step_) kill("kill_in_checkpoint_write");
}

void FaultInjector::after_commit(const std::string& dir, int64_t step) {
  if (step != corrupt_step_ || rank_ != 0) return;
  std::string path = dir + "/model-00000-of-";
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().filename().string().rfind("model-00000-of-", 0) == 0) path = e.path().string();
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(-1, std::ios::end);
  char c = 0;
  f.get(c);
  f.seekp(-1, std::ios::end);
  f.put(char(c ^ 0x01));
}

}  // namespace tessel::train
