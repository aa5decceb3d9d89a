// The ETT ledger: hand-written attempt logs with known leaves, and the log a real training
// run writes.
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/resource.h>
#include <sys/wait.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <set>

#include "support/expect_input_error.hpp"
#include "support/train_fixture.hpp"
#include "tessel/comm/single_communicator.hpp"
#include "tessel/train/checkpoint.hpp"
#include "tessel/train/ett.hpp"
#include "tessel/train/metrics.hpp"
#include "tessel/train/trainer.hpp"

using namespace tessel;
using namespace tessel::train;
namespace fs = std::filesystem;

extern char** environ;

namespace {

constexpr int64_t ms = 1000000;  // ns
// Leaves are sums of integer nanosecond differences; 1 ms is the acceptance bound.
constexpr double kSumTolerance = 1e-3;

void line(const std::string& path, nlohmann::json j) {
  append_json_line(path, j);
}
void phase(const std::string& path, const char* p, int64_t t, int64_t step = -1) {
  nlohmann::json j = {{"phase", p}, {"t", t}};
  if (step >= 0) j["step"] = step;
  line(path, j);
}

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

double leaf(const EttAttempt& a, Phase p) {
  return double(a.leaf_ns[int(p)]) * 1e-9;
}

// Attempt 0 checkpoints after step 2, is killed after step 5 and seen dead 80 ms later;
// attempt 1 resumes from step 2 and finishes steps 3-5.
std::string two_attempt_run() {
  std::string run = fixture::temp_dir("tessel-ett");
  fs::create_directories(ett_dir(run));
  std::string a0 = attempt_path(run, 0), a1 = attempt_path(run, 1);
  line(a0, {{"event", "attempt"}, {"attempt", 0}, {"t", 0}});
  phase(a0, "scheduling", 0);
  phase(a0, "comm_init", 100 * ms);
  phase(a0, "model_build", 150 * ms);
  phase(a0, "data_warmup", 200 * ms);
  phase(a0, "checkpoint_load", 250 * ms);
  phase(a0, "warmup", 260 * ms);
  phase(a0, "productive", 300 * ms, 1);
  phase(a0, "productive", 400 * ms, 2);
  phase(a0, "checkpoint_blocking", 500 * ms);
  phase(a0, "productive", 520 * ms, 3);
  phase(a0, "productive", 620 * ms, 4);
  phase(a0, "productive", 720 * ms, 5);
  line(a0, {{"event", "fault"}, {"t", 820 * ms}, {"rank", 1}, {"step", 5}, {"kind", "kill"}});
  line(a0, {{"event", "exit"}, {"t", 900 * ms}, {"status", 137}});
  line(a1, {{"event", "attempt"}, {"attempt", 1}, {"t", 900 * ms}});
  phase(a1, "scheduling", 900 * ms);
  phase(a1, "comm_init", 1000 * ms);
  phase(a1, "model_build", 1020 * ms);
  phase(a1, "data_warmup", 1040 * ms);
  phase(a1, "checkpoint_load", 1060 * ms);
  line(a1, {{"event", "resume"}, {"t", 1070 * ms}, {"step", 2}});
  phase(a1, "warmup", 1080 * ms);
  phase(a1, "productive", 1100 * ms, 3);
  phase(a1, "productive", 1200 * ms, 4);
  phase(a1, "productive", 1300 * ms, 5);
  phase(a1, "shutdown", 1400 * ms);
  line(a1, {{"event", "exit"}, {"t", 1500 * ms}, {"status", 0}});
  std::ofstream(a1, std::ios::app) << "{\"phase\": \"produ";  // a line cut short by a crash
  return run;
}

// Attempt 0 (a plain `tessel train`) checkpoints after step 2 and is killed in step 5:
// no fault line, no exit line. With `relaunched`, attempt 1 resumes from step 2 and finishes.
std::string killed_run(bool relaunched) {
  std::string run = fixture::temp_dir("tessel-ett-killed");
  fs::create_directories(ett_dir(run));
  std::string a0 = attempt_path(run, 0), a1 = attempt_path(run, 1);
  line(a0, {{"event", "attempt"}, {"attempt", 0}, {"t", 0}});
  phase(a0, "productive", 100 * ms, 1);
  phase(a0, "productive", 200 * ms, 2);
  phase(a0, "checkpoint_blocking", 300 * ms);
  phase(a0, "productive", 320 * ms, 3);
  phase(a0, "productive", 420 * ms, 4);
  phase(a0, "productive", 520 * ms, 5);
  if (relaunched) {
    line(a1, {{"event", "attempt"}, {"attempt", 1}, {"t", 1000 * ms}});
    line(a1, {{"event", "resume"}, {"t", 1100 * ms}, {"step", 2}});
    phase(a1, "productive", 1200 * ms, 3);
    phase(a1, "productive", 1300 * ms, 4);
    phase(a1, "productive", 1400 * ms, 5);
    line(a1, {{"event", "exit"}, {"t", 1500 * ms}, {"status", 0}});
  }
  return run;
}

}  // namespace

TEST(EttLedger, HandWrittenRunHasTheExpectedLeavesAndMetrics) {
  EttReport r = analyze_ett(two_attempt_run());
  ASSERT_EQ(r.attempts.size(), 2u);
  const EttAttempt& a = r.attempts[0];
  EXPECT_TRUE(a.failed);
  EXPECT_TRUE(a.injected);
  EXPECT_EQ(a.failure_step, 5);
  EXPECT_EQ(a.durable_step, 2);
  EXPECT_EQ(a.wasted_steps, 3);
  EXPECT_DOUBLE_EQ(leaf(a, Phase::productive), 0.2);  // steps 1 and 2
  EXPECT_DOUBLE_EQ(leaf(a, Phase::wasted), 0.3);      // steps 3-5, lost
  EXPECT_DOUBLE_EQ(leaf(a, Phase::failure_detection), 0.08);
  EXPECT_DOUBLE_EQ(leaf(a, Phase::checkpoint_blocking), 0.02);
  EXPECT_DOUBLE_EQ(leaf(a, Phase::scheduling), 0.1);
  const EttAttempt& b = r.attempts[1];
  EXPECT_FALSE(b.failed);
  EXPECT_EQ(b.resumed_from, 2);
  EXPECT_DOUBLE_EQ(leaf(b, Phase::productive), 0.3);
  EXPECT_DOUBLE_EQ(leaf(b, Phase::checkpoint_load), 0.02);
  EXPECT_DOUBLE_EQ(leaf(b, Phase::shutdown), 0.1);
  for (const auto& at : r.attempts) {
    double sum = 0;
    for (int64_t ns : at.leaf_ns) sum += double(ns) * 1e-9;
    EXPECT_NEAR(sum, at.seconds(), kSumTolerance) << "attempt " << at.index;
  }
  EXPECT_DOUBLE_EQ(r.wall, 1.5);
  EXPECT_DOUBLE_EQ(r.productive, 0.5);
  EXPECT_DOUBLE_EQ(r.ett, 0.5 / 1.5);
  EXPECT_DOUBLE_EQ(r.tts, 0.3);
  EXPECT_DOUBLE_EQ(r.tts_by_phase[int(Phase::scheduling)], 0.1);
  EXPECT_EQ(r.nof, 1);
  EXPECT_EQ(r.injected, 1);
  ASSERT_EQ(r.ttr.size(), 1u);
  EXPECT_NEAR(r.ttr[0], 0.3 + 0.08 + 0.2, 1e-12);  // wasted + detection + restart to step
  ASSERT_EQ(r.ckpt_block.size(), 1u);
  EXPECT_DOUBLE_EQ(r.ckpt_block[0], 0.02);
  EXPECT_FALSE(a.cut_line);
  EXPECT_TRUE(b.cut_line) << "its last line is cut short";
  EXPECT_TRUE(ett_json(r)["attempts"][1]["last_line_cut"]);
  EXPECT_FALSE(r.mfu) << "no metrics.jsonl: no MFU, not 0";
  EXPECT_FALSE(r.goodput);
  EXPECT_TRUE(ett_json(r)["mfu"].is_null());
}

// MFU is the steps' FLOPs over their time at the peak: each step's MFU weighted by its
// seconds, not their plain mean (which a few fast steps on a loaded machine inflate).
TEST(EttLedger, MfuWeightsEachStepByItsTime) {
  const std::string run = two_attempt_run();
  std::ofstream metrics(run + "/metrics.jsonl");
  metrics << R"({"event": "start", "mfu": 0.9})"
          << "\n"  // no step record: not counted
          << R"({"step": 1, "loss": 2.0, "mfu": 0.4, "step_seconds": 1.0})"
          << "\n"
          << R"({"step": 2, "loss": 1.9, "mfu": 0.1, "step_seconds": 4.0})"
          << "\n";
  metrics.close();
  const EttReport r = analyze_ett(run);
  ASSERT_TRUE(r.mfu);
  EXPECT_NEAR(*r.mfu, (0.4 * 1 + 0.1 * 4) / 5, 1e-15);  // the plain mean would be 0.25
  ASSERT_TRUE(r.goodput);
  EXPECT_NEAR(*r.goodput, *r.mfu * r.ett, 1e-15);
}

// A step record whose MFU was not finite (null in JSON: an older tessel wrote it for a denormal
// mfu.peak_gflops) made every report of the run fail with nlohmann's type_error. It is left
// out of the MFU, with one warning naming its line; the rest of the report stands.
TEST(EttLedger, AStepRecordWithoutAUsableMfuIsLeftOutWithAWarning) {
  const std::string run = two_attempt_run();
  const EttReport before = analyze_ett(run);
  const std::string metrics = run + "/metrics.jsonl";
  std::ofstream(metrics) << R"({"step": 1, "loss": 2.0, "mfu": 0.4, "step_seconds": 1.0})"
                         << "\n"
                         << R"({"step": 2, "loss": 1.9, "mfu": null, "step_seconds": 4.0})"
                         << "\n"
                         << R"({"step": 3, "loss": 1.8, "mfu": 0.2, "step_seconds": "4"})"
                         << "\n"
                         << R"({"step": 4, "loss": 1.7, "mfu": 0.1, "step_seconds": 3.0})"
                         << "\n";
  testing::internal::CaptureStderr();
  const EttReport r = write_ett_report(run);
  const std::string warnings = testing::internal::GetCapturedStderr();
  ASSERT_TRUE(r.mfu);
  EXPECT_NEAR(*r.mfu, (0.4 * 1 + 0.1 * 3) / 4, 1e-15);
  EXPECT_EQ(r.ett, before.ett);
  EXPECT_NE(warnings.find(metrics + ":2: a step record with mfu = null, step_seconds = 4.0 (null: "
                                    "NaN or infinite when written) is left out of the MFU, as are "
                                    "1 more such records"),
            std::string::npos)
      << warnings;
  EXPECT_EQ(std::count(warnings.begin(), warnings.end(), '\n'), 1) << warnings;
}

TEST(EttLedger, ChromeTraceAndHtmlCoverEverySegment) {
  EttReport r = analyze_ett(two_attempt_run());
  nlohmann::json trace = ett_chrome_trace(r);
  double total_us = 0;
  int slices = 0;
  for (const auto& e : trace["traceEvents"])
    if (e["ph"] == "X") total_us += e["dur"].get<double>(), ++slices;
  EXPECT_NEAR(total_us, 1.5e6, 1e-3);
  size_t segments = r.attempts[0].segments.size() + r.attempts[1].segments.size();
  EXPECT_EQ(size_t(slices), segments);
  std::string html = ett_html(r, "hand");
  EXPECT_EQ(html.rfind("<!DOCTYPE html>", 0), 0u);
  EXPECT_NE(html.find("attempt 1"), std::string::npos);
  EXPECT_NE(html.find("33.33 %"), std::string::npos);  // ETT% of the table
  EXPECT_EQ(html.find("<script"), std::string::npos);  // self-contained, static
}

// The run directory and the failure causes come from the user and the logs: the page shows
// them as text, never as markup.
TEST(EttLedger, TheHtmlReportEscapesTheTextItShows) {
  EttReport r = analyze_ett(two_attempt_run());
  r.nof_by_cause = {{"<i>oom</i>", 1}};
  const std::string html = ett_html(r, "runs/\"<b>x</b>\" & 'y'");
  const std::string shown = "runs/&quot;&lt;b&gt;x&lt;/b&gt;&quot; &amp; &#39;y&#39;";
  EXPECT_NE(html.find("<title>ETT report: " + shown + "</title>"), std::string::npos) << html;
  EXPECT_NE(html.find("<h1>Effective training time: " + shown + "</h1>"), std::string::npos);
  EXPECT_NE(html.find("&lt;i&gt;oom&lt;/i&gt; 1"), std::string::npos);
  for (const char* markup : {"<b>", "<i>", "\"<", "'y'"})
    EXPECT_EQ(html.find(markup), std::string::npos) << markup;
}

TEST(EttLedger, AMalformedLineInsideALogNamesTheFile) {
  std::string run = two_attempt_run();
  std::string a0 = attempt_path(run, 0);
  std::ofstream(a0, std::ios::app) << "garbage\n{\"event\": \"exit\", \"t\": 1}\n";
  try {
    analyze_ett(run);
    FAIL() << "no error";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(a0), std::string::npos) << e.what();
  }
}

// A lost log would drop its attempt's time and failure from the report (and, before, every
// attempt after it): the report refuses, naming the file, and the next attempt does not
// take its place.
TEST(EttLedger, AMissingAttemptLogIsAnErrorNamingIt) {
  std::string run = two_attempt_run();
  std::string a2 = attempt_path(run, 2);
  line(a2, {{"event", "attempt"}, {"attempt", 2}, {"t", 2000 * ms}});
  line(a2, {{"event", "exit"}, {"t", 2100 * ms}, {"status", 0}});
  EXPECT_EQ(analyze_ett(run).attempts.size(), 3u);
  fs::remove(attempt_path(run, 1));
  EXPECT_EQ(count_attempts(run), 3);
  try {
    write_ett_report(run);
    FAIL() << "no error";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(attempt_path(run, 1) + ": missing ETT attempt log"),
              std::string::npos)
        << e.what();
  }
  // Files that are not attempt logs do not count.
  std::ofstream(ett_dir(run) + "/attempt-7.jsonl") << "";
  std::ofstream(ett_dir(run) + "/attempt-0009.jsonl.tmp") << "";
  EXPECT_EQ(count_attempts(run), 3);
}

// An empty log is as good as a missing one: its attempt's time and failure would be left out.
TEST(EttLedger, AnEmptyAttemptLogIsRefusedLikeAMissingOne) {
  const std::string run = two_attempt_run();
  std::ofstream(attempt_path(run, 1), std::ios::trunc).close();
  fixture::expect_input_error(
      [&] { analyze_ett(run); },
      {attempt_path(run, 1) + ": empty ETT attempt log (attempt 1 of 2); the report would leave "
                              "its time and failure out"});
}

// A failed attempt that no later attempt followed: its durable step is the run's newest
// checkpoint, or a newer save that every rank wrote and no commit finished (its draft and done
// records, no manifest), which the next start recovers and resumes from.
TEST(EttLedger, WithoutALaterAttemptTheDurableStepIsWhereTheNextStartResumes) {
  const std::string run = killed_run(false);
  const std::string a0 = attempt_path(run, 0);
  line(a0, {{"event", "fault"}, {"t", 530 * ms}, {"rank", 1}, {"step", 5}, {"kind", "kill"}});
  line(a0, {{"event", "exit"}, {"t", 600 * ms}, {"status", 137}});
  comm::SingleCommunicator group;
  CheckpointStore store(run + "/checkpoints", 0);
  for (int64_t step : {2, 4}) {
    CheckpointContent c;
    c.step = step;
    c.state = {{"loader", {{"step", step}, {"micro", 0}}}};
    store.save(group, c);
  }
  const std::string four = store.root() + "/step-00000004";
  auto durable = [&] {
    const EttAttempt a = analyze_ett(run).attempts.at(0);
    EXPECT_TRUE(a.failed);
    EXPECT_EQ(a.wasted_steps, a.failure_step - a.durable_step);
    return a.durable_step;
  };
  EXPECT_EQ(durable(), 4);
  fs::remove(four + "/manifest.json");  // step 4 as its commit left it when the job died
  fs::rename(four, four + ".incomplete");
  EXPECT_EQ(durable(), 4);
  fs::remove(four + ".incomplete/rank-00000-of-00001.done.json");  // a rank died in its write
  EXPECT_EQ(durable(), 2);
}

// Each log begins with its own attempt line, has one exit line, and its times never go back
// (which gave a negative TTR, and leaves that no longer summed to W); a fault line, written by
// whichever rank injects it, may come just before a line of rank 0 with an earlier time.
TEST(EttLedger, ALogOutOfShapeIsRefusedNamingItsLine) {
  std::string run = killed_run(false);
  const std::string a0 = attempt_path(run, 0);
  const std::string lines = slurp(a0);  // 7 lines, the last: step 5 at 520 ms
  std::ofstream(a0) << lines.substr(lines.find('\n') + 1);
  fixture::expect_input_error([&] { analyze_ett(run); },
                              {a0 + ":1: the first line is not the attempt line"});
  std::ofstream(a0) << R"({"event": "attempt", "attempt": 3, "t": 0})"
                    << "\n"
                    << lines.substr(lines.find('\n') + 1);
  fixture::expect_input_error(
      [&] { analyze_ett(run); },
      {a0 + ":1: the attempt line names attempt 3, but the file is attempt 0's log"});

  std::ofstream(a0) << lines;
  line(a0, {{"event", "fault"}, {"t", 510 * ms}, {"rank", 1}, {"step", 4}, {"kind", "kill"}});
  line(a0, {{"event", "exit"}, {"t", 600 * ms}, {"status", 137}});
  // Steps 1-4 wasted up to the fault (no checkpoint to resume from), then 90 ms of detection.
  EXPECT_NEAR(analyze_ett(run).ttr.at(0), 0.39 + 0.09, 1e-12);
  line(a0, {{"event", "exit"}, {"t", 700 * ms}, {"status", 137}});
  fixture::expect_input_error([&] { analyze_ett(run); },
                              {a0 + ":10: a second exit line (the first is line 9)"});

  std::ofstream(a0) << lines;
  phase(a0, "productive", 420 * ms, 6);
  fixture::expect_input_error(
      [&] { analyze_ett(run); },
      {a0 + ":8: time 420000000 is before line 7's 520000000 (the times of a log never go back"});
  std::ofstream(a0) << lines;
  line(a0, {{"event", "fault"}, {"t", 510 * ms}, {"rank", 1}, {"step", 4}, {"kind", "kill"}});
  line(a0, {{"event", "exit"}, {"t", 515 * ms}, {"status", 137}});
  fixture::expect_input_error([&] { analyze_ett(run); },
                              {a0 + ":9: time 515000000 is before line 7's 520000000"});
  std::ofstream(a0) << lines;
  line(a0, {{"event", "fault"}, {"t", -1}, {"rank", 1}, {"step", 4}, {"kind", "kill"}});
  fixture::expect_input_error([&] { analyze_ett(run); }, {a0 + ":8: time -1 is before line 1's 0"});
}

// Every field the report reads has its type and range checked, naming the file and line: a
// phase, event or cause that is no string, a step that is a string or a float threw nlohmann's
// type_error (exit 1); times of -9.2e18 and 9.2e18 wrapped the attempt's duration to -1.6 us
// (ETT 0 %), a fault step of 9.2e18 counted 9.2e18 wasted steps and a step of 1e30 converted
// to int64 (undefined). A training step of a resumed attempt comes after its checkpoint, and
// a hang's progress time within its attempt.
TEST(EttLedger, AFieldOfTheWrongTypeOrOutOfRangeIsRefusedNamingItsLine) {
  const std::string run = killed_run(false);
  const std::string a0 = attempt_path(run, 0);
  std::vector<std::string> lines;  // 7: the attempt line, steps 1-5 from 100 ms, the last at 520
  {
    std::ifstream in(a0);
    for (std::string l; std::getline(in, l);) lines.push_back(l);
  }
  ASSERT_EQ(lines.size(), 7u);
  // The log with line `number` (1-based) replaced by `records` (one past the end: appended).
  auto with = [&](size_t number, const std::vector<std::string>& records) {
    std::ofstream out(a0, std::ios::trunc);
    for (size_t i = 0; i < lines.size(); ++i)
      if (i + 1 == number)
        for (const auto& r : records) out << r << "\n";
      else
        out << lines[i] << "\n";
    if (number == lines.size() + 1)
      for (const auto& r : records) out << r << "\n";
  };
  const std::string steps = "must be an integer in [0, 1099511627776] (a step; train.steps' range)";
  const struct {
    size_t at;  // the line replaced
    std::vector<std::string> records;
    std::string error;
  } cases[] = {
      {2, {R"({"phase": 5, "t": 100000000, "step": 1})"}, ":2: phase = 5 must be a string"},
      {2, {R"({"phase": "produktive", "t": 100000000})"}, ":2: unknown phase 'produktive'"},
      {2,
       {R"({"phase": "productive", "t": 100000000, "step": "one"})"},
       ":2: step = \"one\" " + steps},
      {2,
       {R"({"phase": "productive", "t": 100000000, "step": 1e30})"},
       ":2: step = 1e+30 " + steps},
      {2, {R"({"phase": "productive", "t": 100000000, "step": -1})"}, ":2: step = -1 " + steps},
      {2,
       {R"({"phase": "productive", "t": 1e8, "step": 1})"},
       ":2: t = 100000000.0 must be an integer of 64 bits (CLOCK_MONOTONIC nanoseconds)"},
      {2,
       {R"({"phase": "productive", "t": 18446744073709551615, "step": 1})"},
       ":2: t = 18446744073709551615 must be an integer of 64 bits"},
      {2, {R"({"event": 5, "t": 100000000})"}, ":2: event = 5 must be a string"},
      {1,
       {R"({"event": "attempt", "attempt": 0, "t": -9223372036854775000})"},
       ":1: time -9223372036854775000 of the attempt line is negative"},
      {2,
       {R"({"event": "resume", "t": 50000000, "step": "0"})", lines[1]},
       ":2: step = \"0\" " + steps},
      {2,
       {R"({"event": "resume", "t": 50000000, "step": 2})", lines[1]},
       ":3: step 1 is not after the checkpoint the attempt resumed from (step 2, line 2)"},
      {8,
       {R"({"event": "fault", "t": 600000000, "rank": 1, "step": 9223372036854775806})"},
       ":8: step = 9223372036854775806 " + steps},
      {8,
       {R"({"event": "exit", "t": 600000000, "status": "137"})"},
       ":8: status = \"137\" must be an integer of 64 bits (an exit status)"},
      {8,
       {R"({"event": "exit", "t": 600000000, "status": 1, "cause": 1})"},
       ":8: cause = 1 must be a string"},
      {8,
       {R"({"event": "exit", "t": 600000000, "status": 1, "cause": "hang", "progress_t": 700000000})"},
       ":8: progress_t = 700000000 must be an integer in [0, 600000000] (a time between the "
       "attempt line's and this line's)"},
  };
  for (const auto& c : cases) {
    with(c.at, c.records);
    fixture::expect_input_error([&] { write_ett_report(run); }, {a0 + c.error});
  }
  // A hang's progress time within its attempt, a step after its checkpoint: accepted.
  with(
      8,
      {R"({"event": "exit", "t": 600000000, "status": 1, "cause": "hang", "progress_t": 550000000})"});
  EXPECT_EQ(analyze_ett(run).attempts.at(0).leaf_ns[int(Phase::failure_detection)], 50 * ms);
  with(2, {R"({"event": "resume", "t": 50000000, "step": 0})", lines[1]});
  EXPECT_EQ(analyze_ett(run).attempts.at(0).resumed_from, 0);
}

// metrics.jsonl is read as the logs are: a malformed line other than a last one cut short would
// change the MFU without a word.
TEST(EttLedger, AMalformedMetricsLineIsAnErrorNamingIt) {
  const std::string run = two_attempt_run();
  const std::string metrics = run + "/metrics.jsonl";
  std::ofstream(metrics) << R"({"step": 1, "loss": 2.0, "mfu": 0.4, "step_seconds": 1.0})"
                         << "\n"
                         << R"({"step": 2, "loss": 1.9, "mfu": 0.1, "step_se)"
                         << "\n"
                         << R"({"step": 3, "loss": 1.8, "mfu": 0.1, "step_seconds": 4.0})"
                         << "\n";
  fixture::expect_input_error([&] { analyze_ett(run); },
                              {metrics + ":2: malformed metrics record"});
  std::ofstream(metrics) << R"({"step": 1, "loss": NaN, "mfu": 0.4, "step_seconds": 1.0})"
                         << "\n"
                         << R"({"step": 2, "loss": 1.9, "mfu": 0.1, "step_seconds": 4.0})"
                         << "\n";
  fixture::expect_input_error([&] { analyze_ett(run); },
                              {metrics + ":1: malformed metrics record"});
  // A last line cut short (a crash, or being written) is left out.
  std::ofstream(metrics) << R"({"step": 1, "loss": 2.0, "mfu": 0.4, "step_seconds": 1.0})"
                         << "\n"
                         << R"({"step": 2, "loss": 1.9, "mfu": 0.1, "step_se)";
  EXPECT_NEAR(analyze_ett(run).mfu.value(), 0.4, 1e-15);
}

// A resume from step k keeps the records up to k and the stepless ones; a damaged line is
// dropped with a warning naming it (a step that is no integer threw nlohmann's type_error).
TEST(MetricsLogTest, AResumeKeepsEarlierStepsAndNamesTheLinesItDrops) {
  const std::string metrics = fixture::temp_dir("tessel-metrics") + "/metrics.jsonl";
  const std::string step1 = R"({"step":1,"loss":2.0})", stepless = R"({"event":"start"})",
                    step3 = R"({"step":3,"loss":1.8})";
  std::ofstream(metrics) << step1 << "\n"
                         << R"({"step":2,"lo)"
                         << "\n"
                         << R"({"step":"2","loss":1.9})"
                         << "\n"
                         << stepless << "\n\n"
                         << R"([3])"
                         << "\n"
                         << step3 << "\n"
                         << R"({"step":4,"loss":1.7})"
                         << "\n";
  testing::internal::CaptureStderr();
  MetricsLog(metrics, 3).write({{"step", 4}});
  const std::string warnings = testing::internal::GetCapturedStderr();
  std::ifstream in(metrics);
  const std::string kept{std::istreambuf_iterator<char>(in), {}};
  EXPECT_EQ(kept, step1 + "\n" + stepless + "\n" + step3 + "\n" + R"({"step":4})" + "\n");
  for (int line : {2, 3, 6})
    EXPECT_NE(warnings.find(metrics + ":" + std::to_string(line) + ": malformed metrics record"),
              std::string::npos)
        << warnings;
  EXPECT_EQ(std::count(warnings.begin(), warnings.end(), '\n'), 3) << warnings;
}

// A report is written whole or not at all: a directory in place of ett.html is found before
// ett.json and ett_trace.json are written.
TEST(EttLedger, AReportThatCannotBeWrittenWholeWritesNothing) {
  const std::string run = two_attempt_run();
  fs::create_directory(run + "/ett.html");
  fixture::expect_input_error([&] { write_ett_report(run); },
                              {run + "/ett.html: is a directory", "nothing was written"});
  for (const char* name : {"/ett.json", "/ett_trace.json"})
    EXPECT_FALSE(fs::exists(run + name)) << name;
  EXPECT_EQ(std::distance(fs::directory_iterator(run), fs::directory_iterator()), 2)
      << "ett/ and ett.html only, no temporary left";
  fs::remove(run + "/ett.html");
  write_ett_report(run);
  for (const char* name : {"/ett.json", "/ett_trace.json", "/ett.html"})
    EXPECT_TRUE(fs::is_regular_file(run + name)) << name;
}

TEST(EttLedger, TrainingRunsRecordEveryStepAndTheResume) {
  std::string data = fixture::make_dataset(fixture::temp_dir("tessel-ett-data"));
  std::string run = fixture::temp_dir("tessel-ett-run");
  Config c = fixture::tiny_config(data, run);
  c.train.steps = 6;
  c.train.checkpoint_every = 4;
  c.train.save_final = false;  // the last checkpoint is step 4
  {
    comm::SingleCommunicator world;
    Trainer(c, world).run();
  }
  c.train.steps = 12;
  {
    comm::SingleCommunicator world;
    Trainer(c, world).run();
  }
  EttReport r = analyze_ett(run);
  ASSERT_EQ(r.attempts.size(), 2u);
  EXPECT_EQ(r.nof, 0);
  EXPECT_EQ(r.attempts[1].resumed_from, 4);  // the last checkpoint of the first run
  for (const auto& a : r.attempts) {
    double sum = 0;
    for (int64_t ns : a.leaf_ns) sum += double(ns) * 1e-9;
    EXPECT_NEAR(sum, a.seconds(), kSumTolerance);
    EXPECT_GT(a.leaf_ns[int(Phase::productive)], 0);
    EXPECT_GT(a.leaf_ns[int(Phase::checkpoint_blocking)], 0);
  }
  std::set<int64_t> steps[2];
  for (int i = 0; i < 2; ++i)
    for (const auto& s : r.attempts[size_t(i)].segments)
      if (s.phase == Phase::productive) steps[i].insert(s.step);
  EXPECT_EQ(steps[0], (std::set<int64_t>{1, 2, 3, 4, 5, 6}));
  EXPECT_EQ(steps[1], (std::set<int64_t>{5, 6, 7, 8, 9, 10, 11, 12}));
  EXPECT_GT(r.ett, 0.0);
  EXPECT_LE(r.ett, 1.0);
}

// A killed attempt writes no exit line; the next attempt shows it died. Its steps after the
// checkpoint the next attempt resumed from are wasted, like an injected failure's.
TEST(EttLedger, AnAttemptWithoutExitLineThatALaterOneFollowsFailed) {
  EttReport r = analyze_ett(killed_run(true));
  ASSERT_EQ(r.attempts.size(), 2u);
  const EttAttempt& a = r.attempts[0];
  EXPECT_TRUE(a.failed);
  EXPECT_FALSE(a.open);
  EXPECT_FALSE(a.injected);
  EXPECT_EQ(a.failure_step, 4);  // the last step it completed: step 5 began at its last line
  EXPECT_EQ(a.durable_step, 2);
  EXPECT_EQ(a.wasted_steps, 2);
  EXPECT_DOUBLE_EQ(a.seconds(), 0.52);                // up to its last line
  EXPECT_DOUBLE_EQ(leaf(a, Phase::productive), 0.2);  // steps 1 and 2
  EXPECT_DOUBLE_EQ(leaf(a, Phase::wasted), 0.2);      // steps 3 and 4
  EXPECT_DOUBLE_EQ(leaf(a, Phase::checkpoint_blocking), 0.02);
  EXPECT_FALSE(r.attempts[1].failed);
  EXPECT_EQ(r.nof, 1);
  EXPECT_EQ(r.injected, 0);
  ASSERT_EQ(r.ttr.size(), 1u);
  EXPECT_NEAR(r.ttr[0], 0.2 + 0.2, 1e-12);  // wasted + attempt 1's start until its first step
  EXPECT_DOUBLE_EQ(r.wall, 0.52 + 0.5);
  EXPECT_DOUBLE_EQ(r.productive, 0.2 + 0.3);
}

// Without a later attempt the report cannot tell a killed attempt from a running one: it
// is open, counted up to its last line, and neither a failure nor a success.
TEST(EttLedger, TheLastAttemptWithoutExitLineIsOpen) {
  EttReport r = analyze_ett(killed_run(false));
  ASSERT_EQ(r.attempts.size(), 1u);
  const EttAttempt& a = r.attempts[0];
  EXPECT_TRUE(a.open);
  EXPECT_FALSE(a.failed);
  EXPECT_EQ(r.nof, 0);
  EXPECT_DOUBLE_EQ(r.wall, 0.52);
  EXPECT_DOUBLE_EQ(r.productive, 0.4);  // steps 1-4
  EXPECT_EQ(ett_json(r)["attempts"][0]["open"], true);
  // An attempt that exited is not open.
  EXPECT_FALSE(analyze_ett(two_attempt_run()).attempts[1].open);
  // The last attempt's own fault record says how it ended: failed, not open.
  const std::string faulted = killed_run(false);
  line(attempt_path(faulted, 0),
       {{"event", "fault"}, {"t", 530 * ms}, {"rank", 0}, {"step", 5}, {"kind", "kill_at_step"}});
  r = analyze_ett(faulted);
  EXPECT_TRUE(r.attempts[0].failed);
  EXPECT_FALSE(r.attempts[0].open);
  EXPECT_EQ(r.nof, 1);
}

// A kill inside a step's checkpoint wait (the staging copy the step waits for before its
// update, a checkpoint_blocking boundary tagged with the step): the step never completed,
// though its first part has a productive segment.
TEST(EttLedger, AKillInsideAStepsCheckpointWaitLeavesTheStepIncomplete) {
  const std::string run = fixture::temp_dir("tessel-ett-midstep");
  fs::create_directories(ett_dir(run));
  const std::string a0 = attempt_path(run, 0), a1 = attempt_path(run, 1);
  line(a0, {{"event", "attempt"}, {"attempt", 0}, {"t", 0}});
  phase(a0, "productive", 100 * ms, 1);
  phase(a0, "productive", 200 * ms, 2);
  phase(a0, "checkpoint_blocking", 300 * ms);  // saving step 2, between steps
  phase(a0, "productive", 320 * ms, 3);
  phase(a0, "checkpoint_blocking", 350 * ms, 3);  // step 3 waits for the staging copy: killed
  line(a1, {{"event", "attempt"}, {"attempt", 1}, {"t", 1000 * ms}});
  line(a1, {{"event", "resume"}, {"t", 1100 * ms}, {"step", 2}});
  phase(a1, "productive", 1200 * ms, 3);
  line(a1, {{"event", "exit"}, {"t", 1300 * ms}, {"status", 0}});
  const EttAttempt a = analyze_ett(run).attempts[0];
  EXPECT_TRUE(a.failed);
  EXPECT_EQ(a.failure_step, 2);  // not 3
  EXPECT_EQ(a.durable_step, 2);
  EXPECT_EQ(a.wasted_steps, 0);
  EXPECT_DOUBLE_EQ(leaf(a, Phase::wasted), 0.03);  // step 3's first part
}

// A withdrawn start whose log `tessel run` did not get to remove (it died first) is no
// attempt: the report is that of the run without it.
TEST(EttLedger, AWithdrawnLogLeftBehindIsNoAttempt) {
  const std::string run = killed_run(true);
  const EttReport before = analyze_ett(run);
  const std::string log = attempt_path(run, 2);
  line(log, {{"event", "attempt"}, {"attempt", 2}, {"t", 2000 * ms}});
  line(log, {{"event", "withdrawn"}, {"t", 2100 * ms}, {"reason", "nothing to train"}});
  const EttReport r = analyze_ett(run);
  ASSERT_EQ(r.attempts.size(), 2u);
  EXPECT_EQ(r.nof, before.nof);
  EXPECT_DOUBLE_EQ(r.wall, before.wall);
  EXPECT_FALSE(r.attempts[1].failed);
}

// Only a withdrawn start's log: no attempt, refused as a run without logs is (a report of
// "W 0.000 s over 0 attempt(s), ETT 0.00%" was written), and no report file is written.
TEST(EttLedger, OnlyWithdrawnLogsAreNoAttemptToReport) {
  const std::string run = fixture::temp_dir("tessel-ett-withdrawn");
  fs::create_directories(ett_dir(run));
  const std::string log = attempt_path(run, 0);
  line(log, {{"event", "attempt"}, {"attempt", 0}, {"t", 100}});
  line(log, {{"event", "withdrawn"}, {"t", 200}, {"reason", "nothing to train"}});
  EXPECT_TRUE(analyze_ett(run).attempts.empty());
  fixture::expect_input_error(
      [&] { write_ett_report(run); },
      {run + ": no ETT attempt (the logs in " + ett_dir(run) +
       " are all of withdrawn starts, which are no attempts); run `tessel train` or `tessel "
       "run` first"});
  for (const char* name : {"/ett.json", "/ett.html", "/ett_trace.json"})
    EXPECT_FALSE(fs::exists(run + name)) << name;
}

// Failures are numbered among the failures, attempts by their logs: after a successful
// attempt and a withdrawn start, the first failure is attempt 2.
TEST(EttLedger, EachFailureKnowsItsAttempt) {
  const std::string run = fixture::temp_dir("tessel-ett-failures");
  fs::create_directories(ett_dir(run));
  const std::string a0 = attempt_path(run, 0), a1 = attempt_path(run, 1), a2 = attempt_path(run, 2),
                    a3 = attempt_path(run, 3);
  line(a0, {{"event", "attempt"}, {"attempt", 0}, {"t", 0}});
  phase(a0, "productive", 100 * ms, 1);
  line(a0, {{"event", "exit"}, {"t", 200 * ms}, {"status", 0}});
  line(a1, {{"event", "attempt"}, {"attempt", 1}, {"t", 1000 * ms}});
  line(a1, {{"event", "withdrawn"}, {"t", 1100 * ms}, {"reason", "bad input"}});
  line(a2, {{"event", "attempt"}, {"attempt", 2}, {"t", 2000 * ms}});
  phase(a2, "productive", 2100 * ms, 2);
  line(a2, {{"event", "exit"}, {"t", 2200 * ms}, {"status", 137}});
  line(a3, {{"event", "attempt"}, {"attempt", 3}, {"t", 3000 * ms}});
  phase(a3, "productive", 3100 * ms, 2);
  line(a3, {{"event", "exit"}, {"t", 3200 * ms}, {"status", 0}});
  const EttReport r = analyze_ett(run);
  ASSERT_EQ(r.ttr.size(), 1u);
  EXPECT_EQ(r.failed_attempts, std::vector<int>{2});
}

// Attempt 1 dies in its start-up, before any checkpoint load: it tells nothing of what was
// durable. Attempt 0's durable step is the one attempt 2, the first that got to its start,
// resumed from (taking attempt 1's, it counted every step of attempt 0 as wasted).
TEST(EttLedger, AnAttemptThatDiedBeforeItsStartDoesNotDecideTheDurableStep) {
  const std::string run = fixture::temp_dir("tessel-ett-early-death");
  fs::create_directories(ett_dir(run));
  const std::string a0 = attempt_path(run, 0), a1 = attempt_path(run, 1), a2 = attempt_path(run, 2);
  line(a0, {{"event", "attempt"}, {"attempt", 0}, {"t", 0}});
  for (int64_t step = 1; step <= 5; ++step) phase(a0, "productive", step * 100 * ms, step);
  line(a0, {{"event", "exit"}, {"t", 600 * ms}, {"status", 137}});
  line(a1, {{"event", "attempt"}, {"attempt", 1}, {"t", 1000 * ms}});
  phase(a1, "model_build", 1100 * ms);
  line(a1, {{"event", "fault"}, {"t", 1150 * ms}, {"rank", 0}, {"kind", "kill"}});
  line(a1, {{"event", "exit"}, {"t", 1200 * ms}, {"status", 137}});
  line(a2, {{"event", "attempt"}, {"attempt", 2}, {"t", 2000 * ms}});
  phase(a2, "checkpoint_load", 2050 * ms);
  line(a2, {{"event", "resume"}, {"t", 2100 * ms}, {"step", 2}});
  for (int64_t step = 3; step <= 5; ++step)
    phase(a2, "productive", 2000 * ms + step * 100 * ms, step);
  line(a2, {{"event", "exit"}, {"t", 2600 * ms}, {"status", 0}});
  const EttReport r = analyze_ett(run);
  ASSERT_EQ(r.attempts.size(), 3u);
  EXPECT_EQ(r.attempts[0].durable_step, 2);
  EXPECT_EQ(r.attempts[0].failure_step, 4);  // step 5 began at its last boundary
  EXPECT_EQ(r.attempts[0].wasted_steps, 2);
  EXPECT_DOUBLE_EQ(leaf(r.attempts[0], Phase::productive), 0.2);  // steps 1 and 2
  EXPECT_EQ(r.attempts[1].resumed_from, -1);                      // never got to its start
  EXPECT_EQ(r.attempts[1].wasted_steps, 0);
  EXPECT_EQ(r.attempts[2].resumed_from, 2);
  EXPECT_EQ(r.nof, 2);
  // The TTRs partition the time outside productive work (no checkpoint, shutdown or eval
  // here): attempt 1's start-up (0.15 s) goes to attempt 0's TTR, its detection (0.05 s) to
  // its own, never to both.
  EXPECT_DOUBLE_EQ(leaf(r.attempts[1], Phase::failure_detection), 0.05);
  ASSERT_EQ(r.ttr.size(), 2u);
  double ttr_sum = 0;
  for (double t : r.ttr) ttr_sum += t;
  EXPECT_NEAR(r.productive + r.tts + ttr_sum, r.wall, 1e-9);
  // A fresh attempt that trained started from step 0.
  EXPECT_EQ(analyze_ett(killed_run(false)).attempts[0].resumed_from, 0);
}

// A run continued after it finished (more train.steps): no failure preceded attempt 1, so its
// start-up is TTS too, not in any TTR, and W is still partitioned.
TEST(EttLedger, AContinuationOfAFinishedRunCountsItsStartUpAsTts) {
  const std::string run = fixture::temp_dir("tessel-ett-continued");
  fs::create_directories(ett_dir(run));
  const std::string a0 = attempt_path(run, 0), a1 = attempt_path(run, 1);
  // A phase line starts its phase; an attempt starts in scheduling.
  line(a0, {{"event", "attempt"}, {"attempt", 0}, {"t", 0}});
  phase(a0, "model_build", 100 * ms);
  for (int64_t step = 1; step <= 3; ++step)
    phase(a0, "productive", 200 * ms + step * 100 * ms, step);
  line(a0, {{"event", "exit"}, {"t", 600 * ms}, {"status", 0}});
  line(a1, {{"event", "attempt"}, {"attempt", 1}, {"t", 1000 * ms}});
  phase(a1, "checkpoint_load", 1050 * ms);
  line(a1, {{"event", "resume"}, {"t", 1200 * ms}, {"step", 3}});
  for (int64_t step = 4; step <= 5; ++step)
    phase(a1, "productive", 1200 * ms + (step - 4) * 100 * ms, step);
  line(a1, {{"event", "exit"}, {"t", 1400 * ms}, {"status", 0}});
  const EttReport r = analyze_ett(run);
  ASSERT_EQ(r.attempts.size(), 2u);
  EXPECT_EQ(r.nof, 0);
  EXPECT_NEAR(r.productive, 0.5, 1e-9);
  EXPECT_NEAR(r.tts, 0.3 + 0.2, 1e-9);  // each attempt's start until its first step
  double by_phase = 0;
  for (double s : r.tts_by_phase) by_phase += s;
  EXPECT_NEAR(by_phase, r.tts, 1e-9);
  EXPECT_NEAR(r.tts_by_phase[size_t(Phase::checkpoint_load)], 0.15, 1e-9);
  EXPECT_NEAR(r.productive + r.tts, r.wall, 1e-9);
}

// The adaptive checkpoint policies' MTBF: W over the failures that were no user's stop.
TEST(EttLedger, ObservedMtbfLeavesOutStops) {
  EttReport r;
  r.wall = 120;
  EXPECT_EQ(observed_mtbf(r), std::nullopt);
  r.nof = 3;
  r.nof_by_cause = {{"stop", 1}, {"exit_status", 2}};
  EXPECT_EQ(observed_mtbf(r), 60.0);
  r.nof = 1;
  r.nof_by_cause = {{"stop", 1}};
  EXPECT_EQ(observed_mtbf(r), std::nullopt);
}

// Attempt 0 dies in its start-up: its start-up up to the failure is the TTS, its detection the
// TTR of its failure (with attempt 1's start-up), never both; W is partitioned again.
TEST(EttLedger, AFirstAttemptThatDiedBeforeItsFirstStepCountsItsDetectionOnce) {
  const std::string run = fixture::temp_dir("tessel-ett-first-death");
  fs::create_directories(ett_dir(run));
  const std::string a0 = attempt_path(run, 0), a1 = attempt_path(run, 1);
  line(a0, {{"event", "attempt"}, {"attempt", 0}, {"t", 0}});
  phase(a0, "model_build", 300 * ms);
  line(a0, {{"event", "fault"}, {"t", 400 * ms}, {"rank", 0}, {"kind", "kill"}});
  line(a0, {{"event", "exit"}, {"t", 600 * ms}, {"status", 137}});
  line(a1, {{"event", "attempt"}, {"attempt", 1}, {"t", 1000 * ms}});
  phase(a1, "model_build", 1100 * ms);
  for (int64_t step = 1; step <= 3; ++step)
    phase(a1, "productive", 1100 * ms + step * 100 * ms, step);
  line(a1, {{"event", "exit"}, {"t", 1400 * ms}, {"status", 0}});
  const EttReport r = analyze_ett(run);
  ASSERT_EQ(r.attempts.size(), 2u);
  const double detection = leaf(r.attempts[0], Phase::failure_detection);
  EXPECT_GT(detection, 0.0);
  EXPECT_NEAR(r.tts, 0.6 - detection, 1e-9);
  EXPECT_EQ(r.tts_by_phase[size_t(Phase::failure_detection)], 0.0);
  ASSERT_EQ(r.ttr.size(), 1u);
  EXPECT_NEAR(r.ttr[0], detection + 0.2, 1e-9);  // and attempt 1's start-up, to its step 1
  EXPECT_NEAR(r.productive + r.tts + r.ttr[0], r.wall, 1e-9);
}

// A line that does not fit (a full disk; here a file-size limit, which cuts the write short
// as ENOSPC does) is cut off again, and the error says why: the log keeps whole lines.
TEST(EttLedger, ALineThatDoesNotFitLeavesTheLogWholeAndSaysWhy) {
  const std::string run = fixture::temp_dir("tessel-ett-full");
  fs::create_directories(ett_dir(run));
  const std::string log = attempt_path(run, 0);
  line(log, {{"event", "attempt"}, {"attempt", 0}, {"t", 0}});
  const auto before = fs::file_size(log);
  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &saved), 0);
  rlimit limited = saved;
  limited.rlim_cur = rlim_t(before + 10);  // room for 10 bytes of the line
  const auto old_handler = ::signal(SIGXFSZ, SIG_IGN);
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &limited), 0);
  std::string error;
  try {
    append_json_line(log, {{"phase", "productive"}, {"t", 1}, {"step", 1}});
  } catch (const InputError& e) {
    error = e.what();
  }
  ::setrlimit(RLIMIT_FSIZE, &saved);
  ::signal(SIGXFSZ, old_handler);
  EXPECT_NE(error.find(log + ": write failed: " + std::strerror(EFBIG)), std::string::npos)
      << error;
  EXPECT_EQ(fs::file_size(log), before);
  append_json_line(log, {{"event", "exit"}, {"t", 2}, {"status", 0}});  // whole lines after it
  EXPECT_EQ(analyze_ett(run).attempts.at(0).exited, true);
}

// A file where the ledger's directory belongs is an InputError naming it, for the writers
// (tessel train, tessel run) and for the report alike.
TEST(EttLedger, AnEttPathThatIsNoDirectoryIsAnErrorNamingIt) {
  const std::string run = fixture::temp_dir("tessel-ett-file");
  std::ofstream(ett_dir(run)) << "x";
  const std::string want = ett_dir(run) + ": not a directory";
  auto expect_refused = [&](const char* what, auto&& call) {
    try {
      call();
      ADD_FAILURE() << what << ": no error";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << what << ": " << e.what();
    }
  };
  expect_refused("count_attempts", [&] { count_attempts(run); });
  expect_refused("create_ett_dir", [&] { create_ett_dir(run); });
  expect_refused("write_ett_report", [&] { write_ett_report(run); });
  EXPECT_TRUE(fs::is_regular_file(ett_dir(run)));
}

TEST(RunDirLock, ASecondHolderIsRefusedNamingTheDirectory) {
  const std::string run = fixture::temp_dir("tessel-lock") + "/run";
  {
    const RunDirLock held(run, kSupervisorLock);
    try {
      RunDirLock second(run, kSupervisorLock);
      FAIL() << "taken twice";
    } catch (const InputError& e) {
      EXPECT_NE(std::string(e.what()).find(run + ": in use by another tessel run (" + run +
                                           "/supervisor.lock is locked)"),
                std::string::npos)
          << e.what();
    }
    const RunDirLock job(run, kJobLock);  // the other lock is another file
  }
  const RunDirLock again(run, kSupervisorLock);  // released with its holder
}

// A run directory that cannot be created (below a regular file, which stops root too) is bad
// input naming run.dir, not a raw filesystem error.
TEST(RunDirLock, ARunDirectoryThatCannotBeCreatedIsAnInputErrorNamingRunDir) {
  const std::string file = fixture::temp_dir("tessel-lock") + "/file";
  std::ofstream(file) << "x";
  const std::string run = file + "/run";
  try {
    RunDirLock lock(run, kJobLock);
    FAIL() << "created";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("config key 'run.dir' = \"" + run + "\": cannot create"),
              std::string::npos)
        << e.what();
  }
}

// A process that the holder starts (the supervisor's mpirun) does not inherit the lock, so it
// does not keep the directory locked after the holder is gone.
TEST(RunDirLock, AProcessItsHolderStartsDoesNotKeepIt) {
  const std::string run = fixture::temp_dir("tessel-lock");
  pid_t child = 0;
  {
    const RunDirLock held(run, kSupervisorLock);
    const char* argv[] = {"sleep", "60", nullptr};
    ASSERT_EQ(::posix_spawnp(&child, argv[0], nullptr, nullptr, const_cast<char**>(argv), environ),
              0);
  }
  EXPECT_NO_THROW(RunDirLock(run, kSupervisorLock)) << "the child holds it";
  ::kill(child, SIGKILL);
  ::waitpid(child, nullptr, 0);
}

// A plain `tessel train` on a directory that `tessel run` supervises is refused before it
// touches the ledger or the job's lock.
TEST(RunDirLock, APlainTrainingRunOnASupervisedDirectoryIsRefused) {
  const std::string data = fixture::make_dataset(fixture::temp_dir("tessel-lock-data"));
  const std::string run = fixture::temp_dir("tessel-lock-run");
  const RunDirLock supervisor(run, kSupervisorLock);
  comm::SingleCommunicator world;
  try {
    Trainer(fixture::tiny_config(data, run), world);
    FAIL() << "not refused";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(run + "/supervisor.lock is locked"), std::string::npos)
        << e.what();
  }
  EXPECT_FALSE(fs::exists(ett_dir(run)));
  EXPECT_NO_THROW(RunDirLock(run, kJobLock)) << "the refused run kept the job's lock";
}
