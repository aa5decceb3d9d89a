// Pipeline schedules and the simulator against the closed forms of spec pipeline.md:
// GPipe / 1F1B makespan (M + P - 1)(F + B) and bubble (P - 1)/(M + P - 1) per flush step,
// ZB-H1's M (F + B + W) + (P - 1)(F + B - W) (B the input-gradient half of the backward),
// PACI's version-gap bound ceil((P - 1 - s)/K) and inconsistent share, peak activations.
#include <gtest/gtest.h>

#include <array>
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
  for (auto kind :
       {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::paci, ScheduleKind::zb_h1})
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
        // The histogram holds every backward, up to the largest gap, and the consistent ones.
        const auto& h = r.gap_histogram[size_t(s)];
        ASSERT_EQ(int64_t(h.size()), r.max_version_gap[size_t(s)] + 1);
        int64_t backwards = 0;
        for (int64_t count : h) backwards += count;
        EXPECT_EQ(backwards, n);
        EXPECT_NEAR(1.0 - double(h[0]) / double(n), r.inconsistent_share[size_t(s)], 1e-12);
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
  for (auto kind :
       {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::paci, ScheduleKind::zb_h1}) {
    SimOptions o;
    o.schedule = {kind, 4, 8, 3, 3};
    for (int s = 0; s < 4; ++s) {
      const double backward = 1 + 2 * rng.uniform();
      o.costs.push_back(
          {0.5 + rng.uniform(), backward, 0.1 * rng.uniform(), backward * rng.uniform()});
    }
    o.links = {{0.25}};
    SimResult r = simulate(o);
    std::map<std::pair<int, int64_t>, OpTiming> f, b, w;
    for (const auto& t : r.timeline) {
      if (t.op.kind == OpKind::forward) f[{t.stage, t.op.micro}] = t;
      if (t.op.kind == OpKind::backward) b[{t.stage, t.op.micro}] = t;
      if (t.op.kind == OpKind::weight) w[{t.stage, t.op.micro}] = t;
    }
    EXPECT_EQ(w.size(), kind == ScheduleKind::zb_h1 ? b.size() : 0u);
    for (const auto& [key, t] : w) {
      EXPECT_GE(t.start, b.at(key).end - 1e-12);
      EXPECT_NEAR(t.end - t.start, o.costs[size_t(key.first)].weight, 1e-12);
      EXPECT_NEAR(b.at(key).end - b.at(key).start,
                  o.costs[size_t(key.first)].backward - o.costs[size_t(key.first)].weight, 1e-12);
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
  fixture::expect_input_error([] { parse_schedule("zb"); },
                              {"gpipe, 1f1b, interleaved, zb-h1 or paci", "'zb'"});
  ScheduleOptions o{ScheduleKind::interleaved, 2, 4, 1, 1, 1};
  fixture::expect_input_error([&] { stage_ops(o, 0); }, {"chunks >= 2", "got 1"});
  o.chunks = 2;
  o.micro_batches = 3;
  fixture::expect_input_error([&] { stage_ops(o, 0); },
                              {"micro_batches divisible by stages", "3 micro_batches", "2 stages"});
  o.chunks = 0;
  fixture::expect_input_error([&] { stage_ops(o, 0); }, {"chunks must be >= 1", "got 0"});
  fixture::expect_input_error(
      [] {
        stage_ops({ScheduleKind::one_f_one_b, 2, 4, 1, 1, 2}, 0);
      },
      {"chunks must be 1 under 1f1b", "got 2"});
}

TEST(PipelineSchedule, NamesRoundTrip) {
  for (auto kind : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::paci,
                    ScheduleKind::zb_h1, ScheduleKind::interleaved})
    EXPECT_EQ(parse_schedule(schedule_name(kind)), kind);
  EXPECT_STREQ(schedule_name(ScheduleKind::zb_h1), "zb-h1");
  EXPECT_STREQ(schedule_name(ScheduleKind::interleaved), "interleaved");
}

TEST(PipelineSchedule, ZbH1IsOneF1BWithEachBackwardSplitAndWLaggingSOnStageS) {
  for (int P : {1, 2, 3, 4, 6})
    for (int64_t M : {1, 2, 3, 4, 8})
      for (int s = 0; s < P; ++s) {
        SCOPED_TRACE("P=" + std::to_string(P) + " M=" + std::to_string(M) +
                     " s=" + std::to_string(s));
        const int64_t steps = 2;
        const auto ops = stage_ops({ScheduleKind::zb_h1, P, M, steps, 1}, s);
        // Without its Ws the list is 1F1B's.
        std::vector<Op> without_w;
        for (const Op& op : ops)
          if (op.kind != OpKind::weight) without_w.push_back(op);
        EXPECT_EQ(without_w, stage_ops({ScheduleKind::one_f_one_b, P, M, steps, 1}, s));
        std::set<int64_t> forwarded, backwarded;
        int64_t next_w = 0, step_count = 0, pending = 0, most_pending = 0;
        for (const Op& op : ops) {
          if (op.kind == OpKind::forward) forwarded.insert(op.micro);
          if (op.kind == OpKind::backward) {
            EXPECT_TRUE(forwarded.count(op.micro)) << "B before F";
            backwarded.insert(op.micro);
            ++pending;
          }
          if (op.kind == OpKind::weight) {
            EXPECT_TRUE(backwarded.count(op.micro)) << "W before B";
            EXPECT_EQ(op.micro, next_w++) << "Ws in micro-batch order, each once";
            --pending;
          }
          if (op.kind == OpKind::step) {
            EXPECT_EQ(pending, 0) << "every W before the STEP";
            EXPECT_EQ(next_w, (step_count + 1) * M);
            ++step_count;
          }
          // Only the Ws right after a B may wait; after them at most s are pending.
          if (op.kind == OpKind::weight || op.kind == OpKind::step) {
            EXPECT_LE(pending, s) << "W lags at most s micro-batches";
          }
          most_pending = std::max(most_pending, pending);
        }
        EXPECT_EQ(next_w, steps * M);
        EXPECT_EQ(step_count, steps);
        EXPECT_EQ(most_pending, std::min<int64_t>(s + 1, M)) << "W lags exactly s";
      }
}

namespace {

// ZB-H1's per-stage costs for input-gradient backward B and weight gradient W: the simulator
// takes the whole backward B + W and its weight part W.
SimOptions zb_h1(int P, int64_t M, int64_t steps, double F, double B, double W) {
  SimOptions o;
  o.schedule = {ScheduleKind::zb_h1, P, M, steps, 1};
  o.costs = {{F, B + W, 0, W}};
  return o;
}

}  // namespace

TEST(PipelineSimulator, ZbH1MatchesTheClosedFormWhenWIsAtMostFAndB) {
  // (F, B, W) with W <= F and W <= B, the closed form's precondition.
  const std::vector<std::array<double, 3>> costs = {{1, 1, 1}, {1, 1, 0.5},       {1, 2, 1},
                                                    {2, 1, 1}, {1.5, 1.25, 0.75}, {1, 1, 0}};
  for (int P : {2, 3, 4, 6})
    for (int64_t M : {int64_t(P), int64_t(P + 1), int64_t(2 * P), int64_t(16)})
      for (const auto& [F, B, W] : costs) {
        SCOPED_TRACE("P=" + std::to_string(P) + " M=" + std::to_string(M) + " F=" +
                     std::to_string(F) + " B=" + std::to_string(B) + " W=" + std::to_string(W));
        const int64_t steps = 3;
        SimOptions o = zb_h1(P, M, steps, F, B, W);
        const SimResult r = simulate(o);
        const double step = double(M) * (F + B + W) + double(P - 1) * (F + B - W);
        EXPECT_NEAR(r.makespan, double(steps) * step, 1e-9);
        EXPECT_NEAR(r.bubble, double(P - 1) * (F + B - W) / step, 1e-9);
        for (int s = 0; s < P; ++s) {
          EXPECT_EQ(r.peak_activations[size_t(s)], P) << "stage " << s;
          EXPECT_EQ(r.max_version_gap[size_t(s)], 0);
        }
        // 1F1B with the same whole backward B + W pays (P - 1)(F + B + W) per step.
        o.schedule.kind = ScheduleKind::one_f_one_b;
        const double flush = simulate(o).makespan;
        EXPECT_NEAR(flush, double(steps * (M + P - 1)) * (F + B + W), 1e-9);
        if (W > 0) {
          EXPECT_LT(r.makespan, flush);
        }
      }
}

TEST(PipelineSimulator, ZbH1IsLongerThanTheClosedFormWhenWExceedsFOrB) {
  for (const auto& [F, B, W] : std::vector<std::array<double, 3>>{{1, 1, 2}, {0.5, 1, 1}}) {
    const int P = 4;
    const int64_t M = 8;
    const double closed = double(M) * (F + B + W) + double(P - 1) * (F + B - W);
    EXPECT_GT(simulate(zb_h1(P, M, 1, F, B, W)).makespan, closed + 1e-9)
        << "F " << F << " B " << B << " W " << W;
  }
}

TEST(PipelineSimulator, ZbH1KeepsAtMostMinPMActivations) {
  // A micro-batch lives from its F to its W: P per stage once M >= P, all M below.
  for (int P : {1, 2, 4, 6})
    for (int64_t M : {1, 2, 3, 5, 8}) {
      const SimResult r = simulate(zb_h1(P, M, 2, 1, 1, 1));
      for (int s = 0; s < P; ++s)
        EXPECT_EQ(r.peak_activations[size_t(s)], std::min<int64_t>(P, M))
            << "P " << P << " M " << M << " stage " << s;
    }
}

TEST(PipelineSimulator, ChromeTraceNamesZbH1Ops) {
  const SimResult r = simulate(zb_h1(2, 2, 1, 1, 1, 1));
  const nlohmann::json trace = chrome_trace(r.timeline, 2, 1.0);
  std::set<std::string> names;
  for (const auto& e : trace["traceEvents"])
    if (e["ph"] == "X") names.insert(e["name"].get<std::string>());
  EXPECT_EQ(names, (std::set<std::string>{"F0", "F1", "B0", "B1", "W0", "W1", "STEP"}));
}

TEST(PipelineSimulator, AWeightCostOutsideTheBackwardIsAnInputError) {
  for (double weight : {2.5, -0.5}) {
    SimOptions o = uniform(ScheduleKind::zb_h1, 2, 4, 1);
    o.costs = {{1, 2, 0, 1}, {1, 2, 0, weight}};
    fixture::expect_input_error([&] { simulate(o); }, {"weight cost", "backward 2"});
  }
}

// Links per boundary (latency + bytes / bandwidth per message): GPipe's fill and drain pass each
// boundary once per step in each direction, so a step takes (M + P - 1)(F + B) + 2 sum_b c_b,
// exactly, with uneven links; one link for all applies to every boundary; a wrong count, a
// negative value or message times whose sum overflows is an InputError.
TEST(PipelineSimulator, LinksAddTheirMessageTimeToGPipesFillAndDrain) {
  const int P = 4;
  const int64_t M = 5, steps = 3;
  SimOptions o = uniform(ScheduleKind::gpipe, P, M, steps);
  o.links = {{0.1, 0, 0}, {0.05, 2.0, 1.0}, {0.0, 4.0, 2.0}};  // 0.1, 0.55, 0.5
  const double free = double(M + P - 1) * 4.0;                 // F + B = 1.5 + 2.5
  EXPECT_NEAR(simulate(o).makespan, double(steps) * (free + 2 * (0.1 + 0.55 + 0.5)), 1e-9);
  o.links = {{0.25, 0, 0}};
  EXPECT_NEAR(simulate(o).makespan, double(steps) * (free + 2 * 3 * 0.25), 1e-9);
  o.links = {{0.1, 0, 0}, {0.1, 0, 0}};
  fixture::expect_input_error([&] { simulate(o); }, {"links", "one per boundary (3)"});
  o.links = {{-0.1, 0, 0}};
  fixture::expect_input_error([&] { simulate(o); }, {"link"});
  // Each message's time is finite, their sum is not: refused, not a makespan of inf (a bubble
  // of 1, a throughput of 0).
  o.links = {{1e308, 0, 0}};
  fixture::expect_input_error([&] { simulate(o); },
                              {"pipeline simulator: the simulated gpipe makespan is not finite"});
}

// simulated_ops, which bounds what `tessel simulate` may run, counts the ops the simulator
// runs; PACI with K dividing the horizon n and not (n = 10, K = 3: floor(10 / 3) = 3 local
// steps per stage, 92 ops at P = 4).
TEST(PipelineSimulator, SimulatedOpsCountsEveryOpItRuns) {
  for (const ScheduleKind kind :
       {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::zb_h1,
        ScheduleKind::interleaved, ScheduleKind::paci})
    for (const int P : {1, 2, 4})
      for (const int64_t paci_n : {24, 10}) {
        if (kind == ScheduleKind::interleaved && P == 1) continue;
        if (kind != ScheduleKind::paci && paci_n != 24) continue;
        SimOptions o;
        o.schedule = kind == ScheduleKind::paci ? ScheduleOptions{kind, P, paci_n, 1, 3}
                                                : ScheduleOptions{kind, P, 8, 3, 1};
        if (kind == ScheduleKind::interleaved) o.schedule.chunks = 3;
        o.costs = {{1, 2, 0.5, kind == ScheduleKind::zb_h1 ? 1.0 : 0.0}};
        EXPECT_EQ(double(simulate(o).timeline.size()), simulated_ops(o.schedule))
            << schedule_name(kind) << ", P " << P << ", n " << o.schedule.micro_batches;
      }
  EXPECT_EQ(simulated_ops({ScheduleKind::paci, 4, 10, 1, 3}), 92.0);
}
