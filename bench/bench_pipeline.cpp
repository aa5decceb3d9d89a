// Simulated PACI(K = M) against 1F1B-flush at equal micro-batches and uniform stage costs
// (forward 1, backward 2): the throughput ratio and each schedule's bubble, beside the
// spec's ceiling (M + P - 1) / M. Counters are the result; the timing is the simulator's.
//   build/release/bench/bench_pipeline
#include <benchmark/benchmark.h>

#include "tessel/pipeline/simulator.hpp"

using namespace tessel::pipeline;

static void BM_SimulatedPaciOver1F1B(benchmark::State& state) {
  const int P = int(state.range(0));
  const int64_t M = state.range(1), steps = 100;
  SimOptions flush, paci;
  flush.schedule = {ScheduleKind::one_f_one_b, P, M, steps, 1};
  paci.schedule = {ScheduleKind::paci, P, M * steps, 1, M};
  flush.costs = paci.costs = {{1.0, 2.0, 0.0}};
  SimResult f, p;
  for (auto _ : state) {
    f = simulate(flush);
    p = simulate(paci);
    benchmark::DoNotOptimize(p.makespan);
  }
  state.counters["paci_over_1f1b"] = p.throughput / f.throughput;
  state.counters["ceiling"] = double(M + P - 1) / double(M);
  state.counters["bubble_1f1b"] = f.bubble;
  state.counters["bubble_paci"] = p.bubble;
}
BENCHMARK(BM_SimulatedPaciOver1F1B)->Args({2, 2})->Args({4, 4})->Args({8, 8})->Args({8, 32});

BENCHMARK_MAIN();
