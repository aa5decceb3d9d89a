// profiled_link_latency against the simulator, whose link latency is known: fed a simulated
// timeline it must return exactly the latency the simulation used; profiled_costs of a
// simulated interleaved run give back the simulator's per-stage costs.
#include <gtest/gtest.h>

#include "tessel/pipeline/stage_executor.hpp"

using namespace tessel::pipeline;

TEST(ProfiledLinkLatency, RecoversTheSimulatorsLatency) {
  for (auto kind :
       {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::paci, ScheduleKind::zb_h1})
    for (int P : {2, 4})
      for (double latency : {0.0, 0.25, 1.5}) {
        SimOptions o;
        o.schedule = {kind, P, 6, 3, 2};
        o.costs = {{1.5, 2.5, 0.1, 1.0}, {1.0, 3.0, 0.1, 1.25}};  // ZB-H1's W: no message
        o.costs.resize(size_t(P), {1.25, 2.0, 0.1, 0.75});
        o.links = {{latency}};
        EXPECT_NEAR(profiled_link_latency(simulate(o).timeline, P), latency, 1e-12)
            << schedule_name(kind) << " P " << P;
      }
}

TEST(ProfiledLinkLatency, RecoversTheSimulatorsLatencyWithChunks) {
  // Interleaved messages also cross the wrap from the last stage to chunk c + 1 of the first.
  for (int P : {1, 2, 4})
    for (int v : {2, 3})
      for (double latency : {0.0, 0.25, 1.5}) {
        SimOptions o;
        o.schedule = {ScheduleKind::interleaved, P, 2 * P, 2, 1, v};
        o.costs = {{1.5, 2.5, 0.1}, {1.0, 3.0, 0.1}};
        o.costs.resize(size_t(P), {1.25, 2.0, 0.1});
        o.links = {{latency}};
        EXPECT_NEAR(profiled_link_latency(simulate(o).timeline, P), latency, 1e-12)
            << "P " << P << " v " << v;
      }
}

TEST(ProfiledCosts, OfASimulatedInterleavedRunPredictItAgain) {
  // Stats filled from a simulated timeline as the executor fills them: the profiled costs per
  // micro-batch are the simulator's per-stage costs (each chunk op 1/v of them), so the
  // simulator fed them gives the same makespan. 1e-12: sums of a few dozen op times.
  const int P = 2, v = 3;
  SimOptions o;
  o.schedule = {ScheduleKind::interleaved, P, 2 * P, 2, 1, v};
  o.costs = {{1.5, 2.5, 0.25}, {1.0, 3.0, 0.5}};
  const SimResult r = simulate(o);
  SimOptions again = o;
  again.costs.clear();
  for (int s = 0; s < P; ++s) {
    StageStats stats;
    stats.chunks = v;
    for (const OpTiming& t : r.timeline) {
      if (t.stage != s) continue;
      const double d = t.end - t.start;
      if (t.op.kind == OpKind::forward) ++stats.forwards, stats.forward_seconds += d;
      if (t.op.kind == OpKind::backward) ++stats.backwards, stats.backward_seconds += d;
      if (t.op.kind == OpKind::step) ++stats.steps, stats.step_seconds += d;
    }
    const StageCosts c = stats.profiled_costs();
    EXPECT_NEAR(c.forward, o.costs[size_t(s)].forward, 1e-12);
    EXPECT_NEAR(c.backward, o.costs[size_t(s)].backward, 1e-12);
    EXPECT_NEAR(c.step, o.costs[size_t(s)].step, 1e-12);
    EXPECT_EQ(c.weight, 0);
    again.costs.push_back(c);
  }
  EXPECT_NEAR(simulate(again).makespan, r.makespan, 1e-12);
}

TEST(ProfiledLinkLatency, IsZeroWithoutMessages) {
  SimOptions o;
  o.schedule = {ScheduleKind::one_f_one_b, 1, 4, 2, 1};
  o.costs = {{1, 2, 0}};
  EXPECT_EQ(profiled_link_latency(simulate(o).timeline, 1), 0.0);
}
