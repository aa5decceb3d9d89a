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
#include <numeric>
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

// Deterministic per micro-batch: the first piece's input and the last piece's target.
std::vector<float> micro_data(int64_t micro, size_t n, uint64_t salt) {
  std::vector<float> v(n);
  Rng(salt * 1000003 + uint64_t(micro)).fill_uniform(v.data(), int64_t(n), -1.f, 1.f);
  return v;
}

// One piece of the model, virtual stage j of V: y = tanh(W x), loss 0.5 |y - target|^2 after
// the last, SGD. Widths 4 + (boundary mod period) differ per boundary; a period of P gives
// every message between two stages one size, as chunks of a stage need.
class ToyPiece {
 public:
  ToyPiece(int piece, int pieces, int period)
      : first_(piece == 0),
        last_(piece == pieces - 1),
        in_(4 + size_t(piece % period)),
        out_(4 + size_t((piece + 1) % period)),
        weight_(in_ * out_),
        grad_(in_ * out_, 0.f) {
    Rng(17 + uint64_t(piece)).fill_uniform(weight_.data(), int64_t(weight_.size()), -.5f, .5f);
  }
  size_t in() const { return in_; }
  size_t out() const { return out_; }

  void forward(int64_t micro, std::span<const float> input, std::span<float> output) {
    Saved s{first_ ? micro_data(micro, in_, 1) : std::vector<float>(input.begin(), input.end()),
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

  void step() {
    for (size_t j = 0; j < weight_.size(); ++j) {
      weight_[j] -= kLearningRate * grad_[j];
      grad_[j] = 0;
    }
  }

  const std::vector<float>& weight() const { return weight_; }
  const std::vector<float>& grad() const { return grad_; }

 private:
  struct Saved {
    std::vector<float> x, y;
    std::vector<float> dz;  // from the input gradient, until the weight gradient
  };

  bool first_, last_;
  size_t in_, out_;
  std::vector<float> weight_, grad_;
  std::map<int64_t, Saved> saved_;
};

// Stage s of P holding `chunks` pieces of a chain of P chunks: chunk c is piece c P + s.
class ToyStage : public StageWork {
 public:
  ToyStage(int stage, int stages, int chunks = 1, int period = 0) : stage_(stage) {
    for (int c = 0; c < chunks; ++c)
      pieces_.emplace_back(c * stages + stage, chunks * stages, period > 0 ? period : stages);
    first_ = stage == 0 && chunks == 1;
    last_ = stage == stages - 1 && chunks == 1;
  }
  int chunks() const override { return int(pieces_.size()); }
  size_t input_elems() const override { return first_ ? 0 : pieces_[0].in(); }
  size_t output_elems() const override { return last_ ? 0 : pieces_[0].out(); }

  void forward(int chunk, int64_t micro, std::span<const float> input,
               std::span<float> output) override {
    piece(chunk).forward(micro, input, output);
  }

  // The whole backward is its two halves in a row.
  void backward(int chunk, int64_t micro, std::span<const float> output_grad,
                std::span<float> input_grad) override {
    ++backwards_;
    piece(chunk).input_gradient(micro, output_grad, input_grad);
    piece(chunk).weight_gradient(micro);
  }
  void backward_input(int chunk, int64_t micro, std::span<const float> output_grad,
                      std::span<float> input_grad) override {
    ++backward_inputs_;
    piece(chunk).input_gradient(micro, output_grad, input_grad);
  }
  void backward_weights(int chunk, int64_t micro) override {
    EXPECT_GT(micro, last_weights_micro_) << "Ws in micro-batch order";
    last_weights_micro_ = micro;
    ++backward_weights_;
    piece(chunk).weight_gradient(micro);
  }

  void step(int64_t version) override {
    EXPECT_EQ(version, steps_) << "stage " << stage_;
    ++steps_;
    for (ToyPiece& p : pieces_) p.step();
  }

  ToyPiece& piece(int chunk) {
    EXPECT_TRUE(chunk >= 0 && chunk < chunks()) << "chunk " << chunk;
    return pieces_.at(size_t(chunk));
  }
  // Every chunk's weights (gradients), in chunk order.
  std::vector<float> weight() const { return joined(&ToyPiece::weight); }
  std::vector<float> grad() const { return joined(&ToyPiece::grad); }
  int64_t steps() const { return steps_; }
  // Calls of backward, backward_input and backward_weights.
  int64_t backwards() const { return backwards_; }
  int64_t backward_inputs() const { return backward_inputs_; }
  int64_t backward_weights() const { return backward_weights_; }

 private:
  std::vector<float> joined(const std::vector<float>& (ToyPiece::*part)() const) const {
    std::vector<float> all;
    for (const ToyPiece& p : pieces_) all.insert(all.end(), (p.*part)().begin(), (p.*part)().end());
    return all;
  }

  int stage_;
  bool first_, last_;  // the model's first (last) piece, with no input (output) message
  std::vector<ToyPiece> pieces_;
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

// A stage that keeps its gradients as its first step finds them.
class GradientAtStepStage : public ToyStage {
 public:
  using ToyStage::ToyStage;
  void step(int64_t version) override {
    if (steps() == 0) first_ = grad();
    ToyStage::step(version);
  }
  const std::vector<float>& grad_at_first_step() const { return first_; }

 private:
  std::vector<float> first_;
};

// A stage whose optimizer step fails.
class FailingStepStage : public ToyStage {
 public:
  using ToyStage::ToyStage;
  void step(int64_t) override { throw std::runtime_error("step failed"); }
};

std::vector<ToyStage> make_chain(int stages, int chunks = 1, int period = 0) {
  std::vector<ToyStage> chain;
  for (int s = 0; s < stages; ++s) chain.emplace_back(s, stages, chunks, period);
  return chain;
}

// Plain gradient accumulation in one process: micro-batches first .. first + n - 1, each
// forward through every piece (chunk c of stage s is piece c P + s) and back.
void accumulate(std::vector<ToyStage>& chain, int64_t first, int64_t n) {
  const int P = int(chain.size()), V = P * chain[0].chunks();
  for (int64_t m = first; m < first + n; ++m) {
    std::vector<float> a;
    for (int j = 0; j < V; ++j) {
      ToyPiece& piece = chain[size_t(j % P)].piece(j / P);
      std::vector<float> out(j + 1 < V ? piece.out() : 0);
      piece.forward(m, a, out);
      a = std::move(out);
    }
    std::vector<float> g;
    for (int j = V - 1; j >= 0; --j) {
      ToyPiece& piece = chain[size_t(j % P)].piece(j / P);
      std::vector<float> in(j > 0 ? piece.in() : 0);
      piece.input_gradient(m, g, in);
      piece.weight_gradient(m);
      g = std::move(in);
    }
  }
}

// The single-process chain: `steps` steps of M accumulated micro-batches.
std::vector<ToyStage> chain_reference(int stages, int64_t M, int64_t steps, int chunks = 1,
                                      int period = 0) {
  auto chain = make_chain(stages, chunks, period);
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

ScheduleOptions interleaved(int P, int v, int64_t M, int64_t steps) {
  ScheduleOptions o = flush(ScheduleKind::interleaved, P, M, steps);
  o.chunks = v;
  return o;
}

// Chunk forwards stage s holds at most: its warm-up plus one, at most all M v of a step.
int64_t interleaved_peak(int P, int v, int64_t M, int s) {
  return std::min<int64_t>(2 * (P - 1 - s) + int64_t(v - 1) * P + 1, M * v);
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

TEST(StageExecutor, InterleavedEqualsTheSingleProcessChainOfVirtualStagesBitwise) {
  comm::Communicator& pp = comm::world();
  const int P = pp.size(), s = pp.rank();
  const int64_t steps = 3;
  for (int v : {2, 3})
    for (int64_t M : {int64_t(P), int64_t(2 * P)}) {
      SCOPED_TRACE("v " + std::to_string(v) + " M " + std::to_string(M));
      ToyStage stage(s, P, v);
      StageExecutor executor(pp, stage);
      const auto stats = executor.run(interleaved(P, v, M, steps));
      EXPECT_EQ(stats.chunks, v);
      EXPECT_EQ(stats.forwards, steps * M * v);
      EXPECT_EQ(stats.backwards, steps * M * v);
      EXPECT_EQ(stage.backwards(), steps * M * v);
      EXPECT_EQ(stats.steps, steps);
      EXPECT_EQ(executor.version(), steps);
      EXPECT_EQ(stats.max_version_gap, 0);
      EXPECT_EQ(stats.inconsistent_backwards, 0);
      EXPECT_EQ(stats.peak_live_activations, interleaved_peak(P, v, M, s));
      const auto reference = chain_reference(P, M, steps, v);
      expect_bitwise_equal(stage.weight(), reference[size_t(s)].weight(), "interleaved");
    }
}

TEST(StageExecutor, InterleavedOnHalfTheRanksEquals1F1BOverTheSameVirtualStages) {
  // The same chain of 2G pieces (G = half the ranks, widths of period G): 1F1B with one piece
  // per rank on all 2G ranks, and interleaved with v = 2 on each half (rank s of a half
  // holds pieces s and s + G; G = 1 sends to itself). Every rank compares its interleaved
  // pieces with the 1F1B ranks that held them.
  comm::Communicator& world = comm::world();
  const int G = world.size() / 2, r = world.rank();
  const int64_t M = 2 * G, steps = 2;
  ToyStage single(r, 2 * G, 1, G);
  StageExecutor(world, single).run(flush(ScheduleKind::one_f_one_b, 2 * G, M, steps));
  auto half = world.split(r / G, r);
  const int s = half->rank();
  ToyStage chunked(s, G, 2, G);
  StageExecutor(*half, chunked).run(interleaved(G, 2, M, steps));
  const std::vector<float> mine = single.weight();
  const int64_t count = int64_t(mine.size());
  std::vector<int64_t> counts(size_t(world.size()));
  world.all_gather(std::span(&count, 1), counts);
  const std::vector<size_t> sizes(counts.begin(), counts.end());
  std::vector<float> all(std::accumulate(sizes.begin(), sizes.end(), size_t(0)));
  world.all_gatherv(mine, all, sizes);
  std::vector<float> expected;  // pieces s and s + G, as 1F1B's ranks s and s + G hold them
  for (int piece : {s, s + G}) {
    const size_t at = std::accumulate(sizes.begin(), sizes.begin() + piece, size_t(0));
    expected.insert(expected.end(), all.begin() + ptrdiff_t(at),
                    all.begin() + ptrdiff_t(at + sizes[size_t(piece)]));
  }
  expect_bitwise_equal(chunked.weight(), expected, "interleaved vs 1f1b");
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
  // Interleaved on one stage sends every message to itself.
  for (int v : {2, 3}) {
    ToyStage stage(0, 1, v);
    StageExecutor executor(*alone, stage);
    const auto stats = executor.run(interleaved(1, v, M, steps));
    EXPECT_EQ(stats.peak_live_activations, interleaved_peak(1, v, M, 0));
    EXPECT_EQ(executor.version(), steps);
    expect_bitwise_equal(stage.weight(), chain_reference(1, M, steps, v)[0].weight(),
                         "interleaved");
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

TEST(StageExecutor, PaciAccumulatesThe1F1BGradientsUntilItsFirstStep) {
  comm::Communicator& pp = comm::world();
  const int P = pp.size(), s = pp.rank();
  const int64_t n = 5;
  GradientAtStepStage stage(s, P);
  StageExecutor executor(pp, stage);
  executor.run(paci(P, n, n));
  EXPECT_EQ(executor.version(), 1);
  auto reference = make_chain(P);
  accumulate(reference, 0, n);
  expect_bitwise_equal(stage.grad_at_first_step(), reference[size_t(s)].grad(),
                       "accumulated gradients");
  reference[size_t(s)].step(0);
  expect_bitwise_equal(stage.weight(), reference[size_t(s)].weight(), "weights after the step");
}

TEST(StageExecutor, APaciHorizonNotDivisibleByKIsAnInputError) {
  comm::Communicator& pp = comm::world();
  ToyStage stage(pp.rank(), pp.size());
  StageExecutor executor(pp, stage);
  fixture::expect_input_error([&] { executor.run(paci(pp.size(), 5, 3)); },
                              {"horizon of 5", "multiple of paci_k = 3"});
  EXPECT_EQ(executor.version(), 0);
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

// Message tags wrap at 2^14 micro-batches (chunk ops with v chunks): one chunk crosses the
// wrap only past micro-batch 16383, so these runs start at 16380, with receives posted for
// micro-batches on both sides of it.
TEST(StageExecutor, NoDeadlockAcrossTheTagWrapWithOneChunk) {
  comm::Communicator& pp = comm::world();
  const int P = pp.size(), s = pp.rank();
  const int64_t first = 16380, M = 4, steps = 3, n = M * steps;
  ExecutorOptions options;
  options.max_random_delay_us = 5;
  options.delay_seed = 11;
  auto flushed = make_chain(P);
  for (int64_t t = 0; t < steps; ++t) {
    accumulate(flushed, first + t * M, M);
    for (ToyStage& stage : flushed) stage.step(t);
  }
  for (const ScheduleOptions& schedule :
       {flush(ScheduleKind::gpipe, P, M, steps), flush(ScheduleKind::one_f_one_b, P, M, steps),
        flush(ScheduleKind::zb_h1, P, M, steps), paci(P, n, M)}) {
    SCOPED_TRACE(schedule_name(schedule.kind));
    ToyStage stage(s, P);
    StageExecutor executor(pp, stage, options);
    const auto stats = executor.run(schedule, first);
    EXPECT_EQ(stats.forwards, n);
    EXPECT_EQ(stats.backwards, n);
    if (schedule.kind == ScheduleKind::paci) {
      auto reference = make_chain(P);
      replay(reference, schedule, first);
      expect_bitwise_equal(stage.weight(), reference[size_t(s)].weight(), "paci");
    } else {
      expect_bitwise_equal(stage.weight(), flushed[size_t(s)].weight(), "flush");
    }
  }
}

TEST(StageExecutor, InterleavedHasNoDeadlockOverTenThousandMicroBatchesWithRandomDelays) {
  comm::Communicator& pp = comm::world();
  const int P = pp.size(), s = pp.rank();
  const int64_t M = 4 * P, steps = 10000 / M, n = M * steps;  // 10^4 at P = 2 and 4
  ExecutorOptions options;
  options.max_random_delay_us = 5;
  options.delay_seed = 9;
  for (int v : {2, 3}) {
    ToyStage stage(s, P, v);
    StageExecutor executor(pp, stage, options);
    const auto stats = executor.run(interleaved(P, v, M, steps));
    EXPECT_EQ(stats.forwards, n * v);
    EXPECT_EQ(stats.backwards, n * v);
    EXPECT_EQ(stats.max_version_gap, 0);
    EXPECT_EQ(stats.peak_live_activations, interleaved_peak(P, v, M, s));
    expect_bitwise_equal(stage.weight(), chain_reference(P, M, steps, v)[size_t(s)].weight(),
                         "interleaved");
  }
}

TEST(StageExecutor, InterleavedTimelineChunksAndProfiledCosts) {
  comm::Communicator& pp = comm::world();
  const int P = pp.size(), s = pp.rank();
  const int v = 2;
  const int64_t M = P, steps = 2;
  const ScheduleOptions schedule = interleaved(P, v, M, steps);
  ToyStage stage(s, P, v);
  ExecutorOptions options;
  options.record_timeline = true;
  StageExecutor executor(pp, stage, options);
  const StageStats stats = executor.run(schedule);
  // The timeline follows the list, chunks included.
  const std::vector<Op> ops = stage_ops(schedule, s);
  ASSERT_EQ(stats.timeline.size(), ops.size());
  double forward = 0, backward = 0;
  for (size_t i = 0; i < ops.size(); ++i) {
    EXPECT_EQ(stats.timeline[i].op, ops[i]);
    const OpTiming& t = stats.timeline[i];
    forward += t.op.kind == OpKind::forward ? t.end - t.start : 0;
    backward += t.op.kind == OpKind::backward ? t.end - t.start : 0;
  }
  // Per micro-batch: all v chunk ops (M steps micro-batches); 1e-12 s: summation order.
  const StageCosts costs = stats.profiled_costs();
  EXPECT_NEAR(costs.forward, forward / double(M * steps), 1e-12);
  EXPECT_NEAR(costs.backward, backward / double(M * steps), 1e-12);
  EXPECT_NEAR(costs.step, stats.step_seconds / double(steps), 1e-12);

  const std::vector<OpTiming> timeline = gather_timeline(pp, stats);
  const nlohmann::json trace = nlohmann::json::parse(gather_chrome_trace(pp, stats).dump());
  if (s != 0) return;
  // Gathered with their chunks: every stage's list; the trace names micro-batch and chunk.
  size_t at = 0;
  for (int q = 0; q < P; ++q)
    for (const Op& op : stage_ops(schedule, q)) EXPECT_EQ(timeline.at(at++).op, op);
  std::set<std::string> names;
  for (const auto& e : trace.at("traceEvents"))
    if (e.at("ph") == "X") names.insert(e.at("name").get<std::string>());
  for (int64_t m = 0; m < M * steps; ++m)
    for (int c = 0; c < v; ++c) {
      const std::string name = std::to_string(m) + "." + std::to_string(c);
      EXPECT_TRUE(names.count("F" + name) && names.count("B" + name)) << name;
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

TEST(StageExecutor, ChunkCountsThatDisagreeAreInputErrors) {
  comm::Communicator& pp = comm::world();
  const int P = pp.size(), s = pp.rank();
  ToyStage two(s, P, 2), three(s, P, 3);
  StageWork& work = s == P - 1 ? static_cast<StageWork&>(three) : two;
  fixture::expect_input_error(
      [&] { StageExecutor executor(pp, work); },
      {"same number", "stage 0 holds 2", "stage " + std::to_string(P - 1) + " 3"});
  StageExecutor executor(pp, two);
  fixture::expect_input_error([&] { executor.run(flush(ScheduleKind::one_f_one_b, P, P, 1)); },
                              {"1 chunks per stage", "holds 2"});
  fixture::expect_input_error([&] { executor.run(interleaved(P, 3, P, 1)); },
                              {"3 chunks per stage", "holds 2"});
}

TEST(StageExecutor, WithChunksTheLastStageMustFeedTheFirst) {
  // The ring's wrap: stage P - 1 sends 4 + (P mod P) = 4 elements, stage 0 expects one more.
  comm::Communicator& pp = comm::world();
  const int P = pp.size(), s = pp.rank();
  ToyStage good(s, P, 2);
  MisSizedStage bad(s, P, 2);
  StageWork& work = s == 0 ? static_cast<StageWork&>(bad) : good;
  fixture::expect_input_error([&] { StageExecutor executor(pp, work); },
                              {"stage " + std::to_string(P - 1) + " sends 4", "stage 0 expects 5"});
}

TEST(StageExecutor, AScheduleForAnotherStageCountIsAnInputError) {
  comm::Communicator& pp = comm::world();
  ToyStage stage(pp.rank(), pp.size());
  StageExecutor executor(pp, stage);
  fixture::expect_input_error(
      [&] { executor.run(flush(ScheduleKind::gpipe, pp.size() + 1, 2, 1)); },
      {"stages", "pp group"});
}
