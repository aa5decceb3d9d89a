#include "tessel/train/supervisor.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/file.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>
#include <sstream>
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

// Whether posix_spawnp could start `name`: with a '/', that file; else a file of that name in a
// PATH directory (the C library's default path when PATH is unset). Executable regular files.
bool spawnable(const std::string& name) {
  auto executable = [](const std::string& path) {
    struct stat st {};
    return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
           ::access(path.c_str(), X_OK) == 0;
  };
  if (name.empty()) return false;
  if (name.find('/') != std::string::npos) return executable(name);
  const char* path = std::getenv("PATH");
  const std::string dirs = path ? path : "/bin:/usr/bin";
  for (size_t b = 0, e; b <= dirs.size(); b = e + 1) {
    e = std::min(dirs.find(':', b), dirs.size());
    const std::string dir = dirs.substr(b, e - b);
    if (executable((dir.empty() ? "." : dir) + "/" + name)) return true;
  }
  return false;
}

// The attempt log's modification time: the job's liveness signal (each line rank 0 writes,
// each EttLedger::beat). Zero when it cannot be read, which the next read then tells apart.
timespec log_mtime(const std::string& log) {
  struct stat st {};
  if (::stat(log.c_str(), &st) != 0) return {};
  return st.st_mtim;
}

// How a job ended: its exit status (128 + signal if killed); whether the supervisor killed
// it for making no progress, and then when it last saw the job progress.
struct JobEnd {
  int status = 0;
  bool hung = false;
  int64_t progress_ns = 0;
};

// How long the supervisor waits for processes after it SIGKILLed them (leftovers of a job, the
// holder of the job's lock).
constexpr int64_t kKilledWaitNs = 30'000'000'000;

// SIGTERM makes mpirun tear its ranks down (it SIGKILLs those that ignore SIGTERM within a
// few seconds); SIGKILL to the job's process group, --kill-grace after a forwarded stop
// signal, ends a launcher that does not end itself (one that takes a second SIGTERM as
// nothing, or is stuck starting more ranks than the machine holds; its ranks, in process
// groups of their own, may then outlive it). Once per job: `kill_at` < 0 after it.
void escalate_stop(pid_t pid, int64_t now, int64_t grace_ns, int64_t& kill_at) {
  if (!g_stop || !g_forwarded || kill_at < 0) return;
  if (kill_at == 0) {
    kill_at = now + grace_ns;
  } else if (now >= kill_at) {
    std::fprintf(stderr,
                 "tessel run: the job did not end within %g s of the stop signal (--kill-grace); "
                 "killing it\n",
                 double(grace_ns) * 1e-9);
    ::kill(-pid, SIGKILL);
    kill_at = -1;
  }
}

// Waits until the job `pid` has exited (without reaping it), escalating a stop.
void wait_for_exit(pid_t pid, int64_t grace_ns) {
  int64_t kill_at = 0;
  for (;;) {
    siginfo_t info{};
    if (::waitid(P_PID, id_t(pid), &info, WEXITED | WNOWAIT | WNOHANG) < 0) {
      if (errno == EINTR) continue;
      input_error("tessel run: waitid failed: ", std::strerror(errno));
    }
    if (info.si_pid == pid) return;
    escalate_stop(pid, monotonic_ns(), grace_ns, kill_at);
    ::usleep(10'000);  // an exit is seen within 10 ms
  }
}

// A pidfd of `pid` (readable once it exits); InputError on a kernel without pidfd_open.
int open_pidfd(pid_t pid) {
  const int fd = int(::syscall(SYS_pidfd_open, pid, 0));
  if (fd < 0)
    input_error(
        "tessel run --hang-timeout: cannot watch the job (pidfd_open, Linux 5.3 or newer): ",
        std::strerror(errno));
  return fd;
}

// Watches the running job `pid` until it has exited (without reaping it). When the attempt
// log `log` does not change for `timeout` seconds while no stop is being forwarded, the job
// hangs: SIGTERM to its process group, SIGKILL `grace_ns` later (so is a stop escalated).
// Fills end.hung and end.progress_ns.
void watch_progress(pid_t pid, const std::string& log, double timeout, int64_t grace_ns,
                    JobEnd& end) {
  const int fd = open_pidfd(pid);
  const auto limit = int64_t(timeout * 1e9);
  // Looked at 10 times per timeout, at most once a second: a hang is found at most 10 % late.
  const int poll_ms = int(std::clamp(timeout * 100, 1.0, 1000.0));
  timespec seen = log_mtime(log);
  end.progress_ns = monotonic_ns();
  int64_t sigkill_at = 0, stop_kill_at = 0;
  pollfd exited{fd, POLLIN, 0};  // readable once the job has exited
  for (;;) {
    const int ready = ::poll(&exited, 1, poll_ms);
    if (ready > 0) break;
    if (ready < 0 && errno != EINTR) input_error("tessel run: poll failed: ", std::strerror(errno));
    const int64_t now = monotonic_ns();
    if (!end.hung) escalate_stop(pid, now, grace_ns, stop_kill_at);  // a hang's kill: below
    // Being stopped: what the teardown writes is no progress (mpirun sends SIGCONT before
    // SIGTERM, so a stopped rank trains on for a moment).
    if (end.hung) {
      if (sigkill_at > 0 && now >= sigkill_at) {
        sigkill_at = 0;
        ::kill(-pid, SIGKILL);
      }
      continue;
    }
    const timespec now_seen = log_mtime(log);
    if (now_seen.tv_sec != seen.tv_sec || now_seen.tv_nsec != seen.tv_nsec) {
      seen = now_seen;
      end.progress_ns = now;
    } else if (!g_stop && now - end.progress_ns >= limit) {
      std::fprintf(stderr,
                   "tessel run: the job made no progress for %g s (%s did not change); stopping "
                   "it as hung\n",
                   timeout, log.c_str());
      end.hung = true;
      sigkill_at = now + grace_ns;
      // Counted as forwarded: a stop signal now must not send mpirun a second signal (which
      // makes it exit at once and leave its ranks running).
      g_forwarded = true;
      ::kill(-pid, SIGTERM);
    }
  }
  ::close(fd);
}

// Waits for the job g_job to exit, watching its progress when `hang_timeout` > 0. g_job is
// cleared before the job is reaped, so that a later stop never signals a reused pid.
JobEnd wait_job(const std::string& log, const SuperviseOptions& o) {
  const pid_t pid = g_job;
  JobEnd end;
  const auto grace_ns = int64_t(o.kill_grace * 1e9);
  if (o.hang_timeout > 0)
    watch_progress(pid, log, o.hang_timeout, grace_ns, end);
  else
    wait_for_exit(pid, grace_ns);
  g_job = 0;
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0)
    if (errno != EINTR) input_error("tessel run: waitpid failed: ", std::strerror(errno));
  end.status = WIFEXITED(status)     ? WEXITSTATUS(status)
               : WIFSIGNALED(status) ? 128 + WTERMSIG(status)
                                     : 1;
  return end;
}

// How long processes of the job may outlive its launcher before they are killed. Open MPI's
// mpirun SIGKILLs its ranks as it exits, so only ranks it did not end (mpirun itself killed
// after a hang) live this long.
constexpr int64_t kLeftoverGraceNs = 5'000'000'000;

// Marks the job's processes (the launcher passes it on to the ranks): the supervisor, a child
// subreaper, may also adopt processes that are not the job's (as PID 1 of a container, or
// children it inherited from the process it replaced), which it must leave alone.
constexpr const char* kJobMarker = "TESSEL_SUPERVISOR";

// The whole text of a /proc file ("" once the process is gone).
std::string read_proc_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// This process's children that carry the job's marker and have not exited.
std::vector<pid_t> job_children() {
  const std::string self = std::to_string(::getpid());
  using namespace std::string_literals;
  const std::string entry = "\0"s + kJobMarker + "=" + self + "\0"s;  // in NUL-ended entries
  std::vector<pid_t> children;
  std::error_code error;
  for (std::filesystem::directory_iterator it("/proc", error), end; !error && it != end;
       it.increment(error)) {
    const std::string pid = it->path().filename().string();
    if (pid.find_first_not_of("0123456789") != std::string::npos) continue;
    // "pid (comm) state ppid ...": comm may hold spaces, parentheses and newlines.
    const std::string stat = read_proc_file(it->path() / "stat");
    const size_t close = stat.rfind(')');
    if (close == std::string::npos) continue;  // gone meanwhile
    std::istringstream rest(stat.substr(close + 1));
    std::string state, ppid;
    if (!(rest >> state >> ppid) || ppid != self || state == "Z") continue;
    if (("\0"s + read_proc_file(it->path() / "environ")).find(entry) != std::string::npos)
      children.push_back(pid_t(std::stoi(pid)));
  }
  return children;
}

// Reaps the job's processes that outlived its launcher (and what they leave behind), killing
// those still running after kLeftoverGraceNs: a rank left running would hold the run directory's
// lock, so that every relaunch were refused, and keep its cores. Gives up kKilledWaitNs after
// the kill (a process in uninterruptible sleep does not die), saying which are left.
void end_leftovers() {
  const int64_t kill_at = monotonic_ns() + kLeftoverGraceNs;
  const int64_t give_up_at = kill_at + kKilledWaitNs;
  std::set<pid_t> killed;
  for (;;) {
    while (::waitpid(-1, nullptr, WNOHANG) > 0) {  // also adopted strangers: a subreaper reaps
    }
    const std::vector<pid_t> left = job_children();
    if (left.empty()) break;
    const int64_t now = monotonic_ns();
    if (now >= give_up_at) {
      std::string pids;
      for (pid_t p : left) pids.append(" ").append(std::to_string(p));
      std::fprintf(stderr,
                   "tessel run: process(es)%s of the job did not end when killed; going on\n",
                   pids.c_str());
      break;
    }
    if (now >= kill_at)
      for (pid_t p : left)
        if (::kill(p, SIGKILL) == 0) killed.insert(p);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  if (!killed.empty())
    std::fprintf(stderr,
                 "tessel run: killed %zu process(es) of the job still running %.0f s after its "
                 "launcher exited\n",
                 killed.size(), double(kLeftoverGraceNs) * 1e-9);
}

// Waits (at most kKilledWaitNs) until no process holds the job's lock of `run_dir`.
// mpirun's exit does not mean its ranks are gone: Open MPI kills them and exits without
// reaping them, so rank 0 may still hold the lock, or be writing its last ledger line. After
// this the exit line comes last, and a relaunch finds the run directory free.
void wait_for_job_lock(const std::string& run_dir) {
  const std::string path = run_dir + "/" + kJobLock;
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return;  // no job took it
  const int64_t deadline = monotonic_ns() + kKilledWaitNs;
  while (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    if (errno != EWOULDBLOCK && errno != EINTR) break;
    if (monotonic_ns() > deadline) {
      std::fprintf(stderr,
                   "tessel run: %s is still locked %.0f s after the job's launcher exited\n",
                   path.c_str(), double(kKilledWaitNs) * 1e-9);
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ::close(fd);  // releases the lock if taken
}

}  // namespace

void check_supervise_options(const SuperviseOptions& o) {
  if (o.ranks < 1) input_error("tessel run: --np must be at least 1, got ", o.ranks);
  if (o.max_restarts < 0)
    input_error("tessel run: --max-restarts must not be negative, got ", o.max_restarts);
  if (!(o.hang_timeout >= 0 && o.hang_timeout <= 1e6))
    input_error("tessel run: --hang-timeout must be in [0, 1e6] seconds (0 = off), got ",
                o.hang_timeout);
  if (!(o.kill_grace > 0 && o.kill_grace <= 1e6))
    input_error("tessel run: --kill-grace must be in (0, 1e6] seconds, got ", o.kill_grace);
  // Refused before a job starts, not once it runs unwatched.
  if (o.hang_timeout > 0) ::close(open_pidfd(::getpid()));
  if (!spawnable(o.launcher))
    input_error("tessel run: cannot start ", o.launcher, " (--launcher): no executable file",
                o.launcher.find('/') == std::string::npos ? " of that name on PATH" : "");
}

int supervise(const SuperviseOptions& o) {
  check_supervise_options(o);
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
                                   "-x",
                                   kJobMarker,
                                   o.binary,
                                   "train"};
  args.insert(args.end(), o.train_args.begin(), o.train_args.end());
  create_ett_dir(o.run_dir);
  // The job's processes that outlive the launcher become our children, to reap or kill. Without
  // it only the wait for the run directory's lock remains.
  if (::prctl(PR_SET_CHILD_SUBREAPER, 1) != 0)
    std::fprintf(stderr,
                 "tessel run: warning: prctl(PR_SET_CHILD_SUBREAPER) failed (%s): processes the "
                 "job leaves running after its launcher exits cannot be ended\n",
                 std::strerror(errno));
  ::setenv(kJobMarker, std::to_string(::getpid()).c_str(), 1);
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
      // A relaunch resumes the job's own checkpoints, also where the job said
      // train.resume = false (which refuses an earlier run's checkpoints at its start).
      std::vector<std::string> launch = args;
      if (restart > 0) launch.insert(launch.end(), {"--set", "train.resume=true"});
      try {
        g_job = start_job(launch);
      } catch (const InputError&) {
        remove_attempt(log);  // nothing ran: no attempt of the job
        throw;
      }
    }
    const JobEnd end = wait_job(log, o);
    end_leftovers();
    wait_for_job_lock(o.run_dir);  // a rank 0 on another machine is no child of ours
    const int status = end.status;
    if (attempt_withdrawn(log)) {  // bad input, or nothing to train: no attempt, no relaunch
      remove_attempt(log);
      return status;
    }
    const int64_t ended = monotonic_ns();
    nlohmann::json exit_line = {{"event", "exit"}, {"t", ended}, {"status", status}};
    if (end.hung) {
      exit_line["cause"] = "hang";
      exit_line["progress_t"] = end.progress_ns;
    } else if (g_stop) {
      exit_line["cause"] = "stop";
    }
    append_json_line(log, exit_line);
    // A hung job failed, whatever status its launcher exited with: relaunched like any failure.
    if (!end.hung && status == 0) return status;
    // Bad input, an unwritable file, or divergence: a relaunch would meet it again.
    if (!end.hung && (status == kExitInputError || status == kExitDiverged)) {
      std::fprintf(stderr, "tessel run: attempt %d %s\n", attempt,
                   status == kExitDiverged
                       ? "diverged (a non-finite gradient norm); not relaunching: a resume "
                         "would repeat it"
                       : "failed with exit status 2 (bad input or a file it could not write, "
                         "which a relaunch would meet again); not relaunching");
      return status;
    }
    if (g_stop) break;
    if (restart == o.max_restarts) {
      std::fprintf(stderr, "tessel run: attempt %d failed (exit status %d); no restarts left\n",
                   attempt, status);
      return status != 0 ? status : 1;  // a hung job whose launcher exited 0 still failed
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
