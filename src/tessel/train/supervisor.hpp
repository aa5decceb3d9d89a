#pragma once
// `tessel run`: the supervisor of a training job (spec section 5). It launches the MPI job
// (mpirun, as scripts/launch.sh does), waits for it, and when it fails relaunches it (it
// resumes from the newest durable checkpoint: a relaunch sets train.resume = true), up to
// `max_restarts` times.
// It writes each attempt's first and last lines of the ETT log (ett.hpp): the attempt
// begins when the supervisor starts it (for a relaunch: when it saw the previous attempt
// end, so detection-to-relaunch time is the relaunch's `scheduling` leaf) and ends when
// the job's processes have all exited. With a hang timeout it also watches the job's
// progress: the attempt's ETT log, whose modification time rank 0 advances with every line
// (each training step, each leaf boundary) and with EttLedger::beat inside long leaves
// (validation batches, the synthetic start-up delay). A job whose log stays unchanged that
// long hangs (a hung rank stops rank 0 at its next collective): the supervisor stops it
// (SIGTERM to its process group, SIGKILL kill_grace seconds later), writes its exit line with
// "cause": "hang" and relaunches it like any failure. A job that stops with exit status 2 (bad
// input) or 4 (diverged: a non-finite gradient norm) is not relaunched: a relaunch would fail
// again. SIGTERM, SIGINT, SIGHUP or SIGQUIT to the supervisor stops the job: it is forwarded to the
// job (which runs in its own process group, stdin /dev/null), the supervisor waits for it (SIGKILL
// to the job's process group when it still runs kill_grace seconds later), writes the exit line,
// relaunches nothing and returns 128 + the signal. The caller holds the run directory's
// supervisor.lock (RunDirLock, ett.hpp) while it runs, so that no other `tessel run` or plain
// `tessel train` picks an attempt index there; the job's trainer, started with TESSEL_ETT_ATTEMPT,
// does not take that lock.
#include <string>
#include <vector>

namespace tessel::train {

struct SuperviseOptions {
  std::string binary;                   // the tessel executable the ranks run
  std::string launcher = "mpirun";      // MPI launcher on PATH
  int ranks = 1;                        // -np
  int threads = 0;                      // OMP_NUM_THREADS per rank; 0 = cores / ranks
  int max_restarts = 3;                 // relaunches after the first attempt
  std::string run_dir;                  // the job's run.dir (its ETT log)
  std::vector<std::string> train_args;  // arguments after `tessel train`
  bool quiet = false;                   // no progress lines of the supervisor
  double hang_timeout = 0;              // seconds without progress that make a hang; 0 = off
  double kill_grace = 30;  // seconds from a forwarded stop or a hung job's SIGTERM to SIGKILL
};

// InputError for an option supervise() refuses: --np below 1, negative --max-restarts, a
// --hang-timeout outside [0, 1e6] s or one this kernel cannot watch, a --kill-grace outside
// (0, 1e6] s, a --launcher that is no executable file. `tessel run` checks them before it creates
// anything in run.dir.
void check_supervise_options(const SuperviseOptions& options);

// Runs the job to success, until the restarts are spent or until stopped by a signal;
// returns the last attempt's exit status (0 = success), or 128 + the stop signal.
int supervise(const SuperviseOptions& options);

}  // namespace tessel::train
