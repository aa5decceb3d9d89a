#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include "support/expect_input_error.hpp"
#include "support/train_fixture.hpp"
#include "tessel/comm/single_communicator.hpp"
#include "tessel/core/error.hpp"
#include "tessel/train/trainer.hpp"

using namespace tessel;
namespace fs = std::filesystem;

namespace {

train::TrainResult train_run(const train::Config& config) {
  comm::SingleCommunicator world;
  train::Trainer trainer(config, world);
  return trainer.run();
}

struct TrainerTest : ::testing::Test {
  static void SetUpTestSuite() {
    data_dir = fixture::make_dataset(fixture::temp_dir("tessel-data"));
  }
  static std::string data_dir;
};
std::string TrainerTest::data_dir;

}  // namespace

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
  std::string damaged = run + "/checkpoints/step-00000050/model.safetensors";
  fs::resize_file(damaged, fs::file_size(damaged) - 1);
  auto resumed = train_run(c);
  EXPECT_EQ(resumed.resumed_from, 40);
  ASSERT_EQ(resumed.steps.size(), 10u);
  for (size_t i = 0; i < resumed.steps.size(); ++i)
    EXPECT_EQ(resumed.steps[i].loss, full.steps[40 + i].loss) << "step " << 41 + i;
}

TEST_F(TrainerTest, ResumeRejectsAnIncompatibleCheckpoint) {
  std::string run = fixture::temp_dir("tessel-run");
  train::Config c = fixture::tiny_config(data_dir, run);
  c.train.steps = 10;
  c.optim.warmup_steps = 2;
  train_run(c);
  c.model.width = 64;
  fixture::expect_input_error([&] { train_run(c); }, {"model.width = 32 but this run has 64"});
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
