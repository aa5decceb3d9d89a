// Measured pipeline schedules (issue #7), an MPI driver: one rank per stage, one thread each.
// Synthetic stages with real compute: forward Y = X W (one GEMM), backward dX = dY W^T and
// dW += X^T dY (two GEMMs, so backward ~ 2x forward; ZB-H1's B is the first, its W the
// second, so F ~ B ~ W), SGD step. Per repeat, in the same run: 1F1B (M = K micro-batches per
// step), ZB-H1 (the same steps) and PACI(K) over the same number of micro-batches; measured
// makespan (slowest stage's run()), throughput ratios PACI / 1F1B and ZB-H1 / 1F1B (the
// latter beside the closed form's (M + P - 1)(F + B + W) / (M (F + B + W) + (P - 1)(F + B - W))
// on the ZB-H1 run's stage-mean profiled costs, step included), measured bubble, and the
// simulator's makespan fed that run's profiled per-stage costs, alone and with the run's
// profiled link latency (profiled_link_latency). Then, per repeat, interleaved 1F1B with
// --chunks v (default 2) chunks of one GEMM layer per stage against 1F1B with v layers per
// stage (the same work, v times the messages of the same size) at M = P and 2P: measured
// throughput ratio beside the simulator's from each run's profiled costs (and latency) and
// the closed form (M + P - 1) / (M + (P - 1) / v). --compare paci or interleaved runs one
// part. The last repeat's Chrome traces, measured and simulated (costs and latency), go to
// --trace-dir.
//
//   mpirun --oversubscribe --bind-to none -np 2 -x OMP_NUM_THREADS=1
//          build/release/bench/bench_pipeline_mpi [--k 2] [--micro-batches 64] [--rows 512]
//          [--width 512] [--repeats 3] [--chunks 2] [--compare all|paci|interleaved]
//          [--trace-dir DIR]
#include <array>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
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

// A stage of `chunks` model chunks (interleaved: v; else 1) of `layers` GEMM layers each,
// rows x width activations throughout, so a stage of v chunks of L / v layers does the work
// of a stage of L layers, over v times the messages of the same size.
class GemmStage : public StageWork {
 public:
  GemmStage(int stage, int stages, int64_t rows, int64_t width, int chunks = 1, int layers = 1)
      : stage_(stage),
        stages_(stages),
        chunks_(chunks),
        rows_(rows),
        width_(width),
        weights_(size_t(chunks * layers),
                 std::vector<float>(size_t(width * width), 1.f / float(width))),
        grads_(weights_.size(), std::vector<float>(size_t(width * width), 0.f)),
        source_(size_t(rows * width), 0.5f) {}
  int chunks() const override { return chunks_; }
  // With one chunk the first stage receives nothing and the last sends nothing.
  size_t input_elems() const override {
    return stage_ == 0 && chunks_ == 1 ? 0 : size_t(rows_ * width_);
  }
  size_t output_elems() const override {
    return stage_ == stages_ - 1 && chunks_ == 1 ? 0 : size_t(rows_ * width_);
  }

  void forward(int chunk, int64_t micro, std::span<const float> input,
               std::span<float> output) override {
    Saved& slot = saved_[{chunk, micro}];
    if (!spare_.empty()) {
      slot = std::move(spare_.back());
      spare_.pop_back();
    }
    const int L = layers();
    slot.x.resize(size_t(L) + 1);  // x[l]: layer l's input; x[L]: the chunk's output Y
    slot.dy.resize(size_t(L));
    const std::span<const float> in = first(chunk) ? std::span<const float>(source_) : input;
    slot.x[0].assign(in.begin(), in.end());
    for (int l = 0; l < L; ++l) {
      slot.x[size_t(l) + 1].resize(slot.x[0].size());
      kernels::gemm(false, false, rows_, width_, width_, 1.f, slot.x[size_t(l)].data(), width_,
                    weight(chunk, l).data(), width_, 0.f, slot.x[size_t(l) + 1].data(), width_);
    }
    if (!last(chunk)) std::copy(slot.x.back().begin(), slot.x.back().end(), output.begin());
  }

  // Per layer, last first: dW += X^T dY, then dX = dY W^T is the next layer's dY.
  void backward(int chunk, int64_t micro, std::span<const float> output_grad,
                std::span<float> input_grad) override {
    auto it = saved(chunk, micro);
    const Saved& s = it->second;
    const float* dy = last(chunk) ? s.x.back().data() : output_grad.data();
    for (int l = layers() - 1; l >= 0; --l) {
      weight_gradient(chunk, l, s.x[size_t(l)].data(), dy);
      dy = input_gradient(chunk, l, dy);
    }
    finish(chunk, dy, input_grad);
    release(it);
  }

  // ZB-H1's B keeps each layer's dY (the last stage's is Y, kept already) for its W.
  void backward_input(int chunk, int64_t micro, std::span<const float> output_grad,
                      std::span<float> input_grad) override {
    Saved& s = saved(chunk, micro)->second;
    const float* dy = last(chunk) ? s.x.back().data() : output_grad.data();
    for (int l = layers() - 1; l >= 0; --l) {
      s.dy[size_t(l)].assign(dy, dy + rows_ * width_);
      dy = input_gradient(chunk, l, dy);
    }
    finish(chunk, dy, input_grad);
  }
  void backward_weights(int chunk, int64_t micro) override {
    auto it = saved(chunk, micro);
    const Saved& s = it->second;
    for (int l = layers() - 1; l >= 0; --l)
      weight_gradient(chunk, l, s.x[size_t(l)].data(), s.dy[size_t(l)].data());
    release(it);
  }

  void step(int64_t) override {
    for (size_t i = 0; i < weights_.size(); ++i)
      for (size_t j = 0; j < weights_[i].size(); ++j) {
        weights_[i][j] -= 1e-6f * grads_[i][j];
        grads_[i][j] = 0;
      }
  }

 private:
  struct Saved {
    std::vector<std::vector<float>> x;   // each layer's input, then the chunk's output
    std::vector<std::vector<float>> dy;  // ZB-H1: each layer's output gradient, from B to W
  };
  using Key = std::pair<int, int64_t>;  // (chunk, micro-batch)

  int layers() const { return int(weights_.size()) / chunks_; }
  // The model's first and last pieces: stage 0's chunk 0, the last stage's last chunk.
  bool first(int chunk) const { return stage_ == 0 && chunk == 0; }
  bool last(int chunk) const { return stage_ == stages_ - 1 && chunk == chunks_ - 1; }
  std::vector<float>& weight(int chunk, int l) { return weights_[size_t(chunk * layers() + l)]; }

  // Keeps the buffers for the next forward: allocating them afresh costs page faults, which
  // would charge a schedule that keeps more micro-batches alive for its memory, not compute.
  void release(std::map<Key, Saved>::iterator it) {
    spare_.push_back(std::move(it->second));
    saved_.erase(it);
  }
  std::map<Key, Saved>::iterator saved(int chunk, int64_t micro) {
    auto it = saved_.find({chunk, micro});
    TESSEL_CHECK(it != saved_.end(), "backward before forward: ", micro, " chunk ", chunk);
    return it;
  }
  // dW += X^T dY.
  void weight_gradient(int chunk, int l, const float* x, const float* dy) {
    kernels::gemm(true, false, width_, width_, rows_, 1.f, x, width_, dy, width_, 1.f,
                  grads_[size_t(chunk * layers() + l)].data(), width_);
  }
  // dX = dY W^T into the scratch buffer of layer l (dY may be the other one's); returns it.
  const float* input_gradient(int chunk, int l, const float* dy) {
    std::vector<float>& dx = dx_[size_t(l % 2)];
    dx.resize(size_t(rows_ * width_));
    kernels::gemm(false, true, rows_, width_, width_, 1.f, dy, width_, weight(chunk, l).data(),
                  width_, 0.f, dx.data(), width_);
    return dx.data();
  }
  // The chunk's input gradient goes out unless it is the model's first piece, which
  // computes it too, for equal cost.
  void finish(int chunk, const float* dx, std::span<float> input_grad) const {
    if (!first(chunk)) std::copy(dx, dx + rows_ * width_, input_grad.begin());
  }

  int stage_, stages_, chunks_;
  int64_t rows_, width_;
  std::vector<std::vector<float>> weights_, grads_;  // [chunk * layers + layer]
  std::vector<float> source_;
  std::array<std::vector<float>, 2> dx_;
  std::map<Key, Saved> saved_;  // the last piece's loss is 0.5 |Y|^2, so its dY = Y
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

// Runs `schedule` on this rank's stage (schedule.chunks chunks of `layers` GEMM layers); the
// result is complete on rank 0.
Measured measure(comm::Communicator& pp, const ScheduleOptions& schedule, int64_t rows,
                 int64_t width, const std::string& trace_prefix, int layers = 1) {
  GemmStage stage(pp.rank(), pp.size(), rows, width, schedule.chunks, layers);
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

// Per repeat, in the same run: 1F1B (M = K per step), ZB-H1 (the same steps) and PACI(K)
// over the same micro-batches.
void compare_paci(comm::Communicator& pp, int64_t K, int64_t micro_batches, int64_t rows,
                  int64_t width, int64_t repeats, const std::string& trace_dir) {
  const int P = pp.size();
  const ScheduleOptions one_f_one_b{ScheduleKind::one_f_one_b, P, K, micro_batches / K, 1};
  const ScheduleOptions zb_h1{ScheduleKind::zb_h1, P, K, micro_batches / K, 1};
  const ScheduleOptions paci{ScheduleKind::paci, P, micro_batches, 1, K};
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
}

// Interleaved with v chunks of one GEMM layer per stage against 1F1B with one chunk of v
// layers (the same work per stage, v times the messages), at M = P and 2P micro-batches per
// step over the same micro-batches, per repeat in the same run.
void compare_interleaved(comm::Communicator& pp, int v, int64_t micro_batches, int64_t rows,
                         int64_t width, int64_t repeats, const std::string& trace_dir) {
  const int P = pp.size();
  for (int64_t r = 0; r < repeats; ++r)
    for (const int64_t M : {int64_t(P), int64_t(2 * P)}) {
      const bool traced = r + 1 == repeats && !trace_dir.empty();
      const std::string prefix = trace_dir + "/M" + std::to_string(M) + "_";
      ScheduleOptions interleaved{ScheduleKind::interleaved, P, M, micro_batches / M, 1};
      interleaved.chunks = v;
      const Measured f = measure(pp, {ScheduleKind::one_f_one_b, P, M, micro_batches / M, 1}, rows,
                                 width, traced ? prefix + "1f1b" : "", v);
      const Measured i =
          measure(pp, interleaved, rows, width, traced ? prefix + "interleaved" : "", 1);
      if (pp.rank() != 0) continue;
      // With uniform costs and free links: (M + P - 1)(F + B) against (M + (P - 1) / v)(F + B).
      const double closed = double(M + P - 1) / (double(M) + double(P - 1) / v);
      std::printf(
          "repeat %lld M %lld: 1f1b (%d layers) %.4f s, interleaved (%d chunks) %.4f s; "
          "interleaved / 1f1b throughput %.3f (simulated from each run's profiled costs %.3f, "
          "with its profiled latency %.2f, %.2f ms %.3f; closed form %.3f); bubble measured "
          "%.3f, %.3f (simulated with latency %.3f, %.3f); stage-mean F %.2f, B %.2f ms "
          "(1f1b), %.2f, %.2f (interleaved, per micro-batch); load %s\n",
          (long long)r, (long long)M, v, f.makespan, v, i.makespan, f.makespan / i.makespan,
          f.costs_only.makespan / i.costs_only.makespan, 1e3 * f.latency, 1e3 * i.latency,
          f.with_latency.makespan / i.with_latency.makespan, closed, f.bubble, i.bubble,
          f.with_latency.bubble, i.with_latency.bubble, 1e3 * f.mean.forward, 1e3 * f.mean.backward,
          1e3 * i.mean.forward, 1e3 * i.mean.backward, load_average().c_str());
    }
}

// The positive integer `text` of `flag`.
int64_t positive(const std::string& flag, const char* text) {
  char* end = nullptr;
  errno = 0;
  const long long v = std::strtoll(text, &end, 10);
  if (end == text || *end != '\0' || errno == ERANGE || v < 1)
    input_error("bench_pipeline_mpi: ", flag, " must be a positive integer, got '", text, "'");
  return v;
}

constexpr const char* kUsage =
    "usage: mpirun -np P bench_pipeline_mpi [--k 2] [--micro-batches 64] [--rows 512] "
    "[--width 512] [--repeats 3] [--chunks 2] [--compare all|paci|interleaved] [--trace-dir DIR]\n";

struct Options {
  int64_t K = 2, micro_batches = 64, rows = 512, width = 512, repeats = 3, chunks = 2;
  std::string trace_dir, compare = "all";
  bool help = false;
};

// The flags, checked for P ranks (InputError on a bad one: every rank parses the same).
Options parse(int argc, char** argv, int P) {
  Options o;
  for (int i = 1; i < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--help" || flag == "-h") {
      o.help = true;
      return o;
    }
    if (i + 1 == argc) input_error("bench_pipeline_mpi: ", flag, " needs a value");
    if (flag == "--k")
      o.K = positive(flag, argv[i + 1]);
    else if (flag == "--micro-batches")
      o.micro_batches = positive(flag, argv[i + 1]);
    else if (flag == "--rows")
      o.rows = positive(flag, argv[i + 1]);
    else if (flag == "--width")
      o.width = positive(flag, argv[i + 1]);
    else if (flag == "--repeats")
      o.repeats = positive(flag, argv[i + 1]);
    else if (flag == "--trace-dir")
      o.trace_dir = argv[i + 1];
    else if (flag == "--chunks")
      o.chunks = positive(flag, argv[i + 1]);
    else if (flag == "--compare")
      o.compare = argv[i + 1];
    else
      input_error("bench_pipeline_mpi: unknown flag ", flag);
  }
  if (o.compare != "all" && o.compare != "paci" && o.compare != "interleaved")
    input_error("bench_pipeline_mpi: --compare must be all, paci or interleaved, got ", o.compare);
  if (o.micro_batches % o.K != 0 && o.compare != "interleaved")
    input_error("bench_pipeline_mpi: --micro-batches must be divisible by --k = ", o.K,
                " (1F1B takes K per step, PACI a horizon of whole windows), got ", o.micro_batches);
  if (o.micro_batches % (2 * P) != 0 && o.compare != "paci")
    input_error("bench_pipeline_mpi: --micro-batches must be divisible by 2 P = ", 2 * P,
                " for interleaved, got ", o.micro_batches);
  return o;
}

void run(const Options& o, comm::Communicator& pp) {
  const int P = pp.size();
  if (pp.rank() == 0)
    std::printf("P = %d, K = M = %lld, %lld micro-batches, GEMM %lld x %lld x %lld; load %s\n", P,
                (long long)o.K, (long long)o.micro_batches, (long long)o.rows, (long long)o.width,
                (long long)o.width, load_average().c_str());
  measure(pp, {ScheduleKind::one_f_one_b, P, o.K, 2, 1}, o.rows, o.width, "");  // warm-up
  if (!o.trace_dir.empty()) std::filesystem::create_directories(o.trace_dir);   // as it says
  if (o.compare != "interleaved")
    compare_paci(pp, o.K, o.micro_batches, o.rows, o.width, o.repeats, o.trace_dir);
  if (o.compare != "paci")
    compare_interleaved(pp, int(o.chunks), o.micro_batches, o.rows, o.width, o.repeats,
                        o.trace_dir);
}

}  // namespace

int main(int argc, char** argv) {
  auto guard = comm::init_communication(&argc, &argv);
  comm::Communicator& pp = comm::world();
  Options options;
  try {  // the arguments only: a failure while measuring aborts the job, as before
    options = parse(argc, argv, pp.size());
  } catch (const InputError& e) {  // every rank parsed the same arguments: all stop here
    if (pp.rank() == 0) std::fprintf(stderr, "%s\n%s", e.what(), kUsage);
    return 2;
  }
  if (options.help) {
    if (pp.rank() == 0) std::fputs(kUsage, stdout);
    return 0;
  }
  run(options, pp);
  return 0;
}
