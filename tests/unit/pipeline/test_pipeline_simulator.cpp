// Pipeline schedules and the simulator against the closed forms of spec pipeline.md:
// GPipe / 1F1B makespan (M + P - 1)(F + B) and bubble (P - 1)/(M + P - 1) per flush step,
// PACI's version-gap bound ceil((P - 1 - s)/K) and inconsistent share, peak activations.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <set>
#include <string>

#include "support/expect_input_error.hpp"
#include "tessel/core/rng.hpp"
#include "tessel/pipeline/simulator.hpp"

using namespace tessel;
using namespace tessel::pipeline;

namespace {

SimOptions uniform(ScheduleKind kind, int P, int64_t M, int64_t steps, int64_t K = 1) {
  SimOptions o;
  o.schedule = {kind, P, M, steps, K};
  o.costs = {{1.5, 2.5, 0}};
  return o;
}

}  // namespace

TEST(PipelineSchedule, EveryStageRunsEachMicroBatchOnceForwardThenBackward) {
  for (auto kind : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::paci})
    for (int P : {1, 2, 4})
      for (int s = 0; s < P; ++s) {
        auto ops = stage_ops({kind, P, 6, 2, 4}, s);
        const int64_t micros = kind == ScheduleKind::paci ? 6 : 12;
        std::set<int64_t> forwarded, backwarded;
        int64_t steps = 0;
        for (const auto& op : ops) {
          if (op.kind == OpKind::forward) {
            EXPECT_TRUE(forwarded.insert(op.micro).second);
          }
          if (op.kind == OpKind::backward) {
            EXPECT_TRUE(forwarded.count(op.micro)) << "backward before forward";
            EXPECT_EQ(op.micro, int64_t(backwarded.size())) << "backwards complete in order";
            backwarded.insert(op.micro);
          }
          steps += op.kind == OpKind::step;
        }
        EXPECT_EQ(int64_t(forwarded.size()), micros);
        EXPECT_EQ(int64_t(backwarded.size()), micros);
        EXPECT_EQ(steps, kind == ScheduleKind::paci ? 6 / 4 : 2);
      }
}

TEST(PipelineSchedule, PaciWithKEqualToTheHorizonIs1F1B) {
  // Before its first step PACI is 1F1B; with K = M its one step closes the 1F1B step.
  for (int P : {2, 4, 8})
    for (int s = 0; s < P; ++s)
      EXPECT_EQ(stage_ops({ScheduleKind::paci, P, 8, 1, 8}, s),
                stage_ops({ScheduleKind::one_f_one_b, P, 8, 1, 1}, s));
}

TEST(PipelineSimulator, FlushSchedulesMatchTheClosedForms) {
  for (auto kind : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b})
    for (int P : {1, 2, 4, 8})
      for (int64_t M : {1, 2, 4, 8, 16}) {
        SCOPED_TRACE(std::string(schedule_name(kind)) + " P=" + std::to_string(P) +
                     " M=" + std::to_string(M));
        const int64_t steps = 3;
        SimResult r = simulate(uniform(kind, P, M, steps));
        EXPECT_NEAR(r.makespan, double(steps * (M + P - 1)) * (1.5 + 2.5), 1e-9);
        EXPECT_NEAR(r.bubble, double(P - 1) / double(M + P - 1), 1e-9);
        for (int s = 0; s < P; ++s) {
          EXPECT_EQ(r.peak_activations[size_t(s)],
                    kind == ScheduleKind::gpipe ? M : std::min<int64_t>(P - s, M));
          EXPECT_EQ(r.max_version_gap[size_t(s)], 0);
        }
      }
}

TEST(PipelineSimulator, PaciHasNoFlushBubbleAndTheSpecsVersionGaps) {
  for (int P : {2, 4, 8})
    for (int64_t K : {1, 2, 3, 4, 8}) {
      SCOPED_TRACE("P=" + std::to_string(P) + " K=" + std::to_string(K));
      const int64_t n = 240;
      SimResult r = simulate(uniform(ScheduleKind::paci, P, n, 1, K));
      // One fill and drain for the whole horizon: 1F1B's makespan with M = n.
      EXPECT_NEAR(r.makespan, double(n + P - 1) * 4.0, 1e-9);
      for (int s = 0; s < P; ++s) {
        const int64_t d = P - 1 - s;
        EXPECT_EQ(r.max_version_gap[size_t(s)], (d + K - 1) / K) << "stage " << s;
        EXPECT_EQ(r.peak_activations[size_t(s)], P - s) << "stage " << s;
        if (K >= P - 1) {
          EXPECT_NEAR(r.inconsistent_share[size_t(s)], double(d) / double(K), 1.0 / K);
        }
      }
    }
  // The throughput ratio over 1F1B at P = M = K = 8 approaches (M + P - 1) / M = 1.875.
  const int64_t M = 8, steps = 30;
  double flush = simulate(uniform(ScheduleKind::one_f_one_b, 8, M, steps)).makespan;
  double paci = simulate(uniform(ScheduleKind::paci, 8, M * steps, 1, M)).makespan;
  EXPECT_NEAR(flush / paci, double(steps * (M + 7)) / double(steps * M + 7), 1e-12);
}

TEST(PipelineSimulator, RandomCostsRespectEveryDependency) {
  Rng rng(7);
  for (auto kind : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::paci}) {
    SimOptions o;
    o.schedule = {kind, 4, 8, 3, 3};
    for (int s = 0; s < 4; ++s)
      o.costs.push_back({0.5 + rng.uniform(), 1 + 2 * rng.uniform(), 0.1 * rng.uniform()});
    o.link_latency = 0.25;
    SimResult r = simulate(o);
    std::map<std::pair<int, int64_t>, OpTiming> f, b;
    for (const auto& t : r.timeline) {
      if (t.op.kind == OpKind::forward) f[{t.stage, t.op.micro}] = t;
      if (t.op.kind == OpKind::backward) b[{t.stage, t.op.micro}] = t;
    }
    for (const auto& [key, t] : f)
      if (key.first > 0) {
        EXPECT_GE(t.start, f.at({key.first - 1, key.second}).end + 0.25 - 1e-12);
      }
    for (const auto& [key, t] : b) {
      EXPECT_GE(t.start, f.at(key).end - 1e-12);
      if (key.first < 3) {
        EXPECT_GE(t.start, b.at({key.first + 1, key.second}).end + 0.25 - 1e-12);
      }
    }
    // One op at a time per stage.
    std::vector<double> last(4, 0);
    for (const auto& t : r.timeline) {
      EXPECT_GE(t.start, last[size_t(t.stage)] - 1e-12);
      last[size_t(t.stage)] = t.end;
    }
  }
}

TEST(PipelineSimulator, ChromeTraceHasOneTrackPerStageAndOneSlicePerOp) {
  SimResult r = simulate(uniform(ScheduleKind::one_f_one_b, 4, 4, 1));
  auto trace = nlohmann::json::parse(chrome_trace(r.timeline, 4, 1000.0).dump());
  size_t slices = 0;
  std::set<int> tracks;
  for (const auto& e : trace["traceEvents"])
    if (e["ph"] == "X") {
      ++slices;
      tracks.insert(e["tid"].get<int>());
      EXPECT_GE(e["dur"].get<double>(), 0);
    }
  EXPECT_EQ(slices, r.timeline.size());
  EXPECT_EQ(tracks, (std::set<int>{0, 1, 2, 3}));
}

TEST(PipelineSchedule, BadOptionsAreInputErrors) {
  fixture::expect_input_error([] { stage_ops({ScheduleKind::paci, 2, 4, 1, 0}, 0); }, {"paci_k"});
  fixture::expect_input_error([] { stage_ops({ScheduleKind::gpipe, 0, 4, 1, 1}, 0); }, {"stages"});
  fixture::expect_input_error([] { parse_schedule("zb"); }, {"gpipe, 1f1b or paci"});
}
