// Megatron's interleaved 1F1B (v model chunks per stage) against a hand-written list, the
// per-stage order it promises, the peak live chunk activations 2 (P - 1 - s) + (v - 1) P + 1
// (capped at M v), and the simulator against spec pipeline.md §4.3's closed form
// (M + (P - 1) / v)(F + B) per flush step for uniform costs.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>
#include <string>
#include <utility>

#include "support/expect_input_error.hpp"
#include "tessel/core/rng.hpp"
#include "tessel/pipeline/simulator.hpp"

using namespace tessel;
using namespace tessel::pipeline;

namespace {

ScheduleOptions interleaved(int P, int v, int64_t M, int64_t steps) {
  ScheduleOptions o{ScheduleKind::interleaved, P, M, steps, 1};
  o.chunks = v;
  return o;
}

SimOptions uniform(int P, int v, int64_t M, int64_t steps) {
  SimOptions o;
  o.schedule = interleaved(P, v, M, steps);
  o.costs = {{1.5, 2.5, 0}};
  return o;
}

Op f(int64_t micro, int chunk) {
  return {OpKind::forward, micro, chunk};
}
Op b(int64_t micro, int chunk) {
  return {OpKind::backward, micro, chunk};
}

std::string trace(int P, int v, int64_t M, int s = -1) {
  return "P=" + std::to_string(P) + " v=" + std::to_string(v) + " M=" + std::to_string(M) +
         (s >= 0 ? " s=" + std::to_string(s) : "");
}

}  // namespace

TEST(InterleavedSchedule, MatchesTheHandWrittenListForTwoStagesTwoChunks) {
  // P = 2, v = 2, M = 4: forwards in groups of P = 2 micro-batches, chunk 0 then chunk 1;
  // backwards chunk 1 then chunk 0. Stage 0 warms up with 2 (P - 1) + (v - 1) P = 4 forwards,
  // stage 1 with 2.
  const Op step{OpKind::step};
  EXPECT_EQ(stage_ops(interleaved(2, 2, 4, 1), 0),
            (std::vector<Op>{f(0, 0), f(1, 0), f(0, 1), f(1, 1), f(2, 0), b(0, 1), f(3, 0), b(1, 1),
                             f(2, 1), b(0, 0), f(3, 1), b(1, 0), b(2, 1), b(3, 1), b(2, 0), b(3, 0),
                             step}));
  EXPECT_EQ(stage_ops(interleaved(2, 2, 4, 1), 1),
            (std::vector<Op>{f(0, 0), f(1, 0), f(0, 1), b(0, 1), f(1, 1), b(1, 1), f(2, 0), b(0, 0),
                             f(3, 0), b(1, 0), f(2, 1), b(2, 1), f(3, 1), b(3, 1), b(2, 0), b(3, 0),
                             step}));
  // The second flush step numbers its micro-batches on: 4 .. 7.
  const auto two = stage_ops(interleaved(2, 2, 4, 2), 1);
  ASSERT_EQ(two.size(), 34u);
  EXPECT_EQ(two[17], f(4, 0));
  EXPECT_EQ(two[32], b(7, 0));
}

TEST(InterleavedSchedule, OneChunkListsAreTheHandWrittenOnes) {
  // The 1F1B pattern the interleaved list shares, with one chunk (chunk 0 everywhere): 1F1B at
  // P = 3, M = 4 (stage 0 warms up with 2 forwards, stage 2 with none) and PACI(K = 2).
  auto ops = [](std::initializer_list<std::pair<char, int64_t>> list) {
    std::vector<Op> out;
    for (const auto& [kind, micro] : list)
      out.push_back(kind == 'S' ? Op{OpKind::step} : kind == 'F' ? f(micro, 0) : b(micro, 0));
    return out;
  };
  const ScheduleOptions flush{ScheduleKind::one_f_one_b, 3, 4, 1, 1};
  EXPECT_EQ(stage_ops(flush, 0), ops({{'F', 0},
                                      {'F', 1},
                                      {'F', 2},
                                      {'B', 0},
                                      {'F', 3},
                                      {'B', 1},
                                      {'B', 2},
                                      {'B', 3},
                                      {'S', 0}}));
  EXPECT_EQ(stage_ops(flush, 2), ops({{'F', 0},
                                      {'B', 0},
                                      {'F', 1},
                                      {'B', 1},
                                      {'F', 2},
                                      {'B', 2},
                                      {'F', 3},
                                      {'B', 3},
                                      {'S', 0}}));
  EXPECT_EQ(stage_ops({ScheduleKind::paci, 2, 4, 1, 2}, 0), ops({{'F', 0},
                                                                 {'F', 1},
                                                                 {'B', 0},
                                                                 {'F', 2},
                                                                 {'B', 1},
                                                                 {'S', 0},
                                                                 {'F', 3},
                                                                 {'B', 2},
                                                                 {'B', 3},
                                                                 {'S', 0}}));
}

TEST(InterleavedSchedule, EveryStageRunsEachMicroBatchChunkOnceInTheModelsOrder) {
  for (int P : {1, 2, 3, 4})
    for (int v : {2, 3})
      for (int64_t M : {int64_t(P), int64_t(2 * P), int64_t(3 * P)})
        for (int s = 0; s < P; ++s) {
          SCOPED_TRACE(trace(P, v, M, s));
          const int64_t steps = 2;
          std::set<std::pair<int64_t, int>> forwarded, backwarded;
          std::map<int, int64_t> next_forward;  // chunk -> next micro-batch of its forwards
          int64_t step_count = 0, live = 0, peak = 0;
          for (const Op& op : stage_ops(interleaved(P, v, M, steps), s)) {
            const std::pair<int64_t, int> key{op.micro, op.chunk};
            if (op.kind == OpKind::forward) {
              EXPECT_TRUE(op.chunk >= 0 && op.chunk < v);
              EXPECT_TRUE(forwarded.insert(key).second) << "forward twice";
              // A micro-batch enters chunk c after chunk c - 1; a chunk's forwards (data
              // readers) run in micro-batch order.
              EXPECT_TRUE(op.chunk == 0 || forwarded.count({op.micro, op.chunk - 1}));
              EXPECT_EQ(op.micro, next_forward[op.chunk]++) << "chunk " << op.chunk;
              peak = std::max(peak, ++live);
            } else if (op.kind == OpKind::backward) {
              EXPECT_TRUE(forwarded.count(key)) << "backward before forward";
              EXPECT_TRUE(backwarded.insert(key).second) << "backward twice";
              // Backwards leave chunk c + 1 before chunk c.
              EXPECT_TRUE(op.chunk == v - 1 || backwarded.count({op.micro, op.chunk + 1}));
              --live;
            } else {
              ASSERT_EQ(op.kind, OpKind::step);
              ++step_count;
              EXPECT_EQ(live, 0) << "a flush step follows every backward";
              EXPECT_EQ(int64_t(backwarded.size()), step_count * M * v);
            }
          }
          EXPECT_EQ(int64_t(forwarded.size()), steps * M * v);
          EXPECT_EQ(int64_t(backwarded.size()), steps * M * v);
          EXPECT_EQ(step_count, steps);
          EXPECT_EQ(peak, std::min<int64_t>(2 * (P - 1 - s) + (v - 1) * P + 1, M * v));
        }
}

TEST(InterleavedSimulator, UniformCostsMatchTheClosedForm) {
  // (M + (P - 1) / v)(F + B) per step, exactly (1e-9: sums of a few hundred binary fractions).
  const double F = 1.5, B = 2.5;
  for (int P : {2, 4, 8})
    for (int v : {2, 3, 4})
      for (int64_t M : {int64_t(P), int64_t(2 * P), int64_t(4 * P)}) {
        SCOPED_TRACE(trace(P, v, M));
        const int64_t steps = 2;
        const SimResult r = simulate(uniform(P, v, M, steps));
        const double step = (double(M) + double(P - 1) / v) * (F + B);
        EXPECT_NEAR(r.makespan, double(steps) * step, 1e-9);
        EXPECT_NEAR(r.bubble, double(P - 1) / v / (double(M) + double(P - 1) / v), 1e-9);
        for (int s = 0; s < P; ++s) {
          EXPECT_EQ(r.peak_activations[size_t(s)],
                    std::min<int64_t>(2 * (P - 1 - s) + (v - 1) * P + 1, M * v));
          EXPECT_EQ(r.max_version_gap[size_t(s)], 0);
        }
      }
}

TEST(InterleavedSimulator, BubbleIsOneVthOf1F1BsForTheSameWholeStageCosts) {
  // Per step 1F1B idles (P - 1)(F + B) beyond the M (F + B) of work, interleaved 1/v of it.
  const int64_t steps = 3;
  for (int P : {2, 4})
    for (int v : {2, 3}) {
      const int64_t M = 2 * P;
      SCOPED_TRACE(trace(P, v, M));
      SimOptions o = uniform(P, v, M, steps);
      const double work = double(steps * M) * 4.0;
      const double chunked = simulate(o).makespan - work;
      o.schedule = {ScheduleKind::one_f_one_b, P, M, steps, 1};
      const double flush = simulate(o).makespan - work;
      EXPECT_NEAR(flush, double(steps * (P - 1)) * 4.0, 1e-9);
      EXPECT_NEAR(chunked, flush / v, 1e-9);
      EXPECT_LT(chunked, flush);
    }
}

TEST(InterleavedSimulator, RandomCostsAndLinksRespectEveryVirtualStageDependency) {
  Rng rng(11);
  for (int P : {1, 2, 3, 4})
    for (int v : {2, 3}) {
      SCOPED_TRACE(trace(P, v, 2 * P));
      SimOptions o;
      o.schedule = interleaved(P, v, 2 * P, 3);
      for (int s = 0; s < P; ++s) {
        o.costs.push_back({0.5 + rng.uniform(), 1 + 2 * rng.uniform(), 0.1 * rng.uniform(), 0});
        o.links.push_back({0.5 * rng.uniform()});  // the last: the wrap P - 1 -> 0
      }
      const SimResult r = simulate(o);  // throws if some stage deadlocks
      // (virtual stage, micro) -> timing
      std::map<std::pair<int, int64_t>, OpTiming> fw, bw;
      for (const OpTiming& t : r.timeline) {
        const std::pair<int, int64_t> key{t.op.chunk * P + t.stage, t.op.micro};
        const StageCosts& c = o.costs[size_t(t.stage)];
        // A chunk's op costs 1/v of the stage's (1e-12: one division).
        if (t.op.kind == OpKind::forward) {
          EXPECT_NEAR(t.end - t.start, c.forward / v, 1e-12);
          fw[key] = t;
        }
        if (t.op.kind == OpKind::backward) {
          EXPECT_NEAR(t.end - t.start, c.backward / v, 1e-12);
          bw[key] = t;
        }
      }
      const int V = P * v;
      ASSERT_EQ(fw.size(), size_t(V) * 6 * size_t(P));
      ASSERT_EQ(bw.size(), fw.size());
      // Message from virtual stage j to j + 1: the link leaving stage j mod P.
      auto link = [&](int j) { return o.links[size_t(j % P)].latency; };
      for (const auto& [key, t] : fw) {
        const auto [j, m] = key;
        if (j > 0) {
          EXPECT_GE(t.start, fw.at({j - 1, m}).end + link(j - 1) - 1e-12) << "F " << j << " " << m;
        }
      }
      for (const auto& [key, t] : bw) {
        const auto [j, m] = key;
        EXPECT_GE(t.start, fw.at(key).end - 1e-12);
        if (j + 1 < V) {
          EXPECT_GE(t.start, bw.at({j + 1, m}).end + link(j) - 1e-12) << "B " << j << " " << m;
        }
      }
      std::vector<double> last(size_t(P), 0);
      for (const OpTiming& t : r.timeline) {
        EXPECT_GE(t.start, last[size_t(t.stage)] - 1e-12) << "one op at a time per stage";
        last[size_t(t.stage)] = t.end;
      }
    }
}

TEST(InterleavedSimulator, TheWrapIsTheLastOfPLinks) {
  // One latency L on the wrap alone: each micro-batch crosses it v - 1 times forward and
  // v - 1 times backward, so the step is longer than without it, and as long as with L on
  // every boundary at P = 1 (where the wrap is the only link).
  const int P = 2, v = 2;
  SimOptions o = uniform(P, v, 2, 1);
  const double free = simulate(o).makespan;
  o.links = {{0}, {0.75}};
  EXPECT_GT(simulate(o).makespan, free + 0.75);
  o.links = {{0.75}, {0}};
  EXPECT_GT(simulate(o).makespan, free + 0.75);
  SimOptions one = uniform(1, v, 2, 1);
  one.links = {{0.75}};
  // P = 1, v = 2, M = 2 runs F0.0 F0.1 B0.1 F1.0 B0.0 F1.1 B1.1 B1.0: F0.1 and B1.0 wait for
  // the wrap, B0.0's wait hides behind F1.0, F1.1's behind B0.0.
  EXPECT_NEAR(simulate(one).makespan, 2 * 4.0 + 2 * 0.75, 1e-9);
  o.links = {{0.1}};
  EXPECT_NO_THROW(simulate(o));
  o.links = {{0.1}, {0.1}, {0.1}};
  fixture::expect_input_error([&] { simulate(o); }, {"one per boundary (2", "wrap"});

  // Which link is which, P = 3: latency on the wrap (index 2) alone delays chunk 1's first
  // forward on stage 0 after chunk 0's on stage 2, and not the hand-over from stage 0 to 1.
  SimOptions three = uniform(3, v, 3, 1);
  three.links = {{0}, {0}, {0.75}};
  const SimResult r = simulate(three);
  auto timing = [&r](int stage, const Op& op) {
    for (const OpTiming& t : r.timeline)
      if (t.stage == stage && t.op == op) return t;
    ADD_FAILURE() << "no op on stage " << stage;
    return OpTiming{};
  };
  EXPECT_EQ(timing(1, f(0, 0)).start, timing(0, f(0, 0)).end);
  EXPECT_GE(timing(0, f(0, 1)).start, timing(2, f(0, 0)).end + 0.75);
  EXPECT_GE(timing(2, b(0, 0)).start, timing(0, b(0, 1)).end + 0.75);
}

TEST(InterleavedSimulator, ChromeTraceNamesMicroBatchAndChunk) {
  const SimResult r = simulate(uniform(2, 2, 2, 1));
  const nlohmann::json trace = chrome_trace(r.timeline, 2, 1.0);
  std::set<std::string> names;
  for (const auto& e : trace["traceEvents"])
    if (e["ph"] == "X") names.insert(e["name"].get<std::string>());
  EXPECT_EQ(names, (std::set<std::string>{"F0.0", "F1.0", "F0.1", "F1.1", "B0.0", "B1.0", "B0.1",
                                          "B1.1", "STEP"}));
}
