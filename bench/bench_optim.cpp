// Muon-family benchmarks (spec muon_dion3.md; results in docs/benchmarks.md). Read ratios
// within one run:
//   BM_NewtonSchulz/n/m/path: path 0 = standard NS with GEMM only (the baseline), 1 = standard
//     NS with SYRK, 2 = orthogonalize's choice (Gram NS + symmetric kernels where
//     n >= gram_min and n < m, standard with SYRK otherwise). 5 KellerJordan steps, one
//     restart. A fourth argument > 0 is the gram_min (else the default).
//   BM_NewtonSchulzScaling/n/m/mode: Turbo-Muon's AOL scaling + 4 YOU steps (mode 1) against
//     the default Frobenius scaling + 5 KellerJordan steps (0) and + 5 YOU steps (2).
//   BM_XXt/n/path: X X^T of an n x n X, path 0 = GEMM, 1 = SYRK (+ mirror).
//   BM_CommutingProduct/n/path: A B of commuting symmetric n x n, path 0 = GEMM, 1 = lower tiles.
//   BM_OptimizerStep/<config>: one full optimizer step over the GPT-2-small parameter set
//     (12 layers, width 768, vocab 50304, tied head; the embedding and norms in AdamW) on
//     every rank of the launch (run it under mpirun -np 2); the time of the slowest rank;
//     counters: bytes this rank sent per step and collective calls per step.
#include <benchmark/benchmark.h>

#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "tessel/comm/world.hpp"
#include "tessel/core/rng.hpp"
#include "tessel/core/timer.hpp"
#include "tessel/kernels/cpu/gemm.hpp"
#include "tessel/kernels/cpu/symmetric.hpp"
#include "tessel/optim/muon.hpp"

using namespace tessel;
using namespace tessel::optim;

namespace {

std::vector<float> gaussian(int64_t n, float stddev = 1.0f) {
  std::vector<float> x(static_cast<size_t>(n));
  Rng rng(static_cast<uint64_t>(n));
  rng.fill_normal(x.data(), n, 0.0f, stddev);
  return x;
}

void BM_NewtonSchulz(benchmark::State& state) {
  const int64_t n = state.range(0), m = state.range(1), path = state.range(2);
  NsOptions o;
  o.gram = path == 2;
  o.symmetric = path != 0;
  if (state.range(3) > 0) o.gram_min = state.range(3);
  const auto U = gaussian(n * m);
  std::vector<float> out(U.size());
  for (auto _ : state) {
    orthogonalize(U.data(), n, m, o, out.data());
    benchmark::DoNotOptimize(out.data());
  }
  state.SetLabel(path == 0 ? "standard+gemm" : !uses_gram(o, n, m) ? "standard+syrk" : "gram+sym");
}
// Acceptance shapes: aspect 4 at n = 512 and 1024, aspect 2, square.
BENCHMARK(BM_NewtonSchulz)
    ->ArgsProduct({{512}, {2048}, {0, 1, 2}, {0}})
    ->ArgsProduct({{1024}, {4096}, {0, 1, 2}, {0}})
    ->ArgsProduct({{512}, {1024}, {0, 1, 2}, {0}})
    ->ArgsProduct({{1024}, {1024}, {0, 2}, {0}})
    ->ArgsProduct({{768}, {3072}, {0, 2}, {0}})
    ->Unit(benchmark::kMillisecond);
// Turbo-Muon: Frobenius scaling + KellerJordan's 5 steps (the default, argument 0) against the
// AOL scaling + YOU's last 4 steps (1) and the Frobenius scaling + YOU's 5 (2), each on the
// default path (Gram NS where n < m).
void BM_NewtonSchulzScaling(benchmark::State& state) {
  const int64_t n = state.range(0), m = state.range(1), mode = state.range(2);
  NsOptions o;
  o.aol = mode == 1;
  if (mode > 0) o.coefficients = ns_coefficients("you", mode == 1 ? 4 : 5);
  const auto U = gaussian(n * m);
  std::vector<float> out(U.size());
  for (auto _ : state) {
    orthogonalize(U.data(), n, m, o, out.data());
    benchmark::DoNotOptimize(out.data());
  }
  state.SetLabel(mode == 0 ? "frobenius+keller5" : mode == 1 ? "aol+you4" : "frobenius+you5");
}
BENCHMARK(BM_NewtonSchulzScaling)
    ->ArgsProduct({{256}, {1024}, {0, 1, 2}})
    ->ArgsProduct({{768}, {768, 3072}, {0, 1, 2}})
    ->ArgsProduct({{1024}, {4096}, {0, 1, 2}})
    ->Unit(benchmark::kMillisecond);

// Tuning of gram_min (fourth argument 1: Gram whenever n < m): standard+SYRK (path 1)
// against Gram (path 2) at aspect 2 and 4 for small short sides.
void gram_min_args(benchmark::internal::Benchmark* b) {
  for (int64_t n : {32, 64, 128, 192, 256})
    for (int64_t aspect : {2, 4})
      for (int64_t path : {1, 2}) b->Args({n, aspect * n, path, 1});
}
BENCHMARK(BM_NewtonSchulz)->Apply(gram_min_args)->Unit(benchmark::kMicrosecond);

void BM_XXt(benchmark::State& state) {
  const int64_t n = state.range(0);
  const auto X = gaussian(n * n);
  std::vector<float> C(size_t(n * n));
  for (auto _ : state) {
    if (state.range(1) == 0)
      kernels::gemm(false, true, n, n, n, 1.0f, X.data(), n, X.data(), n, 0.0f, C.data(), n);
    else
      kernels::syrk(n, n, 1.0f, X.data(), 0.0f, C.data());
    benchmark::DoNotOptimize(C.data());
  }
  state.SetLabel(state.range(1) == 0 ? "gemm" : "syrk");
}
BENCHMARK(BM_XXt)->ArgsProduct({{1024, 2048}, {0, 1}})->Unit(benchmark::kMillisecond);

void BM_CommutingProduct(benchmark::State& state) {
  const int64_t n = state.range(0);
  const auto M = gaussian(n * n, 1.0f / float(n));
  std::vector<float> A(size_t(n * n)), B(size_t(n * n)), C(size_t(n * n));
  kernels::syrk(n, n, 1.0f, M.data(), 0.0f, A.data());
  kernels::syrk(n, n, 1.0f, A.data(), 0.0f, B.data());
  for (auto _ : state) {
    if (state.range(1) == 0)
      kernels::gemm(false, false, n, n, n, 1.0f, A.data(), n, B.data(), n, 0.0f, C.data(), n);
    else
      kernels::commuting_product(n, 1.0f, A.data(), B.data(), 0.0f, C.data());
    benchmark::DoNotOptimize(C.data());
  }
  state.SetLabel(state.range(1) == 0 ? "gemm" : "lower tiles");
}
BENCHMARK(BM_CommutingProduct)
    ->ArgsProduct({{512, 1024, 2048}, {0, 1}})
    ->Unit(benchmark::kMillisecond);

// The GPT-2-small parameter registry (model/gpt.cpp order and tags), values and gradients.
struct Gpt2Small {
  Tensor values, grads;
  ParameterList params;
  Gpt2Small() {
    const int64_t C = 768, V = 50304, L = 12;
    std::vector<std::pair<std::string, std::pair<ParamTag, Shape>>> specs;
    specs.push_back({"embed.weight", {ParamTag::embedding, {V, C}}});
    specs.push_back({"pos_embed.weight", {ParamTag::position_embedding, {1024, C}}});
    for (int64_t i = 0; i < L; ++i) {
      const std::string p = "blocks." + std::to_string(i) + ".";
      specs.push_back({p + "attn_norm.weight", {ParamTag::norm, {C}}});
      specs.push_back({p + "attn.qkv.weight", {ParamTag::hidden_matrix, {3 * C, C}}});
      specs.push_back({p + "attn.out.weight", {ParamTag::hidden_matrix, {C, C}}});
      specs.push_back({p + "mlp_norm.weight", {ParamTag::norm, {C}}});
      specs.push_back({p + "mlp.fc_in.weight", {ParamTag::hidden_matrix, {4 * C, C}}});
      specs.push_back({p + "mlp.fc_out.weight", {ParamTag::hidden_matrix, {C, 4 * C}}});
    }
    specs.push_back({"final_norm.weight", {ParamTag::norm, {C}}});
    int64_t total = 0;
    for (auto& s : specs) total += shape_numel(s.second.second);
    values = Tensor({total});
    grads = Tensor({total});
    Rng rng(3);
    rng.fill_normal(values.f32(), total, 0.0f, 0.02f);
    rng.fill_normal(grads.f32(), total, 0.0f, 0.01f);
    int64_t off = 0;
    for (auto& [name, ts] : specs) {
      params.push_back({name, ts.first, values.view(off, ts.second), grads.view(off, ts.second)});
      off += shape_numel(ts.second);
    }
  }
};

// 0: naive all-gather Muon (standard NS, GEMM only); 1: sharded megabatched Muon (Gram +
// symmetric); 2: the Dion3 stack (Gram + symmetric + megabatch + f = 0.25, local scope);
// 3: replicated Muon (round-robin owners + all-gather, Gram + symmetric).
void BM_OptimizerStep(benchmark::State& state) {
  comm::Communicator& world = comm::world();
  const int64_t config = state.range(0);
  MuonHyper h;
  h.variant = config == 2 ? MuonVariant::dion3 : MuonVariant::muon;
  h.mode = config == 0   ? MuonMode::allgather
           : config == 3 ? MuonMode::replicated
                         : MuonMode::sharded;
  h.ns.gram = config != 0;
  h.ns.symmetric = config != 0;
  h.weight_decay = 0.1;
  static Gpt2Small model;
  Muon opt(model.params, h, AdamWHyper{}, {ParamTag::hidden_matrix}, &world);
  opt.step(1.0);  // warm-up
  world.reset_traffic();
  int64_t steps = 0;
  for (auto _ : state) {
    world.barrier();
    Timer t;
    opt.step(1.0);
    double s = t.seconds();
    world.all_reduce(std::span<double>(&s, 1), comm::ReduceOp::max);
    state.SetIterationTime(s);
    ++steps;
  }
  const comm::TrafficCounts calls = world.traffic().calls, bytes = world.traffic().bytes;
  const double per_step = 1.0 / double(steps);
  // The timing all-reduces (one per step) are not the optimizer's.
  state.counters["bytes_sent"] = double(bytes.total() - bytes.all_reduce) * per_step;
  state.counters["collectives"] = double(calls.total() - calls.all_reduce) * per_step;
  state.counters["ranks"] = world.size();
  state.SetLabel(config == 0   ? "naive all-gather muon"
                 : config == 1 ? "sharded muon"
                 : config == 2 ? "dion3 stack f=0.25"
                               : "replicated muon");
}
BENCHMARK(BM_OptimizerStep)
    ->DenseRange(0, 3)
    ->Iterations(2)
    ->UseManualTime()
    ->Unit(benchmark::kMillisecond);

}  // namespace

int main(int argc, char** argv) {
  auto guard = comm::init_communication(&argc, &argv);
  // Rank 0 reports (Google Benchmark writes its context to stderr, results to stdout).
  if (guard.world().rank() != 0 &&
      (!std::freopen("/dev/null", "w", stdout) || !std::freopen("/dev/null", "w", stderr)))
    return 1;
  benchmark::Initialize(&argc, argv);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
