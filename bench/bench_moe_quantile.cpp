// The step-end beta update of the quantile balancing methods (results in docs/benchmarks.md,
// "MoE balancing", "Histogram baseline"): MoeLayer::update on one process (LocalExpertComm,
// so the time is the computation alone, no collective), E = 8 experts, top-2, the margins'
// order keys of `rows` tokens per expert as backward records them.
//   BM_BalanceUpdate/method/rows/bins: method 0 = eqb (radix select, 2 passes over the keys),
//     1 = qb_hist with `bins` uniform bins (keys to f32, the range, 1 pass of binning).
#include <benchmark/benchmark.h>

#include <vector>

#include "tessel/core/rng.hpp"
#include "tessel/moe/layer.hpp"
#include "tessel/moe/quantile.hpp"

using namespace tessel;

namespace {

void BM_BalanceUpdate(benchmark::State& state) {
  const int64_t rows = state.range(1), E = 8;
  moe::MoeConfig config;
  config.experts = E;
  config.top_k = 2;
  config.balance = state.range(0) == 0 ? moe::Balance::eqb : moe::Balance::qb_hist;
  if (config.balance == moe::Balance::qb_hist) config.hist_bins = state.range(2);
  const moe::MoeLayer layer(config, {64, 128, 0, moe::ExpertMlp::gelu});
  Rng rng(7);
  std::vector<std::vector<uint16_t>> keys(static_cast<size_t>(E));
  for (auto& col : keys)
    for (int64_t t = 0; t < rows; ++t) col.push_back(moe::bf16_order_key(rng.normal()));
  moe::LocalExpertComm comm;
  std::vector<float> beta(static_cast<size_t>(E), 0.0f);
  for (auto _ : state) {
    state.PauseTiming();
    moe::BalanceState s;  // update consumes the record
    s.keys = keys;
    state.ResumeTiming();
    layer.update(s, beta.data(), comm);
    benchmark::DoNotOptimize(beta.data());
  }
  state.SetItemsProcessed(state.iterations() * rows * E);
}

}  // namespace

BENCHMARK(BM_BalanceUpdate)
    ->ArgNames({"method", "rows", "bins"})
    ->Args({0, 1024, 0})
    ->Args({1, 1024, 1000})
    ->Args({1, 1024, 64})
    ->Args({0, 16384, 0})
    ->Args({1, 16384, 1000})
    ->Args({1, 16384, 64})
    ->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();
