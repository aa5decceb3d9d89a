// Simulated PACI(K = M) and ZB-H1 against 1F1B-flush.
// PACI(K = M): against 1F1B-flush at equal micro-batches and uniform stage costs
// (forward 1, backward 2, and an optimizer step of the third argument in percent of one
// micro-batch's forward + backward): the throughput ratio and each schedule's bubble, beside
// the spec's ceiling (M + P - 1) / M, which leaves the step out, and the closed form with it,
// ((M + P - 1) x + o) / (M x + o). Counters are the result; the timing is the simulator's.
//   build/release/bench/bench_pipeline
#include <benchmark/benchmark.h>

#include <utility>

#include "tessel/pipeline/simulator.hpp"

using namespace tessel::pipeline;

// Simulates 1F1B `flush` and `other` in the timed loop; their last results.
static std::pair<SimResult, SimResult> simulate_both(benchmark::State& state,
                                                     const SimOptions& flush,
                                                     const SimOptions& other) {
  SimResult f, o;
  for (auto _ : state) {
    f = simulate(flush);
    o = simulate(other);
    benchmark::DoNotOptimize(o.makespan);
  }
  return {f, o};
}

static void BM_SimulatedPaciOver1F1B(benchmark::State& state) {
  const int P = int(state.range(0));
  const int64_t M = state.range(1), steps = 100;
  const double x = 3.0, o = x * double(state.range(2)) / 100.0;  // micro-batch, step
  SimOptions flush, paci;
  flush.schedule = {ScheduleKind::one_f_one_b, P, M, steps, 1};
  paci.schedule = {ScheduleKind::paci, P, M * steps, 1, M};
  flush.costs = paci.costs = {{1.0, 2.0, o}};
  const auto [f, p] = simulate_both(state, flush, paci);
  state.counters["paci_over_1f1b"] = p.throughput / f.throughput;
  state.counters["ceiling"] = double(M + P - 1) / double(M);
  state.counters["ceiling_with_step"] = (double(M + P - 1) * x + o) / (double(M) * x + o);
  state.counters["bubble_1f1b"] = f.bubble;
  state.counters["bubble_paci"] = p.bubble;
}
// The step percentages 38 and 77 are the demo model's on 2 stages (Muon, 4096 tokens per
// step as 2 micro-batches of 16 or 4 of 8 sequences; docs/benchmarks.md).
BENCHMARK(BM_SimulatedPaciOver1F1B)
    ->Args({2, 2, 0})
    ->Args({4, 4, 0})
    ->Args({8, 8, 0})
    ->Args({8, 32, 0})
    ->Args({2, 2, 38})
    ->Args({2, 4, 77});

// Simulated ZB-H1 against 1F1B-flush at equal micro-batches and uniform stage costs F = B = W
// = 1 (the same whole backward 2 as above, split), the step in percent of F + B + W: the
// throughput ratio beside the closed form ((M + P - 1) 3 + o) / (3 M + (P - 1) + o) (ZB-H1's
// bubble (P - 1)(F + B - W), spec pipeline.md §3), each schedule's bubble and ZB-H1's peak
// live activations (P on every stage once M >= P, against 1F1B's P - s).
static void BM_SimulatedZbH1Over1F1B(benchmark::State& state) {
  const int P = int(state.range(0));
  const int64_t M = state.range(1), steps = 100;
  const double F = 1, B = 1, W = 1, o = (F + B + W) * double(state.range(2)) / 100.0;
  SimOptions flush, zb;
  flush.schedule = {ScheduleKind::one_f_one_b, P, M, steps, 1};
  zb.schedule = {ScheduleKind::zb_h1, P, M, steps, 1};
  flush.costs = zb.costs = {{F, B + W, o, W}};
  const auto [f, z] = simulate_both(state, flush, zb);
  state.counters["zb_h1_over_1f1b"] = z.throughput / f.throughput;
  state.counters["closed_form"] = (double(M + P - 1) * (F + B + W) + o) /
                                  (double(M) * (F + B + W) + double(P - 1) * (F + B - W) + o);
  state.counters["bubble_1f1b"] = f.bubble;
  state.counters["bubble_zb_h1"] = z.bubble;
  state.counters["peak_activations_zb_h1"] = double(z.peak_activations.front());
}
BENCHMARK(BM_SimulatedZbH1Over1F1B)
    ->Args({2, 2, 0})
    ->Args({4, 4, 0})
    ->Args({8, 8, 0})
    ->Args({8, 32, 0})
    ->Args({2, 2, 38});

BENCHMARK_MAIN();
