// Greedy text generation on the README demo's model shape (4 blocks of width 256, 8 heads,
// byte vocabulary, max_seq 128, random weights): the KV cache (model::generate through the
// whole model) against running every step's whole window (model::next_token_logits, as
// generation did before the cache). A 12-token prompt and 116 new tokens fill the window
// exactly, so every cached step runs one position. Counter: tokens_per_s (new tokens).
//   OMP_NUM_THREADS=1 build/release/bench/bench_generate --benchmark_repetitions=5
//     --benchmark_enable_random_interleaving=true --benchmark_report_aggregates_only=true
#include <benchmark/benchmark.h>

#include <vector>

#include "tessel/core/rng.hpp"
#include "tessel/model/generate.hpp"
#include "tessel/model/gpt.hpp"

using namespace tessel;
using namespace tessel::model;

namespace {

GptConfig demo_config() {
  GptConfig c;
  c.vocab = 256;
  c.layers = 4;
  c.width = 256;
  c.heads = 8;
  c.max_seq = 128;
  return c;
}

void BM_Generate(benchmark::State& state) {
  const bool cached = state.range(0) != 0;
  const GptConfig c = demo_config();
  const Gpt gpt(c, 1);
  const std::vector<int32_t> prompt = {65, 110, 100, 32, 71, 111, 100, 32, 115, 97, 105, 100};
  const int64_t new_tokens = c.max_seq - int64_t(prompt.size());
  const NextTokenLogits whole_window = [&gpt](std::span<const int32_t> window) {
    return next_token_logits(gpt, std::vector<int32_t>(window.begin(), window.end()));
  };
  for (auto _ : state) {
    Rng rng(3);
    benchmark::DoNotOptimize(
        cached ? generate(gpt, prompt, new_tokens, 0.0f, 0, rng)
               : generate(whole_window, c.max_seq, prompt, new_tokens, 0.0f, 0, rng));
  }
  state.SetLabel(cached ? "kv_cache" : "whole_window");
  state.counters["tokens_per_s"] =
      benchmark::Counter(double(new_tokens), benchmark::Counter::kIsIterationInvariantRate);
}

}  // namespace

BENCHMARK(BM_Generate)->Arg(0)->Arg(1)->Unit(benchmark::kMillisecond)->UseRealTime();

BENCHMARK_MAIN();
