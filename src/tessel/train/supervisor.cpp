#include "tessel/train/supervisor.hpp"

#include <fcntl.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <thread>

#include "tessel/core/error.hpp"
#include "tessel/train/ett.hpp"

extern char** environ;

namespace tessel::train {

namespace {

// A SIGTERM, SIGINT, SIGHUP or SIGQUIT to the supervisor stops the job, not just the supervisor:
// the first one is forwarded to the running job (mpirun, which tears the ranks down), and the
// supervisor waits for the job, records its end and relaunches nothing. The job runs in a
// process group of its own, so that a Ctrl-C at the terminal reaches it once, through the
// supervisor: mpirun takes a second SIGINT as "terminate now" and leaves its ranks behind.
// Lock-free atomics, so the handler (on whichever thread) may use them.
constexpr int kStopSignals[] = {SIGTERM, SIGINT, SIGHUP, SIGQUIT};
std::atomic<pid_t> g_job{0};           // the running job; 0 = none
std::atomic<int> g_stop{0};            // the first stop signal received; 0 = none
std::atomic<bool> g_forwarded{false};  // g_stop was sent to the job
static_assert(std::atomic<pid_t>::is_always_lock_free && std::atomic<int>::is_always_lock_free &&
              std::atomic<bool>::is_always_lock_free);

// Sends g_stop to the job's process group once (a launcher that is a wrapper script passes
// it on to mpirun too; mpirun alone in its group still gets it once).
void forward_stop() {
  const pid_t job = g_job;
  if (g_stop && job > 0 && !g_forwarded.exchange(true)) ::kill(-job, g_stop);
}

// Blocks the stop signals while in scope (restoring the previous mask after): the supervisor
// checks for a stop, starts the job and records its pid as one step, so a stop either comes
// before (no job is started) or is forwarded to the job.
class StopSignalsBlocked {
 public:
  StopSignalsBlocked() {
    sigset_t stops;
    ::sigemptyset(&stops);
    for (int sig : kStopSignals) ::sigaddset(&stops, sig);
    ::sigprocmask(SIG_BLOCK, &stops, &previous_);
  }
  ~StopSignalsBlocked() { ::sigprocmask(SIG_SETMASK, &previous_, nullptr); }
  StopSignalsBlocked(const StopSignalsBlocked&) = delete;
  StopSignalsBlocked& operator=(const StopSignalsBlocked&) = delete;

 private:
  sigset_t previous_;
};

extern "C" void on_stop(int sig) {
  int none = 0;
  g_stop.compare_exchange_strong(none, sig);
  forward_stop();
}

// Installs on_stop for the stop signals while supervise() runs; one ignored when
// tessel run started (nohup, a script's background job) stays ignored.
class StopForwarding {
 public:
  StopForwarding() {
    g_stop = 0;
    g_forwarded = false;
    struct sigaction sa {};
    sa.sa_handler = on_stop;
    sa.sa_flags = SA_RESTART;  // the supervisor's own file writes go on
    ::sigemptyset(&sa.sa_mask);
    for (size_t i = 0; i < std::size(kStopSignals); ++i) {
      ::sigaction(kStopSignals[i], nullptr, &previous_[i]);
      if (previous_[i].sa_handler != SIG_IGN) ::sigaction(kStopSignals[i], &sa, nullptr);
    }
  }
  ~StopForwarding() {
    for (size_t i = 0; i < std::size(kStopSignals); ++i)
      ::sigaction(kStopSignals[i], &previous_[i], nullptr);
  }
  StopForwarding(const StopForwarding&) = delete;
  StopForwarding& operator=(const StopForwarding&) = delete;

 private:
  struct sigaction previous_[std::size(kStopSignals)];
};

// Starts the job `args` (searched on PATH) in a process group of its own, reading nothing
// (a background group that read the terminal would be stopped); InputError when it cannot.
pid_t start_job(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  posix_spawnattr_t attr;
  ::posix_spawnattr_init(&attr);
  ::posix_spawnattr_setpgroup(&attr, 0);
  sigset_t none;  // the job starts with no signal blocked (the supervisor blocks its stops here)
  ::sigemptyset(&none);
  ::posix_spawnattr_setsigmask(&attr, &none);
  ::posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETPGROUP | POSIX_SPAWN_SETSIGMASK);
  posix_spawn_file_actions_t files;
  ::posix_spawn_file_actions_init(&files);
  ::posix_spawn_file_actions_addopen(&files, STDIN_FILENO, "/dev/null", O_RDONLY, 0);
  pid_t pid = 0;
  int rc = ::posix_spawnp(&pid, argv[0], &files, &attr, argv.data(), environ);
  ::posix_spawn_file_actions_destroy(&files);
  ::posix_spawnattr_destroy(&attr);
  if (rc != 0) input_error("tessel run: cannot start ", args[0], ": ", std::strerror(rc));
  return pid;
}

// Waits for the job g_job to exit; its exit status (128 + signal if killed). g_job is
// cleared before the job is reaped, so that a later stop never signals a reused pid.
int wait_job() {
  const pid_t pid = g_job;
  siginfo_t info{};
  while (::waitid(P_PID, id_t(pid), &info, WEXITED | WNOWAIT) < 0)
    if (errno != EINTR) input_error("tessel run: waitid failed: ", std::strerror(errno));
  g_job = 0;
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
  create_ett_dir(o.run_dir);
  StopForwarding forwarding;
  int64_t begins = monotonic_ns();  // the first attempt's scheduling begins now
  for (int restart = 0;; ++restart) {
    if (g_stop) break;  // stopped between two attempts
    const int attempt = count_attempts(o.run_dir);
    const std::string log = attempt_path(o.run_dir, attempt);
    append_json_line(log, {{"event", "attempt"},
                           {"attempt", attempt},
                           {"t", begins},
                           {"ranks", o.ranks},
                           {"supervisor", int(::getpid())}});
    append_json_line(log, {{"phase", phase_name(Phase::scheduling)}, {"t", begins}});
    ::setenv("TESSEL_ETT_ATTEMPT", std::to_string(attempt).c_str(), 1);
    {
      const StopSignalsBlocked blocked;  // a stop now is forwarded once the pid is known
      if (g_stop) {                      // stopped while the log was opened: nothing ran
        remove_attempt(log);
        break;
      }
      try {
        g_job = start_job(args);
      } catch (const InputError&) {
        remove_attempt(log);  // nothing ran: no attempt of the job
        throw;
      }
    }
    const int status = wait_job();
    if (attempt_withdrawn(log)) {  // bad input, or nothing to train: no attempt, no relaunch
      remove_attempt(log);
      return status;
    }
    const int64_t ended = monotonic_ns();
    append_json_line(log, {{"event", "exit"}, {"t", ended}, {"status", status}});
    if (status == 0 || status == kExitInputError) return status;
    if (status == kExitDiverged) {
      std::fprintf(stderr,
                   "tessel run: attempt %d diverged (a non-finite gradient norm); not "
                   "relaunching: a resume would repeat it\n",
                   attempt);
      return status;
    }
    if (g_stop) break;
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
  std::fprintf(stderr, "tessel run: stopped by %s; not relaunching\n", ::strsignal(g_stop));
  return 128 + g_stop;
}

}  // namespace tessel::train
