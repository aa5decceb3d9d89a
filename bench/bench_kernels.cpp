// Fast kernels against their naive twins (Google Benchmark). Each pair runs on the
// same shapes in the same process, so the ratio fast/naive is what to read:
//   build/release/bench/bench_kernels --benchmark_min_time=0.2
// Shapes are those of one GPT-2-small layer at batch 4 x sequence 64 (N = 256 tokens,
// C = 768, 12 heads of 64) unless noted.
#include <benchmark/benchmark.h>

#include <vector>

#include "tessel/core/rng.hpp"
#include "tessel/kernels/cpu/attention.hpp"
#include "tessel/kernels/cpu/cross_entropy.hpp"
#include "tessel/kernels/cpu/gemm.hpp"
#include "tessel/kernels/cpu/norms.hpp"

using namespace tessel;

namespace {

constexpr int64_t kN = 256, kC = 768, kH = 12, kD = 64, kB = 4, kT = 64, kV = 50304;

std::vector<float> random_vector(int64_t n, uint64_t seed) {
  std::vector<float> v(static_cast<size_t>(n));
  Rng rng(seed);
  rng.fill_normal(v.data(), n, 0.0f, 1.0f);
  return v;
}

// The QKV projection: y [N, 3C] = x [N, C] W^T.
template <bool kFast>
void BM_linear_qkv(benchmark::State& state) {
  auto x = random_vector(kN * kC, 1), w = random_vector(3 * kC * kC, 2);
  std::vector<float> y(size_t(kN * 3 * kC));
  for (auto _ : state) {
    if constexpr (kFast)
      kernels::linear_forward(y.data(), x.data(), w.data(), nullptr, kN, kC, 3 * kC);
    else
      kernels::naive::linear_forward<float>(y.data(), x.data(), w.data(), nullptr, kN, kC, 3 * kC);
    benchmark::DoNotOptimize(y.data());
  }
  state.counters["flop/s"] =
      benchmark::Counter(2.0 * kN * kC * 3 * kC, benchmark::Counter::kIsIterationInvariantRate,
                         benchmark::Counter::kIs1000);
}

template <bool kFast>
void BM_layernorm_fwd_bwd(benchmark::State& state) {
  auto x = random_vector(kN * kC, 3), w = random_vector(kC, 4), b = random_vector(kC, 5),
       dy = random_vector(kN * kC, 6);
  std::vector<float> y(size_t(kN * kC)), mean(kN), rstd(kN), dx(size_t(kN * kC)), dw(kC), db(kC);
  for (auto _ : state) {
    if constexpr (kFast) {
      kernels::layernorm_forward(y.data(), mean.data(), rstd.data(), x.data(), w.data(), b.data(),
                                 kN, kC, 1e-5f);
      kernels::layernorm_backward(dx.data(), dw.data(), db.data(), dy.data(), x.data(), w.data(),
                                  mean.data(), rstd.data(), kN, kC);
    } else {
      kernels::naive::layernorm_forward<float>(y.data(), mean.data(), rstd.data(), x.data(),
                                               w.data(), b.data(), kN, kC, 1e-5f);
      kernels::naive::layernorm_backward<float>(dx.data(), dw.data(), db.data(), dy.data(),
                                                x.data(), w.data(), mean.data(), rstd.data(), kN,
                                                kC);
    }
    benchmark::DoNotOptimize(dx.data());
  }
}

// Causal attention, forward and backward, at sequence `range(0)` (batch 4, 12 heads of 64).
template <bool kFast>
void BM_attention_fwd_bwd(benchmark::State& state) {
  const int64_t T = state.range(0);
  kernels::AttentionShape s{kB, T, kH, kH, kD};
  const int64_t n = kB * T * kH * kD;
  auto q = random_vector(n, 7), k = random_vector(n, 8), v = random_vector(n, 9),
       dout = random_vector(n, 10);
  const size_t un = static_cast<size_t>(n);
  std::vector<float> o(un), lse(static_cast<size_t>(kB * kH * T)), dq(un), dk(un), dv(un);
  for (auto _ : state) {
    if constexpr (kFast) {
      kernels::causal_attention_forward(o.data(), lse.data(), q.data(), k.data(), v.data(), s);
      kernels::causal_attention_backward(dq.data(), dk.data(), dv.data(), dout.data(), q.data(),
                                         k.data(), v.data(), o.data(), lse.data(), s);
    } else {
      kernels::naive::causal_attention_forward<float>(o.data(), lse.data(), q.data(), k.data(),
                                                      v.data(), s);
      kernels::naive::causal_attention_backward<float>(dq.data(), dk.data(), dv.data(), dout.data(),
                                                       q.data(), k.data(), v.data(), o.data(),
                                                       lse.data(), s);
    }
    benchmark::DoNotOptimize(dq.data());
  }
}

// Cross-entropy over the GPT-2 vocabulary, forward and backward.
template <bool kFast>
void BM_cross_entropy_fwd_bwd(benchmark::State& state) {
  auto logits = random_vector(kN * kV, 11);
  std::vector<int32_t> targets(kN);
  for (int64_t i = 0; i < kN; ++i) targets[size_t(i)] = int32_t((i * 7919) % kV);
  std::vector<float> weight(kN, 1.0f), lse(kN), dlogits(size_t(kN * kV));
  for (auto _ : state) {
    if constexpr (kFast) {
      kernels::cross_entropy_forward(lse.data(), logits.data(), targets.data(), weight.data(), kN,
                                     kV);
      kernels::cross_entropy_backward(dlogits.data(), logits.data(), lse.data(), targets.data(),
                                      weight.data(), 1.0f, kN, kV);
    } else {
      kernels::naive::cross_entropy_forward<float>(lse.data(), logits.data(), targets.data(),
                                                   weight.data(), kN, kV);
      kernels::naive::cross_entropy_backward<float>(dlogits.data(), logits.data(), lse.data(),
                                                    targets.data(), weight.data(), 1.0f, kN, kV);
    }
    benchmark::DoNotOptimize(dlogits.data());
  }
}

}  // namespace

BENCHMARK(BM_linear_qkv<true>)->Name("linear_qkv/fast")->Unit(benchmark::kMillisecond);
BENCHMARK(BM_linear_qkv<false>)->Name("linear_qkv/naive")->Unit(benchmark::kMillisecond);
BENCHMARK(BM_layernorm_fwd_bwd<true>)
    ->Name("layernorm_fwd_bwd/fast")
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_layernorm_fwd_bwd<false>)
    ->Name("layernorm_fwd_bwd/naive")
    ->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_attention_fwd_bwd<true>)
    ->Name("attention_fwd_bwd/fast")
    ->Arg(64)
    ->Arg(256)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_attention_fwd_bwd<false>)
    ->Name("attention_fwd_bwd/naive")
    ->Arg(64)
    ->Arg(256)
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_cross_entropy_fwd_bwd<true>)
    ->Name("cross_entropy_fwd_bwd/fast")
    ->Unit(benchmark::kMillisecond);
BENCHMARK(BM_cross_entropy_fwd_bwd<false>)
    ->Name("cross_entropy_fwd_bwd/naive")
    ->Unit(benchmark::kMillisecond);

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
