// One micro-batch's forward and backward through the GPT, keeping every block's cache
// (train.recompute = none) against recomputing the blocks in backward (blocks). Counters:
// tokens/s and the activation MiB of the micro-batch.
//   build/release/bench/bench_model --benchmark_repetitions=5
//     --benchmark_enable_random_interleaving=true --benchmark_report_aggregates_only=true
// Shape: width 256, 8 blocks of 8 heads, GELU, micro-batch 8 x 512 tokens (the deeper,
// longer-sequence variant of the README demo in docs/benchmarks.md); threads: OMP_NUM_THREADS.
#include <benchmark/benchmark.h>

#include <vector>

#include "tessel/core/rng.hpp"
#include "tessel/model/gpt.hpp"

using namespace tessel;
using namespace tessel::model;

namespace {

GptConfig bench_config() {
  GptConfig c;
  c.vocab = 256;
  c.layers = 8;
  c.width = 256;
  c.heads = 8;
  c.max_seq = 512;
  return c;
}

void BM_ForwardBackward(benchmark::State& state) {
  const auto recompute = Recompute(state.range(0));
  const GptConfig c = bench_config();
  const int64_t B = 8, T = 512, N = B * T;
  Gpt gpt(c, 1);
  Rng rng(2);
  std::vector<int32_t> tokens(size_t(N + 1));
  for (auto& t : tokens) t = int32_t(rng.below(uint64_t(c.vocab)));
  ModelInputs in;
  in.B = B;
  in.T = T;
  in.tokens = tokens.data();
  in.targets = tokens.data() + 1;
  auto acts = gpt.make_activations(B, T, recompute);
  for (auto _ : state) {
    gpt.zero_grads();
    benchmark::DoNotOptimize(gpt.forward(*acts, in));
    gpt.backward(*acts, 1.0f / float(N));
  }
  state.SetLabel(to_string(recompute));
  state.counters["tokens_per_s"] =
      benchmark::Counter(double(N), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["activation_mib"] = double(acts->tensor_bytes) / double(1 << 20);
}

}  // namespace

BENCHMARK(BM_ForwardBackward)
    ->Arg(int(Recompute::none))
    ->Arg(int(Recompute::blocks))
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

BENCHMARK_MAIN();
