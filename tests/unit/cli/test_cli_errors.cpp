// Bad input through the real `tessel` binary: each case exits non-zero with one
// line on stderr that names the file or config field.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>
#include <utility>

#include "support/train_fixture.hpp"
#include "tessel/core/error.hpp"
#include "tessel/train/checkpoint.hpp"
#include "tessel/train/pipeline_profile.hpp"
#include "unit/cli/cli_test_util.hpp"

namespace fs = std::filesystem;
using tessel::kExitDiverged;
using tessel::kExitTtrOverBound;
using tessel::fixture::temp_dir;
using namespace tessel::cli_test;

namespace {

void expect_one_line_error(const Outcome& o, std::initializer_list<std::string> parts) {
  EXPECT_NE(o.exit_code, 0);
  ASSERT_FALSE(o.err.empty());
  EXPECT_EQ(o.err.find('\n'), o.err.size() - 1) << "more than one line:\n" << o.err;
  EXPECT_EQ(o.err.rfind("tessel: error: ", 0), 0u) << o.err;
  for (const auto& p : parts) EXPECT_NE(o.err.find(p), std::string::npos) << o.err;
}

// Every file under `dir`, by path relative to it, with its bytes.
std::map<std::string, std::string> files_under(const std::string& dir) {
  std::map<std::string, std::string> files;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) files[fs::relative(e.path(), dir).string()] = slurp(e.path().string());
  return files;
}

struct CliTest : ::testing::Test {
  static void SetUpTestSuite() {
    data = tessel::fixture::make_dataset(temp_dir("tessel-cli-data"));
  }
  // A tiny training run over the fixture data into `run`.
  static std::string train_args(const std::string& run) { return "train" + settings(run); }
  // Its --set options (`tessel run` passes them on to its job).
  static std::string settings(const std::string& run) {
    return " --set data.path=" + data + " --set run.dir=" + run +
           " --set run.quiet=true --set model.layers=1 --set model.width=32 --set model.heads=2"
           " --set model.max_seq=16 --set train.seq_len=16 --set train.micro_batch=2"
           " --set train.steps=4 --set optim.warmup_steps=1 --set train.sample_tokens=0"
           " --set mfu.peak_gflops=1";
  }
  static std::string data;
};
std::string CliTest::data;

}  // namespace

TEST_F(CliTest, HelpExplainsSubcommandsAndConfigKeys) {
  Outcome o = run_tessel("--help");
  EXPECT_EQ(o.exit_code, 0);
  for (const char* sub : {"prepare", "train", "generate", "bench-gemm", "export", "simulate"})
    EXPECT_NE(o.out.find(sub), std::string::npos) << sub;
  o = run_tessel("train --help-config");
  EXPECT_EQ(o.exit_code, 0);
  EXPECT_NE(o.out.find("model.width"), std::string::npos);
  EXPECT_NE(o.out.find("train.seq_len"), std::string::npos);
  for (const char* key : {"pipeline.schedule", "pipeline.paci_k", "pipeline.layout"})
    EXPECT_NE(o.out.find(key), std::string::npos) << key;
}

TEST_F(CliTest, TrainsResumesAndGenerates) {
  std::string run = temp_dir("tessel-cli-run");
  Outcome o = run_tessel(train_args(run));
  ASSERT_EQ(o.exit_code, 0) << o.err;
  EXPECT_TRUE(fs::exists(run + "/config.toml"));
  EXPECT_TRUE(fs::exists(run + "/metrics.jsonl"));
  EXPECT_TRUE(fs::exists(run + "/checkpoints/latest"));
  // The same command with more steps resumes at step 4 and trains steps 5 and 6.
  o = run_tessel(train_args(run) + " --set train.steps=6");
  ASSERT_EQ(o.exit_code, 0) << o.err;
  std::string metrics = slurp(run + "/metrics.jsonl");
  EXPECT_NE(metrics.find("\"start_step\":4"), std::string::npos) << metrics;
  EXPECT_NE(metrics.find("\"step\":6,"), std::string::npos) << metrics;
  o = run_tessel("generate --run " + run + " --prompt ab --tokens 5 --temperature 0");
  ASSERT_EQ(o.exit_code, 0) << o.err;
  EXPECT_EQ(o.out.rfind("ab", 0), 0u) << o.out;
  EXPECT_EQ(o.out.size(), 2u + 5u + 1u) << o.out;  // prompt, 5 new bytes, newline
  // Under mpirun rank 0 alone generates: the same text, once.
  const Outcome two =
      run_tessel("generate --run " + run + " --prompt ab --tokens 5 --temperature 0", 2);
  ASSERT_EQ(two.exit_code, 0) << two.err;
  EXPECT_EQ(two.out, o.out);
}

// Bad sampling options and a missing run are refused before anything is printed to stdout.
TEST_F(CliTest, GenerateRefusesBadInputBeforePrinting) {
  std::string run = temp_dir("tessel-cli-gen");
  ASSERT_EQ(run_tessel(train_args(run)).exit_code, 0);
  for (const char* bad :
       {"--temperature -1", "--temperature nan", "--temperature inf", "--top-k -5"}) {
    SCOPED_TRACE(bad);
    const Outcome o = run_tessel("generate --run " + run + " --prompt ab " + bad);
    EXPECT_EQ(o.out, "");
    expect_one_line_error(o, {"generate:"});
  }
  // A finite temperature beyond the float range is named as given, not as the inf it becomes.
  const Outcome huge = run_tessel("generate --run " + run + " --prompt ab --temperature 1e300");
  EXPECT_EQ(huge.out, "");
  expect_one_line_error(huge, {"temperature = 1e+300 is outside the float range"});
  // Its sign is checked before it becomes a float, where -1e-50 would be -0.
  const Outcome tiny = run_tessel("generate --run " + run + " --prompt ab --temperature=-1e-50");
  EXPECT_EQ(tiny.out, "");
  expect_one_line_error(tiny, {"generate: temperature = -1e-50 must be a finite number >= 0"});
  const Outcome o = run_tessel("generate --run " + run + "/nowhere --prompt ab");
  EXPECT_EQ(o.out, "");
  expect_one_line_error(o, {run + "/nowhere: no such run directory or checkpoint"});
}

// An MFU above 100 % means the GEMM peak is too low: said once, on the first such step; a
// plausible peak says nothing. The low peak is 0.01 GFLOP/s, so that even a slow, shared
// machine's first step is far above 100 % (1 GFLOP/s gave 87 % on one CI machine).
TEST_F(CliTest, AnMfuAboveOneHundredPercentIsWarnedOnce) {
  std::string run = temp_dir("tessel-cli-mfu");
  // A peak of 1 kFLOP/s: no step of this model is that slow, however loaded the machine (0.01
  // GFLOP/s was, under a parallel build).
  Outcome o = run_tessel(train_args(run) + " --set run.quiet=false --set mfu.peak_gflops=1e-6");
  ASSERT_EQ(o.exit_code, 0) << o.err;
  const std::string warning = "% is above 100%: the GEMM peak of 1e-06 GFLOP/s per rank is too low";
  const size_t at = o.out.find(warning);
  ASSERT_NE(at, std::string::npos) << o.out;
  EXPECT_EQ(o.out.find(warning, at + 1), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("warning: step 1: MFU"), std::string::npos) << o.out;
  o = run_tessel(train_args(temp_dir("tessel-cli-mfu")) +
                 " --set run.quiet=false --set mfu.peak_gflops=1e9");
  ASSERT_EQ(o.exit_code, 0) << o.err;
  EXPECT_EQ(o.out.find("above 100%"), std::string::npos) << o.out;
}

// More threads than cores: the start line warns and advises run.threads (with one thread per
// rank it would advise fewer ranks; that needs more ranks than this machine's cores).
TEST_F(CliTest, MoreThreadsThanCoresAreWarnedAbout) {
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  if (cores >= 64) GTEST_SKIP() << "OpenBLAS caps the threads at 64";
  const Outcome o =
      run_tessel(train_args(temp_dir("tessel-cli-threads")) +
                 " --set run.quiet=false --set run.threads=" + std::to_string(cores + 1));
  ASSERT_EQ(o.exit_code, 0) << o.err;
  EXPECT_NE(o.out.find("(warning: 1 rank(s) x " + std::to_string(cores + 1) +
                       " thread(s) on this machine's " + std::to_string(cores) +
                       " cores; expect slow steps, set run.threads)"),
            std::string::npos)
      << o.out;
}

// Experts sharded over 2 ranks (ep = 2): the end-of-run sample runs through the ep exchange,
// and `generate` on one process loads the checkpoint (each expert saved once) and, greedy,
// produces the same text as the sample.
TEST_F(CliTest, ExpertShardedRunSamplesAndGeneratesTheSameOnOneProcess) {
  std::string run = temp_dir("tessel-cli-ep");
  Outcome o = run_tessel(train_args(run) +
                             " --set run.quiet=false --set model.moe_layers=all"
                             " --set model.moe_experts=4 --set parallel.ep=2"
                             " --set train.sample_tokens=6 --set train.sample_prompt=ab"
                             " --set train.sample_temperature=0",
                         2);
  ASSERT_EQ(o.exit_code, 0) << o.err;
  const size_t at = o.out.find("sample:\n");
  ASSERT_NE(at, std::string::npos) << o.out;
  const std::string sample = o.out.substr(at + 8, 2 + 6);
  o = run_tessel("generate --run " + run + " --prompt ab --tokens 6 --temperature 0");
  ASSERT_EQ(o.exit_code, 0) << o.err;
  EXPECT_EQ(o.out, sample + "\n");
}

// A 2-stage 1F1B run, then the simulator fed its measured stage costs: every schedule is
// simulated, PACI without the flush bubble is not slower. With a link latency and bandwidth each
// message (the micro-batch's f32 residual stream) takes latency + bytes / bandwidth, and the
// simulator gets that link with the run's costs. A run without a pipeline has no stage costs: one
// line says so.
TEST_F(CliTest, SimulatesSchedulesFromAPipelineRunsCosts) {
  std::string run = temp_dir("tessel-cli-pp");
  Outcome o = run_tessel(train_args(run) +
                             " --set model.layers=2 --set parallel.pp=2 --set train.accum=2"
                             " --set pipeline.schedule=1f1b --set model.tied_head=false",
                         2);
  ASSERT_EQ(o.exit_code, 0) << o.err;
  o = run_tessel("simulate " + run + " --skip 1 --steps 20 --json");
  ASSERT_EQ(o.exit_code, 0) << o.err;
  const auto j = nlohmann::json::parse(o.out);
  EXPECT_EQ(j["run"]["schedule"], "1f1b");
  EXPECT_EQ(j["run"]["micro_batches"], 2);
  EXPECT_EQ(j["run"]["averaged_steps"], nlohmann::json::array({2, 4}));
  ASSERT_EQ(j["stage_costs"].size(), 2u);
  for (const auto& c : j["stage_costs"])
    for (const char* part : {"forward", "backward", "step"}) EXPECT_GT(c[part], 0.0) << part;
  for (const char* s : {"gpipe", "1f1b", "paci"}) EXPECT_GT(j["simulated"][s]["step_seconds"], 0.0);
  // Never slower; strictly faster only when the measured costs leave a bubble to remove (a
  // loaded machine's costs can put all of a step on one stage's chain: both were equal once).
  // The simulator's unit tests show PACI strictly faster on set costs.
  EXPECT_LE(j["simulated"]["paci"]["step_seconds"], j["simulated"]["1f1b"]["step_seconds"]);
  EXPECT_GE(j["simulated"]["paci"]["throughput_vs_1f1b"], 1.0);
  EXPECT_EQ(j["link"]["seconds_per_message"], 0.0);
  // Interleaved (M = 2 divisible by P = 2; --chunks default v = 2). Not compared with 1F1B on
  // the measured costs: with stages far enough out of balance it can be the slower (the
  // simulator finds 1.02x at P = M = v = 2 for F, B, step = 0.58, 2.5, 0.12 and 0.39, 0.30,
  // 0.69). On the stages' mean costs, uniform, the closed forms per step are
  // (M + (P - 1) / v)(F + B) + step against 1F1B's (M + P - 1)(F + B) + step: never slower.
  EXPECT_EQ(j["chunks"], 2);
  EXPECT_GT(j["simulated"]["interleaved"]["step_seconds"], 0.0);
  tessel::pipeline::StageCosts mean{0, 0, 0, 0};
  for (const auto& c : j["stage_costs"]) {
    mean.forward += c["forward"].get<double>() / 2;
    mean.backward += c["backward"].get<double>() / 2;
    mean.step += c["step"].get<double>() / 2;
  }
  const auto uniform = tessel::train::simulate_schedules({mean, mean}, 2, 20);
  auto uniform_step = [&](const std::string& name) {
    for (const auto& s : uniform)
      if (s.name == name) return s.step_seconds;
    ADD_FAILURE() << "no " << name;
    return 0.0;
  };
  const double work = mean.forward + mean.backward;
  // 1e-9 relative: sums of 20 steps' op times.
  EXPECT_NEAR(uniform_step("interleaved"), 2.5 * work + mean.step, 1e-9 * work);
  EXPECT_NEAR(uniform_step("1f1b"), 3 * work + mean.step, 1e-9 * work);
  EXPECT_LT(uniform_step("interleaved"), uniform_step("1f1b"));
  // M = 3 is not divisible by P = 2: no interleaved row, one line saying why.
  o = run_tessel("simulate " + run + " --skip 1 --steps 20 --micro-batches 3");
  ASSERT_EQ(o.exit_code, 0) << o.err;
  EXPECT_NE(o.out.find("interleaved: not simulated, 3 micro-batches per step are not divisible "
                       "by the 2 stages"),
            std::string::npos)
      << o.out;
  o = run_tessel("simulate " + run + " --skip 1 --steps 20 --micro-batches 3 --json");
  ASSERT_EQ(o.exit_code, 0) << o.err;
  EXPECT_FALSE(nlohmann::json::parse(o.out)["simulated"].contains("interleaved"));

  o = run_tessel("simulate " + run +
                 " --skip 1 --steps 20 --json --link-latency 0.01 --link-bandwidth 1e6");
  ASSERT_EQ(o.exit_code, 0) << o.err;
  const auto linked = nlohmann::json::parse(o.out);
  const double bytes = linked["link"]["message_bytes"];
  EXPECT_GT(bytes, 0.0);
  const double message = linked["link"]["seconds_per_message"];
  EXPECT_DOUBLE_EQ(message, 0.01 + bytes / 1e6);
  // The printed costs fed to the simulator with that link give the printed step times.
  std::vector<tessel::pipeline::StageCosts> costs;
  for (const auto& c : linked["stage_costs"])
    costs.push_back({.forward = c["forward"],
                     .backward = c["backward"],
                     .step = c["step"],
                     .weight = c["weight"]});
  const auto sims = tessel::train::simulate_schedules(
      costs, 2, 20, {.latency = 0.01, .bandwidth = 1e6, .bytes = bytes});
  for (const auto& s : sims)
    EXPECT_DOUBLE_EQ(linked["simulated"][s.name]["step_seconds"].get<double>(), s.step_seconds)
        << s.name;
  // A step's longest path crosses the link at most twice (fill and drain), so GPipe's step grows
  // by at most 2 messages; exactly 2 only when no stage's own work hides a message (the measured
  // costs decide: once a stage's optimizer step outlasted the other's step + forward by 6 µs).
  const double gpipe = j["simulated"]["gpipe"]["step_seconds"];
  const double gpipe_linked = linked["simulated"]["gpipe"]["step_seconds"];
  EXPECT_GE(gpipe_linked, gpipe);
  EXPECT_LE(gpipe_linked, gpipe + 2 * message + 1e-12);

  // An interleaved run's records name its chunks, which simulate takes as its default v.
  const std::string interleaved = temp_dir("tessel-cli-ppi");
  o = run_tessel(train_args(interleaved) +
                     " --set model.layers=4 --set parallel.pp=2 --set train.accum=2"
                     " --set pipeline.schedule=interleaved --set pipeline.chunks=3"
                     " --set model.tied_head=false",
                 2);
  ASSERT_EQ(o.exit_code, 0) << o.err;
  o = run_tessel("simulate " + interleaved + " --skip 1 --steps 20 --json");
  ASSERT_EQ(o.exit_code, 0) << o.err;
  const auto from_interleaved = nlohmann::json::parse(o.out);
  EXPECT_EQ(from_interleaved["run"]["schedule"], "interleaved");
  EXPECT_EQ(from_interleaved["run"]["chunks"], 3);
  EXPECT_EQ(from_interleaved["chunks"], 3);
  std::vector<tessel::pipeline::StageCosts> own;
  for (const auto& c : from_interleaved["stage_costs"])
    own.push_back({.forward = c["forward"], .backward = c["backward"], .step = c["step"]});
  for (const auto& s : tessel::train::simulate_schedules(own, 2, 20, {}, 3))
    if (s.name == "interleaved") {
      EXPECT_DOUBLE_EQ(from_interleaved["simulated"]["interleaved"]["step_seconds"].get<double>(),
                       s.step_seconds);
    }
  expect_one_line_error(run_tessel("simulate " + interleaved + " --chunks 1"),
                        {"--chunks", "got 1"});

  std::string plain = temp_dir("tessel-cli-plain");
  ASSERT_EQ(run_tessel(train_args(plain)).exit_code, 0);
  expect_one_line_error(run_tessel("simulate " + plain), {"not a pipeline run"});
}

// What simulate cannot do is said, not done: interleaving at one stage (no neighbour to send
// to), a simulation too large to hold, a malformed record, an empty RUN_DIR (which would be /).
TEST_F(CliTest, SimulateRefusesWhatItCannotModel) {
  const std::string run = temp_dir("tessel-cli-pp1");
  std::ofstream(run + "/config.toml") << "[pipeline]\nschedule = \"1f1b\"\n[train]\naccum = 4\n";
  std::ofstream metrics(run + "/metrics.jsonl");
  metrics << R"({"event": "start", "start_step": 0})"
          << "\n";
  for (int step = 1; step <= 2; ++step)
    metrics << nlohmann::json{{"step", step},
                              {"loss", 1.0},
                              {"step_seconds", 1.3},
                              {"pipeline",
                               {{"schedule", "1f1b"},
                                {"stages",
                                 {{{"forward_seconds", 0.4},
                                   {"backward_seconds", 0.8},
                                   {"optimizer_seconds", 0.1}}}}}}}
                   .dump()
            << "\n";
  metrics.close();
  Outcome o = run_tessel("simulate " + run + " --skip 0 --link-latency 1");
  ASSERT_EQ(o.exit_code, 0) << o.err;
  EXPECT_NE(o.out.find("interleaved: not simulated, it needs at least 2 stages (the run has 1)"),
            std::string::npos)
      << o.out;
  o = run_tessel("simulate " + run + " --skip 0 --json");
  ASSERT_EQ(o.exit_code, 0) << o.err;
  EXPECT_FALSE(nlohmann::json::parse(o.out)["simulated"].contains("interleaved"));
  expect_one_line_error(run_tessel("simulate " + run + " --skip 0 --micro-batches 1048576"),
                        {"simulate: 100 steps of 1048576 micro-batches on 1 stages are",
                         "more than the simulator's 4194304", "lower --steps or --micro-batches"});
  // Never an inf or NaN step, bubble or throughput (exit 0): a link too slow (1e-300 bytes/s
  // made each message take ~1e304 s) is refused by --link-bandwidth's range, 0 still turns
  // transfers off; measured costs whose sums overflow, or that are all 0 (a 0/0 throughput
  // against 1F1B), by the simulator.
  o = run_tessel("simulate " + run + " --skip 0 --link-bandwidth 1e-300");
  EXPECT_EQ(o.exit_code, 105) << o.err;  // CLI11's ValidationError
  for (const char* part : {"--link-bandwidth: Value 1e-300 not in range 1.000000 to", "(or 0)"})
    EXPECT_NE(o.err.find(part), std::string::npos) << o.err;
  EXPECT_EQ(run_tessel("simulate " + run + " --skip 0 --link-bandwidth 0").exit_code, 0);
  const std::string metrics_text = slurp(run + "/metrics.jsonl");
  for (const auto& [costs, error] :
       {std::pair{"1e307", "pipeline simulator: the simulated gpipe makespan is not finite"},
        std::pair{"0",
                  "simulate: the simulated gpipe step takes 0 s: the stage costs are all 0"}}) {
    std::string text = metrics_text;
    for (const char* time : {"0.4", "0.8", "0.1"})
      for (size_t at; (at = text.find(std::string(":") + time)) != std::string::npos;)
        text.replace(at + 1, std::strlen(time), costs);
    std::ofstream(run + "/metrics.jsonl") << text;
    o = run_tessel("simulate " + run + " --skip 0");
    EXPECT_EQ(o.exit_code, 2);
    expect_one_line_error(o, {error});
  }
  std::ofstream(run + "/metrics.jsonl") << metrics_text;
  std::ofstream(run + "/metrics.jsonl", std::ios::app) << R"({"step": 3, "lo)"
                                                       << "\n{}\n";
  expect_one_line_error(run_tessel("simulate " + run + " --skip 0"),
                        {run + "/metrics.jsonl:4: malformed metrics record"});
  for (const char* command : {"simulate ''", "ett-report ''"}) {
    o = run_tessel(command);
    EXPECT_NE(o.exit_code, 0) << command;
    EXPECT_EQ(o.err.rfind("RUN_DIR: must name a directory\n", 0), 0u) << o.err;
  }
}

TEST_F(CliTest, UnknownConfigKey) {
  expect_one_line_error(run_tessel(train_args(temp_dir("r")) + " --set model.widht=3"),
                        {"model.widht"});
  std::string dir = temp_dir("tessel-cli-cfg");
  std::ofstream(dir + "/bad.toml") << "[train]\nstep = 3\n";
  expect_one_line_error(run_tessel("train --config " + dir + "/bad.toml"),
                        {"bad.toml", "train.step"});
}

TEST_F(CliTest, MissingOrCorruptConfig) {
  expect_one_line_error(run_tessel("train --config /nonexistent.toml"), {"/nonexistent.toml"});
  std::string dir = temp_dir("tessel-cli-cfg");
  std::ofstream(dir + "/broken.toml") << "[model\n";
  expect_one_line_error(run_tessel("train --config " + dir + "/broken.toml"), {"broken.toml:1"});
  // An empty path (an unset "$CFG") names no file: not the default config (CLI11's message).
  for (const char* command : {"train --config ''", "run --config ''"}) {
    const Outcome o = run_tessel(command);
    EXPECT_NE(o.exit_code, 0) << command;
    EXPECT_EQ(o.out, "") << command;
    EXPECT_EQ(o.err.rfind("--config: must name a file\n", 0), 0u) << command << ": " << o.err;
  }
}

TEST_F(CliTest, MissingDataset) {
  expect_one_line_error(
      run_tessel(train_args(temp_dir("r")) + " --set data.path=/nonexistent/data"),
      {"/nonexistent/data/train.tok", "tessel prepare"});
}

TEST_F(CliTest, CorruptDataset) {
  std::string dir = temp_dir("tessel-cli-bad-data");
  fs::copy(data + "/val.tok", dir + "/val.tok");
  std::ofstream(dir + "/train.tok") << "this is not a shard";
  expect_one_line_error(run_tessel(train_args(temp_dir("r")) + " --set data.path=" + dir),
                        {dir + "/train.tok"});
}

TEST_F(CliTest, CorruptCheckpoint) {
  std::string run = temp_dir("tessel-cli-run");
  ASSERT_EQ(run_tessel(train_args(run)).exit_code, 0);
  std::string ckpt = run + "/checkpoints/step-00000004";
  {
    std::fstream f(ckpt + "/model-00000-of-00001.safetensors",
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-3, std::ios::end);
    f.put('\x7f');
  }
  expect_one_line_error(run_tessel(train_args(run) + " --set train.steps=6"),
                        {"model-00000-of-00001.safetensors", "checksum"});
  expect_one_line_error(run_tessel("generate --run " + run), {"model-00000-of-00001.safetensors"});
}

// generate, eval and export read and verify the manifest and model files only: a damaged
// optimizer file, which a resume refuses, does not stop them (docs/training.md, "Export").
TEST_F(CliTest, ADamagedOptimizerFileStopsAResumeOnly) {
  const std::string run = temp_dir("tessel-cli-optimizer");
  ASSERT_EQ(run_tessel(train_args(run)).exit_code, 0);
  {
    std::fstream f(run + "/checkpoints/step-00000004/optimizer-00000-of-00001.safetensors",
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-3, std::ios::end);
    f.put('\x7f');
  }
  expect_one_line_error(run_tessel(train_args(run) + " --set train.steps=6"),
                        {"optimizer-00000-of-00001.safetensors", "checksum"});
  for (const std::string& command :
       {"generate --run " + run + " --prompt ab --tokens 2", "eval --run " + run,
        "export " + run + " " + temp_dir("tessel-cli-optimizer-out")}) {
    const Outcome o = run_tessel(command);
    EXPECT_EQ(o.exit_code, 0) << command << ": " << o.err;
  }
}

TEST_F(CliTest, MissingCheckpoint) {
  std::string run = temp_dir("tessel-cli-run");
  expect_one_line_error(run_tessel("generate --run " + run), {run, "neither a run directory"});
  // A live run before its first checkpoint is named as one, by generate and export alike.
  std::ofstream(run + "/config.toml") << "[train]\nsteps = 4\n";
  for (const std::string& command : {"generate --run " + run, "export " + run + " " + run + "/out"})
    expect_one_line_error(run_tessel(command), {run + ": the run has no checkpoint yet"});
  fs::remove(run + "/config.toml");
  fs::create_directories(run + "/checkpoints");
  expect_one_line_error(run_tessel("generate --run " + run), {run, "no complete checkpoint"});
  ASSERT_EQ(run_tessel(train_args(run)).exit_code, 0);
  // One checkpoint directory works as well as its run directory.
  const Outcome from_run = run_tessel("generate --run " + run + " --tokens 4 --temperature 0");
  const Outcome from_checkpoint =
      run_tessel("generate --run " + run + "/checkpoints/step-00000004 --tokens 4 --temperature 0");
  ASSERT_EQ(from_checkpoint.exit_code, 0) << from_checkpoint.err;
  EXPECT_EQ(from_checkpoint.out, from_run.out);
  fs::remove(run + "/checkpoints/step-00000004/optimizer-00000-of-00001.safetensors");
  expect_one_line_error(run_tessel(train_args(run) + " --set train.steps=6"),
                        {"optimizer-00000-of-00001.safetensors", "missing"});
}

// A start rejected for bad input is no attempt of the job: it leaves no ETT record (which
// would count as a failure), and a run with nothing to train rewrites neither config.toml nor
// metrics.jsonl, nor adds an attempt (its start-up would grow W on every call).
TEST_F(CliTest, RejectedAndEmptyStartsLeaveTheRunAsItWas) {
  std::string run = temp_dir("tessel-cli-run");
  ASSERT_EQ(run_tessel(train_args(run)).exit_code, 0);
  const std::string config = slurp(run + "/config.toml"), metrics = slurp(run + "/metrics.jsonl");
  // Rejected while resuming (another model), and while building (no data).
  expect_one_line_error(run_tessel(train_args(run) + " --set model.width=64 --set train.steps=6"),
                        {"model"});
  expect_one_line_error(run_tessel(train_args(run) + " --set data.path=/nonexistent/data"),
                        {"/nonexistent/data/train.tok"});
  EXPECT_TRUE(fs::exists(run + "/ett/attempt-0000.jsonl"));
  EXPECT_FALSE(fs::exists(run + "/ett/attempt-0001.jsonl")) << "a rejected start was recorded";
  Outcome o = run_tessel("ett-report " + run);
  ASSERT_EQ(o.exit_code, 0) << o.err;
  EXPECT_NE(o.out.find("NoF 0"), std::string::npos) << o.out;
  // Nothing to train: the run's files stay as they were, and no sample is drawn.
  o = run_tessel(train_args(run) +
                 " --set train.steps=2 --set run.quiet=false --set train.sample_tokens=5");
  ASSERT_EQ(o.exit_code, 0) << o.err;
  EXPECT_NE(o.out.find("nothing to train"), std::string::npos) << o.out;
  EXPECT_EQ(o.out.find("sample:"), std::string::npos) << o.out;
  EXPECT_EQ(slurp(run + "/config.toml"), config);
  EXPECT_EQ(slurp(run + "/metrics.jsonl"), metrics);
  EXPECT_FALSE(fs::exists(run + "/ett/attempt-0001.jsonl")) << "an empty start was recorded";
  // A fresh directory rejected at once keeps no ett/ either.
  const std::string fresh = temp_dir("tessel-cli-run");
  expect_one_line_error(run_tessel(train_args(fresh) + " --set data.path=/nonexistent/data"),
                        {"/nonexistent/data/train.tok"});
  EXPECT_FALSE(fs::exists(fresh + "/ett"));
}

// A file where the run's ETT ledger belongs is bad input, not an internal error: each command
// that reads or writes the ledger names it.
TEST_F(CliTest, AnEttPathThatIsAFileIsNamed) {
  const std::string run = temp_dir("tessel-cli-ettfile");
  std::ofstream(run + "/ett") << "x";
  for (const std::string& args :
       {train_args(run), "run --np 1 --threads 1" + settings(run), "ett-report " + run}) {
    SCOPED_TRACE(args.substr(0, args.find(' ')));
    const Outcome o = run_tessel(args);
    EXPECT_EQ(o.exit_code, 2);
    expect_one_line_error(o, {run + "/ett: not a directory"});
  }
  EXPECT_EQ(slurp(run + "/ett"), "x");
}

// --max-ttr names each failure over the bound by the index of its attempt: the first failure
// here is attempt 1, after a successful attempt 0 (TTR: its 0.1 s step, wasted, and the 0.5 s
// attempt 2 took to its first step).
TEST_F(CliTest, MaxTtrNamesTheAttemptOfEachFailure) {
  const std::string run = temp_dir("tessel-cli-ttr");
  fs::create_directories(run + "/ett");
  auto log = [&](const char* name, std::initializer_list<const char*> lines) {
    std::ofstream out(run + "/ett/" + name);
    for (const char* l : lines) out << l << "\n";
  };
  log("attempt-0000.jsonl", {R"({"event":"attempt","attempt":0,"t":0})",
                             R"({"phase":"productive","t":100000000,"step":1})",
                             R"({"event":"exit","t":200000000,"status":0})"});
  log("attempt-0001.jsonl", {R"({"event":"attempt","attempt":1,"t":1000000000})",
                             R"({"phase":"productive","t":1100000000,"step":2})",
                             R"({"event":"exit","t":1200000000,"status":137})"});
  log("attempt-0002.jsonl", {R"({"event":"attempt","attempt":2,"t":2000000000})",
                             R"({"phase":"productive","t":2500000000,"step":2})",
                             R"({"event":"exit","t":2600000000,"status":0})"});
  const Outcome o = run_tessel("ett-report --max-ttr 0.1 " + run);
  EXPECT_EQ(o.exit_code, kExitTtrOverBound);
  EXPECT_EQ(o.err, "tessel: TTR of failure 1 (attempt 1) was 0.600 s, over --max-ttr 0.100 s\n");
}

// Under `tessel run` a relaunch resumes from the newest checkpoint: a run that saves none
// before its end is warned once at start that a relaunch starts from step 0.
TEST_F(CliTest, ASupervisedRunWithoutInterimCheckpointsIsWarned) {
  const std::string warning = "relaunch after a failure starts again from step 0";
  auto warnings = [&](const std::string& args) {
    const Outcome o = run_tessel(args + " --set run.quiet=false");
    EXPECT_EQ(o.exit_code, 0) << o.err;
    size_t n = 0;
    for (size_t at = o.out.find(warning); at != std::string::npos; at = o.out.find(warning, at + 1))
      ++n;
    return n;
  };
  EXPECT_EQ(warnings("run --np 1 --threads 1" + settings(temp_dir("sup"))), 1u);
  EXPECT_EQ(warnings("run --np 1 --threads 1" + settings(temp_dir("sup")) +
                     " --set train.checkpoint_every=2"),
            0u);
  EXPECT_EQ(warnings(train_args(temp_dir("plain"))), 0u);  // nothing relaunches it
}

// A mesh the world cannot hold, or a fault rank outside it, is refused before the run
// directory is locked or written.
TEST_F(CliTest, WorldSizeNotMatchingTheMesh) {
  const std::string run = temp_dir("r") + "/run";
  expect_one_line_error(run_tessel(train_args(run) + " --set parallel.dp=2"),
                        {"parallel.dp", "world has 1"});
  // With dp = 0 (world / (pp x cp)) the world must divide: no dp would do.
  expect_one_line_error(run_tessel(train_args(run) + " --set parallel.cp=2"),
                        {"mesh pp=1 x cp=2 needs a multiple of 2 processes", "world has 1"});
  expect_one_line_error(run_tessel(train_args(run) + " --set fault.kill_rank=1"),
                        {"'fault.kill_rank' = 1 is not a rank of this job (world size 1)"});
  EXPECT_FALSE(fs::exists(run));
}

// parallel.ep > 1 on a dense model is allowed, and warned about once: it shards nothing.
TEST_F(CliTest, ExpertParallelismOnADenseModelIsWarned) {
  const Outcome o = run_tessel(train_args(temp_dir("dense-ep")) + " --set parallel.ep=2", 2);
  ASSERT_EQ(o.exit_code, 0) << o.err;
  const std::string warning =
      "tessel: warning: parallel.ep = 2 on a model without MoE blocks (model.moe_layers) shards "
      "nothing";
  const size_t at = o.err.find(warning);
  EXPECT_NE(at, std::string::npos) << o.err;
  EXPECT_EQ(o.err.find(warning, at + 1), std::string::npos) << "warned by more than one rank";
}

// Over 1000 gradient buckets (each a latency-bound all-reduce per step) are warned about once;
// the default 4 MiB, or one rank (nothing to reduce), is not.
TEST_F(CliTest, ManyGradientBucketsAreWarned) {
  const std::string tiny_buckets = " --set parallel.bucket_mb=0.00002";
  const Outcome many = run_tessel(train_args(temp_dir("buckets")) + tiny_buckets, 2);
  ASSERT_EQ(many.exit_code, 0) << many.err;
  const std::string warning = "tessel: warning: parallel.bucket_mb = 2e-05 cuts rank 0's ";
  const size_t at = many.err.find(warning);
  EXPECT_NE(at, std::string::npos) << many.err;
  EXPECT_NE(many.err.find(" all-reduces per step", at), std::string::npos) << many.err;
  EXPECT_EQ(many.err.find(warning, at + 1), std::string::npos) << "warned by more than one rank";
  for (const auto& [args, ranks] : {std::pair{std::string(), 2}, std::pair{tiny_buckets, 1}}) {
    const Outcome o = run_tessel(train_args(temp_dir("buckets")) + args, ranks);
    ASSERT_EQ(o.exit_code, 0) << o.err;
    EXPECT_EQ(o.err.find("all-reduces per step"), std::string::npos) << ranks << args << o.err;
  }
}

TEST_F(CliTest, BadInputOnSeveralRanksIsStillOneLine) {
  expect_one_line_error(run_tessel(train_args(temp_dir("r")) + " --set parallel.dp=3", 2),
                        {"parallel.dp", "world has 2"});
}

// A learning rate of 1e30 makes step 2's gradient NaN: training stops before the update with
// exit status 4 (which `tessel run` does not relaunch) and one line naming the step, on one
// process, with data parallelism and with a pipeline (whose stages share one norm). Step 1's
// checkpoint, still being written when step 2 diverged, is committed first and named: it is
// what a resume with a lower learning rate starts from.
TEST_F(CliTest, ADivergedRunStopsWithItsOwnExitStatus) {
  const std::string diverge =
      " --set optim.lr=1e30 --set optim.weight_decay=0 --set train.checkpoint_every=1";
  for (const auto& [ranks, extra, where] :
       {std::tuple{1, "", "step 2's gradient norm is NaN"},
        std::tuple{2, "", "step 2's gradient norm is NaN"},
        std::tuple{2, " --set parallel.pp=2 --set model.layers=2",
                   "step 2: stage 0's gradient norm is NaN"}}) {
    SCOPED_TRACE(std::to_string(ranks) + " rank(s)" + extra);
    const std::string run = temp_dir("r");
    const Outcome o = run_tessel(train_args(run) + diverge + extra, ranks);
    EXPECT_EQ(o.exit_code, kExitDiverged);
    expect_one_line_error(o, {where, "stopping before the update",
                              "newest checkpoint: " + run + "/checkpoints/step-00000001"});
    EXPECT_TRUE(fs::exists(run + "/checkpoints/step-00000001/manifest.json"));
    // With one step there is no next gradient norm: the validation loss stops the run before
    // the broken model is saved (min_lr too: a one-step cosine schedule ends there).
    const std::string last = temp_dir("r");
    const Outcome one = run_tessel(
        train_args(last) + diverge +
            " --set train.steps=1 --set optim.warmup_steps=0 --set optim.min_lr=1e30" + extra,
        ranks);
    EXPECT_EQ(one.exit_code, kExitDiverged) << one.err;
    expect_one_line_error(one, {"step 1's validation loss is", "stopping before its checkpoint"});
    EXPECT_FALSE(fs::exists(last + "/checkpoints/step-00000001"));
    // The ETT log's exit line records the same status (it said 1 for every failure).
    EXPECT_NE(slurp(run + "/ett/attempt-0000.jsonl").find("\"status\":4"), std::string::npos);
  }
}

// Router logits that overflow under quantile balancing stop the run in a micro-batch's
// backward, on the rank that met them, before any gradient norm: the error still names the
// step (and the stage of a pipeline) and the newest checkpoint, with exit status 4. The last
// stage's backward runs first, so its rank reports.
TEST_F(CliTest, AnOverflowingMoeRouterStopsNamingTheStep) {
  const std::string moe =
      " --set model.layers=2 --set model.moe_layers=all --set model.moe_experts=4"
      " --set model.moe_top_k=2 --set model.moe_score=sigmoid --set model.moe_balance=eqb"
      " --set model.init_std=1e38";
  for (const auto& [ranks, extra, error] :
       {std::tuple{1, "", "tessel: error: step 1: the MoE router's logits are not finite"},
        std::tuple{2, " --set parallel.pp=2",
                   "tessel: error (rank 1): step 1: stage 1: the MoE router's logits"}}) {
    SCOPED_TRACE(std::to_string(ranks) + " rank(s)" + extra);
    const Outcome o = run_tessel(train_args(temp_dir("r")) + moe + extra, ranks);
    EXPECT_EQ(o.exit_code, kExitDiverged);
    EXPECT_EQ(o.err.rfind(error, 0), 0u) << o.err;
    EXPECT_NE(o.err.find("(newest checkpoint: none; a lower optim.lr"), std::string::npos) << o.err;
  }
}

// A checkpoint whose weights hold NaN (saved here, as no run saves one: its validation stops it
// first) is refused by generate and eval as a diverged model, naming the checkpoint and step,
// not sampled as text or evaluated to a loss of nan.
TEST_F(CliTest, AModelWithNanWeightsStopsGenerateAndEval) {
  const std::string run = temp_dir("r"), broken = temp_dir("broken");
  ASSERT_EQ(run_tessel(train_args(run)).exit_code, 0);
  auto content = tessel::train::CheckpointStore::load(run + "/checkpoints/step-00000004",
                                                      tessel::train::CheckpointParts::model);
  for (auto& t : content.model)
    std::fill(t.tensor.f32(), t.tensor.f32() + t.tensor.numel(), std::nanf(""));
  tessel::comm::SingleCommunicator self;
  tessel::train::CheckpointStore(broken + "/checkpoints", 2).save(self, content);
  const std::string checkpoint = broken + "/checkpoints/step-00000004 (step 4): ";
  Outcome o = run_tessel("generate --run " + broken + " --prompt ab --tokens 3");
  EXPECT_EQ(o.exit_code, kExitDiverged);
  expect_one_line_error(o, {checkpoint + "generate: the model's logits for new token 1 hold NaN"});
  o = run_tessel("eval --run " + broken);
  EXPECT_EQ(o.exit_code, kExitDiverged);
  expect_one_line_error(o, {checkpoint.substr(0, checkpoint.size() - 2) + " on " + data +
                            "/val.tok: the loss is NaN"});
}

TEST_F(CliTest, SequenceLongerThanTheModelAllows) {
  expect_one_line_error(run_tessel(train_args(temp_dir("r")) + " --set train.seq_len=64"),
                        {"train.seq_len", "model.max_seq"});
}

TEST_F(CliTest, MistypedCommandsAndImpossibleSizesAreOneLine) {
  expect_one_line_error(run_tessel("trian --config x.toml"), {"unknown subcommand 'trian'"});
  const std::string run = temp_dir("r");
  expect_one_line_error(run_tessel(train_args(run) + " --set model.width=3000000000"),
                        {"model.width", "larger than tessel supports"});
  expect_one_line_error(
      run_tessel(train_args(run) + " --set model.moe_layers=all --set model.moe_experts=300"),
      {"model.moe_experts", "[1, 256]"});
  expect_one_line_error(
      run_tessel(train_args(run) + " --set train.sample_tokens=5 --set train.sample_prompt="),
      {"train.sample_prompt"});
  EXPECT_FALSE(fs::exists(run + "/checkpoints")) << "refused only after training";
  expect_one_line_error(run_tessel("prepare --corpus file:" + run + " --out " + temp_dir("p")),
                        {run, "is a directory"});
  // CLI11's own range checks: its message names the option.
  for (const std::string args :
       {"bench-gemm --seconds -1", "bench-gemm --seconds nan", "run --threads -5",
        "simulate --link-bandwidth nan", "prepare --seed 18446744073709551616", "prepare --seed -1",
        "generate --seed 18446744073709551616", "generate --seed -1"}) {
    const Outcome o = run_tessel(args);
    EXPECT_NE(o.exit_code, 0) << args;
    const std::string option = args.substr(args.find("--"), args.rfind(' ') - args.find("--"));
    EXPECT_NE(o.err.find(option), std::string::npos) << o.err;
  }
  // The bound in a few digits, not CLI::NonNegativeNumber's DBL_MAX in 300.
  const Outcome o = run_tessel("eval --sequences -1");
  EXPECT_NE(o.exit_code, 0);
  EXPECT_EQ(
      o.err.rfind("--sequences: must be an integer from 0 to 9223372036854775807, got -1\n", 0), 0u)
      << o.err;
}

// Without --out, prepare and train-bpe write a file corpus to data/<stem> and data/bpe-<stem>
// under the current directory, never over data/bible.
TEST_F(CliTest, PrepareAndTrainBpeNameTheirOutputAfterTheCorpus) {
  const std::string dir = temp_dir("prepare-default");
  {
    std::ofstream text(dir + "/two.txt");
    for (int p = 0; p < 20; ++p) text << "the " << p << " of the earth\n\n";
  }
  const fs::path cwd = fs::current_path();
  fs::current_path(dir);
  const Outcome prepared = run_tessel("prepare --corpus file:two.txt");
  const Outcome learned = run_tessel("train-bpe --corpus file:two.txt --vocab-size 260");
  fs::current_path(cwd);
  ASSERT_EQ(prepared.exit_code, 0) << prepared.err;
  ASSERT_EQ(learned.exit_code, 0) << learned.err;
  EXPECT_TRUE(fs::exists(dir + "/data/two/train.tok"));
  EXPECT_TRUE(fs::exists(dir + "/data/bpe-two/merges.txt"));
  EXPECT_FALSE(fs::exists(dir + "/data/bible"));
  EXPECT_FALSE(fs::exists(dir + "/data/bpe-bible"));
}

TEST_F(CliTest, BadCorpusForPrepare) {
  expect_one_line_error(run_tessel("prepare --corpus file:/nonexistent.txt --out " + temp_dir("p")),
                        {"/nonexistent.txt"});
}

// `tessel export` writes over an earlier export only: a directory holding a user's files under
// an export's names (a config.toml without a model.safetensors, a model.safetensors that no
// export wrote, a tokenizer/ holding other files or a directory) is refused with the path
// named, before anything in it is written or removed.
TEST_F(CliTest, ExportRefusesAnOutputThatIsNoExportAndKeepsItsFiles) {
  const std::string run = temp_dir("export-run");
  ASSERT_EQ(run_tessel(train_args(run)).exit_code, 0);
  const std::string earlier = temp_dir("export-earlier");
  ASSERT_EQ(run_tessel("export " + run + " " + earlier).exit_code, 0);
  ASSERT_TRUE(fs::exists(earlier + "/tokenizer/tokenizer.json"));
  struct Case {
    bool over_export;  // the user's file lies in a copy of the earlier export
    std::string file, content, named, why;
  };
  for (const Case& c : std::vector<Case>{
           {false, "config.toml", "my notes", "config.toml", " (no model.safetensors beside it)"},
           {true, "model.safetensors", "garbage", "model.safetensors",
            " (no safetensors header with an export's format and step metadata)"},
           {true, "tokenizer/notes.md", "x", "tokenizer/notes.md", ""},
           {true, "tokenizer/sub/data.bin", "precious", "tokenizer/sub", ""},
           {true, "tokenizer/vocab.json/data.bin", "precious", "tokenizer/vocab.json",
            " (not a file)"}}) {
    SCOPED_TRACE(c.file);
    const std::string out = temp_dir("export-out");
    if (c.over_export) fs::copy(earlier, out, fs::copy_options::recursive);
    fs::create_directories(fs::path(out + "/" + c.file).parent_path());
    std::ofstream(out + "/" + c.file) << c.content;
    const auto before = files_under(out);
    const Outcome o = run_tessel("export " + run + " " + out);
    EXPECT_EQ(o.exit_code, 2);
    EXPECT_EQ(o.err, "tessel: error: export: " + out + "/" + c.named +
                         " is not what an export writes" + c.why +
                         "; export into a new or empty directory (or over an earlier export)\n");
    const auto after = files_under(out);
    EXPECT_TRUE(after == before) << after.size() << " files, " << before.size() << " before";
  }
  // An earlier export is one, and is replaced.
  const Outcome o = run_tessel("export " + run + " " + earlier);
  EXPECT_EQ(o.exit_code, 0) << o.err;
}

// tessel eval on a finished run: by default it repeats the run's final validation loss (the
// same shard, sequences and weights: bitwise, one process both times); --sequences and
// --split choose other rows; a missing run is one error.
TEST_F(CliTest, EvalRepeatsTheRunsValidationLoss) {
  const std::string run = temp_dir("eval");
  ASSERT_EQ(run_tessel(train_args(run) + " --set train.eval_every=4 --set train.eval_sequences=6")
                .exit_code,
            0);
  double val_loss = 0;
  std::ifstream metrics(run + "/metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("val_loss")) val_loss = j["val_loss"].get<double>();
  }
  ASSERT_GT(val_loss, 0);
  const Outcome o = run_tessel("eval --json --run " + run);
  ASSERT_EQ(o.exit_code, 0) << o.err;
  const auto e = nlohmann::json::parse(o.out);
  EXPECT_EQ(e["loss"].get<double>(), val_loss);
  EXPECT_EQ(e["step"].get<int64_t>(), 4);
  EXPECT_EQ(e["sequences"].get<int64_t>(), 6);
  EXPECT_NEAR(e["perplexity"].get<double>(), std::exp(val_loss), 1e-12 * std::exp(val_loss));
  const Outcome two = run_tessel("eval --json --sequences 2 --split train --run " + run);
  ASSERT_EQ(two.exit_code, 0) << two.err;
  const auto t = nlohmann::json::parse(two.out);
  EXPECT_EQ(t["sequences"].get<int64_t>(), 2);
  EXPECT_TRUE(t["loss_tokens"].is_number_integer()) << t;
  EXPECT_GT(t["loss_tokens"].get<double>(), 0);  // 2 rows of 16 tokens, less document starts
  EXPECT_LE(t["loss_tokens"].get<double>(), 2 * 16);
  EXPECT_NE(t["shard"].get<std::string>().find("train.tok"), std::string::npos);
  expect_one_line_error(run_tessel("eval --run " + run + "/nonexistent"), {"nonexistent"});
  const Outcome one = run_tessel("eval --sequences 1 --run " + run);
  ASSERT_EQ(one.exit_code, 0) << one.err;
  EXPECT_NE(one.out.find(": 1 sequence, "), std::string::npos) << one.out;
  // An empty directory is no default: it names nothing (CLI11's own two-line message).
  const std::pair<std::string, std::string> empty[] = {
      {"eval --run " + run + " --data ''", "--data"},
      {"eval --run ''", "--run"},
      {"generate --run ''", "--run"},
      {"export '' " + temp_dir("eval-out"), "CHECKPOINT"}};
  for (const auto& [command, option] : empty) {
    const Outcome o = run_tessel(command);
    EXPECT_NE(o.exit_code, 0) << command;
    EXPECT_EQ(o.out, "") << command;
    EXPECT_NE(o.err.find(option + ": must name a directory"), std::string::npos) << o.err;
  }
}

// A mixture run's eval: each data set's loss and their mixture weighted by data.weights, which
// repeat the run's last validation (one process: bitwise).
TEST_F(CliTest, EvalOfAMixtureReportsEachDataSetAndTheRunsValidationLoss) {
  const std::string run = temp_dir("eval-mixture");
  const std::string other = tessel::fixture::make_other_dataset(temp_dir("other-data"));
  const Outcome trained = run_tessel(train_args(run) + " --set data.path=" + data + "," + other +
                                     " --set data.weights=1,6 --set train.eval_sequences=6");
  ASSERT_EQ(trained.exit_code, 0) << trained.err;
  nlohmann::json validation;
  std::ifstream metrics(run + "/metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("val_loss")) validation = j;
  }
  ASSERT_EQ(validation["val_loss_by_data_set"].size(), 2u);
  const Outcome o = run_tessel("eval --json --run " + run);
  ASSERT_EQ(o.exit_code, 0) << o.err;
  const auto e = nlohmann::json::parse(o.out);
  EXPECT_EQ(e["loss"].get<double>(), validation["val_loss"].get<double>());
  ASSERT_EQ(e["data_sets"].size(), 2u);
  const std::string names[2] = {std::filesystem::path(data).filename().string(),
                                std::filesystem::path(other).filename().string()};
  for (size_t d = 0; d < 2; ++d) {
    EXPECT_EQ(e["data_sets"][d]["loss"].get<double>(),
              validation["val_loss_by_data_set"][names[d]].get<double>());
    EXPECT_EQ(e["data_sets"][d]["sequences"].get<int64_t>(), 6);
  }
  // 1/7 and 6/7 do not sum to exactly 1: the run and eval must round the same shares.
  EXPECT_DOUBLE_EQ(e["data_sets"][1]["weight"].get<double>(), 6.0 / 7);
  const Outcome text = run_tessel("eval --run " + run);
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("on the mixture of 2 data sets (weighted by data.weights)"),
            std::string::npos)
      << text.out;
  // Data sets given: each one's loss as alone, their loss weighted equally or by --weights.
  const Outcome alone = run_tessel("eval --json --run " + run + " --data " + other);
  ASSERT_EQ(alone.exit_code, 0) << alone.err;
  const double other_loss = nlohmann::json::parse(alone.out)["loss"].get<double>();
  EXPECT_EQ(other_loss, e["data_sets"][1]["loss"].get<double>());
  const Outcome listed = run_tessel("eval --json --run " + run + " --data " + data + "," + other);
  ASSERT_EQ(listed.exit_code, 0) << listed.err;
  const auto l = nlohmann::json::parse(listed.out);
  ASSERT_EQ(l["data_sets"].size(), 2u);
  EXPECT_EQ(l["data_sets"][1]["loss"].get<double>(), other_loss);
  EXPECT_DOUBLE_EQ(l["loss"].get<double>(),
                   0.5 * e["data_sets"][0]["loss"].get<double>() + 0.5 * other_loss);
  const Outcome weighted =
      run_tessel("eval --json --run " + run + " --data " + data + "," + other + " --weights 1,6");
  ASSERT_EQ(weighted.exit_code, 0) << weighted.err;
  EXPECT_EQ(nlohmann::json::parse(weighted.out)["loss"].get<double>(), e["loss"].get<double>());
  expect_one_line_error(run_tessel("eval --run " + run + " --weights 1,6"),
                        {"--weights needs --data"});
  expect_one_line_error(
      run_tessel("eval --run " + run + " --data " + data + "," + other + " --weights 1"),
      {"--data / --weights", "1 weights for the 2 data sets"});
  expect_one_line_error(run_tessel("eval --run " + run + " --data " + other + " --weights 3"),
                        {"tessel: error: --weights needs several --data directories"});
  expect_one_line_error(run_tessel("eval --run " + run + " --data " + other + ",nowhere"),
                        {"nowhere/val.tok: no such shard"});
}

// Eval of an SFT data set under a run trained with a plain causal mask would let its packed
// samples attend to each other: refused, as training on it is.
TEST_F(CliTest, EvalOfSftDataUnderACausalMaskRunIsRefused) {
  const std::string run = temp_dir("eval-causal");
  const std::string sft = tessel::fixture::make_sft_dataset(temp_dir("sft-data"));
  const Outcome trained = run_tessel(train_args(run) + " --set data.attention_mask=causal");
  ASSERT_EQ(trained.exit_code, 0) << trained.err;
  expect_one_line_error(run_tessel("eval --run " + run + " --data " + sft),
                        {"is an SFT data set", "causal_document", "attend to each other"});
}

namespace {
// A u16 file of token ids (nanoGPT's format): 40 documents, each ending with the eot id 299.
void write_token_file(const std::string& path) {
  std::vector<uint16_t> ids;
  for (int d = 0; d < 40; ++d) {
    for (int t = 0; t < 30 + d; ++t) ids.push_back(uint16_t((d * 7 + t * 13) % 299));
    ids.push_back(299);
  }
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(ids.data()), std::streamsize(2 * ids.size()));
}
}  // namespace

// eval checks every --data directory before it evaluates any: a shard of a larger vocabulary
// than the model's, or one its dataset.json does not describe, is one error and no loss line.
TEST_F(CliTest, EvalChecksEveryDataSetBeforeEvaluatingAny) {
  const std::string run = temp_dir("eval-checks"), dir = temp_dir("eval-checks-data");
  ASSERT_EQ(run_tessel(train_args(run)).exit_code, 0);
  write_token_file(dir + "/ids.bin");
  const Outcome prepared = run_tessel("prepare --corpus tokens:" + dir +
                                      "/ids.bin --vocab 300 --eot 299 --out " + dir + "/wide");
  ASSERT_EQ(prepared.exit_code, 0) << prepared.err;
  Outcome o = run_tessel("eval --run " + run + " --data " + data + "," + dir + "/wide");
  expect_one_line_error(o, {dir + "/wide/val.tok: token vocabulary 300 exceeds model.vocab = 256"});
  EXPECT_EQ(o.out, "");
  fs::copy(data, dir + "/edited", fs::copy_options::recursive);
  nlohmann::json description = nlohmann::json::parse(slurp(dir + "/edited/dataset.json"));
  description["val"]["tokens"] = description["val"]["tokens"].get<int64_t>() + 1;
  std::ofstream(dir + "/edited/dataset.json") << description.dump();
  o = run_tessel("eval --run " + run + " --data " + data + "," + dir + "/edited");
  expect_one_line_error(o,
                        {dir + "/edited/dataset.json does not describe " + dir + "/edited/val.tok",
                         "prepare the data set again"});
  EXPECT_EQ(o.out, "");
}

// Token ids from another tokenizer through the binary: a u16 file (nanoGPT's format) of 40
// documents, each ending with the eot id 299, is prepared into shards of vocabulary 300 and
// trains a model of that vocabulary (not one of the byte vocabulary); without --vocab it is one
// error.
TEST_F(CliTest, ATokenFileIsPreparedAndTrainsAModelOfItsVocabulary) {
  const std::string dir = temp_dir("tokens");
  write_token_file(dir + "/train.bin");
  const Outcome o = run_tessel("prepare --corpus tokens:" + dir +
                               "/train.bin --vocab 300 --eot "
                               "299 --val-fraction 0.1 --out " +
                               dir + "/data");
  ASSERT_EQ(o.exit_code, 0) << o.err;
  EXPECT_NE(o.out.find("train 36 documents"), std::string::npos) << o.out;
  const std::string on_tokens = train_args(dir + "/run") + " --set data.path=" + dir + "/data";
  expect_one_line_error(run_tessel(on_tokens), {"token vocabulary 300 exceeds model.vocab = 256"});
  const Outcome t = run_tessel(on_tokens + " --set model.vocab=300");
  EXPECT_EQ(t.exit_code, 0) << t.err;
  expect_one_line_error(run_tessel("generate --run " + dir + "/run --prompt ab"),
                        {"generate needs a tokenizer", "--tokenizer bpe:DIR"});
  // A run without its own copy (as from before runs kept one) whose data is gone from here.
  fs::remove_all(dir + "/run/tokenizer");
  fs::rename(dir + "/data", dir + "/data-moved");
  expect_one_line_error(
      run_tessel("generate --run " + dir + "/run --prompt ab"),
      {"no copy of the run's tokenizer is found (a run from before runs kept one)",
       dir + "/data does not exist", "--tokenizer"});
  // Export refuses it alike; with the data back, a run on ids without a tokenizer exports (its
  // tokenizer/ names them).
  expect_one_line_error(run_tessel("export " + dir + "/run " + dir + "/out"),
                        {"export needs a tokenizer", dir + "/data does not exist"});
  EXPECT_FALSE(fs::exists(dir + "/out"));
  fs::rename(dir + "/data-moved", dir + "/data");
  const Outcome e = run_tessel("export " + dir + "/run " + dir + "/out");
  EXPECT_EQ(e.exit_code, 0) << e.err;
  EXPECT_NE(slurp(dir + "/out/tokenizer/tokenizer.json").find("pretokenized"), std::string::npos);
  expect_one_line_error(
      run_tessel("prepare --corpus tokens:" + dir + "/train.bin --eot 299 --out " + dir + "/d2"),
      {"needs --vocab"});
}

// A byte-level BPE vocabulary through the binary: train-bpe learns one from a text corpus,
// prepare encodes the text with it, the model trains at its size, and the final sample and
// `generate` speak its tokens; the vocabulary travels with the data, so generate needs no
// option to find it.
TEST_F(CliTest, ABpeVocabularyIsLearnedPreparedTrainedAndSampled) {
  const std::string dir = temp_dir("bpe");
  {
    std::ofstream text(dir + "/text.txt");
    for (int p = 0; p < 40; ++p)
      text << "And the LORD said unto them, the " << p << " of the earth\nhe said and did\n\n";
  }
  Outcome o = run_tessel("train-bpe --corpus file:" + dir + "/text.txt --vocab-size 300 --out " +
                         dir + "/bpe");
  ASSERT_EQ(o.exit_code, 0) << o.err;
  // Every id the output line counts is in vocab.json: bytes, one per merge line, <|endoftext|>.
  const auto vocab = nlohmann::json::parse(slurp(dir + "/bpe/vocab.json"));
  const std::string merges = slurp(dir + "/bpe/merges.txt");
  const auto merge_lines = std::count(merges.begin(), merges.end(), '\n') - 1;  // less #version
  EXPECT_NE(o.out.find("learned " + std::to_string(merge_lines) + " merges"), std::string::npos)
      << o.out;
  EXPECT_NE(o.out.find("vocabulary of " + std::to_string(vocab.size()) + " ids"), std::string::npos)
      << o.out;
  EXPECT_EQ(int64_t(vocab.size()), 257 + merge_lines);
  o = run_tessel("prepare --corpus file:" + dir + "/text.txt --tokenizer bpe:" + dir +
                 "/bpe --out " + dir + "/data");
  ASSERT_EQ(o.exit_code, 0) << o.err;
  const std::string run = dir + "/run";
  const std::string on_bpe = train_args(run) + " --set data.path=" + dir +
                             "/data --set model.vocab=300 --set train.sample_tokens=6"
                             " --set 'train.sample_prompt=\"the LORD\"' --set run.quiet=false";
  o = run_tessel(on_bpe);
  ASSERT_EQ(o.exit_code, 0) << o.err;
  EXPECT_NE(o.out.find("sample:\nthe LORD"), std::string::npos) << o.out;
  o = run_tessel("generate --run " + run + " --prompt 'the LORD' --tokens 5 --temperature 0");
  ASSERT_EQ(o.exit_code, 0) << o.err;
  EXPECT_EQ(o.out.rfind("the LORD", 0), 0u) << o.out;
  EXPECT_GT(o.out.size(), std::string("the LORD\n").size()) << o.out;
  expect_one_line_error(run_tessel("generate --run " + run + " --stop 'the LORD'"),
                        {"--stop", "one token of the bpe tokenizer"});
  expect_one_line_error(run_tessel(on_bpe + " --set 'train.sample_stop=\"the LORD\"'"),
                        {"train.sample_stop", "one token of the bpe tokenizer"});
  // A new vocabulary never lands where ids were made with the old one.
  const std::string data_vocab = slurp(dir + "/data/vocab.json");
  for (const std::string& out : {dir + "/data", run + "/tokenizer"})
    expect_one_line_error(
        run_tessel("train-bpe --corpus file:" + dir + "/text.txt --vocab-size 280 --out " + out),
        {"--out " + out, "the tokenizer its token ids were made with"});
  EXPECT_EQ(slurp(dir + "/data/vocab.json"), data_vocab);
  for (const char* sub : {"train-bpe", "prepare"}) {  // CLI11's own two-line message
    o = run_tessel(std::string(sub) + " --corpus file:" + dir + "/text.txt --out ''");
    EXPECT_NE(o.exit_code, 0);
    EXPECT_NE(o.err.find("--out: must name a directory"), std::string::npos) << o.err;
  }
  // The same text as bytes fits the model's 300 ids but means other text to it.
  ASSERT_EQ(
      run_tessel("prepare --corpus file:" + dir + "/text.txt --out " + dir + "/bytes").exit_code,
      0);
  EXPECT_EQ(run_tessel("eval --run " + run).exit_code, 0);
  expect_one_line_error(run_tessel("eval --run " + run + " --data " + dir + "/bytes"),
                        {dir + "/bytes", "different tokenizers (byte and bpe)"});
  // The run keeps its own copy of the tokenizer: generate works with the data gone, and the
  // data re-prepared with another vocabulary cannot resume the run.
  EXPECT_TRUE(fs::exists(run + "/tokenizer/tokenizer.json"));
  fs::rename(dir + "/data", dir + "/data.moved");
  o = run_tessel("generate --run " + run + " --prompt 'the LORD' --tokens 5 --temperature 0");
  EXPECT_EQ(o.exit_code, 0) << o.err;
  EXPECT_EQ(o.out.rfind("the LORD", 0), 0u) << o.out;
  ASSERT_EQ(run_tessel("train-bpe --corpus file:" + dir + "/text.txt --vocab-size 280 --out " +
                       dir + "/bpe2")
                .exit_code,
            0);
  ASSERT_EQ(run_tessel("prepare --corpus file:" + dir + "/text.txt --tokenizer bpe:" + dir +
                       "/bpe2 --out " + dir + "/data")
                .exit_code,
            0);
  expect_one_line_error(run_tessel(on_bpe + " --set train.steps=8"),
                        {run + "/tokenizer", "bpe vocabularies that differ"});
  // A fresh run in a used directory resumes nothing: it trains and keeps the new copy.
  const std::string fresh = dir + "/fresh";
  ASSERT_EQ(run_tessel(train_args(fresh) + " --set data.path=" + dir + "/data.moved" +
                       " --set model.vocab=300")
                .exit_code,
            0);
  fs::remove_all(fresh + "/checkpoints");  // as the refusal of a fresh start over them says
  o = run_tessel(train_args(fresh) + " --set data.path=" + dir + "/data --set model.vocab=300");
  EXPECT_EQ(o.exit_code, 0) << o.err;
  EXPECT_TRUE(slurp(fresh + "/tokenizer/vocab.json") == slurp(dir + "/bpe2/vocab.json"));
  // The export carries the run's tokenizer: the model's ids decode without the run.
  o = run_tessel("export " + run + " " + dir + "/out");
  ASSERT_EQ(o.exit_code, 0) << o.err;
  EXPECT_NE(o.out.find(dir + "/out/tokenizer/"), std::string::npos) << o.out;
  for (const char* file : {"vocab.json", "merges.txt", "tokenizer.json"})
    EXPECT_EQ(slurp(dir + "/out/tokenizer/" + file), slurp(run + "/tokenizer/" + file)) << file;
  // A checkpoint outside its run reads its data.path's tokenizer, but not from data prepared
  // again since the run (here with the 280-id vocabulary: its train.tok is not the one the
  // checkpoint's record counted): generate, eval and export refuse it rather than read the
  // model's ids as another tokenizer's; --tokenizer names the right one.
  const std::string loose = dir + "/loose";
  fs::copy(run + "/checkpoints/step-00000004", loose, fs::copy_options::recursive);
  for (const std::string& command : {"generate --run " + loose + " --prompt the",
                                     "eval --run " + loose, "export " + loose + " " + dir + "/out"})
    expect_one_line_error(
        run_tessel(command),
        {loose + ": no copy of the run's tokenizer is found (a checkpoint outside",
         dir + "/data changed since the run: its train.tok holds",
         "copy the checkpoint together with its run directory"});
  o = run_tessel("generate --run " + loose + " --tokenizer " + dir +
                 "/data.moved --prompt 'the LORD' --tokens 5 --temperature 0");
  EXPECT_EQ(o.exit_code, 0) << o.err;
  EXPECT_EQ(o.out.rfind("the LORD", 0), 0u) << o.out;
  // With the data the run trained on back at data.path, the export carries its tokenizer.
  fs::rename(dir + "/data", dir + "/data.bpe2");
  fs::rename(dir + "/data.moved", dir + "/data");
  o = run_tessel("export " + loose + " " + dir + "/out");
  ASSERT_EQ(o.exit_code, 0) << o.err;
  EXPECT_NE(o.out.find(dir + "/out/tokenizer/"), std::string::npos) << o.out;
  for (const char* file : {"vocab.json", "merges.txt", "tokenizer.json"})
    EXPECT_EQ(slurp(dir + "/out/tokenizer/" + file), slurp(run + "/tokenizer/" + file)) << file;
  // Without data.path from here export refuses as generate does (it dropped the tokenizer), and
  // the earlier export stays whole.
  fs::rename(dir + "/data", dir + "/data.moved");
  const auto exported = files_under(dir + "/out");
  for (const auto& [command, name] : {std::pair{"export " + loose + " " + dir + "/out", "export"},
                                      std::pair{"generate --run " + loose, "generate"}})
    expect_one_line_error(run_tessel(command),
                          {loose + ": " + name + " needs a tokenizer; no copy of the run's",
                           dir + "/data does not exist from here",
                           "copy the checkpoint together with its run directory"});
  EXPECT_EQ(files_under(dir + "/out"), exported);
  // A checkpoint directory, however spelled, finds its run's copy.
  o = run_tessel("generate --run " + run + "/checkpoints/step-00000004/ --prompt 'the LORD'");
  EXPECT_EQ(o.exit_code, 0) << o.err;
  expect_one_line_error(  // the advice fits generate: the run's copy decodes without one
      run_tessel("generate --run " + run + " --tokenizer " + dir + "/bytes --prompt 'the LORD'"),
      {run + "/tokenizer", dir + "/bytes", "different tokenizers",
       "generate decodes with the run's own copy in " + run + "/tokenizer: leave out --tokenizer"});
  // A merges.txt that is a directory is no vocabulary without merges.
  fs::copy(dir + "/bpe", dir + "/bpe-hollow");
  fs::remove(dir + "/bpe-hollow/merges.txt");
  fs::create_directory(dir + "/bpe-hollow/merges.txt");
  expect_one_line_error(
      run_tessel("generate --run " + run + " --tokenizer " + dir + "/bpe-hollow --prompt 'the'"),
      {dir + "/bpe-hollow/merges.txt: is a directory"});
  // --tokenizer takes a vocabulary directory as train-bpe wrote it, and must exist.
  o = run_tessel("generate --run " + run + " --tokenizer " + dir + "/bpe --prompt 'the LORD'");
  EXPECT_EQ(o.exit_code, 0) << o.err;
  expect_one_line_error(run_tessel("generate --run " + run + " --tokenizer " + dir + "/nowhere"),
                        {"--tokenizer", "nowhere", "no tokenizer there"});
  // A byte prepare into a vocabulary directory leaves that vocabulary alone.
  ASSERT_EQ(
      run_tessel("prepare --corpus file:" + dir + "/text.txt --out " + dir + "/bpe").exit_code, 0);
  EXPECT_TRUE(fs::exists(dir + "/bpe/vocab.json"));
  EXPECT_TRUE(fs::exists(dir + "/bpe/merges.txt"));
  // Bytes under a padded vocabulary (300 ids): the sample draws bytes only.
  o = run_tessel(train_args(dir + "/run-bytes") + " --set data.path=" + dir +
                 "/bytes --set model.vocab=300 --set train.sample_tokens=40 --set "
                 "train.sample_temperature=2 --set run.quiet=false");
  EXPECT_EQ(o.exit_code, 0) << o.err;
  EXPECT_NE(o.out.find("sample:"), std::string::npos) << o.out;
  expect_one_line_error(run_tessel("prepare --corpus file:" + dir +
                                   "/text.txt --tokenizer wordpiece --out " + dir + "/d2"),
                        {"--tokenizer must be byte or bpe:DIR"});
  expect_one_line_error(run_tessel("train-bpe --corpus file:" + dir + "/none.txt --out " + dir),
                        {"none.txt", "no such file"});
  // train-bpe never writes over its corpus: a text that is one of the files it writes.
  fs::create_directories(dir + "/own");
  for (const char* file : {"vocab.json", "merges.txt"}) {
    const std::string corpus = dir + "/own/" + file;
    fs::copy_file(dir + "/text.txt", corpus, fs::copy_options::overwrite_existing);
    expect_one_line_error(
        run_tessel("train-bpe --corpus file:" + corpus + " --out " + dir + "/own"),
        {"train-bpe: corpus \"file:" + corpus + "\" is " + corpus, "a file train-bpe writes"});
    EXPECT_EQ(slurp(corpus), slurp(dir + "/text.txt")) << file;
  }
  o = run_tessel("train-bpe --corpus file:" + dir + "/text.txt --vocab-size 258 --out " + dir +
                 "/one");
  EXPECT_EQ(o.exit_code, 0) << o.err;
  EXPECT_NE(o.out.find("learned 1 merge from"), std::string::npos) << o.out;
  EXPECT_NE(run_tessel("train-bpe --vocab-size 100").exit_code, 0);
  expect_one_line_error(run_tessel("train-bpe --corpus chat:" + dir + "/text.txt"),
                        {"chat:", "a vocabulary is learned from text"});
}

// An SFT corpus through the binary: a good JSON Lines file is prepared with its loss masks and
// counted in the output line; a bad line is one error naming the file and the line.
TEST_F(CliTest, ChatCorpusIsPreparedOrNamesTheBadLine) {
  const std::string dir = temp_dir("chat");
  const std::string good = dir + "/good.jsonl", bad = dir + "/bad.jsonl";
  std::ofstream(good) << "{\"prompt\": \"a?\", \"response\": \"b\"}\n"
                      << "{\"prompt\": \"c?\", \"response\": \"dd\"}\n";
  const Outcome o = run_tessel("prepare --corpus chat:" + good + " --out " + dir + "/data");
  ASSERT_EQ(o.exit_code, 0) << o.err;
  // One sample in each split: "b\n" or "dd\n" is trained, 3 or 2 of its bytes.
  EXPECT_NE(o.out.find("SFT"), std::string::npos) << o.out;
  EXPECT_NE(o.out.find("train 1 sample / "), std::string::npos) << o.out;
  EXPECT_TRUE(fs::exists(dir + "/data/train.loss_mask.tok"));
  EXPECT_TRUE(fs::exists(dir + "/data/val.loss_mask.tok"));
  std::ofstream(bad) << "{\"prompt\": \"a?\", \"response\": \"b\"}\n\n{\"messages\": 3}\n";
  expect_one_line_error(run_tessel("prepare --corpus chat:" + bad + " --out " + dir + "/data2"),
                        {bad + ":3", "\"messages\" is not an array"});
}
