// Simulated PACI(K = M) against 1F1B-flush at equal micro-batches and uniform stage costs
// (forward 1, backward 2, and an optimizer step of the third argument in percent of one
// micro-batch's forward + backward): the throughput ratio and each schedule's bubble, beside
// the spec's ceiling (M + P - 1) / M, which leaves the step out, and the closed form with it,
// ((M + P - 1) x + o) / (M x + o). Counters are the result; the timing is the simulator's.
//   build/release/bench/bench_pipeline
#include <benchmark/benchmark.h>

#include "tessel/pipeline/simulator.hpp"

using namespace tessel::pipeline;

static void BM_SimulatedPaciOver1F1B(benchmark::State& state) {
  const int P = int(state.range(0));
  const int64_t M = state.range(1), steps = 100;
  const double x = 3.0, o = x * double(state.range(2)) / 100.0;  // micro-batch, step
  SimOptions flush, paci;
  flush.schedule = {ScheduleKind::one_f_one_b, P, M, steps, 1};
  paci.schedule = {ScheduleKind::paci, P, M * steps, 1, M};
  flush.costs = paci.costs = {{1.0, 2.0, o}};
  SimResult f, p;
  for (auto _ : state) {
    f = simulate(flush);
    p = simulate(paci);
    benchmark::DoNotOptimize(p.makespan);
  }
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

BENCHMARK_MAIN();
