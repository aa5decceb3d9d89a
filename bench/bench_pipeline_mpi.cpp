// Measured pipeline schedules (issue #7), an MPI driver: one rank per stage, one thread each.
// Synthetic stages with real compute: forward Y = X W (one GEMM), backward dX = dY W^T and
// dW += X^T dY (two GEMMs, so backward ~ 2x forward; ZB-H1's B is the first, its W the
// second, so F ~ B ~ W), SGD step. Per repeat, in the same run: 1F1B (M = K micro-batches per
// step), ZB-H1 (the same steps) and PACI(K) over the same number of micro-batches; measured
// makespan (slowest stage's run()), throughput ratios PACI / 1F1B and ZB-H1 / 1F1B (the
// latter beside the closed form's (M + P - 1)(F + B + W) / (M (F + B + W) + (P - 1)(F + B - W))
// on the ZB-H1 run's stage-mean profiled costs, step included), measured bubble, and the
// simulator's makespan fed that run's profiled per-stage costs, alone and with the run's
// profiled link latency (profiled_link_latency). The last repeat's Chrome traces, measured
// and simulated (costs and latency), go to --trace-dir.
//
//   mpirun --oversubscribe --bind-to none -np 2 -x OMP_NUM_THREADS=1
//          build/release/bench/bench_pipeline_mpi [--k 2] [--micro-batches 64] [--rows 512]
//          [--width 512] [--repeats 3] [--trace-dir DIR]
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "tessel/comm/world.hpp"
#include "tessel/core/error.hpp"
#include "tessel/core/file_io.hpp"
#include "tessel/kernels/cpu/gemm.hpp"
#include "tessel/pipeline/stage_executor.hpp"

using namespace tessel;
using namespace tessel::pipeline;

namespace {

class GemmStage : public StageWork {
 public:
  GemmStage(int stage, int stages, int64_t rows, int64_t width)
      : first_(stage == 0),
        last_(stage == stages - 1),
        rows_(rows),
        width_(width),
        weight_(size_t(width * width), 1.f / float(width)),
        grad_(weight_.size(), 0.f),
        source_(size_t(rows * width), 0.5f) {}
  size_t input_elems() const override { return first_ ? 0 : size_t(rows_ * width_); }
  size_t output_elems() const override { return last_ ? 0 : size_t(rows_ * width_); }

  void forward(int, int64_t micro, std::span<const float> input, std::span<float> output) override {
    Saved& slot = saved_[micro];
    if (!spare_.empty()) {
      slot = std::move(spare_.back());
      spare_.pop_back();
    }
    auto& [x, y, dy] = slot;
    const std::span<const float> in = first_ ? std::span<const float>(source_) : input;
    x.assign(in.begin(), in.end());
    y.resize(x.size());
    kernels::gemm(false, false, rows_, width_, width_, 1.f, x.data(), width_, weight_.data(),
                  width_, 0.f, y.data(), width_);
    if (!last_) std::copy(y.begin(), y.end(), output.begin());
  }

  void backward(int, int64_t micro, std::span<const float> output_grad,
                std::span<float> input_grad) override {
    auto it = saved(micro);
    const Saved& s = it->second;
    const float* dy = last_ ? s.y.data() : output_grad.data();
    weight_gradient(s.x.data(), dy);
    input_gradient(dy, input_grad);
    release(it);
  }

  // ZB-H1's B keeps dY (the last stage's is Y, kept already) for its W.
  void backward_input(int, int64_t micro, std::span<const float> output_grad,
                      std::span<float> input_grad) override {
    Saved& s = saved(micro)->second;
    if (!last_) s.dy.assign(output_grad.begin(), output_grad.end());
    input_gradient(last_ ? s.y.data() : s.dy.data(), input_grad);
  }
  void backward_weights(int, int64_t micro) override {
    auto it = saved(micro);
    const Saved& s = it->second;
    weight_gradient(s.x.data(), last_ ? s.y.data() : s.dy.data());
    release(it);
  }

  void step(int64_t) override {
    for (size_t j = 0; j < weight_.size(); ++j) {
      weight_[j] -= 1e-6f * grad_[j];
      grad_[j] = 0;
    }
  }

 private:
  struct Saved {
    std::vector<float> x, y, dy;  // dy: ZB-H1, from B to W (not on the last stage: dY = Y)
  };

  // Keeps the buffers for the next forward: allocating them afresh costs page faults, which
  // would charge a schedule that keeps more micro-batches alive for its memory, not compute.
  void release(std::map<int64_t, Saved>::iterator it) {
    spare_.push_back(std::move(it->second));
    saved_.erase(it);
  }
  std::map<int64_t, Saved>::iterator saved(int64_t micro) {
    auto it = saved_.find(micro);
    TESSEL_CHECK(it != saved_.end(), "backward before forward: ", micro);
    return it;
  }
  // dW += X^T dY.
  void weight_gradient(const float* x, const float* dy) {
    kernels::gemm(true, false, width_, width_, rows_, 1.f, x, width_, dy, width_, 1.f, grad_.data(),
                  width_);
  }
  // dX = dY W^T; the first stage computes it too, for equal cost.
  void input_gradient(const float* dy, std::span<float> input_grad) {
    dx_.resize(size_t(rows_ * width_));
    kernels::gemm(false, true, rows_, width_, width_, 1.f, dy, width_, weight_.data(), width_, 0.f,
                  dx_.data(), width_);
    if (!first_) std::copy(dx_.begin(), dx_.end(), input_grad.begin());
  }

  bool first_, last_;
  int64_t rows_, width_;
  std::vector<float> weight_, grad_, source_, dx_;
  std::map<int64_t, Saved> saved_;  // the last stage's loss is 0.5 |Y|^2, so its dY = Y
  std::vector<Saved> spare_;
};

std::string load_average() {
  std::ifstream in("/proc/loadavg");
  std::string one, five, fifteen;
  in >> one >> five >> fifteen;
  return one + " " + five + " " + fifteen;
}

struct Measured {
  double makespan = 0, bubble = 0;
  StageCosts mean{0, 0, 0, 0};         // the profiled costs, mean over the stages
  double latency = 0;                  // profiled_link_latency()
  SimResult costs_only, with_latency;  // the simulator fed the profiled costs (and latency)
};

// Runs `schedule` on this rank's stage; the result is complete on rank 0.
Measured measure(comm::Communicator& pp, const ScheduleOptions& schedule, int64_t rows,
                 int64_t width, const std::string& trace_prefix) {
  GemmStage stage(pp.rank(), pp.size(), rows, width);
  ExecutorOptions options;
  options.record_timeline = true;
  StageExecutor executor(pp, stage, options);
  const StageStats stats = executor.run(schedule);
  const StageCosts mine = stats.profiled_costs();
  const std::vector<double> mine_flat{
      mine.forward,
      mine.backward,
      mine.step,
      mine.weight,
      stats.forward_seconds + stats.backward_seconds + stats.weight_seconds + stats.step_seconds,
      stats.total_seconds};
  std::vector<double> all(mine_flat.size() * size_t(pp.size()));
  pp.all_gather(mine_flat, all);
  const std::vector<OpTiming> timeline = gather_timeline(pp, stats);
  Measured m;
  if (pp.rank() != 0) return m;
  SimOptions sim;
  sim.schedule = schedule;
  double busy = 0;
  for (int s = 0; s < pp.size(); ++s) {
    const double* v = &all[size_t(s) * mine_flat.size()];
    sim.costs.push_back({v[0], v[1], v[2], v[3]});
    busy += v[4];
    m.makespan = std::max(m.makespan, v[5]);
    const double share = 1.0 / pp.size();
    m.mean.forward += share * v[0], m.mean.backward += share * v[1];
    m.mean.step += share * v[2], m.mean.weight += share * v[3];
  }
  m.bubble = 1 - busy / (pp.size() * m.makespan);
  m.costs_only = simulate(sim);
  m.latency = profiled_link_latency(timeline, pp.size());
  sim.links = {{m.latency}};
  m.with_latency = simulate(sim);
  if (!trace_prefix.empty()) {
    write_file_atomically(trace_prefix + "_measured.json",
                          chrome_trace(timeline, pp.size(), 1e6).dump());
    write_file_atomically(trace_prefix + "_simulated.json",
                          chrome_trace(m.with_latency.timeline, pp.size(), 1e6).dump());
  }
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  auto guard = comm::init_communication(&argc, &argv);
  comm::Communicator& pp = comm::world();
  int64_t K = 2, micro_batches = 64, rows = 512, width = 512, repeats = 3;
  std::string trace_dir;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (i + 1 == argc) input_error("bench_pipeline_mpi: ", flag, " needs a value");
    if (flag == "--k")
      K = std::atoll(argv[i + 1]);
    else if (flag == "--micro-batches")
      micro_batches = std::atoll(argv[i + 1]);
    else if (flag == "--rows")
      rows = std::atoll(argv[i + 1]);
    else if (flag == "--width")
      width = std::atoll(argv[i + 1]);
    else if (flag == "--repeats")
      repeats = std::atoll(argv[i + 1]);
    else if (flag == "--trace-dir")
      trace_dir = argv[i + 1];
    else
      input_error("bench_pipeline_mpi: unknown flag ", flag);
  }
  const int P = pp.size();
  const ScheduleOptions one_f_one_b{ScheduleKind::one_f_one_b, P, K, micro_batches / K, 1};
  const ScheduleOptions zb_h1{ScheduleKind::zb_h1, P, K, micro_batches / K, 1};
  const ScheduleOptions paci{ScheduleKind::paci, P, micro_batches, 1, K};
  if (pp.rank() == 0)
    std::printf("P = %d, K = M = %lld, %lld micro-batches, GEMM %lld x %lld x %lld; load %s\n", P,
                (long long)K, (long long)micro_batches, (long long)rows, (long long)width,
                (long long)width, load_average().c_str());
  measure(pp, {ScheduleKind::one_f_one_b, P, K, 2, 1}, rows, width, "");  // warm-up
  for (int64_t r = 0; r < repeats; ++r) {
    const bool last = r + 1 == repeats && !trace_dir.empty();
    const Measured f = measure(pp, one_f_one_b, rows, width, last ? trace_dir + "/1f1b" : "");
    const Measured z = measure(pp, zb_h1, rows, width, last ? trace_dir + "/zb-h1" : "");
    const Measured p = measure(pp, paci, rows, width, last ? trace_dir + "/paci" : "");
    if (pp.rank() != 0) continue;
    for (const auto& [name, m] :
         {std::pair{"1f1b", f}, std::pair{"zb-h1", z}, std::pair{"paci", p}})
      std::printf(
          "repeat %lld %-5s measured %.4f s (bubble %.3f; stage-mean F %.2f, backward %.2f, "
          "W %.2f ms); simulated from the profiled costs %.4f s (%+.1f %%), with the profiled "
          "latency %.2f ms %.4f s (%+.1f %%, bubble %.3f)\n",
          (long long)r, name, m.makespan, m.bubble, 1e3 * m.mean.forward, 1e3 * m.mean.backward,
          1e3 * m.mean.weight, m.costs_only.makespan,
          100 * (m.costs_only.makespan / m.makespan - 1), 1e3 * m.latency, m.with_latency.makespan,
          100 * (m.with_latency.makespan / m.makespan - 1), m.with_latency.bubble);
    std::printf("repeat %lld paci / 1f1b throughput %.3f (ceiling %.3f); load %s\n", (long long)r,
                f.makespan / p.makespan, double(K + P - 1) / double(K), load_average().c_str());
    // The closed forms per step on ZB-H1's stage-mean costs (B = backward - W).
    const StageCosts& c = z.mean;
    const double F = c.forward, W = c.weight, B = c.backward - W;
    const double closed_1f1b = double(K + P - 1) * (F + B + W) + c.step;
    const double closed_zb = double(K) * (F + B + W) + double(P - 1) * (F + B - W) + c.step;
    std::printf(
        "repeat %lld zb-h1 / 1f1b throughput %.3f (simulated, each from its run's profiled costs "
        "and latency, %.3f; closed form %.3f at zb-h1's F %.2f B %.2f W %.2f step %.2f ms)\n",
        (long long)r, f.makespan / z.makespan, f.with_latency.makespan / z.with_latency.makespan,
        closed_1f1b / closed_zb, 1e3 * F, 1e3 * B, 1e3 * W, 1e3 * c.step);
  }
  return 0;
}
