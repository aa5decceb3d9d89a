#include "tessel/train/supervisor.hpp"

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <thread>

#include "tessel/core/error.hpp"
#include "tessel/train/ett.hpp"

extern char** environ;

namespace tessel::train {

namespace {

// Starts `args` (searched on PATH); InputError when it cannot.
pid_t start_process(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  pid_t pid = 0;
  int rc = ::posix_spawnp(&pid, argv[0], nullptr, nullptr, argv.data(), environ);
  if (rc != 0) input_error("tessel run: cannot start ", args[0], ": ", std::strerror(rc));
  return pid;
}

// Waits for `pid` to exit; its exit status (128 + signal if killed).
int wait_process(pid_t pid) {
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) input_error("tessel run: waitpid failed: ", std::strerror(errno));
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

}  // namespace

int supervise(const SuperviseOptions& o) {
  if (o.ranks < 1) input_error("tessel run: --np must be at least 1, got ", o.ranks);
  if (o.max_restarts < 0)
    input_error("tessel run: --max-restarts must not be negative, got ", o.max_restarts);
  int threads = o.threads > 0
                    ? o.threads
                    : std::max(1, int(std::max(1u, std::thread::hardware_concurrency())) / o.ranks);
  // Root is allowed (containers, CI), as in scripts/launch.sh.
  ::setenv("OMPI_ALLOW_RUN_AS_ROOT", "1", 0);
  ::setenv("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1", 0);
  std::filesystem::create_directories(ett_dir(o.run_dir));
  int64_t begins = monotonic_ns();  // the first attempt's scheduling begins now
  for (int restart = 0;; ++restart) {
    const int attempt = count_attempts(o.run_dir);
    const std::string log = attempt_path(o.run_dir, attempt);
    append_json_line(log, {{"event", "attempt"},
                           {"attempt", attempt},
                           {"t", begins},
                           {"ranks", o.ranks},
                           {"supervisor", int(::getpid())}});
    append_json_line(log, {{"phase", phase_name(Phase::scheduling)}, {"t", begins}});
    ::setenv("TESSEL_ETT_ATTEMPT", std::to_string(attempt).c_str(), 1);
    std::vector<std::string> args = {o.launcher,
                                     "--quiet",
                                     "--oversubscribe",
                                     "--bind-to",
                                     "none",
                                     "-np",
                                     std::to_string(o.ranks),
                                     "-x",
                                     "OMP_NUM_THREADS=" + std::to_string(threads),
                                     "-x",
                                     "TESSEL_ETT_ATTEMPT",
                                     o.binary,
                                     "train"};
    args.insert(args.end(), o.train_args.begin(), o.train_args.end());
    pid_t job = 0;
    try {
      job = start_process(args);
    } catch (const InputError&) {
      remove_attempt(log);  // nothing ran: no attempt of the job
      throw;
    }
    int status = wait_process(job);
    if (attempt_withdrawn(log)) {  // bad input, or nothing to train: no attempt, no relaunch
      remove_attempt(log);
      return status;
    }
    int64_t ended = monotonic_ns();
    append_json_line(log, {{"event", "exit"}, {"t", ended}, {"status", status}});
    if (status == 0 || status == 2) return status;
    if (restart == o.max_restarts) {
      std::fprintf(stderr, "tessel run: attempt %d failed (exit status %d); no restarts left\n",
                   attempt, status);
      return status;
    }
    if (!o.quiet)
      std::fprintf(stderr,
                   "tessel run: attempt %d failed (exit status %d); relaunching (%d of %d)\n",
                   attempt, status, restart + 1, o.max_restarts);
    begins = ended;
  }
}

}  // namespace tessel::train
