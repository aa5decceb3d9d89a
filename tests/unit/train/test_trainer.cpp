#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iomanip>
#include <nlohmann/json.hpp>
#include <sstream>

#include "support/expect_input_error.hpp"
#include "support/train_fixture.hpp"
#include "tessel/comm/single_communicator.hpp"
#include "tessel/core/error.hpp"
#include "tessel/core/threading.hpp"
#include "tessel/data/shard.hpp"
#include "tessel/model/gpt.hpp"
#include "tessel/train/checkpoint.hpp"
#include "tessel/train/checkpoint_interval.hpp"
#include "tessel/train/ett.hpp"
#include "tessel/train/run_model.hpp"
#include "tessel/train/trainer.hpp"

using namespace tessel;
namespace fs = std::filesystem;

using fixture::train_run;

namespace {

struct TrainerTest : ::testing::Test {
  static void SetUpTestSuite() {
    data_dir = fixture::make_dataset(fixture::temp_dir("tessel-data"));
  }
  static std::string data_dir;
};
std::string TrainerTest::data_dir;

}  // namespace

// Elapsed time and ETA stay readable at any size: a step count near 2^63 once printed a
// negative ETA from lround's overflow.
TEST(FormatDuration, StaysReadableAtAnySize) {
  EXPECT_EQ(train::format_duration(65.4), "1m05s");
  EXPECT_EQ(train::format_duration(3599.6), "1h00m");
  EXPECT_EQ(train::format_duration(-3), "0m00s");
  EXPECT_EQ(train::format_duration(3.6e9 - 60), "999999h59m");
  for (double huge : {3.6e9, 1e19, 1.8e17, double(INFINITY)})
    EXPECT_EQ(train::format_duration(huge), ">1000000h") << huge;
}

TEST_F(TrainerTest, LossFallsAndRunsRepeatBitwise) {
  auto a = train_run(fixture::tiny_config(data_dir, fixture::temp_dir("tessel-run")));
  auto b = train_run(fixture::tiny_config(data_dir, fixture::temp_dir("tessel-run")));
  ASSERT_EQ(a.steps.size(), 50u);
  // ln(256) = 5.55 at init; the synthetic text is easy: the loss must fall below 3.5.
  EXPECT_NEAR(a.steps.front().loss, std::log(256.0), 0.3);
  EXPECT_LT(a.steps.back().loss, 3.5);
  for (size_t i = 0; i < a.steps.size(); ++i) EXPECT_EQ(a.steps[i].loss, b.steps[i].loss) << i;
  ASSERT_EQ(a.validation.size(), 1u);
  EXPECT_EQ(a.validation[0].second, b.validation[0].second);
}

// config.toml records the thread count the pools actually run (OpenBLAS caps a request at its
// pool's size), and the result the peak resident memory.
TEST_F(TrainerTest, TheResolvedConfigRecordsTheThreadsUsed) {
  const int before = num_threads();
  train::Config c = fixture::tiny_config(data_dir, fixture::temp_dir("tessel-run"));
  c.train.steps = 2;
  c.optim.warmup_steps = 1;
  c.run.threads = 200;  // Debian's OpenBLAS caps it at 64
  const auto result = train_run(c);
  const int used = num_threads();
  set_num_threads(before);
  const train::Config written = train::load_config(c.run.dir + "/config.toml", {});
  EXPECT_EQ(written.run.threads, used);
  EXPECT_LE(used, 200);
  EXPECT_GT(result.peak_resident_bytes, int64_t(1) << 20);
}

// The adaptive checkpoint interval estimates the MTBF from the run's ETT ledger; a damaged
// ledger (a missing attempt log) falls back to train.mtbf_seconds instead of stopping the run.
TEST_F(TrainerTest, ADamagedLedgerDoesNotStopAnAdaptiveCheckpointRun) {
  train::Config c = fixture::tiny_config(data_dir, fixture::temp_dir("tessel-run"));
  c.train.steps = 6;
  c.optim.warmup_steps = 1;
  c.train.checkpoint_policy = "young";
  c.train.checkpoint_every = 2;
  fs::create_directories(train::ett_dir(c.run.dir));
  std::ofstream(train::attempt_path(c.run.dir, 1)) << R"({"event":"attempt","attempt":1,"t":0})"
                                                   << "\n";
  EXPECT_ANY_THROW(train::analyze_ett(c.run.dir));  // attempt 0's log is missing
  const auto result = train_run(c);
  EXPECT_EQ(result.steps.size(), 6u);
}

// metrics.jsonl's FLOP accounting against the closed form (ETT spec §6), with N counted here
// from the model's own parameter list: FLOPs/token = 6N + 12·L·H·Q·T; TFLOP/s per rank and
// MFU from tokens/s; HFU = MFU without recomputation, and with train.recompute = blocks
// counts the blocks' forward again (2·N_blocks + 4·L·H·Q·T; the head is not recomputed).
TEST_F(TrainerTest, MetricsCountModelAndHardwareFlops) {
  for (const char* recompute : {"none", "blocks"}) {
    SCOPED_TRACE(recompute);
    const train::Config c = train::load_config(
        "",
        {"data.path=" + data_dir, "run.dir=" + fixture::temp_dir("tessel-flops"), "run.quiet=true",
         "run.threads=1", "model.layers=2", "model.width=32", "model.heads=4", "model.kv_heads=2",
         "model.tied_head=false", "model.max_seq=16", "train.seq_len=16", "train.micro_batch=2",
         "train.steps=3", "optim.warmup_steps=1", "train.sample_tokens=0", "mfu.peak_gflops=2.5",
         std::string("train.recompute=") + recompute});
    const model::Gpt gpt(c.model, 1);
    int64_t blocks = 0, head = 0;
    for (const auto& p : gpt.parameters()) {
      if (p.tag == ParamTag::hidden_matrix) blocks += p.value.numel();
      if (p.tag == ParamTag::head) head += p.value.numel();
    }
    ASSERT_EQ(head, 256 * 32);
    const double L = 2, H = 4, Q = 8, T = 16, attention = L * H * Q * T;
    const double model_flops = 6.0 * double(blocks + head) + 12 * attention;
    const double hardware_flops =
        model_flops +
        (std::string(recompute) == "blocks" ? 2.0 * double(blocks) + 4 * attention : 0.0);
    train_run(c);
    std::ifstream in(c.run.dir + "/metrics.jsonl");
    int steps = 0;
    for (std::string line; std::getline(in, line);) {
      const auto j = nlohmann::json::parse(line);
      if (j.value("event", "") == "start") {
        EXPECT_EQ(j["flops_per_token"].get<double>(), model_flops);
        EXPECT_EQ(j["hardware_flops_per_token"].get<double>(), hardware_flops);
      } else if (j.contains("mfu")) {
        ++steps;
        const double tflops = j["tokens_per_s"].get<double>() * model_flops / 1e12;
        EXPECT_NEAR(j["tflops_per_rank"].get<double>(), tflops, 1e-12 * tflops);
        EXPECT_NEAR(j["mfu"].get<double>(), tflops * 1e3 / 2.5, 1e-12 * tflops * 1e3);
        EXPECT_NEAR(j["hfu"].get<double>(), j["mfu"].get<double>() * hardware_flops / model_flops,
                    1e-12);
      }
    }
    EXPECT_EQ(steps, 3);
  }
}

TEST_F(TrainerTest, ResumeContinuesBitwise) {
  std::string run = fixture::temp_dir("tessel-run");
  train::Config c = fixture::tiny_config(data_dir, run);
  c.train.checkpoint_every = 20;
  c.train.keep_checkpoints = 3;
  auto full = train_run(c);  // checkpoints at 20, 40 and 50
  // Drop the later checkpoints: the rerun resumes from step 20.
  fs::remove_all(run + "/checkpoints/step-00000040");
  fs::remove_all(run + "/checkpoints/step-00000050");
  auto resumed = train_run(c);
  EXPECT_EQ(resumed.resumed_from, 20);
  ASSERT_EQ(resumed.steps.size(), 30u);
  for (size_t i = 0; i < resumed.steps.size(); ++i) {
    EXPECT_EQ(resumed.steps[i].step, full.steps[20 + i].step);
    EXPECT_EQ(resumed.steps[i].loss, full.steps[20 + i].loss) << "step " << resumed.steps[i].step;
    EXPECT_EQ(resumed.steps[i].grad_norm, full.steps[20 + i].grad_norm);
  }
  // metrics.jsonl holds each step once: the redone steps replaced the old lines.
  std::ifstream in(run + "/metrics.jsonl");
  std::string line;
  int train_lines = 0;
  while (std::getline(in, line))
    if (line.find("\"loss\"") != std::string::npos) ++train_lines;
  EXPECT_EQ(train_lines, 50);
}

TEST_F(TrainerTest, ADamagedNewestCheckpointResumesFromThePreviousOne) {
  std::string run = fixture::temp_dir("tessel-run");
  train::Config c = fixture::tiny_config(data_dir, run);
  c.train.checkpoint_every = 20;
  c.train.keep_checkpoints = 3;
  auto full = train_run(c);  // checkpoints at 20, 40 and 50
  std::string damaged = run + "/checkpoints/step-00000050/model-00000-of-00001.safetensors";
  fs::resize_file(damaged, fs::file_size(damaged) - 1);
  auto resumed = train_run(c);
  EXPECT_EQ(resumed.resumed_from, 40);
  ASSERT_EQ(resumed.steps.size(), 10u);
  for (size_t i = 0; i < resumed.steps.size(); ++i)
    EXPECT_EQ(resumed.steps[i].loss, full.steps[40 + i].loss) << "step " << 41 + i;
}

// A `latest` naming an older checkpoint (a crash between the rename and its rewrite, a hand
// edit), or a copy under a newer step's name, does not make the resume go back and overwrite
// the newer ones.
TEST_F(TrainerTest, ResumeTakesTheNewestCheckpointWhateverLatestNames) {
  std::string run = fixture::temp_dir("tessel-run");
  train::Config c = fixture::tiny_config(data_dir, run);
  c.train.steps = 15;
  c.train.checkpoint_every = 5;
  c.train.keep_checkpoints = 0;
  c.optim.warmup_steps = 2;
  train_run(c);  // checkpoints at 5, 10 and 15
  auto manifest = [&](const char* step) {
    std::ifstream in(run + "/checkpoints/" + step + "/manifest.json");
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  const std::string manifests[2] = {manifest("step-00000010"), manifest("step-00000015")};
  std::ofstream(run + "/checkpoints/latest") << "step-00000005\n";
  c.train.steps = 20;  // in every manifest's config: one rewritten would differ
  const auto resumed = train_run(c);
  EXPECT_EQ(resumed.resumed_from, 15);
  EXPECT_EQ(resumed.steps.size(), 5u);
  EXPECT_EQ(manifest("step-00000010"), manifests[0]);
  EXPECT_EQ(manifest("step-00000015"), manifests[1]);
  EXPECT_FALSE(manifest("step-00000020").empty());
  // A checkpoint copied under a newer step's name holds its own step: it fails verification,
  // the resume takes the real newest one and drops the copy.
  fs::copy(run + "/checkpoints/step-00000015", run + "/checkpoints/step-00000099");
  c.train.steps = 22;
  const auto after_copy = train_run(c);
  EXPECT_EQ(after_copy.resumed_from, 20);
  EXPECT_EQ(after_copy.steps.size(), 2u);
  EXPECT_FALSE(fs::exists(run + "/checkpoints/step-00000099"));
  // Named explicitly (generate --run DIR, train.init_from = DIR), a copy loads as what it holds.
  const std::string named = run + "/elsewhere/step-00000030";
  fs::create_directories(named);
  fs::copy(run + "/checkpoints/step-00000020", named);
  EXPECT_EQ(train::CheckpointStore::load(named).step, 20);
}

namespace {
// A 12-step run into `run` with checkpoints at steps 6 and 12, and its config.
train::Config twelve_steps(const std::string& data_dir, const std::string& run) {
  train::Config c = fixture::tiny_config(data_dir, run);
  c.train.steps = 12;
  c.train.checkpoint_every = 6;
  c.train.checkpoint_async = false;
  c.optim.warmup_steps = 2;
  train_run(c);
  return c;
}

// Rewrites the manifest of checkpoint directory `dir` through `edit`.
void edit_manifest(const std::string& dir, const std::function<void(nlohmann::json&)>& edit) {
  const std::string path = dir + "/manifest.json";
  nlohmann::json m = nlohmann::json::parse(std::ifstream(path));
  edit(m);
  std::ofstream(path) << m.dump();
}
}  // namespace

// A checkpoint written by a newer tessel is not damaged: the resume stops, naming it and the
// tessel to use, and keeps it (it used to fall back to step 6 and delete it as damaged).
// Whatever else loads a run's newest checkpoint (generate, eval, export, train.init_from)
// stops on it too rather than take an older one's weights.
TEST_F(TrainerTest, ACheckpointOfANewerTesselStopsTheResumeAndIsKept) {
  const std::string run = fixture::temp_dir("tessel-run");
  train::Config c = twelve_steps(data_dir, run);
  const std::string newest = run + "/checkpoints/step-00000012";
  edit_manifest(newest, [](nlohmann::json& m) { m["version"] = m["version"].get<int>() + 1; });
  c.train.steps = 18;
  fixture::expect_input_error([&] { train_run(c); },
                              {newest + "/manifest.json", "newer", "the tessel that wrote it"});
  EXPECT_TRUE(fs::exists(newest + "/manifest.json"));
  fixture::expect_input_error([&] { train::load_run_checkpoint(run); },
                              {newest + "/manifest.json", "newer"});
}

// Every checkpoint is saved between steps, where the loader stands at the start of the next
// one: a manifest whose loader position is anywhere else (edited or damaged) would replay or
// skip data, so it fails verification and the resume falls back to the previous checkpoint.
TEST_F(TrainerTest, ALoaderPositionOffItsCheckpointsStepIsDamage) {
  const std::string run = fixture::temp_dir("tessel-run");
  train::Config c = twelve_steps(data_dir, run);
  const auto resume_after = [&](const std::string& step_dir, const char* key, int64_t value,
                                int64_t steps) {
    const std::string dir = run + "/checkpoints/" + step_dir;
    edit_manifest(dir, [&](nlohmann::json& m) { m["state"]["loader"][key] = value; });
    c.train.steps = steps;
    testing::internal::CaptureStderr();
    const auto resumed = train_run(c);
    const std::string warned = testing::internal::GetCapturedStderr();
    EXPECT_NE(warned.find(dir + "/manifest.json"), std::string::npos) << warned;
    EXPECT_NE(warned.find("loader position"), std::string::npos) << warned;
    return resumed.resumed_from;
  };
  EXPECT_EQ(resume_after("step-00000012", "step", 11, 18), 6);
  EXPECT_EQ(resume_after("step-00000018", "micro", 1, 24), 12);
  // So is trainer state the resume reads in another form: once an exit 1 naming a JSON key.
  for (const auto& [edit, why] :
       {std::pair<std::function<void(nlohmann::json&)>, const char*>{
            [](nlohmann::json& s) { s["spike_norms"] = "1.0"; }, "spike_norms is not a list"},
        {[](nlohmann::json& s) {
           s["spike_norms"] = {1.0, "x"};
         },
         "spike_norms is not a list"},
        {[](nlohmann::json& s) { s.erase("compatibility"); }, "malformed trainer state"},
        {[](nlohmann::json& s) { s["compatibility"] = 3; }, "the compatibility record is not"}}) {
    const std::string dir = run + "/checkpoints/step-00000024";
    c.train.steps = 24;
    ASSERT_EQ(train_run(c).resumed_from, 24);  // nothing to train: the checkpoint stays
    edit_manifest(dir, [&](nlohmann::json& m) { edit(m["state"]); });
    testing::internal::CaptureStderr();
    EXPECT_EQ(train_run(c).resumed_from, 18);
    const std::string warned = testing::internal::GetCapturedStderr();
    EXPECT_NE(warned.find(dir + "/manifest.json: " + why), std::string::npos) << warned;
  }
}

namespace {
// A 10-step run into `run` (its last checkpoint: step 10), and its config.
train::Config ten_steps(const std::string& data_dir, const std::string& run) {
  train::Config c = fixture::tiny_config(data_dir, run);
  c.train.steps = 10;
  c.optim.warmup_steps = 2;
  train_run(c);
  return c;
}
}  // namespace

TEST_F(TrainerTest, ResumeRejectsAnIncompatibleCheckpoint) {
  train::Config c = ten_steps(data_dir, fixture::temp_dir("tessel-run"));
  c.model.width = 64;
  fixture::expect_input_error([&] { train_run(c); }, {"model.width = 32 but this run has 64"});
  c.model.width = 32;
  c.data.attention_mask = train::AttentionMaskKind::causal;  // other attention, other positions
  fixture::expect_input_error(
      [&] { train_run(c); },
      {"data.attention_mask = 'causal_document' but this run has 'causal'", "new run.dir"});
}

// An older tessel wrote floats in another form (model.norm_eps = 1.0000000000000001e-05 where
// it now writes 1e-05): its checkpoints still resume and still initialize a fine-tuning run;
// a different value is still refused.
TEST_F(TrainerTest, ResumeComparesFloatSettingsByValue) {
  const std::string run = fixture::temp_dir("tessel-run");
  train::Config c = ten_steps(data_dir, run);
  // Sets model.norm_eps in the compatibility record of checkpoint `step_dir`.
  auto rewrite_norm_eps = [&](const std::string& step_dir, const std::string& text) {
    const std::string manifest = run + "/checkpoints/" + step_dir + "/manifest.json";
    nlohmann::json m = nlohmann::json::parse(std::ifstream(manifest));
    ASSERT_EQ(m["state"]["compatibility"]["model.norm_eps"], "1e-05");
    m["state"]["compatibility"]["model.norm_eps"] = text;
    std::ofstream(manifest) << m.dump();
  };
  rewrite_norm_eps("step-00000010", "1.0000000000000001e-05");
  train::Config fine = fixture::tiny_config(data_dir, fixture::temp_dir("tessel-run"));
  fine.train.steps = 4;
  fine.optim.warmup_steps = 1;
  fine.train.init_from = run;
  EXPECT_EQ(train_run(fine).steps.size(), 4u);
  c.train.steps = 12;
  const auto resumed = train_run(c);
  EXPECT_EQ(resumed.resumed_from, 10);
  EXPECT_EQ(resumed.steps.size(), 2u);
  rewrite_norm_eps("step-00000012", "1.1e-05");
  c.train.steps = 14;
  fixture::expect_input_error([&] { train_run(c); },
                              {"model.norm_eps = 1.1e-05 but this run has 1e-05"});
}

namespace {
// 4 steps of the tiny model in a new run directory, with `moe_layers` MoE blocks of 4 experts.
train::Config four_moe_steps(const std::string& data_dir, const char* moe_layers) {
  train::Config c = fixture::tiny_config(data_dir, fixture::temp_dir("tessel-run"));
  c.train.steps = 4;
  c.optim.warmup_steps = 1;
  c.model.moe_layers = moe_layers;
  c.model.moe.experts = 4;
  return c;
}
}  // namespace

// Top-1 routing with normalized gates (every gate p / p = 1: the router never learns) is
// refused for a run that starts, but a checkpoint an earlier tessel trained with it still
// resumes, and generate, eval and export still load it.
TEST_F(TrainerTest, TopOneWithNormalizedGatesIsRefusedForANewRunOnly) {
  train::Config c = four_moe_steps(data_dir, "all");
  c.model.moe.top_k = 1;
  fixture::expect_input_error([&] { train_run(c); },
                              {"model.moe_top_k = 1 with model.moe_normalize_gates = true"});
  c.model.moe.top_k = 2;
  train_run(c);
  // The same checkpoint as of top-1, as an earlier tessel wrote it (the router's shape does
  // not depend on k).
  edit_manifest(c.run.dir + "/checkpoints/step-00000004", [](nlohmann::json& m) {
    m["state"]["compatibility"]["model.moe_top_k"] = "1";
    std::string config = m["state"]["config"];
    const size_t at = config.find("moe_top_k = 2\n");
    ASSERT_NE(at, std::string::npos);
    m["state"]["config"] = config.replace(at, 13, "moe_top_k = 1");
  });
  c.model.moe.top_k = 1;
  c.train.steps = 5;
  EXPECT_EQ(train_run(c).resumed_from, 4);
  EXPECT_EQ(train::load_run_model(c.run.dir).config.model.moe.top_k, 1);
}

// model.moe_layers names blocks: "0,1", "1,0" and "all" are one setting on the 2-block model,
// and its checkpoint resumes under any of them; another set of blocks is refused.
TEST_F(TrainerTest, ResumeComparesMoeBlocksNotTheirSpelling) {
  train::Config c = four_moe_steps(data_dir, "0,1");
  train_run(c);
  c.model.moe_layers = "1";
  c.train.steps = 5;
  fixture::expect_input_error([&] { train_run(c); },
                              {"model.moe_layers = '0,1' but this run has '1'"});
  c.model.moe_layers = "all";
  EXPECT_EQ(train_run(c).resumed_from, 4);
  c.model.moe_layers = "1,0";
  c.train.steps = 6;
  EXPECT_EQ(train_run(c).resumed_from, 5);
  // A record naming a block this model lacks is another setting, not an error of its own.
  const std::string manifest = c.run.dir + "/checkpoints/step-00000006/manifest.json";
  nlohmann::json m = nlohmann::json::parse(std::ifstream(manifest));
  m["state"]["compatibility"]["model.moe_layers"] = "'0,7'";
  std::ofstream(manifest) << m.dump();
  c.train.steps = 7;
  fixture::expect_input_error([&] { train_run(c); },
                              {"model.moe_layers = '0,7' but this run has '1,0'"});
}

// A checkpoint of an older tessel lacks the keys added since; it ran as their defaults, so a
// run at the default resumes from it and a run with another value is refused, naming both.
// A key it had without recording it (data.attention_mask) is compared with its config.
TEST_F(TrainerTest, AKeyAnOlderCheckpointLacksMatchesOnlyItsDefault) {
  const std::string run = fixture::temp_dir("tessel-run");
  train::Config c = ten_steps(data_dir, run);
  const std::string manifest = run + "/checkpoints/step-00000010/manifest.json";
  nlohmann::json m = nlohmann::json::parse(std::ifstream(manifest));
  ASSERT_EQ(m["state"]["compatibility"].erase("model.attention_window"), 1u);
  ASSERT_EQ(m["state"]["compatibility"].erase("data sets (normalized data.weights)"), 1u);
  ASSERT_EQ(m["state"]["compatibility"].erase("model.moe_lei_margin"), 1u);
  ASSERT_EQ(m["state"]["compatibility"].erase("model.moe_lei_loss"), 1u);
  ASSERT_EQ(m["state"]["compatibility"].erase("model.moe_hist_bins"), 1u);
  ASSERT_EQ(m["state"]["compatibility"].erase("data.attention_mask"), 1u);
  std::ofstream(manifest) << m.dump();
  // A key that older tessel had but did not record is compared with the checkpoint's config.
  c.data.attention_mask = train::AttentionMaskKind::causal;
  fixture::expect_input_error([&] { train_run(c); },
                              {"checkpoint has data.attention_mask = 'causal_document' (in its "
                               "stored config) but this run has 'causal'"});
  c.data.attention_mask = train::AttentionMaskKind::causal_document;
  c.train.steps = 12;
  c.model.moe.hist_bins = 64;
  fixture::expect_input_error([&] { train_run(c); },
                              {"has no model.moe_hist_bins", "an older tessel",
                               "model.moe_hist_bins = 1000, and this run has 64"});
  c.model.moe.hist_bins = 1000;
  c.model.moe.lei_loss = moe::LeiLoss::maxvio;
  fixture::expect_input_error([&] { train_run(c); },
                              {"has no model.moe_lei_loss", "an older tessel",
                               "model.moe_lei_loss = 'centered_fsq', and this run has "
                               "'maxvio'"});
  c.model.moe.lei_loss = moe::LeiLoss::centered_fsq;
  c.model.moe.lei_margin = moe::LeiMargin::topk;
  fixture::expect_input_error([&] { train_run(c); }, {"has no model.moe_lei_margin", "'midpoint'"});
  c.model.moe.lei_margin = moe::LeiMargin::midpoint;
  c.model.attention_window = 4;
  fixture::expect_input_error([&] { train_run(c); },
                              {"has no model.attention_window", "an older tessel",
                               "model.attention_window = 0, and this run has 4"});
  c.model.attention_window = 0;
  c.data.path = data_dir + "," + fixture::make_other_dataset(fixture::temp_dir("tessel-data"));
  c.data.weights = "1,1";
  fixture::expect_input_error([&] { train_run(c); },
                              {"has no data sets (normalized data.weights)",
                               "data sets (normalized data.weights) = 1.0, and this run has "
                               "0.5,0.5"});
  c.data.path = data_dir;
  c.data.weights = "";
  EXPECT_EQ(train_run(c).resumed_from, 10);
}

// optim.schedule = "wsd" reaches the optimizer: each step's lr is the schedule's (6 steps,
// decay_fraction 0.5: the peak for steps 1-3, then linear to min_lr at step 6), and before
// its decay a run does not depend on train.steps: a 12-step run's first 3 steps are bitwise
// the 6-step run's (a cosine run's are not).
TEST_F(TrainerTest, AWsdScheduleHoldsThePeakUntilItsDecay) {
  auto run = [&](int64_t steps, const char* schedule) {
    train::Config c = fixture::tiny_config(data_dir, fixture::temp_dir("tessel-wsd"));
    c.train.steps = steps;
    c.optim.warmup_steps = 1;
    c.optim.schedule =
        std::string(schedule) == "wsd" ? optim::LrScheduleKind::wsd : optim::LrScheduleKind::cosine;
    c.optim.decay_fraction = 0.5;
    return train_run(c);
  };
  const auto six = run(6, "wsd"), twelve = run(12, "wsd");
  const double lr = fixture::tiny_config(data_dir, "").optim.lr,
               min_lr = fixture::tiny_config(data_dir, "").optim.min_lr;
  ASSERT_EQ(six.steps.size(), 6u);
  const double want[] = {lr, lr, lr, lr - (lr - min_lr) / 3, lr - 2 * (lr - min_lr) / 3, min_lr};
  for (size_t i = 0; i < 6; ++i) EXPECT_NEAR(six.steps[i].lr, want[i], 1e-15 * lr) << i;
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(six.steps[i].loss, twelve.steps[i].loss) << i;
  EXPECT_NE(run(6, "cosine").steps[2].loss, run(12, "cosine").steps[2].loss);
}

// A gradient spike injected at step 9 (fault.spike_step: x1000) is skipped under
// train.spike_factor and no other step is; the record names it. With a factor that never
// triggers, the run equals one without the filter bitwise. A run resumed after its checkpoint
// at step 6 restores the window and continues bitwise (constant schedule: train.steps may grow).
TEST_F(TrainerTest, AGradientSpikeIsSkipped) {
  auto config = [&](double factor, int64_t steps, const std::string& run) {
    train::Config c = fixture::tiny_config(data_dir, run);
    c.train.steps = steps;
    c.train.checkpoint_every = 6;
    c.optim.warmup_steps = 1;
    c.optim.schedule = optim::LrScheduleKind::constant;
    c.train.spike_factor = factor;
    c.train.spike_window = 4;
    c.fault.spike_step = 9;
    return c;
  };
  const auto skipped = train_run(config(5, 12, fixture::temp_dir("tessel-spike")));
  ASSERT_EQ(skipped.steps.size(), 12u);
  for (const auto& r : skipped.steps) EXPECT_EQ(r.skipped, r.step == 9) << r.step;
  EXPECT_GT(skipped.steps[8].grad_norm, 100 * skipped.steps[7].grad_norm);
  const auto unfiltered = train_run(config(0, 12, fixture::temp_dir("tessel-spike")));
  const auto never = train_run(config(1e9, 12, fixture::temp_dir("tessel-spike")));
  for (size_t i = 0; i < 12; ++i) EXPECT_EQ(never.steps[i].loss, unfiltered.steps[i].loss) << i;
  // The spike's update, clipped but applied, moves the run away from the skipping one.
  EXPECT_NE(unfiltered.steps[9].loss, skipped.steps[9].loss);
  const std::string run = fixture::temp_dir("tessel-spike");
  train_run(config(5, 7, run));  // checkpoints at 6 and 7, before the spike
  const auto resumed = train_run(config(5, 12, run));
  ASSERT_EQ(resumed.steps.size(), 5u);
  for (size_t i = 0; i < 5; ++i) {
    EXPECT_EQ(resumed.steps[i].loss, skipped.steps[7 + i].loss) << i;
    EXPECT_EQ(resumed.steps[i].skipped, skipped.steps[7 + i].skipped) << i;
  }
  std::ifstream metrics(run + "/metrics.jsonl");
  int records = 0;
  for (std::string line; std::getline(metrics, line);) {
    const auto j = nlohmann::json::parse(line);
    if (!j.contains("skipped")) continue;
    ++records;
    EXPECT_EQ(j["step"], 9);
    EXPECT_GT(j["skipped"]["spike_median"].get<double>(), 0);
  }
  EXPECT_EQ(records, 1);
}

// A skipped spike in an MoE model leaves no balancing statistics behind (they are not
// checkpointed): with a checkpoint at the skipped step, the resumed run equals the
// uninterrupted one bitwise, under EQB + LEI and the global-batch aux loss.
TEST_F(TrainerTest, ASkippedSpikeLeavesNoMoeBalancingBehind) {
  for (const char* balance : {"eqb_lei", "aux_global"}) {
    SCOPED_TRACE(balance);
    auto config = [&](int64_t steps, const std::string& run) {
      return train::load_config("", {"data.path=" + data_dir,
                                     "run.dir=" + run,
                                     "run.quiet=true",
                                     "run.threads=1",
                                     "model.layers=2",
                                     "model.width=32",
                                     "model.heads=4",
                                     "model.max_seq=16",
                                     "train.seq_len=16",
                                     "train.micro_batch=2",
                                     "train.steps=" + std::to_string(steps),
                                     "train.checkpoint_every=9",
                                     "optim.warmup_steps=1",
                                     "optim.schedule=constant",
                                     "train.sample_tokens=0",
                                     "model.moe_layers=all",
                                     "model.moe_experts=4",
                                     std::string("model.moe_balance=") + balance,
                                     "train.spike_factor=5",
                                     "train.spike_window=4",
                                     "fault.spike_step=9"});
    };
    const auto whole = train_run(config(12, fixture::temp_dir("tessel-spike-moe")));
    ASSERT_TRUE(whole.steps[8].skipped);
    const std::string run = fixture::temp_dir("tessel-spike-moe");
    train_run(config(9, run));
    const auto resumed = train_run(config(12, run));
    ASSERT_EQ(resumed.steps.size(), 3u);
    for (size_t i = 0; i < 3; ++i) EXPECT_EQ(resumed.steps[i].loss, whole.steps[9 + i].loss) << i;
  }
}

// train.init_from may change how MoE balancing trains (aux -> eqb_lei, with LEI's margin and
// loss; aux -> qb_hist with its bin count) but not switch to expert choice, whose gates (raw router
// scores) make the same weights compute another function.
TEST_F(TrainerTest, FineTuningMayChangeTheBalanceButNotSwitchToExpertChoice) {
  auto config = [&](const std::vector<std::string>& balance, const std::string& run,
                    const std::string& from) {
    train::Config c = fixture::tiny_config(data_dir, run);
    c.train.steps = 3;
    c.optim.warmup_steps = 1;
    c.train.init_from = from;
    for (const char* kv : {"model.moe_layers=all", "model.moe_experts=4"})
      train::apply_override(c, kv);
    for (const std::string& kv : balance) train::apply_override(c, kv);
    return c;
  };
  const std::string base = fixture::temp_dir("tessel-run");
  train_run(config({"model.moe_balance=aux"}, base, ""));
  EXPECT_EQ(train_run(config({"model.moe_balance=eqb_lei", "model.moe_lei_margin=exact_margin",
                              "model.moe_lei_loss=totalvio"},
                             fixture::temp_dir("tessel-run"), base))
                .steps.size(),
            3u);
  EXPECT_EQ(train_run(config({"model.moe_balance=qb_hist", "model.moe_hist_bins=64"},
                             fixture::temp_dir("tessel-run"), base))
                .steps.size(),
            3u);
  fixture::expect_input_error(
      [&] {
        train_run(
            config({"model.moe_balance=expert_choice"}, fixture::temp_dir("tessel-run"), base));
      },
      {"holds another model", "model.moe_balance"});
}

TEST_F(TrainerTest, MissingDatasetNamesTheFile) {
  train::Config c = fixture::tiny_config("/nonexistent/data", fixture::temp_dir("tessel-run"));
  fixture::expect_input_error([&] { train_run(c); }, {"/nonexistent/data/train.tok"});
}

TEST_F(TrainerTest, WorldSizeMustMatchTheMesh) {
  train::Config c = fixture::tiny_config(data_dir, fixture::temp_dir("tessel-run"));
  c.parallel.dp = 2;
  fixture::expect_input_error([&] { train_run(c); }, {"parallel.dp"});
}

TEST_F(TrainerTest, FreshRunRefusesADirectoryWithCheckpoints) {
  train::Config c = fixture::tiny_config(data_dir, fixture::temp_dir("tessel-run"));
  c.train.steps = 6;
  c.optim.warmup_steps = 1;
  train_run(c);
  c.train.resume = false;
  fixture::expect_input_error([&] { train_run(c); }, {"train.resume"});
}

// A `checkpoints` that is a file would stop the run at its first save, after the steps before
// it: the start refuses it.
TEST_F(TrainerTest, ACheckpointsPathThatIsAFileIsRefusedAtTheStart) {
  const std::string run = fixture::temp_dir("tessel-run");
  std::ofstream(run + "/checkpoints") << "x";
  train::Config c = fixture::tiny_config(data_dir, run);
  c.train.steps = 4;
  c.optim.warmup_steps = 1;
  fixture::expect_input_error([&] { train_run(c); },
                              {"run.dir", run + "/checkpoints exists and is not a directory"});
  EXPECT_FALSE(fs::exists(run + "/metrics.jsonl")) << "it trained";
}

TEST_F(TrainerTest, ARunDirectoryTakesOneRunAtATime) {
  train::Config c = fixture::tiny_config(data_dir, fixture::temp_dir("tessel-run"));
  comm::SingleCommunicator world;
  train::Trainer first(c, world);  // holds the lock until destroyed
  fixture::expect_input_error([&] { train::Trainer second(c, world); },
                              {"in use by another tessel run"});
}

TEST_F(TrainerTest, DataVocabularyMustFitTheModel) {
  train::Config c = fixture::tiny_config(data_dir, fixture::temp_dir("tessel-run"));
  c.model.vocab = 100;  // byte shards hold ids up to 255
  fixture::expect_input_error([&] { train_run(c); }, {"model.vocab", "train.tok"});
}

namespace {
// A token shard at `path` of 8 documents of 50 ids below `vocab` (the largest among them).
void write_shard(const std::string& path, data::TokenDtype dtype, int64_t vocab) {
  data::ShardWriter shard(path, dtype, vocab);
  for (int64_t d = 0; d < 8; ++d) {
    std::vector<int32_t> ids(50);
    for (int64_t i = 0; i < 50; ++i) ids[size_t(i)] = int32_t((d * 50 + i * 7) % vocab);
    shard.add_document(ids);
  }
  shard.finish();
}
}  // namespace

// A val.tok from another prepare than its train.tok (another vocabulary or dtype) is refused
// before any step: it would fail at the first validation, the steps before it lost (a
// vocabulary beyond the model's), or be validated silently as other ids.
TEST_F(TrainerTest, AValidationShardOfAnotherVocabularyIsRefusedAtTheStart) {
  using data::TokenDtype;
  struct Case {
    TokenDtype train_dtype;
    int64_t train_vocab;
    TokenDtype val_dtype;
    int64_t val_vocab, model_vocab;
  };
  for (const Case& k : {Case{TokenDtype::u8, 256, TokenDtype::u16, 300, 256},
                        Case{TokenDtype::u16, 300, TokenDtype::u8, 256, 300},
                        Case{TokenDtype::u16, 256, TokenDtype::u8, 256, 256},
                        Case{TokenDtype::u16, 300, TokenDtype::u16, 300, 300}}) {
    const std::string dir = fixture::temp_dir("tessel-data"), run = fixture::temp_dir("tessel-run");
    write_shard(dir + "/train.tok", k.train_dtype, k.train_vocab);
    write_shard(dir + "/val.tok", k.val_dtype, k.val_vocab);
    train::Config c = fixture::tiny_config(dir, run);
    c.model.vocab = k.model_vocab;
    c.train.steps = 2;
    c.train.eval_every = 1;
    c.optim.warmup_steps = 1;
    if (k.val_dtype == k.train_dtype && k.val_vocab == k.train_vocab) {
      EXPECT_EQ(train_run(c).validation.size(), 2u) << "one prepare's pair trains";
      continue;
    }
    SCOPED_TRACE(dir);
    fixture::expect_input_error(
        [&] { train_run(c); },
        {dir + "/val.tok: token vocabulary " + std::to_string(k.val_vocab),
         dir + "/train.tok has " + std::to_string(k.train_vocab), "different prepares"});
    EXPECT_FALSE(fs::exists(run + "/checkpoints/step-00000001")) << "it trained";
  }
}

// A dataset.json that does not describe the shards beside it (edited, or another prepare's)
// is refused before any step, for val.tok as for train.tok: its tokenizer would sample the
// ids, and the run would copy it as what the ids mean.
TEST_F(TrainerTest, ADescriptionOfOtherShardsIsRefusedAtTheStart) {
  const std::string dir = fixture::temp_dir("tessel-data");
  fs::copy(data_dir, dir, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
  const nlohmann::json original = nlohmann::json::parse(std::ifstream(dir + "/dataset.json"));
  train::Config c = fixture::tiny_config(dir, fixture::temp_dir("tessel-run"));
  c.train.steps = 2;
  c.optim.warmup_steps = 1;
  auto edited = [&](const char* split, const char* key, int64_t add) {
    nlohmann::json j = original;
    (split ? j[split] : j)[key] = (split ? j[split] : j)[key].get<int64_t>() + add;
    std::ofstream(dir + "/dataset.json") << j.dump();
  };
  edited(nullptr, "vocab_size", 44);
  fixture::expect_input_error(
      [&] { train_run(c); },
      {dir + "/dataset.json does not describe " + dir + "/train.tok", "\"vocab_size\": 300",
       "vocabulary of 256 ids", "prepare the data set again"});
  edited("val", "tokens", 1);
  fixture::expect_input_error([&] { train_run(c); }, {dir + "/val.tok", "\"val\": {\"tokens\""});
  edited("train", "documents", -1);
  fixture::expect_input_error([&] { train_run(c); }, {dir + "/train.tok", "documents"});
  // "byte" over shards of another vocabulary (a BPE data set's, with its name edited).
  write_shard(dir + "/train.tok", data::TokenDtype::u16, 300);
  write_shard(dir + "/val.tok", data::TokenDtype::u16, 300);
  std::ofstream(dir + "/dataset.json") << R"({"tokenizer": "byte"})";
  c.model.vocab = 300;
  fixture::expect_input_error([&] { train_run(c); },
                              {"\"tokenizer\": \"byte\" (256 ids)", "vocabulary of 300 ids"});
  std::ofstream(dir + "/dataset.json") << R"({"tokenizer": "pretokenized u16, eot 299"})";
  EXPECT_NO_THROW(train_run(c));
}

namespace {
// Every tensor of both checkpoints, bitwise.
void expect_same_checkpoint(const std::string& a_dir, const std::string& b_dir) {
  auto a = train::CheckpointStore::load(a_dir), b = train::CheckpointStore::load(b_dir);
  EXPECT_EQ(a.step, b.step);
  ASSERT_EQ(a.model.size(), b.model.size());
  ASSERT_EQ(a.optimizer.size(), b.optimizer.size());
  for (size_t i = 0; i < a.model.size(); ++i)
    EXPECT_EQ(
        std::memcmp(a.model[i].tensor.raw(), b.model[i].tensor.raw(), a.model[i].tensor.bytes()), 0)
        << a.model[i].name;
  for (size_t i = 0; i < a.optimizer.size(); ++i)
    EXPECT_EQ(std::memcmp(a.optimizer[i].tensor.raw(), b.optimizer[i].tensor.raw(),
                          a.optimizer[i].tensor.bytes()),
              0)
        << a.optimizer[i].name;
}
}  // namespace

TEST_F(TrainerTest, FastStartAndAsyncCheckpointsLeaveTheRunBitwiseUnchanged) {
  train::Config c = fixture::tiny_config(data_dir, fixture::temp_dir("tessel-run"));
  c.train.steps = 12;
  c.train.checkpoint_every = 3;
  auto fast = train_run(c);  // fast start, asynchronous checkpoints (the defaults)
  train::Config slow = c;
  slow.run.dir = fixture::temp_dir("tessel-run");
  slow.train.fast_start = false;
  slow.train.checkpoint_async = false;
  auto plain = train_run(slow);
  ASSERT_EQ(fast.steps.size(), plain.steps.size());
  for (size_t i = 0; i < fast.steps.size(); ++i)
    EXPECT_EQ(fast.steps[i].loss, plain.steps[i].loss) << "step " << i + 1;
  for (const char* step : {"/checkpoints/step-00000009", "/checkpoints/step-00000012"})
    expect_same_checkpoint(c.run.dir + step, slow.run.dir + step);
}

// Fast start takes the GEMM peak from gemm_peak.json, but not one too small for a finite MFU
// (a hand-edited file): that is measured again (it made every step's MFU infinite, null in
// metrics.jsonl).
TEST_F(TrainerTest, ACachedPeakTooSmallForAFiniteMfuIsMeasuredAgain) {
  for (const double cached : {1e-3, 1e-310}) {
    train::Config c = fixture::tiny_config(data_dir, fixture::temp_dir("tessel-run"));
    c.train.steps = 6;      // past optim.warmup_steps = 5
    c.mfu.peak_gflops = 0;  // measure, or with fast start take the cached peak
    std::ofstream(c.run.dir + "/gemm_peak.json")
        << nlohmann::json{{"key", {{"ranks", 1}, {"threads", 1}}}, {"peak_gflops", cached}};
    const auto r = train_run(c);
    if (cached >= train::kMinPeakGflops)
      EXPECT_EQ(r.peak_gflops, cached);
    else
      EXPECT_GE(r.peak_gflops, train::kMinPeakGflops);
    for (const auto& step : r.steps) EXPECT_TRUE(std::isfinite(step.mfu)) << step.mfu;
  }
}

TEST_F(TrainerTest, YoungAndDalyPoliciesChooseTheIntervalFromTheFormula) {
  for (const char* policy : {"young", "daly"}) {
    train::Config c = fixture::tiny_config(data_dir, fixture::temp_dir("tessel-run"));
    c.train.steps = 30;
    c.train.checkpoint_every = 2;  // the first interval
    c.train.checkpoint_policy = policy;
    c.train.mtbf_seconds = 0.5;  // tiny: frequent checkpoints
    c.train.keep_checkpoints = 100;
    train_run(c);
    std::ifstream in(c.run.dir + "/metrics.jsonl");
    std::vector<int64_t> saved_after;  // interval decisions: step, interval
    int decisions = 0;
    for (std::string line; std::getline(in, line);) {
      auto j = nlohmann::json::parse(line);
      if (j.value("event", "") != "checkpoint_interval") continue;
      ++decisions;
      int64_t want = train::checkpoint_interval_steps(
          policy, 2, j["blocking_seconds"].get<double>(), j["mtbf_seconds"].get<double>(),
          j["step_seconds"].get<double>());
      EXPECT_EQ(j["interval_steps"].get<int64_t>(), want) << policy << ": " << line;
      // The next checkpoint exists at (save step) + interval, if within the run.
      int64_t next = j["step"].get<int64_t>() - 1 + want;
      if (next < c.train.steps) {
        EXPECT_TRUE(fs::exists(
            c.run.dir + "/checkpoints/" +
            (std::ostringstream() << "step-" << std::setw(8) << std::setfill('0') << next).str()))
            << policy << " " << next;
      }
    }
    EXPECT_GE(decisions, 1) << policy;
  }
}

TEST_F(TrainerTest, ACorruptedShardIsFoundOnResumeByItsChecksum) {
  std::string run = fixture::temp_dir("tessel-run");
  train::Config c = fixture::tiny_config(data_dir, run);
  c.train.steps = 8;
  c.train.checkpoint_every = 4;
  c.fault.corrupt_step = 8;  // flips a byte of the final checkpoint once it is committed
  train_run(c);
  std::string dir = run + "/checkpoints/step-00000008";
  fixture::expect_input_error([&] { train::CheckpointStore::load(dir); },
                              {dir + "/model-00000-of-00001.safetensors", "checksum mismatch"});
  c.fault.corrupt_step = 0;
  c.train.steps = 10;
  auto resumed = train_run(c);
  EXPECT_EQ(resumed.resumed_from, 4);  // the damaged step 8 was passed over
}
