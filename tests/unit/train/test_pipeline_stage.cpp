// GptStage chained in one process: the stages of a split GPT, driven by the schedules'
// instruction lists with the boundary tensors handed over in memory, against the whole
// model's forward / backward.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <memory>

#include "support/train_fixture.hpp"
#include "tessel/comm/single_communicator.hpp"
#include "tessel/pipeline/schedule.hpp"
#include "tessel/train/batch_inputs.hpp"
#include "tessel/train/pipeline_stage.hpp"
#include "tessel/train/stage_partition.hpp"

using namespace tessel;

namespace {

struct StepResult {
  std::vector<float> grads;                 // the model's whole gradient at the STEP
  std::vector<train::StageWindow> windows;  // per stage
};

data::DataLoader make_loader(const train::Config& c) {
  return data::DataLoader(c.data.path + "/train.tok",
                          {c.train.seq_len, c.train.micro_batch, c.train.accum, 0, 1,
                           uint64_t(c.run.seed), c.data.shuffle});
}

std::vector<float> copy_of(const Tensor& t) {
  return std::vector<float>(t.f32(), t.f32() + t.numel());
}

// Runs every stage's list of `schedule` over one model in one process: an op runs when its
// input has arrived; a STEP waits for every stage to reach it (the collective of a flush
// STEP), then the gradients are recorded and zeroed. `layout` counts blocks per virtual stage
// (schedule.stages x schedule.chunks of them); chunk c of stage s is virtual stage c P + s.
std::vector<StepResult> run_chained(const train::Config& c, const std::vector<int64_t>& layout,
                                    const pipeline::ScheduleOptions& schedule) {
  model::Gpt model(c.model, uint64_t(c.run.seed));
  const int P = schedule.stages;
  const int last = P * schedule.chunks - 1;  // the last virtual stage
  const auto boundaries = train::stage_boundaries(layout);
  std::vector<data::DataLoader> loaders;
  std::vector<std::unique_ptr<train::GptStage>> stages;
  for (int s = 0; s < P; ++s) loaders.push_back(make_loader(c));
  std::vector<int64_t> versions_seen;
  comm::SingleCommunicator no_cp;  // parallel.cp = 1
  const bool all_at_once = schedule.kind == pipeline::ScheduleKind::gpipe ||
                           schedule.kind == pipeline::ScheduleKind::interleaved;
  for (int s = 0; s < P; ++s)
    stages.push_back(std::make_unique<train::GptStage>(
        model, boundaries, s, P, loaders[size_t(s)], c, no_cp,
        all_at_once ? schedule.micro_batches : P - s,
        [&versions_seen](int64_t v) { versions_seen.push_back(v); }));
  std::vector<std::vector<pipeline::Op>> ops;
  for (int s = 0; s < P; ++s) ops.push_back(pipeline::stage_ops(schedule, s));
  std::vector<size_t> next(static_cast<size_t>(P), 0);
  // Messages by virtual stage, then micro-batch.
  std::vector<std::map<int64_t, std::vector<float>>> acts_in(size_t(last) + 1),
      grads_in(size_t(last) + 1);
  std::vector<StepResult> steps;
  int64_t version = 0;
  model.zero_grads();
  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < P; ++s) {
      auto& stage = *stages[size_t(s)];
      while (next[size_t(s)] < ops[size_t(s)].size()) {
        const pipeline::Op op = ops[size_t(s)][next[size_t(s)]];
        const int j = op.chunk * P + s;
        if (op.kind == pipeline::OpKind::forward) {
          if (j > 0 && !acts_in[size_t(j)].count(op.micro)) break;
          std::vector<float> out(j < last ? stage.output_elems() : 0);
          stage.forward(op.chunk, op.micro,
                        j > 0 ? acts_in[size_t(j)][op.micro] : std::vector<float>{}, out);
          acts_in[size_t(j)].erase(op.micro);
          if (j < last) acts_in[size_t(j) + 1][op.micro] = std::move(out);
        } else if (op.kind == pipeline::OpKind::backward) {
          if (j < last && !grads_in[size_t(j)].count(op.micro)) break;
          std::vector<float> dx(j > 0 ? stage.input_elems() : 0);
          stage.backward(op.chunk, op.micro,
                         j < last ? grads_in[size_t(j)][op.micro] : std::vector<float>{}, dx);
          grads_in[size_t(j)].erase(op.micro);
          if (j > 0) grads_in[size_t(j) - 1][op.micro] = std::move(dx);
        } else {
          bool all_there = true;  // every stage waits at its STEP
          for (int o = 0; o < P; ++o)
            all_there = all_there && next[size_t(o)] < ops[size_t(o)].size() &&
                        ops[size_t(o)][next[size_t(o)]].kind == pipeline::OpKind::step;
          if (!all_there) break;
          StepResult r{copy_of(model.flat_grads()), {}};
          for (int o = 0; o < P; ++o) {
            stages[size_t(o)]->step(version);
            r.windows.push_back(stages[size_t(o)]->take_window());
            ++next[size_t(o)];
          }
          ++version;
          model.zero_grads();
          steps.push_back(std::move(r));
          progress = true;
          continue;
        }
        ++next[size_t(s)];
        progress = true;
      }
    }
  }
  for (int s = 0; s < P; ++s) {
    EXPECT_EQ(next[size_t(s)], ops[size_t(s)].size()) << "stage " << s << " stalled";
    EXPECT_TRUE(stages[size_t(s)]->drained());
  }
  EXPECT_EQ(int64_t(versions_seen.size()), int64_t(steps.size()) * P);
  return steps;
}

// The whole model, micro-batch after micro-batch: the gradients and loss sum of each
// group of `per_step` micro-batches.
std::vector<StepResult> run_whole(const train::Config& c, int64_t steps, int64_t per_step) {
  model::Gpt model(c.model, uint64_t(c.run.seed));
  data::DataLoader loader = make_loader(c);
  std::vector<StepResult> out;
  for (int64_t t = 0; t < steps; ++t) {
    model.zero_grads();
    train::StageWindow w;
    for (int64_t m = 0; m < per_step; ++m) {
      data::Batch b = loader.next();
      train::BatchInputs in(b, c.data.attention_mask);
      auto acts = model.make_activations(b.B, b.T);
      w.loss_sum += model.forward(*acts, in.inputs());
      for (float x : b.loss_mask) w.loss_tokens += x;
      ++w.micro_batches;
      model.backward(*acts, 1.0f);
    }
    out.push_back({copy_of(model.flat_grads()), {w}});
  }
  return out;
}

struct PipelineStageTest : ::testing::Test {
  std::string data = fixture::make_dataset(fixture::temp_dir("tessel-pstage") + "/data");
  train::Config config = fixture::tiny_config(data, fixture::temp_dir("tessel-pstage-run"));
  void SetUp() override { config.model.layers = 4; }
};

void expect_equal_steps(const std::vector<StepResult>& pipe, const std::vector<StepResult>& whole,
                        int P) {
  ASSERT_EQ(pipe.size(), whole.size());
  for (size_t t = 0; t < pipe.size(); ++t) {
    ASSERT_EQ(pipe[t].grads.size(), whole[t].grads.size());
    EXPECT_EQ(0, std::memcmp(pipe[t].grads.data(), whole[t].grads.data(),
                             pipe[t].grads.size() * sizeof(float)))
        << "step " << t << ": gradients differ";
    const train::StageWindow& ref = whole[t].windows[0];
    for (int s = 0; s < P; ++s) {
      const train::StageWindow& w = pipe[t].windows[size_t(s)];
      EXPECT_EQ(w.loss_tokens, ref.loss_tokens) << "step " << t << " stage " << s;
      EXPECT_EQ(w.micro_batches, ref.micro_batches);
      EXPECT_EQ(w.loss_sum, s == P - 1 ? ref.loss_sum : 0.0) << "step " << t << " stage " << s;
    }
    EXPECT_GT(ref.loss_sum, 0.0);
  }
}

}  // namespace

TEST_F(PipelineStageTest, FlushSchedulesEqualTheWholeModelBitwise) {
  const auto whole = run_whole(config, 2, 4);
  for (auto kind : {pipeline::ScheduleKind::gpipe, pipeline::ScheduleKind::one_f_one_b})
    for (auto layout :
         std::vector<std::vector<int64_t>>{{4}, {3, 1}, {1, 2, 1}, {1, 1, 1, 1}, {0, 4}, {4, 0}}) {
      SCOPED_TRACE(std::string(pipeline::schedule_name(kind)) + ", " +
                   std::to_string(layout.size()) + " stages, first " + std::to_string(layout[0]));
      const int P = int(layout.size());
      pipeline::ScheduleOptions s{kind, P, 4, 2, 1};
      expect_equal_steps(run_chained(config, layout, s), whole, P);
    }
}

// Interleaved: each stage runs its chunks' pieces (embedding on virtual stage 0, head on the
// last); each micro-batch's loss tokens count once per stage however many chunks it crosses.
// Also with recomputation, where every chunk's micro-batches in flight share one block cache.
TEST_F(PipelineStageTest, InterleavedChunksEqualTheWholeModelBitwise) {
  config.model.layers = 6;
  const auto whole = run_whole(config, 2, 4);
  for (const auto recompute : {model::Recompute::none, model::Recompute::blocks}) {
    config.train.recompute = recompute;
    struct Case {
      int stages, chunks;
      std::vector<int64_t> layout;  // per virtual stage
    };
    for (const Case& k : {Case{2, 2, {2, 1, 2, 1}}, Case{2, 3, {1, 1, 1, 1, 1, 1}},
                          Case{2, 2, {0, 2, 2, 2}}, Case{4, 2, {1, 1, 1, 0, 1, 1, 1, 0}}}) {
      SCOPED_TRACE(std::to_string(k.stages) + " stages x " + std::to_string(k.chunks) + " chunks");
      pipeline::ScheduleOptions s{pipeline::ScheduleKind::interleaved, k.stages, 4, 2, 1, k.chunks};
      expect_equal_steps(run_chained(config, k.layout, s), whole, k.stages);
    }
  }
}

TEST_F(PipelineStageTest, PaciWithoutAStepInsideTheHorizonEquals1F1B) {
  // K = the horizon: the only STEP is the one after the last backward.
  const auto whole = run_whole(config, 1, 6);
  pipeline::ScheduleOptions s{pipeline::ScheduleKind::paci, 2, 6, 1, 6};
  expect_equal_steps(run_chained(config, {2, 2}, s), whole, 2);
}

TEST_F(PipelineStageTest, TiedHeadSumsBothStagesGradientsInAnotherOrder) {
  // The embedding's gradient gets the head's and the lookups' parts in another order when
  // they run on two stages, so only rounding may differ.
  config.model.tied_head = true;
  const auto whole = run_whole(config, 1, 4);
  pipeline::ScheduleOptions s{pipeline::ScheduleKind::one_f_one_b, 2, 4, 1, 1};
  const auto pipe = run_chained(config, {2, 2}, s);
  ASSERT_EQ(pipe.size(), 1u);
  double max_diff = 0, max_abs = 0;
  for (size_t i = 0; i < pipe[0].grads.size(); ++i) {
    max_diff = std::max(max_diff, double(std::abs(pipe[0].grads[i] - whole[0].grads[i])));
    max_abs = std::max(max_abs, double(std::abs(whole[0].grads[i])));
  }
  EXPECT_LE(max_diff, 1e-5 * max_abs);
  EXPECT_EQ(pipe[0].windows[1].loss_sum, whole[0].windows[0].loss_sum);
}
