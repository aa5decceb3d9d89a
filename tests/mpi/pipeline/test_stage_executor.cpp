// The stage executor on real MPI (one rank per stage, P = world size, or P = 1 through
// split) with a toy stage (y = tanh(W x), loss 0.5 |y - target|^2 on the last stage, SGD),
// against single-process references run on every rank: the plain chain with gradient
// accumulation for flush schedules, and a one-process replay of the same instruction lists
// for PACI. Weights are compared bitwise; version gaps and peak activations against the
// closed forms of spec pipeline.md §2.3, §2.4. ZB-H1 runs the toy stage's backward in its two
// halves (B: dz and the input gradient; W: dz x^T into the gradient), which must give 1F1B's
// weights bitwise.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <set>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "support/expect_input_error.hpp"
#include "tessel/comm/world.hpp"
#include "tessel/core/rng.hpp"
#include "tessel/pipeline/stage_executor.hpp"

using namespace tessel;
using namespace tessel::pipeline;

namespace {

constexpr float kLearningRate = 0.05f;
size_t width(int boundary) {
  return size_t(4 + boundary);
}  // differs per boundary

// Deterministic per micro-batch: the first stage's input and the last stage's target.
std::vector<float> micro_data(int64_t micro, size_t n, uint64_t salt) {
  std::vector<float> v(n);
  Rng(salt * 1000003 + uint64_t(micro)).fill_uniform(v.data(), int64_t(n), -1.f, 1.f);
  return v;
}

class ToyStage : public StageWork {
 public:
  ToyStage(int stage, int stages)
      : stage_(stage),
        last_(stage == stages - 1),
        in_(width(stage)),
        out_(width(stage + 1)),
        weight_(in_ * out_),
        grad_(in_ * out_, 0.f) {
    Rng(17 + uint64_t(stage)).fill_uniform(weight_.data(), int64_t(weight_.size()), -.5f, .5f);
  }
  size_t input_elems() const override { return stage_ == 0 ? 0 : in_; }
  size_t output_elems() const override { return last_ ? 0 : out_; }

  void forward(int, int64_t micro, std::span<const float> input, std::span<float> output) override {
    Saved s{
        stage_ == 0 ? micro_data(micro, in_, 1) : std::vector<float>(input.begin(), input.end()),
        std::vector<float>(out_),
        {}};
    for (size_t o = 0; o < out_; ++o) {
      float z = 0;
      for (size_t i = 0; i < in_; ++i) z += weight_[o * in_ + i] * s.x[i];
      s.y[o] = std::tanh(z);
    }
    if (!last_) std::copy(s.y.begin(), s.y.end(), output.begin());
    EXPECT_TRUE(saved_.emplace(micro, std::move(s)).second) << "forward twice: " << micro;
  }

  // The whole backward is its two halves in a row.
  void backward(int, int64_t micro, std::span<const float> output_grad,
                std::span<float> input_grad) override {
    ++backwards_;
    input_gradient(micro, output_grad, input_grad);
    weight_gradient(micro);
  }
  void backward_input(int, int64_t micro, std::span<const float> output_grad,
                      std::span<float> input_grad) override {
    ++backward_inputs_;
    input_gradient(micro, output_grad, input_grad);
  }
  void backward_weights(int, int64_t micro) override {
    EXPECT_GT(micro, last_weights_micro_) << "Ws in micro-batch order";
    last_weights_micro_ = micro;
    ++backward_weights_;
    weight_gradient(micro);
  }

  void step(int64_t version) override {
    EXPECT_EQ(version, steps_) << "stage " << stage_;
    ++steps_;
    for (size_t j = 0; j < weight_.size(); ++j) {
      weight_[j] -= kLearningRate * grad_[j];
      grad_[j] = 0;
    }
  }

  const std::vector<float>& weight() const { return weight_; }
  const std::vector<float>& grad() const { return grad_; }
  int64_t steps() const { return steps_; }
  // Calls of backward, backward_input and backward_weights.
  int64_t backwards() const { return backwards_; }
  int64_t backward_inputs() const { return backward_inputs_; }
  int64_t backward_weights() const { return backward_weights_; }

 private:
  struct Saved {
    std::vector<float> x, y;
    std::vector<float> dz;  // from the input gradient, until the weight gradient
  };

  // dz = dL/d(W x), kept, and the input gradient W^T dz.
  void input_gradient(int64_t micro, std::span<const float> output_grad,
                      std::span<float> input_grad) {
    auto it = saved_.find(micro);
    ASSERT_NE(it, saved_.end()) << "backward before forward: " << micro;
    Saved& s = it->second;
    ASSERT_TRUE(s.dz.empty()) << "input gradient twice: " << micro;
    const std::vector<float> target = last_ ? micro_data(micro, out_, 2) : std::vector<float>{};
    s.dz.resize(out_);
    for (size_t o = 0; o < out_; ++o)
      s.dz[o] = (last_ ? s.y[o] - target[o] : output_grad[o]) * (1 - s.y[o] * s.y[o]);
    for (size_t i = 0; i < input_grad.size(); ++i) {
      float g = 0;
      for (size_t o = 0; o < out_; ++o) g += weight_[o * in_ + i] * s.dz[o];
      input_grad[i] = g;
    }
  }

  // grad += dz x^T; releases what the forward kept.
  void weight_gradient(int64_t micro) {
    auto it = saved_.find(micro);
    ASSERT_NE(it, saved_.end()) << "weight gradient before forward: " << micro;
    const Saved& s = it->second;
    ASSERT_EQ(s.dz.size(), out_) << "weight gradient before the input gradient: " << micro;
    for (size_t o = 0; o < out_; ++o)
      for (size_t i = 0; i < in_; ++i) grad_[o * in_ + i] += s.dz[o] * s.x[i];
    saved_.erase(it);
  }

  int stage_;
  bool last_;
  size_t in_, out_;
  std::vector<float> weight_, grad_;
  std::map<int64_t, Saved> saved_;
  int64_t steps_ = 0;
  int64_t backwards_ = 0, backward_inputs_ = 0, backward_weights_ = 0;
  int64_t last_weights_micro_ = -1;
};

// A stage whose input size disagrees with its predecessor's output.
class MisSizedStage : public ToyStage {
 public:
  using ToyStage::ToyStage;
  size_t input_elems() const override { return ToyStage::input_elems() + 1; }
};

// A stage whose optimizer step fails.
class FailingStepStage : public ToyStage {
 public:
  using ToyStage::ToyStage;
  void step(int64_t) override { throw std::runtime_error("step failed"); }
};

std::vector<ToyStage> make_chain(int stages) {
  std::vector<ToyStage> chain;
  for (int s = 0; s < stages; ++s) chain.emplace_back(s, stages);
  return chain;
}

// Plain gradient accumulation in one process: micro-batches first .. first + n - 1, each
// forward through every stage and back.
void accumulate(std::vector<ToyStage>& chain, int64_t first, int64_t n) {
  for (int64_t m = first; m < first + n; ++m) {
    std::vector<float> a;
    for (ToyStage& stage : chain) {
      std::vector<float> out(stage.output_elems());
      stage.forward(0, m, a, out);
      a = std::move(out);
    }
    std::vector<float> g;
    for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
      std::vector<float> in(it->input_elems());
      it->backward(0, m, g, in);
      g = std::move(in);
    }
  }
}

// The single-process chain: `steps` steps of M accumulated micro-batches.
std::vector<ToyStage> chain_reference(int stages, int64_t M, int64_t steps) {
  auto chain = make_chain(stages);
  for (int64_t t = 0; t < steps; ++t) {
    accumulate(chain, t * M, M);
    for (ToyStage& stage : chain) stage.step(t);
  }
  return chain;
}

// Every stage's instruction list run in one process, each op once its input exists: the
// same per-stage op order as the executor, without messages or timing.
void replay(std::vector<ToyStage>& chain, const ScheduleOptions& schedule, int64_t first_micro) {
  const int P = int(chain.size());
  std::vector<std::vector<Op>> ops;
  for (int s = 0; s < P; ++s) ops.push_back(stage_ops(schedule, s));
  std::vector<size_t> next(size_t(P), 0);
  std::map<std::pair<int, int64_t>, std::vector<float>> inbox[2];  // [forward, backward]
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < P; ++s) {
      ToyStage& st = chain[size_t(s)];
      while (next[size_t(s)] < ops[size_t(s)].size()) {
        const Op op = ops[size_t(s)][next[size_t(s)]];
        const int64_t m = op.micro + first_micro;
        if (op.kind == OpKind::step) {
          st.step(st.steps());
        } else {
          const bool fwd = op.kind == OpKind::forward;
          const bool needs = fwd ? s > 0 : s < P - 1;
          auto& box = inbox[fwd ? 0 : 1];
          if (needs && !box.count({s, m})) break;
          std::vector<float> in = needs ? box.at({s, m}) : std::vector<float>{};
          std::vector<float> out(fwd ? st.output_elems() : st.input_elems());
          if (fwd)
            st.forward(0, m, in, out);
          else
            st.backward(0, m, in, out);
          if (!out.empty()) box[{fwd ? s + 1 : s - 1, m}] = std::move(out);
        }
        ++next[size_t(s)];
        progress = true;
      }
    }
  }
  for (int s = 0; s < P; ++s) EXPECT_EQ(next[size_t(s)], ops[size_t(s)].size()) << "stuck";
}

void expect_bitwise_equal(const std::vector<float>& a, const std::vector<float>& b,
                          const char* what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0) << what;
}

ScheduleOptions flush(ScheduleKind kind, int P, int64_t M, int64_t steps) {
  return {kind, P, M, steps, 1};
}
ScheduleOptions paci(int P, int64_t n, int64_t K) {
  return {ScheduleKind::paci, P, n, 1, K};
}

// ceil(a / b) for a >= 0, b > 0.
int64_t ceil_div(int64_t a, int64_t b) {
  return (a + b - 1) / b;
}

}  // namespace

TEST(StageExecutor, FlushSchedulesEqualTheSingleProcessChainBitwise) {
  comm::Communicator& pp = comm::world();
  const int P = pp.size(), s = pp.rank();
  for (auto kind : {ScheduleKind::one_f_one_b, ScheduleKind::gpipe, ScheduleKind::zb_h1})
    for (int64_t M : {int64_t(2), int64_t(5)}) {
      SCOPED_TRACE(std::string(schedule_name(kind)) + " M " + std::to_string(M));
      ToyStage stage(s, P);
      StageExecutor executor(pp, stage);
      const auto stats = executor.run(flush(kind, P, M, 3));
      const bool split = kind == ScheduleKind::zb_h1;
      EXPECT_EQ(stats.forwards, 3 * M);
      EXPECT_EQ(stats.backwards, 3 * M);
      EXPECT_EQ(stats.weights, split ? 3 * M : 0);
      // ZB-H1 calls the two halves only, the others the whole backward only.
      EXPECT_EQ(stage.backwards(), split ? 0 : 3 * M);
      EXPECT_EQ(stage.backward_inputs(), split ? 3 * M : 0);
      EXPECT_EQ(stage.backward_weights(), split ? 3 * M : 0);
      EXPECT_EQ(stats.steps, 3);
      EXPECT_EQ(executor.version(), 3);
      EXPECT_EQ(stats.max_version_gap, 0);
      const auto reference = chain_reference(P, M, 3);
      expect_bitwise_equal(stage.weight(), reference[size_t(s)].weight(), schedule_name(kind));
    }
}

TEST(StageExecutor, OneStageUnderEveryScheduleIsGradientAccumulation) {
  auto alone = comm::world().split(comm::world().rank(), 0);
  const int64_t M = 4, steps = 3;
  const auto reference = chain_reference(1, M, steps);
  for (const ScheduleOptions& schedule :
       {flush(ScheduleKind::gpipe, 1, M, steps), flush(ScheduleKind::one_f_one_b, 1, M, steps),
        flush(ScheduleKind::zb_h1, 1, M, steps), paci(1, M * steps, M)}) {
    ToyStage stage(0, 1);
    StageExecutor executor(*alone, stage);
    executor.run(schedule);
    EXPECT_EQ(executor.version(), steps);
    expect_bitwise_equal(stage.weight(), reference[0].weight(), schedule_name(schedule.kind));
  }
}

TEST(StageExecutor, PaciWithADrainAtEveryKBoundaryIs1F1BWithMEqualK) {
  comm::Communicator& pp = comm::world();
  const int P = pp.size(), s = pp.rank();
  const int64_t K = 3, windows = 4;
  ToyStage stage(s, P);
  StageExecutor executor(pp, stage);
  for (int64_t w = 0; w < windows; ++w) {
    const auto stats = executor.run(paci(P, K, K), w * K);
    EXPECT_EQ(stats.max_version_gap, 0) << "a drained window is consistent";
  }
  EXPECT_EQ(executor.version(), windows);
  expect_bitwise_equal(stage.weight(), chain_reference(P, K, windows)[size_t(s)].weight(),
                       "weights");
}

TEST(StageExecutor, PaciBeforeItsFirstStepAccumulatesThe1F1BGradients) {
  comm::Communicator& pp = comm::world();
  const int P = pp.size(), s = pp.rank();
  const int64_t n = 5;
  ToyStage stage(s, P);
  StageExecutor executor(pp, stage);
  executor.run(paci(P, n, n + 1));
  EXPECT_EQ(executor.version(), 0);
  auto reference = make_chain(P);
  accumulate(reference, 0, n);
  expect_bitwise_equal(stage.grad(), reference[size_t(s)].grad(), "accumulated gradients");
  expect_bitwise_equal(stage.weight(), reference[size_t(s)].weight(), "untouched weights");
}

TEST(StageExecutor, PaciVersionGapsAndActivationsMatchTheBounds) {
  comm::Communicator& pp = comm::world();
  const int P = pp.size(), s = pp.rank();
  const int64_t d = P - 1 - s;
  for (int64_t K : std::set<int64_t>{1, 2, std::max(P - 1, 1), P, 2 * P}) {
    const int64_t n = 8 * K;
    ToyStage stage(s, P);
    StageExecutor executor(pp, stage);
    const auto stats = executor.run(paci(P, n, K));
    EXPECT_EQ(stats.max_version_gap, ceil_div(d, K)) << "K " << K;
    if (K >= P - 1) {
      const double share = double(stats.inconsistent_backwards) / double(stats.backwards);
      EXPECT_NEAR(share, double(d) / double(K), 1.0 / double(K)) << "K " << K;
    }
    // Backward m runs under version floor(m / K) on every stage.
    std::vector<int64_t> versions;
    for (int64_t m = 0; m < n; ++m) versions.push_back(m / K);
    EXPECT_EQ(stats.backward_versions, versions) << "K " << K;
    int64_t histogram_total = 0, gapped = 0;
    for (size_t g = 0; g < stats.gap_histogram.size(); ++g) {
      histogram_total += stats.gap_histogram[g];
      gapped += g > 0 ? stats.gap_histogram[g] : 0;
    }
    EXPECT_EQ(histogram_total, n);
    EXPECT_EQ(gapped, stats.inconsistent_backwards);
    EXPECT_EQ(stats.peak_live_activations, P - s) << "K " << K;
    // The in-place updates under asynchrony equal the one-process replay of the same lists.
    auto reference = make_chain(P);
    replay(reference, paci(P, n, K), 0);
    expect_bitwise_equal(stage.weight(), reference[size_t(s)].weight(), "PACI weights");
  }
}

TEST(StageExecutor, PeakLiveActivationsFollowTheSchedule) {
  comm::Communicator& pp = comm::world();
  const int P = pp.size(), s = pp.rank();
  for (int64_t M : {int64_t(1), int64_t(2), int64_t(P + 1)}) {
    ToyStage stage(s, P);
    StageExecutor executor(pp, stage);
    EXPECT_EQ(executor.run(flush(ScheduleKind::one_f_one_b, P, M, 2)).peak_live_activations,
              std::min<int64_t>(P - s, M));
    EXPECT_EQ(executor.run(flush(ScheduleKind::gpipe, P, M, 2)).peak_live_activations, M);
  }
}

TEST(StageExecutor, ZbH1KeepsEachMicroBatchUntilItsW) {
  // W lags s micro-batches on stage s, so once M >= P every stage holds P (all M below).
  comm::Communicator& pp = comm::world();
  const int P = pp.size(), s = pp.rank();
  for (int64_t M : {int64_t(1), int64_t(2), int64_t(P), int64_t(P + 1), int64_t(2 * P)}) {
    ToyStage stage(s, P);
    StageExecutor executor(pp, stage);
    EXPECT_EQ(executor.run(flush(ScheduleKind::zb_h1, P, M, 2)).peak_live_activations,
              std::min<int64_t>(P, M))
        << "M " << M;
  }
}

TEST(StageExecutor, ZbH1StatsTimelineAndProfiledCosts) {
  comm::Communicator& pp = comm::world();
  const int P = pp.size(), s = pp.rank();
  const int64_t M = P + 1, steps = 2;
  const ScheduleOptions schedule = flush(ScheduleKind::zb_h1, P, M, steps);
  ToyStage stage(s, P);
  ExecutorOptions options;
  options.record_timeline = true;
  StageExecutor executor(pp, stage, options);
  const StageStats stats = executor.run(schedule);
  EXPECT_EQ(stats.forwards, M * steps);
  EXPECT_EQ(stats.backwards, M * steps);
  EXPECT_EQ(stats.weights, M * steps);
  EXPECT_EQ(stats.steps, steps);
  EXPECT_EQ(stats.max_version_gap, 0);
  EXPECT_GT(stats.weight_seconds, 0);
  // The timeline follows the list; W times add up to weight_seconds, B times to
  // backward_seconds.
  ASSERT_EQ(stats.timeline.size(), stage_ops(schedule, s).size());
  double b = 0, w = 0;
  for (size_t i = 0; i < stats.timeline.size(); ++i) {
    const OpTiming& t = stats.timeline[i];
    EXPECT_EQ(t.op, stage_ops(schedule, s)[i]);
    b += t.op.kind == OpKind::backward ? t.end - t.start : 0;
    w += t.op.kind == OpKind::weight ? t.end - t.start : 0;
  }
  EXPECT_NEAR(w, stats.weight_seconds, 1e-9);
  EXPECT_NEAR(b, stats.backward_seconds, 1e-9);
  const StageCosts costs = stats.profiled_costs();
  EXPECT_NEAR(costs.weight, w / double(M * steps), 1e-12);
  EXPECT_NEAR(costs.backward, (b + w) / double(M * steps), 1e-12);
  // A run without Ws profiles no weight cost.
  EXPECT_EQ(executor.run(flush(ScheduleKind::one_f_one_b, P, M, 1)).profiled_costs().weight, 0);

  const nlohmann::json trace = nlohmann::json::parse(gather_chrome_trace(pp, stats).dump());
  if (s != 0) return;
  std::set<std::string> names;
  for (const auto& e : trace.at("traceEvents"))
    if (e.at("ph") == "X") names.insert(e.at("name").get<std::string>());
  for (int64_t m = 0; m < M * steps; ++m)
    EXPECT_TRUE(names.count("W" + std::to_string(m))) << "W" << m;
}

TEST(StageExecutor, NoDeadlockOverTenThousandMicroBatchesWithRandomDelays) {
  comm::Communicator& pp = comm::world();
  const int P = pp.size(), s = pp.rank();
  const int64_t M = 10, steps = 1000, n = M * steps;
  ExecutorOptions options;
  options.max_random_delay_us = 5;
  options.delay_seed = 7;
  const auto flushed = chain_reference(P, M, steps);
  for (const ScheduleOptions& schedule :
       {flush(ScheduleKind::gpipe, P, M, steps), flush(ScheduleKind::one_f_one_b, P, M, steps),
        flush(ScheduleKind::zb_h1, P, M, steps), paci(P, n, P)}) {
    ToyStage stage(s, P);
    StageExecutor executor(pp, stage, options);
    const auto stats = executor.run(schedule);
    EXPECT_EQ(stats.forwards, n);
    EXPECT_EQ(stats.backwards, n);
    EXPECT_EQ(stats.weights, schedule.kind == ScheduleKind::zb_h1 ? n : 0);
    if (schedule.kind == ScheduleKind::paci) {
      auto reference = make_chain(P);
      replay(reference, schedule, 0);
      expect_bitwise_equal(stage.weight(), reference[size_t(s)].weight(), "paci");
    } else {
      expect_bitwise_equal(stage.weight(), flushed[size_t(s)].weight(),
                           schedule_name(schedule.kind));
    }
  }
}

TEST(StageExecutor, MeasuredChromeTraceHasOneSlicePerOpOnEachStageTrack) {
  comm::Communicator& pp = comm::world();
  const int P = pp.size(), s = pp.rank();
  const ScheduleOptions schedule = flush(ScheduleKind::one_f_one_b, P, 3, 2);
  ToyStage stage(s, P);
  ExecutorOptions options;
  options.record_timeline = true;
  StageExecutor executor(pp, stage, options);
  const StageStats stats = executor.run(schedule);
  EXPECT_EQ(stats.timeline.size(), stage_ops(schedule, s).size());
  double forward = 0;
  for (const OpTiming& t : stats.timeline)
    forward += t.op.kind == OpKind::forward ? t.end - t.start : 0;
  EXPECT_NEAR(stats.profiled_costs().forward * double(stats.forwards), forward, 1e-9);

  const nlohmann::json trace = nlohmann::json::parse(gather_chrome_trace(pp, stats).dump());
  if (s != 0) {
    EXPECT_TRUE(trace.empty());
    return;
  }
  std::map<int, std::vector<std::pair<double, double>>> slices;  // tid -> (ts, end)
  std::set<int> named;
  for (const auto& e : trace.at("traceEvents")) {
    if (e.at("ph") == "M") named.insert(e.at("tid").get<int>());
    if (e.at("ph") != "X") continue;
    const double ts = e.at("ts").get<double>(), dur = e.at("dur").get<double>();
    EXPECT_GE(ts, 0);
    EXPECT_GE(dur, 0);
    slices[e.at("tid").get<int>()].push_back({ts, ts + dur});
  }
  EXPECT_EQ(int(named.size()), P);
  ASSERT_EQ(int(slices.size()), P);
  for (const auto& [tid, spans] : slices) {
    EXPECT_EQ(spans.size(), stage_ops(schedule, tid).size()) << "stage " << tid;
    for (size_t i = 1; i < spans.size(); ++i)
      EXPECT_LE(spans[i - 1].second, spans[i].first) << "stage " << tid << " runs one op at a time";
  }
}

TEST(StageExecutor, MeasuredTimelinesOfAllStagesShareOneClock) {
  comm::Communicator& pp = comm::world();
  const int P = pp.size(), s = pp.rank();
  ToyStage stage(s, P);
  ExecutorOptions options;
  options.record_timeline = true;
  options.max_random_delay_us = 200;  // spreads the stages apart
  StageExecutor executor(pp, stage, options);
  const std::vector<OpTiming> timeline = gather_timeline(pp, executor.run(paci(P, 4 * P, P)));
  if (s != 0) {
    EXPECT_TRUE(timeline.empty());
    return;
  }
  EXPECT_EQ(timeline.size(), size_t(P) * (2 * 4 * size_t(P) + 4));
  std::map<std::tuple<int, OpKind, int64_t>, double> ends;
  for (const OpTiming& t : timeline) ends[{t.stage, t.op.kind, t.op.micro}] = t.end;
  // A message is consumed after it was produced. Slack: the two clock reads per stage.
  constexpr double kSlack = 1e-4;
  for (const OpTiming& t : timeline) {
    if (t.op.kind == OpKind::forward && t.stage > 0) {
      EXPECT_GE(t.start, ends.at({t.stage - 1, OpKind::forward, t.op.micro}) - kSlack);
    }
    if (t.op.kind == OpKind::backward && t.stage < P - 1) {
      EXPECT_GE(t.start, ends.at({t.stage + 1, OpKind::backward, t.op.micro}) - kSlack);
    }
  }
}

TEST(StageExecutor, AStageWorkErrorReachesTheCallerWithMessagesInFlight) {
  // Every stage reaches its first PACI step, and fails there with receives posted for
  // activations that will never come; its own communicator keeps those away from later tests.
  auto pp = comm::world().split(0, comm::world().rank());
  FailingStepStage stage(pp->rank(), pp->size());
  StageExecutor executor(*pp, stage);
  EXPECT_THROW(executor.run(paci(pp->size(), 8 * pp->size(), 2)), std::runtime_error);
}

TEST(StageExecutor, MismatchedBoundarySizesAreAnInputErrorNamingBothStages) {
  comm::Communicator& pp = comm::world();
  const int P = pp.size(), s = pp.rank();
  ToyStage good(s, P);
  MisSizedStage bad(s, P);
  StageWork& work = s == 1 ? static_cast<StageWork&>(bad) : good;
  fixture::expect_input_error([&] { StageExecutor executor(pp, work); },
                              {"stage 0 sends 5", "stage 1 expects 6"});
}

TEST(StageExecutor, AScheduleForAnotherStageCountIsAnInputError) {
  comm::Communicator& pp = comm::world();
  ToyStage stage(pp.rank(), pp.size());
  StageExecutor executor(pp, stage);
  fixture::expect_input_error(
      [&] { executor.run(flush(ScheduleKind::gpipe, pp.size() + 1, 2, 1)); },
      {"stages", "pp group"});
}
