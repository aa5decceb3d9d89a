// tessel simulate's inputs: a pipeline run's stage costs averaged from its step records
// (against sums worked by hand), and the simulated schedules against the closed forms.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "support/expect_input_error.hpp"
#include "support/train_fixture.hpp"
#include "tessel/train/pipeline_profile.hpp"

using namespace tessel;

namespace {

// A run directory with `config` as config.toml and `records` as metrics.jsonl.
std::string run_dir(const std::string& config, const std::vector<nlohmann::json>& records) {
  const std::string dir = fixture::temp_dir("tessel-profile");
  std::ofstream(dir + "/config.toml") << config;
  std::ofstream metrics(dir + "/metrics.jsonl");
  metrics << nlohmann::json{{"event", "start"}, {"start_step", 0}}.dump() << "\n";
  for (const auto& r : records) metrics << r.dump() << "\n";
  return dir;
}

// A step record whose stage s spent (s + 1) x `forward`, `backward`, `optimizer` seconds.
nlohmann::json step_record(int64_t step, double seconds, const char* schedule, double forward,
                           double backward, double optimizer, int stages = 2) {
  nlohmann::json pipe = {{"schedule", schedule}};
  for (int s = 0; s < stages; ++s)
    pipe["stages"].push_back({{"forward_seconds", (s + 1) * forward},
                              {"backward_seconds", (s + 1) * backward},
                              {"optimizer_seconds", (s + 1) * optimizer},
                              {"sync_seconds", 0.0}});
  return {{"step", step}, {"loss", 1.0}, {"step_seconds", seconds}, {"pipeline", pipe}};
}

// The costs step_record's stages average to: stage s's are (s + 1) times these.
void expect_stage_costs(const train::PipelineProfile& p, double forward, double backward,
                        double step) {
  ASSERT_EQ(p.costs.size(), 2u);
  for (size_t s = 0; s < 2; ++s) {
    EXPECT_DOUBLE_EQ(p.costs[s].forward, double(s + 1) * forward) << "stage " << s;
    EXPECT_DOUBLE_EQ(p.costs[s].backward, double(s + 1) * backward) << "stage " << s;
    EXPECT_DOUBLE_EQ(p.costs[s].step, double(s + 1) * step) << "stage " << s;
  }
}

constexpr const char* kFlushConfig = "[parallel]\npp = 2\n[train]\naccum = 4\n";

}  // namespace

TEST(PipelineProfile, FlushRunAveragesTheStepsAfterTheSkip) {
  // Step 1 is the skipped warm-up; step 3 was redone after a resume: its last record counts.
  const std::string dir =
      run_dir(kFlushConfig,
              {step_record(1, 9.0, "1f1b", 9, 9, 9), step_record(2, 1.0, "1f1b", 0.4, 0.8, 0.1),
               step_record(3, 5.0, "1f1b", 7, 7, 7), step_record(3, 2.0, "1f1b", 0.8, 1.6, 0.3)});
  const train::PipelineProfile p = train::read_pipeline_profile(dir, 1);
  EXPECT_EQ(p.schedule, "1f1b");
  EXPECT_EQ(p.micro_batches, 4);
  EXPECT_EQ(p.first_step, 2);
  EXPECT_EQ(p.last_step, 3);
  EXPECT_DOUBLE_EQ(p.step_seconds, 1.5);
  expect_stage_costs(p, 1.2 / 8, 2.4 / 8, 0.4 / 2);  // 2 steps x 4 micro-batches; 2 steps
  // A message between stages: the config's micro-batch x seq_len x width f32s (defaults).
  const train::Config defaults;
  EXPECT_EQ(p.message_bytes,
            double(defaults.train.micro_batch * defaults.train.seq_len * defaults.model.width * 4));
}

TEST(PipelineProfile, OnlyTheLastAttemptCountsAndItsOwnWarmUpIsSkipped) {
  // A GPipe attempt, then one resumed from step 2 under 1F1B: with skip 1 only its steps
  // after 3 count.
  const std::string dir = run_dir(kFlushConfig, {step_record(1, 9.0, "gpipe", 9, 9, 9),
                                                 step_record(2, 9.0, "gpipe", 9, 9, 9),
                                                 step_record(3, 9.0, "gpipe", 9, 9, 9),
                                                 {{"event", "start"}, {"start_step", 2}},
                                                 step_record(3, 7.0, "1f1b", 7, 7, 7),
                                                 step_record(4, 1.0, "1f1b", 0.4, 0.8, 0.1),
                                                 step_record(5, 3.0, "1f1b", 0.4, 0.8, 0.1)});
  const train::PipelineProfile p = train::read_pipeline_profile(dir, 1);
  EXPECT_EQ(p.schedule, "1f1b");
  EXPECT_EQ(p.first_step, 4);
  EXPECT_EQ(p.last_step, 5);
  EXPECT_DOUBLE_EQ(p.step_seconds, 2.0);
  EXPECT_DOUBLE_EQ(p.costs[0].forward, 0.8 / 8);
  EXPECT_DOUBLE_EQ(p.costs[1].step, 2 * 0.2 / 2);
}

TEST(PipelineProfile, AnAttemptWithoutStepRecordsDoesNotHideTheOneBefore) {
  // The second attempt started from step 3 with accum 2 in config.toml and wrote no step (it
  // failed at once): the first attempt's records are the last ones, and their own micro-batch
  // count (4) holds, not the config's.
  auto record = [](int64_t step, double seconds, double f) {
    nlohmann::json r = step_record(step, seconds, "1f1b", f, 2 * f, f / 4);
    r["pipeline"]["micro_batches"] = 4;
    return r;
  };
  const std::string dir = run_dir("[parallel]\npp = 2\n[train]\naccum = 2\n",
                                  {record(1, 9.0, 9),
                                   record(2, 1.0, 0.4),
                                   record(3, 3.0, 0.4),
                                   {{"event", "start"}, {"start_step", 3}}});
  const train::PipelineProfile p = train::read_pipeline_profile(dir, 1);
  EXPECT_EQ(p.micro_batches, 4);
  EXPECT_EQ(p.first_step, 2);
  EXPECT_EQ(p.last_step, 3);
  EXPECT_DOUBLE_EQ(p.step_seconds, 2.0);
  expect_stage_costs(p, 0.8 / 8, 1.6 / 8, 0.2 / 2);
}

TEST(PipelineProfile, PaciRecordsCountOncePerHorizon) {
  // Each window's record repeats its horizon's totals; K = 2; the horizon of steps 1-2 is
  // skipped whole with skip 1.
  auto window = [](int64_t step, int64_t first, int64_t last, double seconds, double f) {
    nlohmann::json r = step_record(step, seconds, "paci", f, 2 * f, f / 2);
    r["pipeline"]["horizon"] = {first, last};
    return r;
  };
  const std::string dir = run_dir(
      "[parallel]\npp = 2\n[model]\ntied_head = false\n[pipeline]\nschedule = \"paci\"\npaci_k = "
      "2\n",
      {window(1, 1, 2, 9.0, 9), window(2, 1, 2, 9.0, 9), window(3, 3, 5, 1.0, 0.6),
       window(4, 3, 5, 1.0, 0.6), window(5, 3, 5, 1.0, 0.6)});
  const train::PipelineProfile p = train::read_pipeline_profile(dir, 1);
  EXPECT_EQ(p.schedule, "paci");
  EXPECT_EQ(p.micro_batches, 2);
  EXPECT_EQ(p.first_step, 3);
  EXPECT_EQ(p.last_step, 5);
  EXPECT_DOUBLE_EQ(p.step_seconds, 1.0);
  expect_stage_costs(p, 0.6 / 6, 1.2 / 6, 0.3 / 3);  // 3 windows x 2 micro-batches; 3 windows
}

TEST(PipelineProfile, ARunWithoutPipelineRecordsIsAClearError) {
  fixture::expect_input_error([&] { train::read_pipeline_profile(run_dir(kFlushConfig, {}), 0); },
                              {"metrics.jsonl", "no pipeline step records"});
  fixture::expect_input_error(
      [&] {
        train::read_pipeline_profile(run_dir(kFlushConfig, {step_record(1, 1.0, "1f1b", 1, 1, 1)}),
                                     1);
      },
      {"--skip 1", "start at step 0", "lower --skip"});
  fixture::expect_input_error(
      [&] { train::read_pipeline_profile(run_dir("[train]\naccum = 4\n", {}), 0); },
      {"not a pipeline run", "parallel.pp = 1"});
  fixture::expect_input_error(
      [&] { train::read_pipeline_profile(fixture::temp_dir("tessel-profile-none"), 0); },
      {"config.toml", "run directory"});
  const std::string no_metrics = run_dir(kFlushConfig, {});
  std::filesystem::remove(no_metrics + "/metrics.jsonl");
  fixture::expect_input_error([&] { train::read_pipeline_profile(no_metrics, 0); },
                              {"metrics.jsonl", "cannot read"});
  // Records written before the step records split the stages' busy time.
  nlohmann::json old = step_record(2, 1.0, "1f1b", 1, 1, 1);
  old["pipeline"]["stages"][1].erase("forward_seconds");
  fixture::expect_input_error(
      [&] { train::read_pipeline_profile(run_dir(kFlushConfig, {old}), 1); },
      {"metrics.jsonl", "without the stage costs", "forward_seconds"});
}

TEST(PipelineProfile, SimulatedSchedulesFollowTheClosedForms) {
  // Uniform stages: a flush step takes (M + P - 1)(F + B) + o, interleaved with v chunks
  // (M + (P - 1) / v)(F + B) + o when P divides M (else it is left out); PACI's window
  // M (F + B) + o once filled, its fill and drain (P - 1)(F + B) paid once over the run.
  const double F = 0.01, B = 0.02, o = 0.007;
  for (const int P : {2, 4})
    for (const int64_t M : {2, 8})
      for (const int v : {2, 3}) {
        SCOPED_TRACE("P " + std::to_string(P) + ", M " + std::to_string(M) + ", v " +
                     std::to_string(v));
        const int64_t steps = 50;
        const auto sims = train::simulate_schedules(
            std::vector<pipeline::StageCosts>(size_t(P), {F, B, o}), M, steps, {}, v);
        const bool interleaved = M % P == 0;
        ASSERT_EQ(sims.size(), interleaved ? 4u : 3u);
        EXPECT_EQ(sims[0].name, "gpipe");
        EXPECT_EQ(sims[1].name, "1f1b");
        const auto& paci_row = sims.back();
        EXPECT_EQ(paci_row.name, "paci");
        const double flush = double(M + P - 1) * (F + B) + o;
        EXPECT_NEAR(sims[0].step_seconds, flush, 1e-12);
        EXPECT_NEAR(sims[1].step_seconds, flush, 1e-12);
        if (interleaved) {
          EXPECT_EQ(sims[2].name, "interleaved");
          EXPECT_NEAR(sims[2].step_seconds, (double(M) + double(P - 1) / v) * (F + B) + o, 1e-12);
          // Chunk forwards: stage 0 warms up with 2 (P - 1) + (v - 1) P of them.
          EXPECT_EQ(sims[2].peak_activations.front(),
                    std::min<int64_t>(2 * (P - 1) + (v - 1) * P + 1, M * v));
        }
        const double paci = double(M) * (F + B) + o + double(P - 1) * (F + B) / double(steps);
        EXPECT_NEAR(paci_row.step_seconds, paci, 0.01 * paci);
        EXPECT_EQ(sims[1].peak_activations.front(), std::min<int64_t>(M, P));
        EXPECT_EQ(sims[0].peak_activations.front(), M);
      }
}

TEST(PipelineProfile, ZbH1RecordsGiveTheWeightCostAndTheWholeBackward) {
  // A ZB-H1 record's backward_seconds are the whole backward's, weight_seconds its Ws' part.
  auto record = [](int64_t step, double f, double b, double w) {
    nlohmann::json r = step_record(step, 1.0, "zb-h1", f, b, f / 4);
    for (size_t s = 0; s < 2; ++s) r["pipeline"]["stages"][s]["weight_seconds"] = double(s + 1) * w;
    return r;
  };
  const std::string dir = run_dir(
      kFlushConfig, {record(1, 9, 9, 9), record(2, 0.4, 0.4, 0.1), record(3, 0.4, 0.4, 0.2)});
  const train::PipelineProfile p = train::read_pipeline_profile(dir, 1);
  EXPECT_EQ(p.schedule, "zb-h1");
  expect_stage_costs(p, 0.8 / 8, 0.8 / 8, 0.2 / 2);
  for (size_t s = 0; s < 2; ++s) EXPECT_DOUBLE_EQ(p.costs[s].weight, double(s + 1) * 0.3 / 8);
  // Records without Ws (any other schedule) profile no weight.
  const std::string plain = run_dir(
      kFlushConfig, {step_record(1, 1.0, "1f1b", 1, 1, 1), step_record(2, 1.0, "1f1b", 1, 1, 1)});
  EXPECT_EQ(train::read_pipeline_profile(plain, 1).costs[1].weight, 0);
}

TEST(PipelineProfile, ZbH1IsSimulatedOnlyFromMeasuredWeightCosts) {
  // With W <= F, B and M >= P a ZB-H1 step takes M (F + B + W) + (P - 1)(F + B - W) + o.
  const double F = 0.01, B = 0.012, W = 0.008, o = 0.007;
  for (const int P : {2, 4})
    for (const int64_t M : {4, 8}) {
      SCOPED_TRACE("P " + std::to_string(P) + ", M " + std::to_string(M));
      const auto sims = train::simulate_schedules(
          std::vector<pipeline::StageCosts>(size_t(P), {F, B + W, o, W}), M, 20);
      ASSERT_EQ(sims.size(), 5u);  // gpipe, 1f1b, interleaved, paci, zb-h1
      EXPECT_EQ(sims[4].name, "zb-h1");
      EXPECT_NEAR(sims[4].step_seconds, double(M) * (F + B + W) + double(P - 1) * (F + B - W) + o,
                  1e-12);
      EXPECT_NEAR(sims[1].step_seconds, double(M + P - 1) * (F + B + W) + o, 1e-12);
      EXPECT_EQ(sims[4].peak_activations, std::vector<int64_t>(size_t(P), P));
    }
  // Without measured Ws (weight 0 everywhere) there is no ZB-H1 to simulate.
  const auto sims =
      train::simulate_schedules(std::vector<pipeline::StageCosts>(2, {F, B + W, o}), 4, 20);
  ASSERT_EQ(sims.size(), 4u);
  EXPECT_EQ(sims.back().name, "paci");
}

// metrics.jsonl is read as the ETT logs are: a malformed line (a record cut in the middle, a NaN
// Python wrote) other than a last one cut short is an error naming it, not a record left out
// of the averages.
TEST(PipelineProfile, AMalformedLineIsAnErrorNamingIt) {
  const std::string dir = run_dir(
      kFlushConfig, {step_record(1, 1.0, "1f1b", 1, 1, 1), step_record(2, 1.0, "1f1b", 1, 1, 1)});
  const std::string metrics = dir + "/metrics.jsonl";
  const std::string third = step_record(3, 1.0, "1f1b", 3, 3, 3).dump();
  std::ofstream(metrics, std::ios::app) << third.substr(0, 40) << "\n" << third << "\n";
  fixture::expect_input_error([&] { train::read_pipeline_profile(dir, 1); },
                              {metrics + ":4: malformed metrics record"});
  std::ofstream(metrics) << R"({"event": "start", "start_step": 0})"
                         << "\n"
                         << R"({"step": 1, "loss": NaN, "step_seconds": 1.0, "pipeline": {}})"
                         << "\n"
                         << third << "\n";
  fixture::expect_input_error([&] { train::read_pipeline_profile(dir, 0); },
                              {metrics + ":2: malformed metrics record"});
  // A last line cut short (a crash, or being written) is left out.
  const std::string cut = run_dir(kFlushConfig, {step_record(1, 1.0, "1f1b", 1, 1, 1),
                                                 step_record(2, 1.0, "1f1b", 0.4, 0.8, 0.1)});
  std::ofstream(cut + "/metrics.jsonl", std::ios::app) << third.substr(0, 40);
  EXPECT_EQ(train::read_pipeline_profile(cut, 1).last_step, 2);
}

// A negative or non-finite (JSON null) time would give negative costs and a bubble above 1.
TEST(PipelineProfile, NegativeOrNonFiniteTimesAreRefusedNamingTheirLine) {
  nlohmann::json negative = step_record(2, 1.0, "1f1b", 1, 1, 1);
  negative["pipeline"]["stages"][1]["forward_seconds"] = -5.0;
  const std::string dir = run_dir(kFlushConfig, {step_record(1, 1.0, "1f1b", 1, 1, 1), negative});
  fixture::expect_input_error(
      [&] { train::read_pipeline_profile(dir, 1); },
      {dir + "/metrics.jsonl:3: stage 1's forward_seconds = -5.0 must be finite and >= 0"});
  nlohmann::json nan = step_record(2, 1.0, "1f1b", 1, 1, 1);
  nan["pipeline"]["stages"][0]["weight_seconds"] = std::nan("");  // written as null
  const std::string with_nan = run_dir(kFlushConfig, {step_record(1, 1.0, "1f1b", 1, 1, 1), nan});
  fixture::expect_input_error(
      [&] { train::read_pipeline_profile(with_nan, 1); },
      {with_nan + "/metrics.jsonl:3: stage 0's weight_seconds = null must be finite and >= 0"});
  nlohmann::json slow = step_record(2, -1.0, "1f1b", 1, 1, 1);
  const std::string with_slow = run_dir(kFlushConfig, {slow});
  fixture::expect_input_error(
      [&] { train::read_pipeline_profile(with_slow, 0); },
      {with_slow + "/metrics.jsonl:2: step_seconds = -1.0 must be finite and >= 0"});
}

// Interleaving needs a neighbour stage: at pp = 1 it would only charge messages from the one
// stage to itself.
TEST(PipelineProfile, OneStageHasNoInterleavedSchedule) {
  const auto sims = train::simulate_schedules({{0.01, 0.02, 0.007}}, 4, 10, {.latency = 1});
  std::vector<std::string> names;
  for (const auto& s : sims) names.push_back(s.name);
  EXPECT_EQ(names, (std::vector<std::string>{"gpipe", "1f1b", "paci"}));
  EXPECT_NEAR(sims[1].step_seconds, 4 * 0.03 + 0.007, 1e-12) << "no message on one stage";
}

// A simulation whose ops the simulator could not hold in about 0.4 GB is refused before any
// schedule runs.
TEST(PipelineProfile, ASimulationBeyondTheOpCapIsRefusedUpFront) {
  const std::vector<pipeline::StageCosts> two(2, {0.01, 0.02, 0.007});
  fixture::expect_input_error(
      [&] { train::simulate_schedules(two, int64_t(1) << 20, 100); },
      {"simulate: 100 steps of 1048576 micro-batches on 2 stages are 419430600 ops under gpipe, "
       "more than the simulator's 4194304",
       "lower --steps or --micro-batches"});
  // Interleaved's v chunks multiply its ops: the other schedules alone would fit.
  fixture::expect_input_error([&] { train::simulate_schedules(two, 4, 200000, {}, 2); },
                              {"ops under interleaved"});
  EXPECT_EQ(train::simulate_schedules(two, 4, 1000, {}, 2).size(), 4u);
}
