// Pipeline parallelism on real MPI ranks (spec pipeline.md C2, C3): GPipe and 1F1B over pp
// stages give bitwise the losses, gradient norms, validation losses and final weights of
// the single-process run; pp x dp those of the plain dp run; PACI drained after every window
// equals 1F1B; resume continues bitwise.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "support/mpi_train_fixture.hpp"
#include "support/pipeline_fixture.hpp"
#include "support/train_fixture.hpp"
#include "tessel/comm/single_communicator.hpp"
#include "tessel/comm/world.hpp"

using namespace tessel;
using fixture::run_on;
using fixture::shared_temp_dir;
namespace fs = std::filesystem;

namespace {

train::Config pipeline_config(comm::Communicator& world, const std::string& stem) {
  train::Config c =
      fixture::tiny_config(fixture::shared_dataset(world), shared_temp_dir(world, stem));
  c.model.layers = 4;
  c.train.steps = 8;
  c.train.accum = 4;
  c.train.eval_every = 4;
  c.train.grad_clip = 0.5;  // clipping fires in the early steps
  return c;
}

// The same run in this process alone (every rank makes its own).
struct Reference {
  train::TrainResult result;
  std::map<std::string, std::vector<float>> weights;
};
Reference single_process(train::Config c) {
  c.parallel.pp = 1;
  c.pipeline.schedule.clear();
  c.pipeline.layout.clear();
  c.run.dir = fixture::temp_dir("tessel-pp-ref");
  comm::SingleCommunicator self;
  Reference r{run_on(self, c), {}};
  r.weights = fixture::final_weights(c.run.dir);
  return r;
}

// Each metrics.jsonl step record's pipeline section (rank 0 writes it).
std::vector<nlohmann::json> pipeline_records(const std::string& run_dir) {
  std::vector<nlohmann::json> out;
  std::ifstream in(run_dir + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("pipeline")) out.push_back(j["pipeline"]);
  }
  return out;
}

}  // namespace

TEST(PipelineTrain, FlushSchedulesEqualTheSingleProcessRunBitwise) {
  comm::Communicator& world = comm::world();
  const int P = world.size();
  train::Config c = pipeline_config(world, "tessel-pp-run");
  const Reference ref = single_process(c);
  bool clipped = false;
  for (const auto& s : ref.result.steps) clipped = clipped || s.grad_norm > c.train.grad_clip;
  EXPECT_TRUE(clipped);
  for (const char* schedule : {"gpipe", "1f1b"})
    for (const std::string layout : {"", P == 2 ? "3,1" : "1,1,1,1"}) {
      SCOPED_TRACE(std::string(schedule) + ", layout '" + layout + "'");
      c.parallel.pp = P;
      c.pipeline.schedule = schedule;
      c.pipeline.layout = layout;
      c.run.dir = shared_temp_dir(world, "tessel-pp-run");
      const auto piped = run_on(world, c);
      fixture::expect_same_steps(piped, ref.result);
      fixture::expect_same_weights(fixture::final_weights(c.run.dir), ref.weights);
      if (world.rank() != 0) continue;
      const auto records = pipeline_records(c.run.dir);
      ASSERT_EQ(records.size(), 8u);
      for (const auto& r : records) {
        ASSERT_EQ(r["stages"].size(), size_t(P));
        for (int s = 0; s < P; ++s) {
          EXPECT_EQ(r["stages"][s]["max_version_gap"], 0);
          // 1F1B keeps P - s micro-batches in flight at most, GPipe all M = 4.
          EXPECT_EQ(r["stages"][s]["peak_live_activations"],
                    std::string(schedule) == "gpipe" ? 4 : std::min(4, P - s));
        }
      }
    }
}

TEST(PipelineTrain, TiedHeadOverStagesFollowsTheSingleProcessRun) {
  // The tied weight's two gradient parts are summed in another order than one process
  // accumulates them, so only rounding may differ.
  comm::Communicator& world = comm::world();
  train::Config c = pipeline_config(world, "tessel-pp-tied");
  c.model.tied_head = true;
  const Reference ref = single_process(c);
  c.parallel.pp = world.size();
  const auto piped = run_on(world, c);
  ASSERT_EQ(piped.steps.size(), ref.result.steps.size());
  for (size_t i = 0; i < piped.steps.size(); ++i)
    EXPECT_NEAR(piped.steps[i].loss, ref.result.steps[i].loss, 1e-5 * ref.result.steps[i].loss)
        << "step " << i + 1;
  const auto weights = fixture::final_weights(c.run.dir);
  for (const auto& [name, values] : ref.weights)
    for (size_t i = 0; i < values.size(); ++i)
      ASSERT_NEAR(weights.at(name)[i], values[i], 1e-4) << name << "[" << i << "]";
}

TEST(PipelineTrain, StagesTimesDataParallelEqualThePlainDataParallelRun) {
  comm::Communicator& world = comm::world();
  if (world.size() != 4) GTEST_SKIP() << "pp = 2 x dp = 2 needs 4 ranks";
  auto half = world.split(world.rank() / 2, world.rank());
  // AdamW, and Muon whose sharded update is collective over each stage's dp group.
  for (const char* optimizer : {"adamw", "muon"}) {
    train::Config c = pipeline_config(world, "tessel-ppdp-run");
    c.optim.name = optimizer;
    // The plain dp = 2 run on each half of the world.
    train::Config plain = c;
    plain.run.dir = shared_temp_dir(*half, "tessel-ppdp-ref");
    const auto ref = run_on(*half, plain);
    const auto ref_weights = fixture::final_weights(plain.run.dir);
    for (const char* schedule : {"gpipe", "1f1b"}) {
      SCOPED_TRACE(std::string(optimizer) + ", " + schedule);
      c.parallel.pp = 2;
      c.pipeline.schedule = schedule;
      c.run.dir = shared_temp_dir(world, "tessel-ppdp-run");
      const auto piped = run_on(world, c);
      fixture::expect_same_steps(piped, ref);
      fixture::expect_same_weights(fixture::final_weights(c.run.dir), ref_weights);
    }
  }
}

TEST(PipelineTrain, PaciDrainedAfterEveryWindowEquals1F1B) {
  comm::Communicator& world = comm::world();
  train::Config c = pipeline_config(world, "tessel-paci-run");
  c.parallel.pp = world.size();
  c.train.grad_clip = 0;  // PACI clips per stage, 1F1B globally: compare without clipping
  c.pipeline.schedule = "1f1b";
  c.train.eval_every = 1;  // PACI below drains at every validation
  const auto flush = run_on(world, c);
  const auto flush_weights = fixture::final_weights(c.run.dir);

  c.pipeline.schedule = "paci";  // K = train.accum
  c.run.dir = shared_temp_dir(world, "tessel-paci-run");
  auto drained = run_on(world, c);
  fixture::expect_same_steps(drained, flush, /*norms_too=*/false);
  fixture::expect_same_weights(fixture::final_weights(c.run.dir), flush_weights);

  // Undrained, the first window still equals 1F1B's first step; later forwards on the
  // first stages run on newer weights: gap ceil((P - 1 - s) / K) with K = 4.
  c.train.eval_every = 0;
  c.run.dir = shared_temp_dir(world, "tessel-paci-run");
  const auto paci = run_on(world, c);
  ASSERT_EQ(paci.steps.size(), flush.steps.size());
  EXPECT_EQ(paci.steps[0].loss, flush.steps[0].loss);
  EXPECT_NE(paci.steps.back().loss, flush.steps.back().loss);
  if (world.rank() == 0) {
    const auto records = pipeline_records(c.run.dir);
    ASSERT_EQ(records.size(), 8u);
    const int P = world.size();
    for (int s = 0; s < P; ++s) {
      EXPECT_EQ(records.back()["stages"][s]["max_version_gap"], (P - 1 - s + 3) / 4) << s;
      EXPECT_EQ(records.back()["stages"][s]["peak_live_activations"], P - s) << s;
    }
    EXPECT_EQ(records.back()["horizon"], nlohmann::json::array({1, 8}));
  }
}

TEST(PipelineTrain, ResumeContinuesBitwise) {
  comm::Communicator& world = comm::world();
  for (const char* schedule : {"1f1b", "paci"}) {
    SCOPED_TRACE(schedule);
    train::Config c = pipeline_config(world, "tessel-pp-resume");
    c.parallel.pp = world.size();
    c.pipeline.schedule = schedule;
    c.train.eval_every = 0;
    c.train.checkpoint_every = 4;
    const std::string run = c.run.dir;
    const auto full = fixture::expect_resume_continues_bitwise(
        world, c, 4, [&] { fs::remove_all(run + "/checkpoints/step-00000008"); });
    EXPECT_EQ(full.steps.size(), 8u);
  }
}
