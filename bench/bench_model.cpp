// One micro-batch's forward and backward through the GPT. Counters: tokens/s and the
// activation MiB of the micro-batch.
//   build/release/bench/bench_model --benchmark_repetitions=5
//     --benchmark_enable_random_interleaving=true --benchmark_report_aggregates_only=true
// BM_Recompute: keeping every block's cache (train.recompute = none) against recomputing the
// blocks in backward (blocks); width 256, 8 blocks of 8 heads, GELU, micro-batch 8 x 512
// tokens (the deeper, longer-sequence variant of the README demo in docs/benchmarks.md).
// BM_AttentionWindow: model.attention_window 0 (none) / 128 / 512 at 2048 tokens, 4 blocks
// of width 256, micro-batch 2 x 2048. Threads: OMP_NUM_THREADS.
#include <benchmark/benchmark.h>

#include <vector>

#include "tessel/core/rng.hpp"
#include "tessel/model/gpt.hpp"

using namespace tessel;
using namespace tessel::model;

namespace {

GptConfig bench_config(int64_t layers, int64_t T) {
  GptConfig c;
  c.vocab = 256;
  c.layers = layers;
  c.width = 256;
  c.heads = 8;
  c.max_seq = T;
  return c;
}

// Times forward and backward of B x T random tokens (next-token targets, plain causal mask).
void run_forward_backward(benchmark::State& state, const GptConfig& c, int64_t B, int64_t T,
                          Recompute recompute) {
  const int64_t N = B * T;
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
  state.counters["tokens_per_s"] =
      benchmark::Counter(double(N), benchmark::Counter::kIsIterationInvariantRate);
  state.counters["activation_mib"] = double(acts->tensor_bytes) / double(1 << 20);
}

void BM_Recompute(benchmark::State& state) {
  const auto recompute = Recompute(state.range(0));
  state.SetLabel(to_string(recompute));
  run_forward_backward(state, bench_config(8, 512), 8, 512, recompute);
}

void BM_AttentionWindow(benchmark::State& state) {
  GptConfig c = bench_config(4, 2048);
  c.attention_window = state.range(0);
  run_forward_backward(state, c, 2, 2048, Recompute::none);
}

}  // namespace

BENCHMARK(BM_Recompute)
    ->Arg(int(Recompute::none))
    ->Arg(int(Recompute::blocks))
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();
BENCHMARK(BM_AttentionWindow)
    ->Arg(0)
    ->Arg(128)
    ->Arg(512)
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

BENCHMARK_MAIN();
