// The pipeline path of the trainer in one process (parallel.pp = 1, pipeline.schedule set):
// every schedule through the stage executor equals the plain trainer bitwise (spec C1).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "support/expect_input_error.hpp"
#include "support/pipeline_fixture.hpp"
#include "support/train_fixture.hpp"
#include "tessel/comm/single_communicator.hpp"
#include "tessel/train/pipeline_trainer.hpp"
#include "tessel/train/trainer.hpp"

using namespace tessel;

using fixture::train_run;

namespace {

struct PipelineTrainerTest : ::testing::Test {
  std::string data = fixture::make_dataset(fixture::temp_dir("tessel-ptrain") + "/data");
  train::Config config = fixture::tiny_config(data, "");
  void SetUp() override {
    config.train.steps = 8;
    config.train.accum = 3;
    config.train.eval_every = 3;
    config.train.grad_clip = 0.5;  // clipping fires in the early steps
  }
  std::string fresh_dir() { return fixture::temp_dir("tessel-ptrain-run"); }
};

}  // namespace

TEST_F(PipelineTrainerTest, OneStageEqualsThePlainTrainerUnderEverySchedule) {
  config.run.dir = fresh_dir();
  const auto plain = train_run(config);
  const auto plain_weights = fixture::final_weights(config.run.dir);
  bool clipped = false;
  for (const auto& s : plain.steps) clipped = clipped || s.grad_norm > config.train.grad_clip;
  EXPECT_TRUE(clipped) << "the comparison should cover a clipped step";
  for (const char* schedule : {"gpipe", "1f1b", "paci"}) {
    SCOPED_TRACE(schedule);
    train::Config c = config;
    c.pipeline.schedule = schedule;
    c.run.dir = fresh_dir();
    const auto piped = train_run(c);
    fixture::expect_same_steps(piped, plain);
    fixture::expect_same_weights(fixture::final_weights(c.run.dir), plain_weights);
    // metrics.jsonl names the schedule and the stage's record in every step.
    std::ifstream in(c.run.dir + "/metrics.jsonl");
    int steps = 0;
    for (std::string line; std::getline(in, line);) {
      auto j = nlohmann::json::parse(line);
      if (!j.contains("loss")) continue;
      ++steps;
      EXPECT_EQ(j["pipeline"]["schedule"], schedule);
      EXPECT_EQ(j["pipeline"]["stages"].size(), 1u);
      EXPECT_EQ(j["pipeline"]["stages"][0]["max_version_gap"], 0);
      EXPECT_EQ(j["pipeline"]["stages"][0]["peak_live_activations"],
                std::string(schedule) == "gpipe" ? 3 : 1);
    }
    EXPECT_EQ(steps, 8);
  }
}

// PACI keeps no spike window: resumed from a 1F1B checkpoint that holds one, its own
// checkpoint holds none, so a later resume without PACI does not compare the norm with norms
// from before the PACI steps (PACI's stages have no common norm to add to it).
TEST_F(PipelineTrainerTest, PaciKeepsNoSpikeWindow) {
  config.run.dir = fresh_dir();
  config.pipeline.schedule = "1f1b";
  config.train.spike_factor = 1000;  // never skips; the window fills all the same
  config.train.spike_window = 2;
  config.optim.warmup_steps = 1;
  config.train.checkpoint_every = 4;
  config.train.steps = 4;
  train_run(config);
  auto window = [&](const char* step) {
    const std::string manifest =
        config.run.dir + "/checkpoints/step-0000000" + step + "/manifest.json";
    return nlohmann::json::parse(std::ifstream(manifest))["state"]["spike_norms"].size();
  };
  EXPECT_EQ(window("4"), 2u);
  config.pipeline.schedule = "paci";
  config.train.spike_factor = 0;
  config.train.steps = 8;
  EXPECT_EQ(train_run(config).resumed_from, 4);
  EXPECT_EQ(window("8"), 0u);
}

TEST_F(PipelineTrainerTest, UnsupportedCombinationsAreClearErrors) {
  config.run.dir = fresh_dir();
  auto with = [&](std::vector<std::string> overrides) {
    overrides.push_back("data.path=" + data);
    return [&, overrides] { train::load_config("", overrides); };
  };
  fixture::expect_input_error(with({"pipeline.schedule=zb"}), {"pipeline.schedule", "zb"});
  for (std::string key : {"pipeline.layout=2", "pipeline.paci_k=2", "pipeline.paci_stash=true",
                          "pipeline.paci_predict=1", "pipeline.chunks=2"})
    fixture::expect_input_error(with({key}), {key.substr(0, key.find('=')), "parallel.pp > 1"});
  fixture::expect_input_error(with({"pipeline.schedule=1f1b", "pipeline.layout=1,1"}),
                              {"pipeline.layout", "parallel.pp = 1"});
  fixture::expect_input_error(with({"parallel.pp=2", "model.layers=4", "pipeline.layout=1,2"}),
                              {"pipeline.layout", "model.layers = 4"});
  fixture::expect_input_error(
      with({"parallel.pp=2", "pipeline.schedule=paci", "model.tied_head=true"}),
      {"model.tied_head", "paci"});
  fixture::expect_input_error(
      with({"parallel.pp=2", "pipeline.schedule=paci", "model.tied_head=false",
            "train.checkpoint_policy=young", "train.checkpoint_every=5"}),
      {"train.checkpoint_policy", "paci"});
  fixture::expect_input_error(with({"parallel.pp=2", "pipeline.paci_k=-1"}), {"pipeline.paci_k"});
  fixture::expect_input_error(with({"parallel.pp=2", "pipeline.paci_stash=true"}),
                              {"pipeline.paci_stash", "paci"});
  fixture::expect_input_error(with({"parallel.pp=2", "pipeline.paci_predict=1"}),
                              {"pipeline.paci_predict", "paci"});
  fixture::expect_input_error(
      with({"parallel.pp=2", "pipeline.schedule=paci", "pipeline.paci_predict=-0.5"}),
      {"pipeline.paci_predict", "[0, 4]", "-0.5"});
  fixture::expect_input_error(with({"pipeline.schedule=paci", "pipeline.paci_predict=0.5"}),
                              {"pipeline.paci_predict", "parallel.pp > 1"});
  fixture::expect_input_error(
      with({"parallel.pp=2", "pipeline.schedule=paci", "model.tied_head=false",
            "pipeline.paci_stash=true", "pipeline.paci_predict=1"}),
      {"pipeline.paci_stash", "pipeline.paci_predict", "at most one"});
  fixture::expect_input_error(
      with({"parallel.pp=2", "pipeline.schedule=1f1b", "pipeline.paci_k=2"}),
      {"pipeline.paci_k", "pipeline.schedule = paci"});
  // Interleaved: chunks >= 2 (0 = 2), pp >= 2, accum in groups of pp, a block for every middle
  // virtual stage, a layout per virtual stage.
  fixture::expect_input_error(
      with({"parallel.pp=2", "pipeline.schedule=1f1b", "pipeline.chunks=2"}),
      {"pipeline.chunks", "pipeline.schedule = interleaved"});
  for (const char* chunks : {"pipeline.chunks=1", "pipeline.chunks=-2"})
    fixture::expect_input_error(
        with({"parallel.pp=2", "pipeline.schedule=interleaved", chunks}),
        {"pipeline.chunks", ">= 2", chunks + std::string("pipeline.chunks=").size()});
  fixture::expect_input_error(with({"pipeline.schedule=interleaved"}),
                              {"interleaved", "parallel.pp >= 2"});
  fixture::expect_input_error(
      with({"parallel.pp=2", "pipeline.schedule=interleaved", "train.accum=3"}),
      {"train.accum", "parallel.pp = 2", "got 3"});
  fixture::expect_input_error(
      with({"parallel.pp=2", "pipeline.schedule=interleaved", "train.accum=2", "model.layers=1"}),
      {"model.layers = 1", "parallel.pp x pipeline.chunks = 4"});
  fixture::expect_input_error(
      with({"parallel.pp=2", "pipeline.schedule=interleaved", "train.accum=2", "model.layers=4",
            "pipeline.layout=2,2"}),
      {"pipeline.layout", "2 stage(s)", "parallel.pp x pipeline.chunks = 4"});
  EXPECT_NO_THROW(with({"parallel.pp=2", "pipeline.schedule=interleaved", "train.accum=2",
                        "model.layers=4", "pipeline.layout=1,1,1,1"})());
  // The stash keeps one version: 3 stages with K = 1 would have gaps of 2.
  fixture::expect_input_error(with({"parallel.pp=3", "model.layers=3", "pipeline.schedule=paci",
                                    "pipeline.paci_stash=true", "pipeline.paci_k=1"}),
                              {"pipeline.paci_stash", "parallel.pp - 1 = 2", "got 1"});
  // A stale backward's recomputed forward would see newer weights unless the stash restores
  // the forward's; with the stash (and under the flush schedules) recomputation is accepted.
  fixture::expect_input_error(with({"parallel.pp=2", "pipeline.schedule=paci",
                                    "model.tied_head=false", "train.recompute=blocks"}),
                              {"train.recompute", "pipeline.paci_stash"});
  EXPECT_NO_THROW(with({"parallel.pp=2", "pipeline.schedule=paci", "model.tied_head=false",
                        "train.recompute=blocks", "pipeline.paci_stash=true"})());
  EXPECT_NO_THROW(with({"parallel.pp=2", "pipeline.schedule=1f1b", "train.recompute=blocks"})());
}

TEST_F(PipelineTrainerTest, ParametersBelongToTheStageOfTheirPiece) {
  config.model.layers = 4;
  for (bool tied : {false, true}) {
    config.model.tied_head = tied;
    model::Gpt model(config.model, 1);
    // Layout 0,3,1: the first stage holds only the embedding.
    const auto stages = train::parameter_stages(model, {0, 0, 3, 4}, 3);
    ASSERT_EQ(stages.size(), model.parameters().size());
    for (size_t i = 0; i < stages.size(); ++i) {
      const std::string& name = model.parameters()[i].name;
      int want = 2;  // final norm, head
      if (name == "embed.weight") want = 0;
      if (name.rfind("blocks.", 0) == 0) want = name[7] == '3' ? 2 : 1;
      EXPECT_EQ(stages[i], want) << name;
    }
    // Interleaved, 2 stages x 2 chunks of one block: virtual stage j (block j) on stage j % 2.
    const auto interleaved = train::parameter_stages(model, {0, 1, 2, 3, 4}, 2);
    for (size_t i = 0; i < interleaved.size(); ++i) {
      const std::string& name = model.parameters()[i].name;
      int want = 1;  // final norm, head: the last stage
      if (name == "embed.weight") want = 0;
      if (name.rfind("blocks.", 0) == 0) want = (name[7] - '0') % 2;
      EXPECT_EQ(interleaved[i], want) << name;
    }
  }
}

// A pipeline checkpoint resumes without the pipeline and a plain one with it: the stage's
// optimizer state, saved as "stage0/...", is found by its name without the stage, so with
// AdamW and Muon either continues bitwise as the uninterrupted run (at pp = 1 every schedule
// equals the plain trainer): losses, norms, validation and the final weights.
TEST_F(PipelineTrainerTest, ResumesAcrossThePipelineAndThePlainLoopBitwise) {
  config.train.checkpoint_every = 4;
  for (const char* optimizer : {"adamw", "muon"})
    for (bool piped_first : {true, false}) {
      SCOPED_TRACE(std::string(optimizer) + (piped_first ? ", pipeline first" : ", plain first"));
      train::Config first = config;
      first.optim.name = optimizer;
      first.run.dir = fresh_dir();
      if (piped_first) first.pipeline.schedule = "1f1b";
      const auto full = train_run(first);
      const auto full_weights = fixture::final_weights(first.run.dir);
      std::filesystem::remove_all(first.run.dir + "/checkpoints/step-00000008");
      train::Config second = first;
      second.pipeline.schedule = piped_first ? "" : "1f1b";
      const auto resumed = train_run(second);
      EXPECT_EQ(resumed.resumed_from, 4);
      fixture::expect_same_steps(resumed, fixture::after_step(full, 4));
      fixture::expect_same_weights(fixture::final_weights(second.run.dir), full_weights);
    }
}
