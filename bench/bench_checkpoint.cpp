// Checkpoint blocking time, asynchronous against synchronous, on the same state (spec
// section 4.3). A "training loop" of GEMM steps saves `MiB` of f32 state in 32 tensors:
//   sync   save() then wait(): training stops for the copy, the write, fsync and commit;
//   async  save(), one step (the forward/backward the staging copy overlaps), then
//          wait_staged() before the "optimizer": training stops only for what is left.
// The iteration time (manual) is the blocking time B of one checkpoint; counters:
//   upload_s        save() until committed,
//   interference_s  the steps run while the writer works, minus as many baseline steps,
//   B_k_p50_s, B_k_max_s  the spec's B_k = B + interference of each checkpoint: median and
//                   largest over the saves (8 saves: the largest is the p99 by nearest rank).
// Run: OMP_NUM_THREADS=1 build/release/bench/bench_checkpoint
#include <benchmark/benchmark.h>
#include <stdlib.h>

#include <algorithm>
#include <filesystem>
#include <vector>

#include "tessel/comm/single_communicator.hpp"
#include "tessel/core/median.hpp"
#include "tessel/core/timer.hpp"
#include "tessel/kernels/cpu/gemm.hpp"
#include "tessel/train/checkpoint.hpp"

using namespace tessel;
using namespace tessel::train;

namespace {

constexpr int64_t kGemm = 384;  // one "training step": a 384^3 GEMM

struct Step {
  std::vector<float> a = std::vector<float>(kGemm * kGemm, 0.5f), c = a;
  void operator()() {
    kernels::gemm(false, false, kGemm, kGemm, kGemm, 1.0f, a.data(), kGemm, a.data(), kGemm, 0.0f,
                  c.data(), kGemm);
  }
};

void BM_CheckpointBlocking(benchmark::State& state) {
  const bool async = state.range(0) == 1;
  const int64_t mib = state.range(1);
  CheckpointContent content;
  const int64_t per = mib * 1024 * 1024 / 4 / 32;
  for (int i = 0; i < 32; ++i) {
    Tensor t({per});
    for (int64_t j = 0; j < per; ++j) t.f32()[j] = float(i + j % 97);
    std::string name = "w";  // (not "w" + ...: a GCC 12 -Wrestrict false positive)
    name += std::to_string(i);
    content.model.push_back({name, t});
  }
  content.state = nlohmann::json::object();
  std::string tmpl = "/tmp/tessel-bench-ckpt-XXXXXX";
  std::string dir = mkdtemp(tmpl.data());
  comm::SingleCommunicator group;
  CheckpointStore store(dir + "/checkpoints", 2);
  AsyncCheckpointer writer(store, group);
  Step step;
  Timer base_timer;
  for (int i = 0; i < 20; ++i) step();
  const double baseline = base_timer.seconds() / 20;
  double upload = 0, interference = 0, steps_during = 0;
  std::vector<double> b_k;  // per checkpoint
  int64_t n = 0;
  for (auto _ : state) {
    content.step = ++n;
    Timer saving, blocked;
    double b = 0;
    const double interference_before = interference;
    writer.save(content);
    if (async) {
      b += blocked.seconds();
      Timer s;
      step();  // forward/backward: the staging copy runs beside it
      interference += s.seconds() - baseline;
      ++steps_during;
      blocked.reset();
      writer.wait_staged();
      b += blocked.seconds();
      while (writer.in_flight()) {
        Timer t;
        step();
        writer.poll();
        interference += t.seconds() - baseline;
        ++steps_during;
      }
    } else {
      writer.wait();
      b = blocked.seconds();
    }
    upload += saving.seconds();
    state.SetIterationTime(b);
    b_k.push_back(b + interference - interference_before);
  }
  state.counters["upload_s"] = upload / double(n);
  state.counters["interference_s"] = interference / double(n);
  state.counters["steps_during_upload"] = steps_during / double(n);
  state.counters["baseline_step_s"] = baseline;
  state.counters["B_k_p50_s"] = median(b_k);
  state.counters["B_k_max_s"] = *std::max_element(b_k.begin(), b_k.end());
  state.counters["GiB"] = double(mib) / 1024;
  std::filesystem::remove_all(dir);
}

}  // namespace

BENCHMARK(BM_CheckpointBlocking)
    ->ArgNames({"async", "MiB"})
    ->Args({0, 1024})
    ->Args({1, 1024})
    ->UseManualTime()
    ->Iterations(8)
    ->Unit(benchmark::kMillisecond);

BENCHMARK_MAIN();
