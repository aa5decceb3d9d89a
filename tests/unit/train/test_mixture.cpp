// Training on a mixture of data sets (data.path with several directories, data.weights):
// validation per data set and weighted, tessel eval's losses, resume, and the refusals.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "support/expect_input_error.hpp"
#include "support/train_fixture.hpp"
#include "tessel/comm/single_communicator.hpp"
#include "tessel/train/run_model.hpp"
#include "tessel/train/trainer.hpp"

using namespace tessel;
namespace fs = std::filesystem;

using fixture::train_run;

namespace {

struct MixtureTest : ::testing::Test {
  static void SetUpTestSuite() {
    first = fixture::make_dataset(fixture::temp_dir("tessel-mix-a") + "/words");
    second = fixture::make_other_dataset(fixture::temp_dir("tessel-mix-b") + "/other");
  }
  // 10 steps on the two data sets 3 : 1, validated at steps 5 and 10, checkpointed at 5.
  static train::Config mixture_config(const std::string& run) {
    train::Config c = fixture::tiny_config(first, run);
    c.data.path = first + "," + second;
    c.data.weights = "3,1";
    c.train.steps = 10;
    c.train.eval_every = 5;
    c.train.checkpoint_every = 5;
    return c;
  }
  static std::string first, second;
};
std::string MixtureTest::first, MixtureTest::second;

}  // namespace

// Each validation reports every data set's loss and their mixture weighted 3 : 1; each data
// set's is bitwise what `tessel eval` (train::evaluate) computes from the final checkpoint on
// that data set's val.tok, and metrics.jsonl names them by directory.
TEST_F(MixtureTest, ValidationReportsEachDataSetAndTheirWeightedMean) {
  const std::string run = fixture::temp_dir("tessel-mix-run");
  const train::Config c = mixture_config(run);
  const auto r = train_run(c);
  ASSERT_EQ(r.validation.size(), 2u);
  ASSERT_EQ(r.data_set_validation.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    const auto& losses = r.data_set_validation[i];
    ASSERT_EQ(losses.size(), 2u);
    EXPECT_NE(losses[0], losses[1]);
    EXPECT_DOUBLE_EQ(r.validation[i].second, 0.75 * losses[0] + 0.25 * losses[1]);
  }
  train::RunModel model = train::load_run_model(run);
  EXPECT_EQ(model.step, 10);
  EXPECT_EQ(
      train::evaluate(model, data::ShardReader(first + "/val.tok"), c.train.eval_sequences).loss,
      r.data_set_validation[1][0]);
  EXPECT_EQ(
      train::evaluate(model, data::ShardReader(second + "/val.tok"), c.train.eval_sequences).loss,
      r.data_set_validation[1][1]);
  nlohmann::json last_validation, start;
  std::ifstream in(run + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("val_loss")) last_validation = j;
    if (j.value("event", "") == "start") start = j;
  }
  EXPECT_EQ(last_validation["val_loss_by_data_set"]["words"].get<double>(),
            r.data_set_validation[1][0]);
  EXPECT_EQ(last_validation["val_loss_by_data_set"]["other"].get<double>(),
            r.data_set_validation[1][1]);
  ASSERT_EQ(start["data"].size(), 2u);
  EXPECT_EQ(start["data"][1]["weight"].get<double>(), 0.25);
  EXPECT_EQ(start["data"][1]["path"].get<std::string>(), second);
}

// A mixture resumes bitwise; other shares, or the first data set alone, are refused.
TEST_F(MixtureTest, ResumesBitwiseAndRefusesOtherShares) {
  const std::string run = fixture::temp_dir("tessel-mix-run");
  train::Config c = mixture_config(run);
  const auto full = train_run(c);
  fs::remove_all(run + "/checkpoints/step-00000010");
  const auto resumed = train_run(c);
  EXPECT_EQ(resumed.resumed_from, 5);
  ASSERT_EQ(resumed.steps.size(), 5u);
  for (size_t i = 0; i < 5; ++i) EXPECT_EQ(resumed.steps[i].loss, full.steps[5 + i].loss);
  EXPECT_EQ(resumed.data_set_validation.back(), full.data_set_validation.back());
  c.train.steps = 12;
  c.data.weights = "1,1";
  fixture::expect_input_error(
      [&] { train_run(c); },
      {"data sets (normalized data.weights) = 0.75,0.25 but this run has 0.5,0.5"});
  c.data.path = first;
  c.data.weights = "";
  fixture::expect_input_error([&] { train_run(c); }, {"0.75,0.25 but this run has 1.0"});
  c.data.path = first + "," + second;
  c.data.weights = "6,2";  // the same shares
  EXPECT_EQ(train_run(c).resumed_from, 10);
}

// A checkpoint copied out of its run reads its data.path's tokenizer: every data set of a
// mixture held the run's, so each one still the run's (its train.tok the record counted)
// speaks for the model. One prepared again is left out; only when each one here changed is
// the checkpoint refused (generate, eval, export and train.init_from alike).
TEST_F(MixtureTest, ACopiedCheckpointReadsTheTokenizerOfAnyUnchangedDataSet) {
  const std::string a = fixture::make_dataset(fixture::temp_dir("tessel-mix-own") + "/a");
  const std::string b = fixture::make_other_dataset(fixture::temp_dir("tessel-mix-own") + "/b");
  const std::string run = fixture::temp_dir("tessel-mix-run");
  train::Config c = mixture_config(run);
  c.data.path = a + "," + b;
  train_run(c);
  const std::string loose = fixture::temp_dir("tessel-mix-loose") + "/step";
  fs::copy(run + "/checkpoints/step-00000010", loose, fs::copy_options::recursive);
  const train::RunModel model = train::load_run_model(loose);
  const auto dirs = [&] { return train::model_tokenizer_dirs(loose, model.config, model.record); };
  EXPECT_EQ(dirs(), (std::vector<std::string>{a, b}));
  fixture::make_dataset(b);  // b prepared again from a's documents: shards the run never read
  EXPECT_EQ(dirs(), std::vector<std::string>{a});
  fs::remove_all(a);
  fixture::expect_input_error(
      [&] { dirs(); }, {loose + ": no copy of the run's tokenizer is found (a checkpoint outside",
                        b + " changed since the run: its train.tok holds"});
  fs::remove_all(b);
  EXPECT_EQ(dirs(), std::vector<std::string>{a});  // none is here: the caller's to refuse
}
