#include "tessel/train/ett.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "tessel/core/error.hpp"
#include "tessel/core/file_io.hpp"
#include "tessel/train/checkpoint.hpp"
#include "tessel/train/config.hpp"
#include "tessel/train/metrics.hpp"

namespace fs = std::filesystem;

namespace tessel::train {

namespace {

constexpr const char* kPhaseNames[kNumPhases] = {"scheduling",
                                                 "comm_init",
                                                 "model_build",
                                                 "data_warmup",
                                                 "checkpoint_load",
                                                 "warmup",
                                                 "productive",
                                                 "wasted",
                                                 "checkpoint_blocking",
                                                 "eval",
                                                 "failure_detection",
                                                 "shutdown",
                                                 "other"};

// Fill colours of the HTML page, by leaf.
constexpr const char* kPhaseColors[kNumPhases] = {
    "#9e9e9e", "#7e57c2", "#5c6bc0", "#26a69a", "#42a5f5", "#ffca28", "#66bb6a",
    "#ef5350", "#ff7043", "#ab47bc", "#8d6e63", "#78909c", "#bdbdbd"};

int idx(Phase p) {
  return int(p);
}
double sec(int64_t ns) {
  return double(ns) * 1e-9;
}

// InputError naming path:line unless the record's `key`, when present, is an integer in
// [lo, hi]: a string or a float (1e30 has no int64 value) threw nlohmann's type_error or
// converted wrongly, and a number out of range wrapped a duration or counted ~1e19 steps.
void check_integer(const nlohmann::json& r, const char* key, int64_t lo, int64_t hi,
                   const std::string& path, int64_t line, const char* meaning) {
  const auto at = r.find(key);
  if (at == r.end()) return;
  // (An unsigned one above int64's range would wrap in get<int64_t>.)
  const bool int64 = at->is_number_integer() &&
                     !(at->is_number_unsigned() &&
                       at->get<uint64_t>() > uint64_t(std::numeric_limits<int64_t>::max()));
  const bool in_range = int64 && at->get<int64_t>() >= lo && at->get<int64_t>() <= hi;
  if (!in_range && lo == std::numeric_limits<int64_t>::min() &&
      hi == std::numeric_limits<int64_t>::max())
    input_error(path, ":", line, ": ", key, " = ", at->dump(), " must be an integer of 64 bits (",
                meaning, ")");
  if (!in_range)
    input_error(path, ":", line, ": ", key, " = ", at->dump(), " must be an integer in [", lo, ", ",
                hi, "] (", meaning, ")");
}

// InputError naming path:line unless the record's `key`, when present, is a string.
void check_string(const nlohmann::json& r, const char* key, const std::string& path, int64_t line) {
  const auto at = r.find(key);
  if (at != r.end() && !at->is_string())
    input_error(path, ":", line, ": ", key, " = ", at->dump(), " must be a string");
}

// The log's records, each with its time; `cut_line` tells whether its last line was cut short
// and left out. InputError naming path:line for a record without its time, a field of the
// wrong type or out of range (each field parse_attempt reads), a log that does not begin with
// its own attempt line, a second exit line, a time before an earlier line's and a step of a
// resumed attempt not after its checkpoint: each would change the accounting without a word (a
// lost attempt's time, a negative TTR, leaves that no longer sum to W, wasted steps that are
// not).
std::vector<JsonLine> read_log(const std::string& path, int index, bool& cut_line) {
  auto records = read_json_lines(path, "ETT", cut_line);
  if (records.empty())
    input_error(path, ": no complete line, not even its attempt line (the first)");
  constexpr int64_t kMin = std::numeric_limits<int64_t>::min(),
                    kMax = std::numeric_limits<int64_t>::max();
  for (const auto& [number, r] : records) {
    if (!r.contains("t")) input_error(path, ":", number, ": malformed ETT record");
    // Any int64 here; the attempt line's >= 0 and the order below bound the others.
    check_integer(r, "t", kMin, kMax, path, number, "CLOCK_MONOTONIC nanoseconds");
    check_integer(r, "step", 0, kMaxSteps, path, number, "a step; train.steps' range");
    check_integer(r, "status", kMin, kMax, path, number, "an exit status");
    for (const char* key : {"event", "phase", "cause"}) check_string(r, key, path, number);
    if (r.contains("phase") && !phase_from_name(r["phase"].get<std::string>()))
      input_error(path, ":", number, ": unknown phase '", r["phase"].get<std::string>(), "'");
  }
  const nlohmann::json& header = records.front().record;
  if (header.value("event", "") != "attempt")
    input_error(path, ":", records.front().line,
                ": the first line is not the attempt line ({\"event\": \"attempt\", ...})");
  if (!(header.contains("attempt") && header["attempt"] == index))
    input_error(path, ":", records.front().line, ": the attempt line names attempt ",
                header.value("attempt", nlohmann::json()).dump(), ", but the file is attempt ",
                index, "'s log");
  // CLOCK_MONOTONIC is never negative; with the order below, no line's time is, so the
  // difference of any two times (a duration, or a time since attempt 0's start) fits int64.
  if (header["t"].get<int64_t>() < 0)
    input_error(path, ":", records.front().line, ": time ", header["t"].get<int64_t>(),
                " of the attempt line is negative (CLOCK_MONOTONIC nanoseconds are not)");
  // A time and the line it is on.
  struct Seen {
    int64_t t = std::numeric_limits<int64_t>::min(), line = 0;
  };
  Seen ordered, latest, attempt_line, exit_line, resume_line;
  int64_t resumed_from = 0;
  for (const auto& [number, r] : records) {
    const int64_t t = r["t"].get<int64_t>();
    const std::string event = r.value("event", "");
    if (event == "exit" && exit_line.line > 0)
      input_error(path, ":", number, ": a second exit line (the first is line ", exit_line.line,
                  ")");
    // A fault line comes from whichever rank (or timer thread) injects it, at any moment of rank
    // 0's lines: it may come before one whose time was taken just before its own. The exit line
    // comes after all of them.
    const bool fault = event == "fault";
    const Seen& bound = fault ? attempt_line : event == "exit" ? latest : ordered;
    if (t < bound.t)
      input_error(path, ":", number, ": time ", t, " is before line ", bound.line, "'s ", bound.t,
                  " (the times of a log never go backwards; are tessel run and rank 0 on machines "
                  "with different clocks?)");
    // A hang's detection runs from when the supervisor last saw progress, within the attempt.
    if (event == "exit")
      check_integer(r, "progress_t", attempt_line.t, t, path, number,
                    "a time between the attempt line's and this line's");
    if (event == "resume") resume_line = {t, number}, resumed_from = r.value("step", int64_t(0));
    // An attempt trains the steps after the checkpoint it resumed from. (A fault line's step
    // has no such bound: under PACI the faulting stage completes steps of a horizon before rank
    // 0 writes their lines, and its count starts at 0 in a resumed attempt.)
    if (r.contains("phase") && resume_line.line > 0 &&
        r.value("step", resumed_from + 1) <= resumed_from)
      input_error(path, ":", number, ": step ", r["step"].get<int64_t>(),
                  " is not after the checkpoint the attempt resumed from (step ", resumed_from,
                  ", line ", resume_line.line, ")");
    if (number == records.front().line) attempt_line = {t, number};
    if (event == "exit") exit_line = {t, number};
    if (!fault) ordered = {t, number};
    if (t >= latest.t) latest = {t, number};
  }
  return records;
}

// The step of the newest complete checkpoint of the run (0 if none), or of a newer save that
// every rank wrote but no commit finished: the next start recovers and resumes from it.
int64_t latest_checkpoint_step(const std::string& run_dir) {
  const CheckpointStore store(run_dir + "/checkpoints", 2);
  if (const auto prepared = store.prepared()) return *prepared;
  auto latest = store.latest();
  if (!latest) return 0;
  std::string name = fs::path(*latest).filename().string();
  return std::stoll(name.substr(5));
}

EttAttempt parse_attempt(const std::string& path, int index) {
  EttAttempt a;
  a.index = index;
  const auto records = read_log(path, index, a.cut_line);
  struct Boundary {
    int64_t t;
    Phase phase;
    int64_t step;
  };
  std::vector<Boundary> bounds;
  std::optional<int64_t> fault_t, exit_t, progress_t;
  a.t0 = records.front().record["t"].get<int64_t>();
  a.t1 = a.t0;
  for (const JsonLine& l : records) {
    const nlohmann::json& r = l.record;
    int64_t t = r["t"].get<int64_t>();
    a.t1 = std::max(a.t1, t);
    if (r.contains("phase")) {  // a known leaf (read_log)
      bounds.push_back(
          {t, *phase_from_name(r["phase"].get<std::string>()), r.value("step", int64_t(-1))});
      continue;
    }
    std::string ev = r.value("event", "");
    if (ev == "resume") a.resumed_from = r.value("step", int64_t(0));
    if (ev == "fault" && !fault_t) {
      fault_t = t;
      a.injected = true;
      a.failure_step = r.value("step", int64_t(-1));
    }
    if (ev == "exit") {
      exit_t = t;
      a.cause = r.value("cause", "");
      a.failed = r.value("status", int64_t(0)) != 0 || a.cause == "hang";
      if (r.contains("progress_t")) progress_t = r["progress_t"].get<int64_t>();
    }
  }
  a.exited = exit_t.has_value();
  if (exit_t) a.t1 = *exit_t;
  if (fault_t) a.failed = true;
  // The failure began at the fault, or for a hang found by the supervisor at the latest when
  // it last saw progress: detection runs from there to the exit.
  const std::optional<int64_t> failed_t = fault_t && progress_t ? std::min(*fault_t, *progress_t)
                                          : fault_t             ? fault_t
                                                                : progress_t;
  std::stable_sort(bounds.begin(), bounds.end(),
                   [](const Boundary& x, const Boundary& y) { return x.t < y.t; });
  if (!bounds.empty()) a.step_in_progress = bounds.back().step;
  const int64_t cut = failed_t ? std::min(*failed_t, a.t1) : a.t1;
  auto add = [&](Phase p, int64_t t0, int64_t t1, int64_t step) {
    if (t1 > t0) a.segments.push_back({p, t0, t1, step});
  };
  add(Phase::other, a.t0, bounds.empty() ? cut : std::min(bounds.front().t, cut), -1);
  for (size_t i = 0; i < bounds.size(); ++i) {
    int64_t end = i + 1 < bounds.size() ? bounds[i + 1].t : a.t1;
    add(bounds[i].phase, std::max(bounds[i].t, a.t0), std::min(end, cut), bounds[i].step);
    if (bounds[i].phase == Phase::productive && a.first_step_ns < 0) a.first_step_ns = bounds[i].t;
  }
  if (failed_t) add(Phase::failure_detection, cut, a.t1, -1);
  if (a.resumed_from < 0 && a.first_step_ns >= 0) a.resumed_from = 0;  // a fresh start
  return a;
}

// Sums the leaves after the failed attempts' lost steps have been reclassified.
void finish_attempt(EttAttempt& a) {
  if (a.failed) {
    int64_t max_step = a.durable_step;
    for (auto& s : a.segments)
      if (s.phase == Phase::productive) {
        max_step = std::max(max_step, s.step);
        if (s.step > a.durable_step) s.phase = Phase::wasted;
      }
    // A step split by a checkpoint wait has a first part even if it never completed.
    if (a.failure_step < 0)
      a.failure_step =
          max_step == a.step_in_progress ? std::max(a.durable_step, max_step - 1) : max_step;
    a.wasted_steps = std::max<int64_t>(0, a.failure_step - a.durable_step);
  }
  a.leaf_ns.fill(0);
  for (const auto& s : a.segments) a.leaf_ns[idx(s.phase)] += s.t1 - s.t0;
}

// The steps' MFU weighted by their seconds (their FLOPs over their time at the peak), so that
// fast steps on a machine whose load varies do not outweigh slow ones; nullopt without step
// records (or without metrics.jsonl). A step record whose mfu or step_seconds is no number
// >= 0 is left out with a warning naming its line: the MFU is an aside of the report, and
// the record cannot be mended (an older tessel wrote an infinite MFU, from a denormal
// mfu.peak_gflops, as null).
std::optional<double> time_weighted_mfu(const std::string& run_dir) {
  const std::string path = run_dir + "/metrics.jsonl";
  if (!fs::exists(path)) return std::nullopt;
  bool cut_line = false;  // being written, or a crash's: the trainer drops it on resume
  double flop_seconds = 0, seconds = 0;
  int64_t first_unusable = 0, unusable = 0;  // its line; their count
  std::string why;                           // of the first
  for (const JsonLine& l : read_json_lines(path, "metrics", cut_line)) {
    const nlohmann::json& j = l.record;
    if (!(j.contains("loss") && j.contains("mfu") && j.contains("step_seconds"))) continue;
    const nlohmann::json &mfu = j["mfu"], &t = j["step_seconds"];
    const bool usable =
        mfu.is_number() && mfu.get<double>() >= 0 && t.is_number() && t.get<double>() >= 0;
    if (!usable) {
      if (unusable++ == 0) {
        first_unusable = l.line;
        why = "mfu = " + mfu.dump() + ", step_seconds = " + t.dump() +
              (mfu.is_null() || t.is_null() ? " (null: NaN or infinite when written)" : "");
      }
      continue;
    }
    flop_seconds += mfu.get<double>() * t.get<double>();
    seconds += t.get<double>();
  }
  if (unusable > 0)
    warn_on_stderr(detail::concat(
        path, ":", first_unusable, ": a step record with ", why, " is left out of the MFU",
        unusable > 1 ? detail::concat(", as are ", unusable - 1, " more such records") : ""));
  if (!(seconds > 0)) return std::nullopt;
  return flop_seconds / seconds;
}

std::string fmt(const char* f, double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, f, v);
  return buf;
}

// `text` as HTML text or attribute value: the run directory and the causes in the logs are
// the user's, and may hold markup.
std::string html_escaped(const std::string& text) {
  std::string out;
  for (char ch : text) switch (ch) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += ch;
    }
  return out;
}

// Consecutive segments of one leaf merged (for drawing).
std::vector<EttSegment> merged(const std::vector<EttSegment>& segs) {
  std::vector<EttSegment> out;
  for (const auto& s : segs)
    if (!out.empty() && out.back().phase == s.phase && out.back().t1 == s.t0)
      out.back().t1 = s.t1;
    else
      out.push_back(s);
  return out;
}

// InputError naming <run.dir>/ett, which the ledger cannot use as its directory: `ec` is what
// listing or creating it reported.
[[noreturn]] void unusable_ett_dir(const std::string& dir, const std::error_code& ec) {
  std::error_code ignored;
  const auto status = fs::status(dir, ignored);
  if (fs::exists(status) && !fs::is_directory(status))
    input_error(dir, ": not a directory; the ETT ledger keeps its attempt logs there (move ", dir,
                " away)");
  input_error(dir, ": cannot use it as the ETT ledger's directory: ", ec.message());
}

}  // namespace

const char* phase_name(Phase phase) {
  return kPhaseNames[idx(phase)];
}

std::optional<Phase> phase_from_name(std::string_view name) {
  for (int i = 0; i < kNumPhases; ++i)
    if (name == kPhaseNames[i]) return Phase(i);
  return std::nullopt;
}

int64_t monotonic_ns() {
  timespec ts{};
  ::clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

void append_json_line(const std::string& path, const nlohmann::json& record) {
  std::string line = record.dump() + "\n";
  int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) input_error(path, ": cannot open for appending: ", std::strerror(errno));
  const off_t before = ::lseek(fd, 0, SEEK_END);
  // A short write (a full disk) is followed by one that says why; a line that did not fit
  // is cut off again, so the log stays whole lines.
  size_t done = 0;
  int failure = 0;
  while (done < line.size() && failure == 0) {
    const ssize_t n = ::write(fd, line.data() + done, line.size() - done);
    if (n > 0)
      done += size_t(n);
    else if (n == 0)
      failure = ENOSPC;  // no progress, no errno: never loop on it
    else if (errno != EINTR)
      failure = errno;
  }
  // Cut only our own part: the fault injector may append to the same log, and a line of its
  // that came between would make the size differ.
  struct stat st {};
  const bool torn = failure != 0 && done > 0 &&
                    !(before >= 0 && ::fstat(fd, &st) == 0 && st.st_size == before + off_t(done) &&
                      ::ftruncate(fd, before) == 0);
  ::close(fd);
  if (failure != 0)
    input_error(path, ": write failed: ", std::strerror(failure),
                torn ? " (a cut-off line stays at its end)" : "");
}

std::string ett_dir(const std::string& run_dir) {
  return run_dir + "/ett";
}

void create_ett_dir(const std::string& run_dir) {
  const std::string dir = ett_dir(run_dir);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) unusable_ett_dir(dir, ec);
}

std::string attempt_path(const std::string& run_dir, int attempt) {
  char name[32];
  std::snprintf(name, sizeof name, "/attempt-%04d.jsonl", attempt);
  return ett_dir(run_dir) + name;
}

int count_attempts(const std::string& run_dir) {
  // One past the highest index, not the first gap: a new attempt that filled the gap a lost
  // log left would sit before attempts that ran earlier.
  const std::string dir = ett_dir(run_dir);
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(dir, ec))) return 0;  // no attempt yet
  fs::directory_iterator entries(dir, ec);
  if (ec) unusable_ett_dir(dir, ec);
  int n = 0;
  for (const auto& e : entries) {
    const std::string name = e.path().filename().string();
    if (!name.starts_with("attempt-")) continue;
    int k = -1;
    std::from_chars(name.data() + 8, name.data() + name.size(), k);
    if (k >= 0 && name == fs::path(attempt_path(run_dir, k)).filename()) n = std::max(n, k + 1);
  }
  return n;
}

bool attempt_withdrawn(const std::string& path) {
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    // (value("event", "") would throw for an event that is no string; read_log names it.)
    if (j.is_object() && j.value("event", nlohmann::json()) == "withdrawn") return true;
  }
  return false;
}

void remove_attempt(const std::string& path) {
  std::error_code ec;
  fs::remove(path, ec);
  fs::remove(fs::path(path).parent_path(), ec);  // ett/, when now empty
}

RunDirLock::RunDirLock(const std::string& run_dir, const char* name) {
  std::error_code ec;
  fs::create_directories(run_dir, ec);
  if (ec) input_error("config key 'run.dir' = \"", run_dir, "\": cannot create it: ", ec.message());
  const std::string path = run_dir + "/" + name;
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) input_error(path, ": cannot open: ", std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    ::close(fd_);
    input_error(run_dir, ": in use by another tessel run (", path,
                " is locked); wait for it or choose another run.dir");
  }
}

RunDirLock::~RunDirLock() {
  if (fd_ >= 0) ::close(fd_);
}

EttLedger::EttLedger(const std::string& run_dir, int attempt, bool begin, int64_t t0)
    : path_(attempt_path(run_dir, attempt)), attempt_(attempt) {
  create_ett_dir(run_dir);
  if (begin) event({{"event", "attempt"}, {"attempt", attempt}, {"t", t0}});
}

void EttLedger::enter(Phase phase, int64_t step, int64_t t) {
  if (!active()) return;
  nlohmann::json r = {{"phase", phase_name(phase)}, {"t", t}};
  if (step >= 0) r["step"] = step;
  append_json_line(path_, r);
}

void EttLedger::event(nlohmann::json record) {
  if (!active()) return;
  if (!record.contains("t")) record["t"] = monotonic_ns();
  append_json_line(path_, record);
}

void EttLedger::beat() const {
  if (active()) ::utimensat(AT_FDCWD, path_.c_str(), nullptr, 0);  // a lost beat is no error
}

std::optional<double> observed_mtbf(const EttReport& report) {
  const auto stops = report.nof_by_cause.find("stop");
  const int interruptions = report.nof - (stops == report.nof_by_cause.end() ? 0 : stops->second);
  if (interruptions <= 0) return std::nullopt;
  return report.wall / interruptions;
}

EttReport analyze_ett(const std::string& run_dir) {
  EttReport rep;
  int n = count_attempts(run_dir);
  for (int i = 0; i < n; ++i) {
    const std::string path = attempt_path(run_dir, i);
    // An empty log (its lines lost, or never written) is as good as none.
    const bool missing = !fs::exists(path);
    if (missing || fs::is_empty(path))
      input_error(path, missing ? ": missing" : ": empty", " ETT attempt log (attempt ", i, " of ",
                  n, "); the report would leave its time and failure out");
    // A withdrawn start whose supervisor died before removing its log is no attempt either.
    if (attempt_withdrawn(path)) continue;
    rep.attempts.push_back(parse_attempt(path, i));
  }
  n = int(rep.attempts.size());
  for (int i = 0; i < n; ++i) {
    auto& a = rep.attempts[i];
    // No exit line: the attempt died before anyone could write one (killed, machine lost),
    // which a later attempt proves; the last one may as well still be running, unless its
    // own fault record says how it ended.
    if (!a.exited && i + 1 < n) a.failed = true;
    a.open = !a.exited && i + 1 == n && !a.failed;
    if (!a.failed)
      a.cause.clear();  // a stop that came as the job finished
    else if (a.cause.empty())
      a.cause = a.exited ? "exit_status" : "no_exit_record";
    // A later attempt that died before its start (in start-up or the checkpoint load) tells
    // nothing: the next one that got there resumed from what was durable at this failure.
    a.durable_step = -1;
    for (int j = i + 1; j < n && a.durable_step < 0; ++j)
      a.durable_step = rep.attempts[j].resumed_from;
    if (a.durable_step < 0 && a.failed) a.durable_step = latest_checkpoint_step(run_dir);
    finish_attempt(a);
  }
  for (int i = 0; i < n; ++i) {
    const auto& a = rep.attempts[i];
    rep.wall += a.seconds();
    for (int p = 0; p < kNumPhases; ++p) rep.leaves[p] += sec(a.leaf_ns[p]);
    for (const auto& s : a.segments)
      if (s.phase == Phase::checkpoint_blocking) rep.ckpt_block.push_back(sec(s.t1 - s.t0));
    if (a.failed) {
      ++rep.nof;
      rep.injected += a.injected;
      ++rep.nof_by_cause[a.cause];
      double ttr = sec(a.leaf_ns[idx(Phase::wasted)] + a.leaf_ns[idx(Phase::failure_detection)]);
      if (i + 1 < n) {
        // The next attempt's start-up; one that failed before its first step has its own
        // detection time in its own TTR (so that the TTRs partition W).
        const auto& b = rep.attempts[i + 1];
        // (Without a step it has no wasted time: only productive segments can be wasted.)
        ttr += b.first_step_ns >= 0
                   ? sec(b.first_step_ns - b.t0)
                   : sec(b.t1 - b.t0) -
                         (b.failed ? sec(b.leaf_ns[idx(Phase::failure_detection)]) : 0.0);
      }
      rep.ttr.push_back(ttr);
      rep.failed_attempts.push_back(a.index);
    }
  }
  for (int i = 0; i < n; ++i) {
    if (i > 0 && rep.attempts[i - 1].failed) continue;  // its start-up is in that TTR
    const auto& a = rep.attempts[i];
    int64_t first = a.first_step_ns >= 0 ? a.first_step_ns : a.t1;
    // One that failed before its first step: its detection is in its failure's TTR.
    const bool detection_in_ttr = a.first_step_ns < 0 && a.failed;
    rep.tts += sec(first - a.t0) -
               (detection_in_ttr ? sec(a.leaf_ns[idx(Phase::failure_detection)]) : 0.0);
    for (const auto& s : a.segments)
      if (s.t0 < first && !(detection_in_ttr && s.phase == Phase::failure_detection))
        rep.tts_by_phase[idx(s.phase)] += sec(std::min(s.t1, first) - s.t0);
  }
  rep.productive = rep.leaves[idx(Phase::productive)];
  rep.ett = rep.wall > 0 ? rep.productive / rep.wall : 0;
  rep.mfu = time_weighted_mfu(run_dir);
  if (rep.mfu) rep.goodput = *rep.mfu * rep.ett;
  return rep;
}

nlohmann::json ett_json(const EttReport& r) {
  auto leaves = [](const auto& arr, auto conv) {
    nlohmann::json j = nlohmann::json::object();
    for (int p = 0; p < kNumPhases; ++p) j[kPhaseNames[p]] = conv(arr[p]);
    return j;
  };
  auto same = [](double v) { return v; };
  nlohmann::json j;
  j["wall_seconds"] = r.wall;
  j["productive_seconds"] = r.productive;
  j["ett"] = r.ett;
  j["tts_seconds"] = r.tts;
  j["tts_by_phase"] = leaves(r.tts_by_phase, same);
  j["nof"] = r.nof;
  j["nof_injected"] = r.injected;
  j["nof_by_cause"] = r.nof_by_cause;
  j["ttr_seconds"] = r.ttr;
  if (r.ttr_bound > 0) {
    j["ttr_bound_seconds"] = r.ttr_bound;
    j["ttr_over_bound"] = ttr_over_bound(r);
  }
  j["checkpoint_blocking_seconds"] = r.ckpt_block;
  j["mfu"] = r.mfu ? nlohmann::json(*r.mfu) : nlohmann::json();
  j["goodput"] = r.goodput ? nlohmann::json(*r.goodput) : nlohmann::json();
  j["leaves"] = leaves(r.leaves, same);
  for (const auto& a : r.attempts) {
    nlohmann::json aj = {{"attempt", a.index},
                         {"seconds", a.seconds()},
                         {"failed", a.failed},
                         {"open", a.open},
                         {"injected", a.injected},
                         {"last_line_cut", a.cut_line},
                         {"resumed_from", a.resumed_from},
                         {"leaves", leaves(a.leaf_ns, [](int64_t ns) { return sec(ns); })}};
    if (a.failed) {
      aj["cause"] = a.cause;
      aj["failure_step"] = a.failure_step;
      aj["durable_step"] = a.durable_step;
      aj["wasted_steps"] = a.wasted_steps;
    }
    j["attempts"].push_back(aj);
  }
  return j;
}

nlohmann::json ett_chrome_trace(const EttReport& r) {
  nlohmann::json events = nlohmann::json::array();
  if (r.attempts.empty()) return {{"traceEvents", events}};
  const int64_t origin = r.attempts.front().t0;
  for (const auto& a : r.attempts) {
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", 1},
                      {"tid", a.index},
                      {"args", {{"name", "attempt " + std::to_string(a.index)}}}});
    for (const auto& s : a.segments) {
      nlohmann::json e = {{"name", phase_name(s.phase)},
                          {"cat", "ett"},
                          {"ph", "X"},
                          {"pid", 1},
                          {"tid", a.index},
                          {"ts", double(s.t0 - origin) / 1e3},
                          {"dur", double(s.t1 - s.t0) / 1e3}};
      if (s.step >= 0) e["args"] = {{"step", s.step}};
      events.push_back(e);
    }
  }
  return {{"traceEvents", events}, {"displayTimeUnit", "ms"}};
}

std::string ett_html(const EttReport& r, const std::string& title) {
  std::ostringstream h;
  const std::string escaped_title = html_escaped(title);
  h << "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>ETT report: " << escaped_title
    << "</title>\n<style>body{font-family:sans-serif;margin:24px}table{border-collapse:collapse}"
       "td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}"
       "th{background:#f3f3f3}.l{text-align:left}</style></head><body>\n";
  h << "<h1>Effective training time: " << escaped_title << "</h1>\n<table>\n";
  auto row = [&](const std::string& k, const std::string& v) {
    h << "<tr><th class=\"l\">" << html_escaped(k) << "</th><td>" << html_escaped(v)
      << "</td></tr>\n";
  };
  row("wall time W", fmt("%.3f s", r.wall));
  row("productive T_prod", fmt("%.3f s", r.productive));
  row("ETT%", fmt("%.2f %%", 100 * r.ett));
  row("TTS", fmt("%.3f s", r.tts));
  row("NoF (injected)", std::to_string(r.nof) + " (" + std::to_string(r.injected) + ")");
  row("NoF by cause", r.nof ? nof_by_cause_text(r) : "-");
  std::string ttr;
  for (double t : r.ttr) ttr += (ttr.empty() ? "" : ", ") + fmt("%.3f s", t);
  row("TTR per failure", ttr.empty() ? "-" : ttr);
  if (r.ttr_bound > 0)
    row("TTR bound", fmt("%.3f s", r.ttr_bound) + ", exceeded by " +
                         std::to_string(ttr_over_bound(r).size()) + " failure(s)");
  row("MFU (steps, time-weighted)", mfu_percent_text(r.mfu));
  row("goodput = MFU x ETT%", r.goodput ? mfu_percent_text(r.goodput) : "n/a");
  h << "</table>\n";

  const int W = 900, bar = 26, gap = 10, left = 90;
  double longest = 1e-9;
  for (const auto& a : r.attempts) longest = std::max(longest, a.seconds());
  auto legend = [&]() {
    h << "<p>";
    for (int p = 0; p < kNumPhases; ++p)
      h << "<span style=\"display:inline-block;margin-right:12px\"><span style=\"display:inline-"
           "block;width:12px;height:12px;background:"
        << kPhaseColors[p] << "\"></span> " << kPhaseNames[p] << "</span>";
    h << "</p>\n";
  };
  h << "<h2>Leaves per attempt</h2>\n";
  legend();
  int height = int(r.attempts.size()) * (bar + gap) + gap;
  h << "<svg width=\"" << W + left + 120 << "\" height=\"" << height
    << "\" xmlns=\"http://www.w3.org/2000/svg\" font-size=\"12\">\n";
  for (size_t i = 0; i < r.attempts.size(); ++i) {
    const auto& a = r.attempts[i];
    int y = gap + int(i) * (bar + gap);
    h << "<text x=\"0\" y=\"" << y + bar * 0.7 << "\">attempt " << a.index
      << (a.failed ? " \xe2\x9c\x97"
          : a.open ? " (open)"
                   : "")
      << "</text>\n";
    double x = left;
    for (int p = 0; p < kNumPhases; ++p) {
      double w = sec(a.leaf_ns[p]) / longest * W;
      if (w <= 0) continue;
      h << "<rect x=\"" << x << "\" y=\"" << y << "\" width=\"" << w << "\" height=\"" << bar
        << "\" fill=\"" << kPhaseColors[p] << "\"><title>" << kPhaseNames[p] << ": "
        << fmt("%.3f s", sec(a.leaf_ns[p])) << "</title></rect>\n";
      x += w;
    }
    h << "<text x=\"" << x + 6 << "\" y=\"" << y + bar * 0.7 << "\">" << fmt("%.2f s", a.seconds())
      << "</text>\n";
  }
  h << "</svg>\n<h2>Timeline</h2>\n";
  legend();
  double job = 1e-9;
  const int64_t origin = r.attempts.empty() ? 0 : r.attempts.front().t0;
  for (const auto& a : r.attempts) job = std::max(job, sec(a.t1 - origin));
  h << "<svg width=\"" << W + left + 20 << "\" height=\"" << height + 20
    << "\" xmlns=\"http://www.w3.org/2000/svg\" font-size=\"12\">\n";
  for (size_t i = 0; i < r.attempts.size(); ++i) {
    const auto& a = r.attempts[i];
    int y = gap + int(i) * (bar + gap);
    h << "<text x=\"0\" y=\"" << y + bar * 0.7 << "\">attempt " << a.index << "</text>\n";
    for (const auto& s : merged(a.segments)) {
      double x = left + sec(s.t0 - origin) / job * W, w = sec(s.t1 - s.t0) / job * W;
      h << "<rect x=\"" << x << "\" y=\"" << y << "\" width=\"" << std::max(w, 0.5)
        << "\" height=\"" << bar << "\" fill=\"" << kPhaseColors[idx(s.phase)] << "\"><title>"
        << phase_name(s.phase) << ": " << fmt("%.3f s", sec(s.t1 - s.t0)) << "</title></rect>\n";
    }
  }
  h << "<text x=\"" << left << "\" y=\"" << height + 14 << "\">0 s</text><text x=\""
    << left + W - 40 << "\" y=\"" << height + 14 << "\">" << fmt("%.2f s", job) << "</text>\n";
  h << "</svg>\n</body></html>\n";
  return h.str();
}

std::string nof_by_cause_text(const EttReport& r) {
  std::string text;
  for (const auto& [cause, n] : r.nof_by_cause)
    text += (text.empty() ? "" : ", ") + cause + " " + std::to_string(n);
  return text;
}

std::string mfu_percent_text(const std::optional<double>& fraction) {
  return fraction ? fmt("%.2f %%", 100 * *fraction) : "n/a (no step records in metrics.jsonl)";
}

std::vector<int> ttr_over_bound(const EttReport& r) {
  std::vector<int> over;
  if (r.ttr_bound > 0)
    for (size_t i = 0; i < r.ttr.size(); ++i)
      if (r.ttr[i] > r.ttr_bound) over.push_back(int(i));
  return over;
}

EttReport write_ett_report(const std::string& run_dir, double ttr_bound) {
  auto nothing_to_report = [&](const std::string& what) {
    input_error(run_dir, ": ", what, "; run `tessel train` or `tessel run` first");
  };
  if (count_attempts(run_dir) == 0)
    nothing_to_report("no ETT log (" + ett_dir(run_dir) + "/attempt-0000.jsonl)");
  if (!(ttr_bound >= 0)) input_error("--max-ttr must be >= 0 seconds, got ", ttr_bound);
  EttReport r = analyze_ett(run_dir);
  // Only withdrawn starts' logs: no attempt, as without logs (a report of 0 s would say ETT 0 %).
  if (r.attempts.empty())
    nothing_to_report("no ETT attempt (the logs in " + ett_dir(run_dir) +
                      " are all of withdrawn starts, which are no attempts)");
  r.ttr_bound = ttr_bound;
  // All three or none: a report is never part old, part new.
  write_files_atomically({{run_dir + "/ett.json", ett_json(r).dump(2) + "\n"},
                          {run_dir + "/ett_trace.json", ett_chrome_trace(r).dump() + "\n"},
                          {run_dir + "/ett.html", ett_html(r, run_dir)}});
  return r;
}

}  // namespace tessel::train
