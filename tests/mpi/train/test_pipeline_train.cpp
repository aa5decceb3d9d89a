// Pipeline parallelism on real MPI ranks (spec pipeline.md C2, C3): GPipe, 1F1B, interleaved
// 1F1B and ZB-H1 over pp stages give bitwise the losses, gradient norms, validation losses and
// final weights of the single-process run; pp x dp those of the plain dp run, pp x cp those of the
// plain cp run; PACI drained after every window equals 1F1B; undrained PACI equals a sequential
// single-process reference of its semantics; resume continues bitwise.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

#include "support/expect_input_error.hpp"
#include "support/mpi_train_fixture.hpp"
#include "support/pipeline_fixture.hpp"
#include "support/train_fixture.hpp"
#include "tessel/comm/mesh.hpp"
#include "tessel/comm/single_communicator.hpp"
#include "tessel/comm/world.hpp"
#include "tessel/data/loader.hpp"
#include "tessel/model/gpt.hpp"
#include "tessel/optim/grad_clip.hpp"
#include "tessel/optim/lr_schedule.hpp"
#include "tessel/optim/optimizer.hpp"
#include "tessel/train/batch_inputs.hpp"
#include "tessel/train/export.hpp"
#include "tessel/train/pipeline_trainer.hpp"
#include "tessel/train/safetensors.hpp"

using namespace tessel;
using fixture::pipeline_config;
using fixture::run_on;
using fixture::shared_temp_dir;
namespace fs = std::filesystem;

namespace {

// The same run in this process alone (every rank makes its own).
struct Reference {
  train::TrainResult result;
  std::map<std::string, std::vector<float>> weights;
  std::string dir;
};
Reference single_process(train::Config c) {
  c.parallel.pp = 1;
  c.pipeline.schedule.clear();
  c.pipeline.layout.clear();
  c.run.dir = fixture::temp_dir("tessel-pp-ref");
  comm::SingleCommunicator self;
  Reference r{run_on(self, c), {}, c.run.dir};
  r.weights = fixture::final_weights(c.run.dir);
  return r;
}

// A run of `c` (in c.run.dir) gives `ref`'s steps and weights bitwise; its result.
train::TrainResult expect_run_equals(comm::Communicator& world, const train::Config& c,
                                     const Reference& ref) {
  train::TrainResult r = run_on(world, c);
  fixture::expect_same_steps(r, ref.result);
  fixture::expect_same_weights(fixture::final_weights(c.run.dir), ref.weights);
  return r;
}

// `c` with 1F1B over every rank as a stage gives `ref`'s steps and weights bitwise.
void expect_1f1b_equals(comm::Communicator& world, train::Config c, const Reference& ref,
                        const char* run_name) {
  c.parallel.pp = world.size();
  c.pipeline.schedule = "1f1b";
  c.run.dir = shared_temp_dir(world, run_name);
  expect_run_equals(world, c, ref);
}

// Every record of a run's metrics.jsonl (rank 0 writes them), in order.
std::vector<nlohmann::json> metrics_records(const std::string& run_dir) {
  std::vector<nlohmann::json> out;
  std::ifstream in(run_dir + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line));
  return out;
}

// Each step record's pipeline section.
std::vector<nlohmann::json> pipeline_records(const std::string& run_dir) {
  std::vector<nlohmann::json> out;
  for (const auto& j : metrics_records(run_dir))
    if (j.contains("pipeline")) out.push_back(j["pipeline"]);
  return out;
}

// The MoE fields of each step and validation record.
std::vector<nlohmann::json> moe_records(const std::string& run_dir) {
  std::vector<nlohmann::json> out;
  for (const auto& j : metrics_records(run_dir)) {
    if (!j.contains("moe")) continue;
    out.push_back({{"step", j["step"]}, {"validation", j.contains("val_loss")}, {"moe", j["moe"]}});
    if (j.contains("all_to_all_bytes")) out.back()["all_to_all_bytes"] = j["all_to_all_bytes"];
  }
  return out;
}

// PACI's semantics (spec pipeline.md section 2.2) in one process, written without the stage
// executor, GptStage or the pipeline trainer: one Gpt whose stages' parameter sets each have
// their own optimizer. Each stage keeps P - s micro-batches in flight (a backward, of the
// oldest, only when that many are or no forward is left) and steps after every K-th local
// backward: its gradients (of loss sums) times 1 / the window's loss tokens, clipped by the
// stage's own norm, updated in place, so a backward in flight uses the new weights against
// activations saved under older ones. The stages' lists run in one valid sequential order,
// drained where the trainer validates (every `eval_every` windows) and at the end. With
// pipeline.paci_stash, a stage's backward whose forward ran before its last STEP runs
// against the weights from before that STEP instead. With pipeline.paci_predict, a forward
// whose backward will run g STEPs later runs on the weights extrapolated g x paci_predict
// along the stage's last STEP of the same drained stretch (none before its first).
struct PaciReference {
  std::vector<double> losses;                    // per window
  std::vector<std::vector<double>> stage_norms;  // [window][stage], before clipping
  std::map<std::string, std::vector<float>> weights;
};
PaciReference paci_reference(const train::Config& c) {
  const int P = c.parallel.pp;
  const int64_t K = train::micro_batches_per_step(c);
  const std::vector<int64_t> bounds = train::pipeline_boundaries(c);
  model::Gpt model(c.model, uint64_t(c.run.seed));
  const std::vector<int> stage_of = train::parameter_stages(model, bounds, P);
  std::vector<ParameterList> params(static_cast<size_t>(P));
  for (size_t i = 0; i < stage_of.size(); ++i)
    params[size_t(stage_of[i])].push_back(model.parameters()[i]);
  std::vector<std::unique_ptr<optim::Optimizer>> optimizers;
  for (const ParameterList& p : params) optimizers.push_back(optim::make_optimizer(c.optim, p));
  const optim::LrSchedule schedule = optim::lr_schedule(c.optim, c.train.steps);
  data::DataLoader loader(c.data.path + "/train.tok", {c.train.seq_len, c.train.micro_batch, K, 0,
                                                       1, uint64_t(c.run.seed), c.data.shuffle});
  struct Micro {
    data::Batch batch;
    std::unique_ptr<model::Activations> acts;
    double loss = 0;
    std::vector<int64_t> versions;  // [stage] at its forward
  };
  std::vector<std::vector<std::vector<float>>> previous(static_cast<size_t>(P));  // [stage][param]
  auto swap_previous = [&](size_t s) {
    for (size_t j = 0; j < params[s].size(); ++j)
      std::swap_ranges(previous[s][j].begin(), previous[s][j].end(), params[s][j].value.f32());
  };
  std::map<int64_t, Micro> live;
  std::vector<int64_t> versions(size_t(P), 0);
  std::vector<double> window_tokens(size_t(P), 0);
  double window_loss = 0;
  PaciReference out;
  out.stage_norms.assign(size_t(c.train.steps), std::vector<double>(size_t(P)));
  const int64_t horizon = c.train.eval_every > 0 ? c.train.eval_every : c.train.steps;
  for (int64_t start = 0; start < c.train.steps; start += horizon) {
    const int64_t first = start * K, end = std::min(start + horizon, c.train.steps) * K;
    std::vector<int64_t> forwards(size_t(P), first), backwards(size_t(P), first);
    std::vector<bool> step_due(size_t(P), false);
    for (bool progress = true; progress;) {
      progress = false;
      for (int s = 0; s < P; ++s) {
        const size_t i = size_t(s);
        const int64_t f = forwards[i], b = backwards[i];
        if (step_due[i]) {  // STEP after the K-th backward
          step_due[i] = false;
          for (Parameter& p : params[i]) {
            float* g = p.grad.f32();
            for (int64_t e = 0; e < p.grad.numel(); ++e) g[e] *= float(1.0 / window_tokens[i]);
          }
          double& norm = out.stage_norms[size_t(versions[i])][i];
          norm = optim::global_grad_norm(params[i]);
          optim::scale_to_max_norm(params[i], norm, c.train.grad_clip);
          previous[i].clear();
          for (const Parameter& p : params[i])
            previous[i].emplace_back(p.value.f32(), p.value.f32() + p.value.numel());
          optimizers[i]->step(schedule.scale(++versions[i]));
          for (Parameter& p : params[i]) std::fill_n(p.grad.f32(), p.grad.numel(), 0.0f);
          window_tokens[i] = 0;
          progress = true;
        } else if (f < end && f - b < P - s && (s == 0 || forwards[i - 1] > f)) {
          // The backward of f runs after f / K STEPs (the versions count from the first).
          const int64_t gap =
              c.pipeline.paci_predict != 0 && versions[i] > start ? f / K - versions[i] : 0;
          std::vector<std::vector<float>> current;
          for (size_t j = 0; gap > 0 && j < params[i].size(); ++j) {
            Tensor& w = params[i][j].value;
            current.emplace_back(w.f32(), w.f32() + w.numel());
            train::extrapolate_weights({w.f32(), size_t(w.numel())}, previous[i][j],
                                       float(double(gap) * c.pipeline.paci_predict));
          }
          if (s == 0) {
            Micro& m = live[f];
            m.batch = loader.next();
            m.acts = model.make_activations(m.batch.B, m.batch.T);
            model.load_inputs(*m.acts, train::BatchInputs(m.batch, c.data.attention_mask).inputs());
            model.forward_embedding(*m.acts);
          }
          Micro& m = live.at(f);
          m.versions.push_back(versions[i]);
          model.forward_blocks(*m.acts, bounds[i], bounds[i + 1]);
          if (s == P - 1) m.loss = model.forward_head(*m.acts);
          for (size_t j = 0; j < current.size(); ++j)
            std::copy(current[j].begin(), current[j].end(), params[i][j].value.f32());
          ++forwards[i];
          progress = true;
        } else if (b < f && (f - b == P - s || f == end) && (s == P - 1 || backwards[i + 1] > b)) {
          Micro& m = live.at(b);
          const bool stashed = c.pipeline.paci_stash && m.versions[i] != versions[i];
          if (stashed) swap_previous(i);
          if (s == P - 1) {
            model.backward_head(*m.acts, 1.0f);
            window_loss += m.loss;
          }
          model.backward_blocks(*m.acts, bounds[i], bounds[i + 1]);
          for (float w : m.batch.loss_mask) window_tokens[i] += w;
          if (s == 0) model.backward_embedding(*m.acts);
          if (stashed) swap_previous(i);
          if (s == 0) live.erase(b);
          if (s == P - 1 && (b + 1) % K == 0) {
            out.losses.push_back(window_loss / window_tokens[i]);
            window_loss = 0;
          }
          step_due[i] = (++backwards[i]) % K == 0;
          progress = true;
        }
      }
    }
    for (int s = 0; s < P; ++s) EXPECT_EQ(backwards[size_t(s)], end) << "stage " << s << " stalled";
  }
  for (const Parameter& p : model.parameters())
    out.weights[p.name] = std::vector<float>(p.value.f32(), p.value.f32() + p.value.numel());
  return out;
}

}  // namespace

TEST(PipelineTrain, FlushSchedulesEqualTheSingleProcessRunBitwise) {
  comm::Communicator& world = comm::world();
  const int P = world.size();
  train::Config c = pipeline_config(world, "tessel-pp-run");
  // The sample runs its windows through the stages; the single process through its KV
  // cache: logits equal to rounding, so the same tokens unless a draw sits on a near-tie.
  c.train.sample_tokens = 12;
  const Reference ref = single_process(c);
  ASSERT_FALSE(ref.result.sample.empty());
  bool clipped = false;
  for (const auto& s : ref.result.steps) clipped = clipped || s.grad_norm > c.train.grad_clip;
  EXPECT_TRUE(clipped);
  for (const std::string schedule : {"gpipe", "1f1b", "zb-h1"})
    // Balanced, explicit, and first and last stage without blocks.
    for (const std::string layout : {"", P == 2 ? "3,1" : "1,1,1,1", P == 2 ? "0,4" : "0,2,2,0"}) {
      SCOPED_TRACE(std::string(schedule) + ", layout '" + layout + "'");
      c.parallel.pp = P;
      c.pipeline.schedule = schedule;
      c.pipeline.layout = layout;
      c.run.dir = shared_temp_dir(world, "tessel-pp-run");
      const auto piped = expect_run_equals(world, c, ref);
      if (world.rank() != 0) continue;
      EXPECT_EQ(piped.sample, ref.result.sample);
      const auto records = pipeline_records(c.run.dir);
      ASSERT_EQ(records.size(), 8u);
      for (const auto& r : records) {
        ASSERT_EQ(r["stages"].size(), size_t(P));
        for (int s = 0; s < P; ++s) {
          EXPECT_EQ(r["stages"][s]["max_version_gap"], 0);
          // 1F1B keeps P - s micro-batches in flight at most, GPipe all M = 4, ZB-H1 P (with
          // the s whose W lags).
          EXPECT_EQ(r["stages"][s]["peak_live_activations"], schedule == "gpipe" ? 4
                                                             : schedule == "zb-h1"
                                                                 ? P
                                                                 : std::min(4, P - s));
          // The busy time is reported with its three parts; every stage does all three.
          const auto& st = r["stages"][s];
          const double parts = st["forward_seconds"].get<double>() +
                               st["backward_seconds"].get<double>() +
                               st["optimizer_seconds"].get<double>();
          EXPECT_NEAR(st["busy_seconds"].get<double>(), parts, 1e-12 + 1e-12 * parts);
          for (const char* part : {"forward_seconds", "backward_seconds", "optimizer_seconds"})
            EXPECT_GT(st[part].get<double>(), 0.0) << part;
          // ZB-H1's W ops, a part of the backward; the other schedules run none.
          const double w = st["weight_seconds"].get<double>();
          if (schedule == "zb-h1")
            EXPECT_TRUE(w > 0 && w < st["backward_seconds"].get<double>()) << w;
          else
            EXPECT_EQ(w, 0.0);
          // The flush step's global-norm all-reduce is timed apart from the step's own work.
          EXPECT_GT(st["sync_seconds"].get<double>(), 0.0);
        }
      }
    }
}

// Interleaved 1F1B (spec C2): each stage runs pipeline.chunks model chunks (stage s the
// virtual stages s, s + P, ..), so its blocks are not adjacent, yet the run equals the single
// process bitwise: losses, gradient norms, validation and the sample through the chunks, and
// the final weights each stage saves. Peak live chunk activations are those of the schedule's
// list; no backward is stale. A tied head (embedding on stage 0's chunk 0, head on the last
// stage's last chunk) follows to rounding, as over plain stages.
TEST(PipelineTrain, InterleavedChunksEqualTheSingleProcessRunBitwise) {
  comm::Communicator& world = comm::world();
  const int P = world.size();
  train::Config c = pipeline_config(world, "tessel-pp-inter");
  c.model.layers = 2 * P + 2;  // enough blocks for every middle virtual stage
  c.model.tied_head = false;
  c.train.sample_tokens = 12;
  const Reference ref = single_process(c);
  for (const int chunks : P == 2 ? std::vector<int>{2, 3} : std::vector<int>{2})
    for (const std::string& layout :
         {std::string(), std::string(chunks == 2 && P == 2 ? "0,3,3,0" : "")}) {
      SCOPED_TRACE(std::to_string(chunks) + " chunks, layout '" + layout + "'");
      c.parallel.pp = P;
      c.pipeline.schedule = "interleaved";
      c.pipeline.chunks = chunks;
      c.pipeline.layout = layout;
      c.run.dir = shared_temp_dir(world, "tessel-pp-inter");
      const auto piped = expect_run_equals(world, c, ref);
      if (world.rank() != 0) continue;
      EXPECT_EQ(piped.sample, ref.result.sample);
      const pipeline::ScheduleOptions list{pipeline::ScheduleKind::interleaved, P, 4, 1, 1, chunks};
      for (const auto& r : pipeline_records(c.run.dir))
        for (int s = 0; s < P; ++s) {
          int64_t live = 0, peak = 0;
          for (const pipeline::Op& op : pipeline::stage_ops(list, s))
            peak = std::max(peak, live += op.kind == pipeline::OpKind::forward    ? 1
                                          : op.kind == pipeline::OpKind::backward ? -1
                                                                                  : 0);
          EXPECT_EQ(r["stages"][s]["peak_live_activations"], peak) << "stage " << s;
          EXPECT_EQ(r["stages"][s]["max_version_gap"], 0);
        }
    }

  c.model.tied_head = true;
  const Reference tied = single_process(c);
  c.pipeline.chunks = 2;
  c.pipeline.layout.clear();
  c.run.dir = shared_temp_dir(world, "tessel-pp-inter");
  const auto piped = run_on(world, c);
  ASSERT_EQ(piped.steps.size(), tied.result.steps.size());
  for (size_t i = 0; i < piped.steps.size(); ++i)
    EXPECT_NEAR(piped.steps[i].loss, tied.result.steps[i].loss, 1e-5 * tied.result.steps[i].loss)
        << "step " << i + 1;
}

// model.attention_window reaches every stage's blocks: 1F1B over the stages with a 3-key window
// equals the single process with it, bitwise (and the window changes the run).
TEST(PipelineTrain, AnAttentionWindowOverStagesEqualsTheSingleProcessRun) {
  comm::Communicator& world = comm::world();
  train::Config c = pipeline_config(world, "tessel-pp-window");
  const Reference unwindowed = single_process(c);
  c.model.attention_window = 3;
  const Reference ref = single_process(c);
  EXPECT_NE(ref.result.steps.back().loss, unwindowed.result.steps.back().loss);
  expect_1f1b_equals(world, c, ref, "tessel-pp-window");
}

namespace {

// A 10-step run of `c` with a x1000 gradient spike injected at step kSpikeStep
// (fault.spike_step) and train.spike_factor = 5 over a window of 4, which skips it.
constexpr int64_t kSpikeStep = 7;
train::Config with_a_spike(train::Config c) {
  c.train.steps = 10;
  c.train.spike_factor = 5;
  c.train.spike_window = 4;
  c.fault.spike_step = kSpikeStep;
  return c;
}

// Step kSpikeStep of `r` was skipped, and no other.
void expect_only_the_spike_skipped(const train::TrainResult& r) {
  for (size_t i = 0; i < r.steps.size(); ++i)
    EXPECT_EQ(r.steps[i].skipped, int64_t(i) + 1 == kSpikeStep) << "step " << i + 1;
}

}  // namespace

// Gradient-spike skipping over flush schedules: an injected spike (fault.spike_step, x1000) is
// skipped on every stage, as one process skips it. GPipe, 1F1B, ZB-H1 and (on 2 ranks: 2 x 2
// virtual stages of the 4 blocks) interleaved 1F1B over the stages equal the single process
// bitwise; the spike step alone is skipped.
TEST(PipelineTrain, AGradientSpikeIsSkippedOnEveryStageAsInOneProcess) {
  comm::Communicator& world = comm::world();
  const train::Config c = with_a_spike(pipeline_config(world, "tessel-pp-spike"));
  const Reference ref = single_process(c);
  expect_only_the_spike_skipped(ref.result);
  for (const char* schedule : {"gpipe", "1f1b", "zb-h1", "interleaved"}) {
    if (std::string(schedule) == "interleaved" && world.size() != 2) continue;
    SCOPED_TRACE(schedule);
    train::Config piped = c;
    piped.parallel.pp = world.size();
    piped.pipeline.schedule = schedule;
    piped.run.dir = shared_temp_dir(world, "tessel-pp-spike");
    const auto r = run_on(world, piped);
    fixture::expect_same_steps(r, ref.result);
    expect_only_the_spike_skipped(r);
    fixture::expect_same_weights(fixture::final_weights(piped.run.dir), ref.weights);
  }
}

// The same with MoE blocks balanced by the sign bias: a skipped spike's expert loads must not
// move the bias on any stage (discard_balance), so 1F1B over the stages keeps the single
// process's losses, gradient norms and weights (the bias included) bitwise.
TEST(PipelineTrain, AGradientSpikeLeavesTheMoeBalanceOfEveryStageAlone) {
  comm::Communicator& world = comm::world();
  train::Config c = with_a_spike(pipeline_config(world, "tessel-pp-spike-moe"));
  for (const char* s : {"model.moe_layers=all", "model.moe_experts=4", "model.moe_top_k=2",
                        "model.moe_balance=bias", "model.moe_bias_rate=0.01"})
    train::apply_override(c, s);
  c.train.grad_clip = 0;
  const Reference ref = single_process(c);
  ASSERT_TRUE(ref.result.steps[kSpikeStep - 1].skipped);
  c.parallel.pp = world.size();
  c.pipeline.schedule = "1f1b";
  c.run.dir = shared_temp_dir(world, "tessel-pp-spike-moe");
  const auto r = run_on(world, c);
  fixture::expect_same_steps(r, ref.result, /*norms_too=*/true);
  expect_only_the_spike_skipped(r);
  fixture::expect_same_weights(fixture::final_weights(c.run.dir), ref.weights);
}

// A mixture's validation runs through the stages per data set: 1F1B over the stages on two
// data sets 1 : 3 equals the single process run, bitwise, each data set's loss included.
TEST(PipelineTrain, AMixtureOverStagesEqualsTheSingleProcessRun) {
  comm::Communicator& world = comm::world();
  train::Config c = pipeline_config(world, "tessel-pp-mixture");
  c.data.path += "," + fixture::shared_other_dataset(world);
  c.data.weights = "1,3";
  const Reference ref = single_process(c);
  ASSERT_EQ(ref.result.data_set_validation.size(), 2u);
  expect_1f1b_equals(world, c, ref, "tessel-pp-mixture");
}

// Activation recomputation inside each stage (train.recompute = blocks) changes nothing: GPipe,
// 1F1B and ZB-H1 (also with first and last stages that hold no block), and PACI with the stash
// (K = P - 1, so that backwards are stale and recompute against the stashed weights), give
// the same losses, norms, validation and weights bitwise.
TEST(PipelineTrain, RecomputationEqualsKeepingTheCachesBitwise) {
  comm::Communicator& world = comm::world();
  const int P = world.size();
  const std::string empty_ends = P == 2 ? "0,4" : "0,2,2,0";
  for (const auto& [schedule, layout] : {std::pair<std::string, std::string>{"gpipe", ""},
                                         {"1f1b", ""},
                                         {"1f1b", empty_ends},
                                         {"zb-h1", ""},
                                         {"zb-h1", empty_ends},
                                         {"paci", ""}}) {
    SCOPED_TRACE(schedule + ", layout '" + layout + "'");
    train::Config c = pipeline_config(world, "tessel-pp-recompute");
    c.parallel.pp = P;
    c.pipeline.schedule = schedule;
    c.pipeline.layout = layout;
    const bool paci = schedule == "paci";
    if (paci) {
      c.model.tied_head = false;
      c.pipeline.paci_stash = true;
      c.train.accum = P - 1;
    }
    const auto kept = run_on(world, c);
    const auto kept_weights = fixture::final_weights(c.run.dir);
    const std::string kept_dir = c.run.dir;
    c.train.recompute = model::Recompute::blocks;
    c.run.dir = shared_temp_dir(world, "tessel-pp-recompute");
    const auto recomputed = run_on(world, c);
    ASSERT_EQ(kept.steps.size(), size_t(c.train.steps));
    fixture::expect_same_steps(recomputed, kept);
    fixture::expect_same_weights(fixture::final_weights(c.run.dir), kept_weights);
    if (world.rank() != 0) continue;
    // Each stage reports its activation bytes: fewer with recomputation wherever a stage holds
    // more than one block (2 of the 4 blocks each on 2 ranks; one each on 4 ranks) or has had
    // more than one micro-batch in flight (they share the one block cache).
    const auto kept_records = pipeline_records(kept_dir);
    const auto records = pipeline_records(c.run.dir);
    ASSERT_EQ(records.size(), kept_records.size());
    int64_t max_gap = 0;
    for (const auto& r : records)
      max_gap = std::max(max_gap, r["stages"][0]["max_version_gap"].get<int64_t>());
    EXPECT_EQ(max_gap, paci ? 1 : 0);  // PACI's first stage ran stale backwards
    if (!layout.empty()) continue;
    for (int s = 0; s < P; ++s) {
      const auto& stage = records.back()["stages"][s];
      const auto before = kept_records.back()["stages"][s]["activation_bytes"].get<int64_t>();
      const auto after = stage["activation_bytes"].get<int64_t>();
      EXPECT_GT(after, 0);
      if (P == 2 || stage["peak_live_activations"].get<int64_t>() > 1)
        EXPECT_LT(after, before) << "stage " << s;
      else
        EXPECT_EQ(after, before) << "stage " << s;
    }
  }
}

// SFT over the stages: a 1F1B pipeline fine-tuned on packed samples from a single-process
// checkpoint (train.init_from: each stage takes its own tensors) equals the single-process
// fine-tuning bitwise.
TEST(PipelineTrain, SftFromACheckpointEqualsTheSingleProcessRun) {
  comm::Communicator& world = comm::world();
  train::Config c = pipeline_config(world, "tessel-pp-sft");
  c.model.max_seq = c.train.seq_len = 128;  // room for a reply after the prompt
  c.train.accum = 2;
  const Reference base = single_process(c);
  c.data.path = fixture::shared_sft_dataset(world);
  c.train.init_from = base.dir;
  const Reference ref = single_process(c);
  expect_1f1b_equals(world, c, ref, "tessel-pp-sft");
}

TEST(PipelineTrain, TiedHeadOverStagesFollowsTheSingleProcessRun) {
  // The tied weight's two gradient parts are summed in another order than one process
  // accumulates them, so only rounding may differ.
  comm::Communicator& world = comm::world();
  train::Config c = pipeline_config(world, "tessel-pp-tied");
  c.model.tied_head = true;
  const Reference ref = single_process(c);
  c.parallel.pp = world.size();
  for (const char* schedule : {"1f1b", "zb-h1"}) {
    SCOPED_TRACE(schedule);
    c.pipeline.schedule = schedule;
    c.run.dir = shared_temp_dir(world, "tessel-pp-tied");
    const auto piped = run_on(world, c);
    ASSERT_EQ(piped.steps.size(), ref.result.steps.size());
    for (size_t i = 0; i < piped.steps.size(); ++i)
      EXPECT_NEAR(piped.steps[i].loss, ref.result.steps[i].loss, 1e-5 * ref.result.steps[i].loss)
          << "step " << i + 1;
    const auto weights = fixture::final_weights(c.run.dir);
    for (const auto& [name, values] : ref.weights)
      for (size_t i = 0; i < values.size(); ++i)
        ASSERT_NEAR(weights.at(name)[i], values[i], 1e-4) << name << "[" << i << "]";
  }
}

TEST(PipelineTrain, StagesTimesDataParallelEqualThePlainDataParallelRun) {
  comm::Communicator& world = comm::world();
  if (world.size() != 4) GTEST_SKIP() << "pp = 2 x dp = 2 needs 4 ranks";
  auto half = world.split(world.rank() / 2, world.rank());
  // AdamW, and Muon whose sharded update is collective over each stage's dp group.
  for (const char* optimizer : {"adamw", "muon"}) {
    train::Config c = pipeline_config(world, "tessel-ppdp-run");
    c.optim.name = optimizer;
    // The plain dp = 2 run on each half of the world.
    train::Config plain = c;
    plain.run.dir = shared_temp_dir(*half, "tessel-ppdp-ref");
    const auto ref = run_on(*half, plain);
    const auto ref_weights = fixture::final_weights(plain.run.dir);
    for (const char* schedule : {"gpipe", "1f1b", "zb-h1", "interleaved"}) {
      SCOPED_TRACE(std::string(optimizer) + ", " + schedule);
      c.parallel.pp = 2;
      c.pipeline.schedule = schedule;
      c.run.dir = shared_temp_dir(world, "tessel-ppdp-run");
      const auto piped = run_on(world, c);
      fixture::expect_same_steps(piped, ref);
      fixture::expect_same_weights(fixture::final_weights(c.run.dir), ref_weights);
    }
  }
}

// Context parallelism inside the stages: each stage runs its cp rank's chunks of every
// micro-batch, so GPipe, 1F1B and ZB-H1 over the stages equal the plain cp run bitwise (losses,
// norms, validation through the stages, weights), with the causal mask and zigzag chunks and
// with the causal-document mask and the per-micro-batch balanced layout, and with MoE blocks
// (EQB + LEI and the z-loss: their sums over dp x cp and cp; the MoE records of GPipe and 1F1B
// equal); PACI drained after every window equals it too, but for its per-stage norms. np 2: pp 1
// (schedule set) x cp 2; np 4: pp 2 x cp 2, also interleaved (2 chunks per stage).
TEST(PipelineTrain, StagesTimesContextParallelEqualThePlainContextParallelRun) {
  comm::Communicator& world = comm::world();
  auto pair = world.split(world.rank() / 2, world.rank());  // the plain cp runs: 2 ranks each
  struct Case {
    train::AttentionMaskKind mask;
    train::CpLayoutKind layout;
    bool moe;
  };
  const Case cases[] = {
      {train::AttentionMaskKind::causal, train::CpLayoutKind::zigzag, false},
      {train::AttentionMaskKind::causal_document, train::CpLayoutKind::balanced, false},
      {train::AttentionMaskKind::causal_document, train::CpLayoutKind::zigzag, true}};
  for (const auto& [mask, layout, moe] : cases) {
    SCOPED_TRACE(std::to_string(int(layout)) + (moe ? ", MoE" : ""));
    train::Config c = pipeline_config(world, "tessel-ppcp-run");
    if (moe)
      for (const char* s : {"model.moe_layers=all", "model.moe_experts=4", "model.moe_top_k=2",
                            "model.moe_balance=eqb_lei", "model.moe_z_coeff=0.001"})
        train::apply_override(c, s);
    c.data.attention_mask = mask;
    c.parallel.cp = 2;
    c.parallel.cp_layout = layout;
    c.train.grad_clip = 0;      // PACI clips per stage: compare without clipping
    c.train.eval_every = 1;     // PACI drains at every validation
    c.train.sample_tokens = 8;  // generated through the stages of the first replica
    train::Config plain = c;
    plain.run.dir = shared_temp_dir(*pair, "tessel-ppcp-ref");
    const auto ref = run_on(*pair, plain);
    const auto ref_weights = fixture::final_weights(plain.run.dir);
    for (const char* schedule : {"gpipe", "1f1b", "zb-h1", "paci", "interleaved"}) {
      if (world.size() / 2 < 2 && std::string(schedule) == "interleaved") continue;  // pp >= 2
      SCOPED_TRACE(schedule);
      c.parallel.pp = world.size() / 2;
      c.pipeline.schedule = schedule;
      c.run.dir = shared_temp_dir(world, "tessel-ppcp-run");
      const auto piped = run_on(world, c);
      // PACI's norm combines the stages' own.
      const bool flush = std::string(schedule) != "paci";
      fixture::expect_same_steps(piped, ref, flush);
      fixture::expect_same_weights(fixture::final_weights(c.run.dir), ref_weights);
      if (world.rank() == 0) {
        EXPECT_FALSE(ref.sample.empty());
        EXPECT_EQ(piped.sample, ref.sample);
        if (moe && flush) {  // the balance statistics, summed over the cp ranks too
          EXPECT_EQ(moe_records(c.run.dir), moe_records(plain.run.dir));
        }
      }
    }
  }
}

// MoE blocks in the stages, their experts sharded over ep as without pipeline (dense
// gradients over dp, experts over edp): GPipe, 1F1B and PACI drained after every window give
// the plain run's losses, validation losses and weights bitwise, its sample (the plain run's
// through the KV cache, equal to rounding), and (but PACI, whose norms are per stage) its
// gradient norms bitwise (both add each parameter's sum of squares in registry order, an
// expert's summed over ep first). Uneven validation batches over dp keep each ep group in step
// (idle rounds). np 2: pp 2 against one process; np 4: pp 2 x dp 2 with ep 2 against the plain
// dp 2 x ep 2 run; the step and validation records' MoE statistics are the plain run's.
// Interleaved (2 chunks per stage) too, plain and with recomputation.
// Also with MoE in the last stage only (1F1B), on SFT data (1F1B: each stage leaves the
// padding out of its MoE blocks), with activation recomputation (GPipe, 1F1B and ZB-H1: the
// micro-batches in flight share the one block cache, rebuilt through the token exchange; ZB-H1's
// W reads its own copies of the cache),
// and undrained PACI's per-window statistics.
TEST(PipelineTrain, MoeStagesEqualThePlainExpertParallelRun) {
  comm::Communicator& world = comm::world();
  struct Case {
    const char* moe_layers;  // "3": only the last stage has MoE blocks; all ranks still sample
    std::vector<const char*> schedules;
    bool sft, recompute;
  };
  const Case cases[] = {{"all", {"gpipe", "1f1b", "paci", "interleaved"}, false, false},
                        {"3", {"1f1b"}, false, false},
                        {"all", {"1f1b"}, true, false},
                        {"all", {"gpipe", "1f1b", "zb-h1", "interleaved"}, false, true}};
  for (const auto& [moe_layers, schedules, sft, recompute] : cases) {
    SCOPED_TRACE(std::string("moe_layers = ") + moe_layers + (sft ? ", SFT" : "") +
                 (recompute ? ", recompute" : ""));
    train::Config c = pipeline_config(world, "tessel-ppmoe-run");
    if (sft) {
      c.data.path = fixture::shared_sft_dataset(world);
      c.model.max_seq = c.train.seq_len = 128;
    }
    for (const char* s : {"model.moe_experts=4", "model.moe_top_k=2", "model.moe_shared=8",
                          "model.moe_balance=eqb_lei"})
      train::apply_override(c, s);
    c.model.moe_layers = moe_layers;
    if (recompute) c.train.recompute = model::Recompute::blocks;  // in the plain run too
    c.parallel.ep = world.size() / 2;
    c.train.grad_clip = 0;                      // PACI clips per stage: compare without clipping
    c.train.eval_every = 1;                     // PACI drains at every validation
    c.train.eval_sequences = world.size() + 1;  // np 4: 2 batches on dp rank 0, 1 on dp rank 1
    c.train.sample_tokens = 8;
    train::TrainResult ref;
    std::map<std::string, std::vector<float>> ref_weights;
    std::string ref_dir;
    if (world.size() == 2) {
      const Reference one = single_process(c);
      ref = one.result;
      ref_weights = one.weights;
      ref_dir = one.dir;
    } else {
      auto pair = world.split(world.rank() / 2, world.rank());
      train::Config plain = c;
      plain.run.dir = shared_temp_dir(*pair, "tessel-ppmoe-ref");
      ref = run_on(*pair, plain);
      ref_weights = fixture::final_weights(plain.run.dir);
      ref_dir = plain.run.dir;
    }
    ASSERT_EQ(ref.steps.size(), 8u);
    for (const char* schedule : schedules) {
      SCOPED_TRACE(schedule);
      c.parallel.pp = 2;
      c.pipeline.schedule = schedule;
      c.run.dir = shared_temp_dir(world, "tessel-ppmoe-run");
      const auto piped = run_on(world, c);
      // PACI's norm combines the stages' own.
      fixture::expect_same_steps(piped, ref, /*norms_too=*/std::string(schedule) != "paci");
      fixture::expect_same_weights(fixture::final_weights(c.run.dir), ref_weights);
      if (world.rank() == 0) {
        EXPECT_FALSE(ref.sample.empty());
        EXPECT_EQ(piped.sample, ref.sample);
        // The balance statistics of every step and validation, each block from its stage:
        // the same forwards in the same order, so the same numbers.
        const auto ref_moe = moe_records(ref_dir);
        EXPECT_EQ(ref_moe.size(), 16u);  // 8 steps, 8 validations
        EXPECT_EQ(moe_records(c.run.dir), ref_moe);
        // Export lists the parameters in the model's order, not in the stages' and ep
        // ranks' writing order.
        const std::string out = fixture::temp_dir("tessel-ppmoe-export");
        train::export_checkpoint(c.run.dir, out);
        std::vector<std::string> names, want;
        for (const auto& t : train::read_safetensors(out + "/model.safetensors").tensors)
          names.push_back(t.name);
        const model::Gpt model(c.model, 0);
        for (const Parameter& p : model.parameters()) want.push_back(p.name);
        EXPECT_EQ(names, want);
      }
    }
  }
  // Undrained PACI, horizons of 4 windows: each window's record counts the routing of its
  // own forwards only (top-k assignments of its K micro-batches on every dp rank).
  train::Config c = pipeline_config(world, "tessel-ppmoe-paci");
  for (const char* s : {"model.moe_layers=all", "model.moe_experts=4", "model.moe_top_k=2",
                        "model.moe_balance=eqb_lei"})
    train::apply_override(c, s);
  c.parallel.pp = 2;
  c.parallel.ep = world.size() / 2;
  c.pipeline.schedule = "paci";
  run_on(world, c);
  if (world.rank() != 0) return;
  const double per_window = double(c.model.moe.top_k * c.train.micro_batch * c.train.seq_len *
                                   train::micro_batches_per_step(c) * (world.size() / 2));
  int64_t windows = 0;
  for (const nlohmann::json& r : moe_records(c.run.dir)) {
    if (r["validation"].get<bool>()) continue;
    ++windows;
    ASSERT_EQ(r["moe"].size(), 4u);
    for (const auto& block : r["moe"]) {
      double loads = 0;
      for (const auto& l : block["loads"]) loads += l.get<double>();
      EXPECT_EQ(loads, per_window) << "step " << r["step"] << ", block " << block["layer"];
    }
  }
  EXPECT_EQ(windows, c.train.steps);
}

TEST(PipelineTrain, PaciDrainedAfterEveryWindowEquals1F1B) {
  comm::Communicator& world = comm::world();
  train::Config c = pipeline_config(world, "tessel-paci-run");
  c.parallel.pp = world.size();
  c.train.grad_clip = 0;  // PACI clips per stage, 1F1B globally: compare without clipping
  c.pipeline.schedule = "1f1b";
  c.train.eval_every = 1;  // PACI below drains at every validation
  const auto flush = run_on(world, c);
  const auto flush_weights = fixture::final_weights(c.run.dir);

  c.pipeline.schedule = "paci";  // K = train.accum
  c.run.dir = shared_temp_dir(world, "tessel-paci-run");
  auto drained = run_on(world, c);
  fixture::expect_same_steps(drained, flush, /*norms_too=*/false);
  fixture::expect_same_weights(fixture::final_weights(c.run.dir), flush_weights);

  // Undrained, the first window still equals 1F1B's first step; later forwards on the
  // first stages run on newer weights: gap ceil((P - 1 - s) / K) with K = 4.
  c.train.eval_every = 0;
  c.run.dir = shared_temp_dir(world, "tessel-paci-run");
  const auto paci = run_on(world, c);
  ASSERT_EQ(paci.steps.size(), flush.steps.size());
  EXPECT_EQ(paci.steps[0].loss, flush.steps[0].loss);
  EXPECT_NE(paci.steps.back().loss, flush.steps.back().loss);
  if (world.rank() == 0) {
    const auto records = pipeline_records(c.run.dir);
    ASSERT_EQ(records.size(), 8u);
    const int P = world.size();
    for (int s = 0; s < P; ++s) {
      EXPECT_EQ(records.back()["stages"][s]["max_version_gap"], (P - 1 - s + 3) / 4) << s;
      EXPECT_EQ(records.back()["stages"][s]["peak_live_activations"], P - s) << s;
    }
    EXPECT_EQ(records.back()["horizon"], nlohmann::json::array({1, 8}));
  }
}

TEST(PipelineTrain, PaciEqualsItsSequentialReferenceBitwise) {
  // K = 1 (every backward of all but the last stage inconsistent, gap up to P - 1) and
  // K = 2, with Muon (the demo's optimizer) and AdamW; the stash at K = P - 1 (gap 1); the
  // prediction (a whole step per step of gap, half for AdamW) at K = 1 (np 4: gaps 2 and 3
  // extrapolate further) and K = P - 1.
  // Drained at each validation (every 4 windows), clipped per stage.
  comm::Communicator& world = comm::world();
  const int P = world.size();
  struct Case {
    const char* optimizer;
    int64_t K;
    const char* stale;  // "", "stash" or "predict"
  };
  for (const Case& run :
       {Case{"muon", 1, ""}, Case{"muon", 2, ""}, Case{"adamw", 1, ""}, Case{"adamw", 2, ""},
        Case{"muon", P - 1, "stash"}, Case{"adamw", P - 1, "stash"}, Case{"muon", 1, "predict"},
        Case{"muon", P - 1, "predict"}, Case{"adamw", P - 1, "predict"}}) {
    const int64_t K = run.K;
    const std::string stale = run.stale;
    SCOPED_TRACE(std::string(run.optimizer) + ", K = " + std::to_string(K) + ", " + stale);
    train::Config c = pipeline_config(world, "tessel-paci-ref");
    c.parallel.pp = P;
    c.pipeline.schedule = "paci";
    c.pipeline.paci_stash = stale == "stash";
    c.pipeline.paci_predict = stale != "predict"                     ? 0.0
                              : run.optimizer == std::string("muon") ? 1.0
                                                                     : 0.5;
    c.train.accum = K;
    c.train.eval_every = 4;
    c.optim.name = run.optimizer;
    const auto paci = run_on(world, c);
    const PaciReference ref = paci_reference(c);
    if (!stale.empty()) {  // the stash or the prediction changes what the run computes
      c.pipeline.paci_stash = false;
      c.pipeline.paci_predict = 0;
      EXPECT_NE(paci_reference(c).weights, ref.weights);
    }
    ASSERT_EQ(paci.steps.size(), ref.losses.size());
    bool clipped = false;
    for (size_t i = 0; i < paci.steps.size(); ++i) {
      EXPECT_EQ(paci.steps[i].loss, ref.losses[i]) << "window " << i + 1;
      double squares = 0;
      for (double n : ref.stage_norms[i]) squares += n * n;
      // The trainer adds the same squares in the same order; only its rounding may differ
      // (the compiler may fuse a multiply-add in one translation unit and not the other).
      EXPECT_NEAR(paci.steps[i].grad_norm, std::sqrt(squares), 1e-14 * std::sqrt(squares))
          << "window " << i + 1;
      for (double n : ref.stage_norms[i]) clipped = clipped || n > c.train.grad_clip;
    }
    EXPECT_TRUE(clipped);
    fixture::expect_same_weights(fixture::final_weights(c.run.dir), ref.weights);
    if (world.rank() != 0) continue;
    // Each stage's norm bitwise; the comparison covers inconsistent backwards: stage 0's
    // largest gap is ceil((P - 1) / K).
    const auto records = pipeline_records(c.run.dir);
    ASSERT_EQ(records.size(), paci.steps.size());
    int64_t max_gap = 0;
    for (size_t i = 0; i < records.size(); ++i) {
      for (int s = 0; s < P; ++s)
        EXPECT_EQ(records[i]["stages"][s]["grad_norm"].get<double>(), ref.stage_norms[i][size_t(s)])
            << "window " << i + 1 << ", stage " << s;
      max_gap = std::max(max_gap, records[i]["stages"][0]["max_version_gap"].get<int64_t>());
    }
    EXPECT_EQ(max_gap, (P - 1 + K - 1) / K);
  }
}

// Dense over pp = world, and MoE over pp 2 (np 4: x dp 2 with ep 2, each expert's weights and
// optimizer state written by the rank holding it). PACI also with the weight prediction,
// which extrapolates only along steps taken since the last drain, so the resumed run, which
// has not seen the step before the checkpoint, predicts as the uninterrupted one.
TEST(PipelineTrain, ResumeContinuesBitwise) {
  comm::Communicator& world = comm::world();
  for (const bool moe : {false, true})
    for (const std::string variant : {"1f1b", "paci", "paci predict"}) {
      SCOPED_TRACE(variant + (moe ? ", MoE" : ""));
      const std::string schedule = variant.substr(0, variant.find(' '));
      train::Config c = pipeline_config(world, "tessel-pp-resume");
      c.parallel.pp = world.size();
      if (moe) {
        // With a shared expert, registered after the experts but stored before them.
        for (const char* s : {"model.moe_layers=all", "model.moe_experts=4", "model.moe_top_k=2",
                              "model.moe_balance=eqb_lei", "model.moe_shared=32"})
          train::apply_override(c, s);
        c.parallel.pp = 2;
        c.parallel.ep = world.size() / 2;
      }
      c.pipeline.schedule = schedule;
      c.pipeline.paci_predict = variant == "paci predict" ? 1.0 : 0.0;
      c.train.eval_every = 0;
      c.train.checkpoint_every = 4;
      const std::string run = c.run.dir;
      const auto full = fixture::expect_resume_continues_bitwise(
          world, c, 4, [&] { fs::remove_all(run + "/checkpoints/step-00000008"); });
      EXPECT_EQ(full.steps.size(), 8u);
    }
}

namespace {

// A copy of `run_dir` without its checkpoints after step `step` (a run directory that resumes
// from step `step`), made by rank 0 and known to every rank.
std::string copy_to_resume(comm::Communicator& world, const std::string& run_dir, int64_t step) {
  const std::string copy = shared_temp_dir(world, "tessel-pp-resplit-copy");
  if (world.rank() == 0) {
    fs::copy(run_dir, copy, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
    char kept[32];
    std::snprintf(kept, sizeof kept, "step-%08lld", static_cast<long long>(step));
    for (const auto& e : fs::directory_iterator(copy + "/checkpoints"))
      if (e.is_directory() && e.path().filename().string() > kept) fs::remove_all(e.path());
  }
  world.barrier();
  return copy;
}

// `c` without a pipeline.
train::Config without_pipeline(train::Config c) {
  c.parallel.pp = 1;
  c.pipeline.schedule.clear();
  c.pipeline.layout.clear();
  return c;
}

// `c` resumed without a pipeline on one process (rank 0; the others wait) from a copy of
// `run_dir` cut at step 4: rank 0's result (the others' is empty) and its run directory.
struct OneProcessResume {
  train::TrainResult result;
  std::string run_dir;
};
OneProcessResume resume_on_one_process(comm::Communicator& world, const train::Config& c,
                                       const std::string& run_dir) {
  train::Config one = without_pipeline(c);
  one.run.dir = copy_to_resume(world, run_dir, 4);
  OneProcessResume r{{}, one.run.dir};
  if (world.rank() == 0) {
    comm::SingleCommunicator self;
    r.result = run_on(self, one);
  }
  world.barrier();
  return r;
}

// `resumed`, run from `full`'s checkpoint of step `step` into `run_dir`, repeats `full` bitwise
// from there: losses, norms, validation and final weights.
void expect_continues(const train::TrainResult& resumed, const std::string& run_dir,
                      const train::TrainResult& full,
                      const std::map<std::string, std::vector<float>>& full_weights,
                      int64_t step = 4) {
  EXPECT_EQ(resumed.resumed_from, step);
  fixture::expect_same_steps(resumed, fixture::after_step(full, step));
  fixture::expect_same_weights(fixture::final_weights(run_dir), full_weights);
}

}  // namespace

// Spike skipping with resume and with dp: a 1F1B run over P stages saved at step kSpikeStep - 1
// resumes as the uninterrupted run and still skips the spike (only the checkpointed window of
// norms can decide it: without it the spike would be applied); np 4 also: 1F1B over pp 2 x dp 2
// equals the plain dp 2 run on each half of the world bitwise, the spike step alone skipped.
TEST(PipelineTrain, SpikeSkippingResumesAndComposesWithDataParallel) {
  comm::Communicator& world = comm::world();
  train::Config c = with_a_spike(pipeline_config(world, "tessel-pp-spike-resume"));
  c.parallel.pp = world.size();
  c.pipeline.schedule = "1f1b";
  c.train.checkpoint_every = kSpikeStep - 1;
  const auto full = run_on(world, c);
  expect_only_the_spike_skipped(full);
  train::Config resumed = c;
  resumed.run.dir = copy_to_resume(world, c.run.dir, kSpikeStep - 1);
  const auto continued = run_on(world, resumed);
  expect_continues(continued, resumed.run.dir, full, fixture::final_weights(c.run.dir),
                   kSpikeStep - 1);
  ASSERT_FALSE(continued.steps.empty());
  EXPECT_EQ(continued.steps.front().skipped, 1);  // step kSpikeStep, the first after the resume

  if (world.size() != 4) return;
  auto half = world.split(world.rank() / 2, world.rank());
  train::Config plain = with_a_spike(pipeline_config(world, "tessel-ppdp-spike"));
  plain.run.dir = shared_temp_dir(*half, "tessel-ppdp-spike-ref");
  const auto ref = run_on(*half, plain);
  train::Config wide = plain;
  wide.parallel.pp = 2;
  wide.pipeline.schedule = "1f1b";
  wide.run.dir = shared_temp_dir(world, "tessel-ppdp-spike");
  const auto piped = run_on(world, wide);
  fixture::expect_same_steps(piped, ref);
  expect_only_the_spike_skipped(piped);
  fixture::expect_same_weights(fixture::final_weights(wide.run.dir),
                               fixture::final_weights(plain.run.dir));
}

// A checkpoint resumes under another stage split (docs/training.md section 6). The stages'
// optimizers save their state as "stage<s>/..." with the split in the compatibility record
// (the format older tessel wrote, and reads back under the same split); a resume finds each
// tensor by its name without the stage. Untied head, so GPipe and 1F1B over any split equal
// the single process bitwise: with Muon (the demo's optimizer) and AdamW, a 1F1B run over
// pp = P stages saved at step 4 continues bitwise as the uninterrupted run when resumed on one
// process (pp = 1), and under another layout at pp = P as ZB-H1; a single-process checkpoint does
// so under GPipe over P stages; np 2 also as interleaved 1F1B, and an interleaved run's
// checkpoint as 1F1B. np 4 also: pp 2 x dp 2, Muon's momentum in ZeRO-1 row shards of
// each stage's dp group, resumes as plain dp 2 on two ranks, and plain dp 2 as pp 2 x dp 2
// under another layout.
TEST(PipelineTrain, ResumesWithAnotherStageSplitBitwise) {
  comm::Communicator& world = comm::world();
  const int P = world.size();
  comm::SingleCommunicator self;
  const std::string layout = P == 2 ? "3,1" : "1,1,1,1", other = P == 2 ? "1,3" : "0,2,2,0";
  for (const char* optimizer : {"muon", "adamw"}) {
    SCOPED_TRACE(optimizer);
    train::Config c = pipeline_config(world, "tessel-pp-resplit");
    c.optim.name = optimizer;
    c.train.checkpoint_every = 4;
    c.parallel.pp = P;
    c.pipeline.schedule = "1f1b";
    c.pipeline.layout = layout;
    const auto full = run_on(world, c);
    const auto weights = fixture::final_weights(c.run.dir);
    if (world.rank() == 0) {
      nlohmann::json manifest;
      std::ifstream(c.run.dir + "/checkpoints/step-00000004/manifest.json") >> manifest;
      for (const auto& name : manifest["tensors"]["optimizer"])
        EXPECT_EQ(name.get<std::string>().rfind("stage", 0), 0u) << name;
      EXPECT_EQ(manifest["state"]["compatibility"]
                        ["pipeline stage boundaries (parallel.pp, pipeline.layout)"],
                nlohmann::json(train::pipeline_boundaries(c)));
    }

    const auto one = resume_on_one_process(world, c, c.run.dir);
    if (world.rank() == 0) expect_continues(one.result, one.run_dir, full, weights);

    train::Config relaid = c;  // and another flush schedule
    relaid.pipeline.layout = other;
    relaid.pipeline.schedule = "zb-h1";
    relaid.run.dir = copy_to_resume(world, c.run.dir, 4);
    expect_continues(run_on(world, relaid), relaid.run.dir, full, weights);

    if (P == 2) {                     // 2 x 2 virtual stages for the 4 blocks (4 x 2 would need 6)
      train::Config interleaved = c;  // its chunks hold blocks of both 1F1B stages
      interleaved.pipeline.schedule = "interleaved";
      interleaved.pipeline.layout = "1,1,1,1";
      interleaved.run.dir = copy_to_resume(world, c.run.dir, 4);
      expect_continues(run_on(world, interleaved), interleaved.run.dir, full, weights);
      // And back: an interleaved run's checkpoint (chunks recorded beside the boundaries, which
      // pp 4 x 1F1B could repeat) continues as 1F1B.
      interleaved.run.dir = shared_temp_dir(world, "tessel-pp-resplit");
      const auto interleaved_full = run_on(world, interleaved);
      fixture::expect_same_steps(interleaved_full, full);
      if (world.rank() == 0) {
        nlohmann::json manifest;
        std::ifstream(interleaved.run.dir + "/checkpoints/step-00000004/manifest.json") >> manifest;
        EXPECT_EQ(manifest["state"]["compatibility"]["pipeline chunks per stage (pipeline.chunks)"],
                  2);
      }
      train::Config back = c;
      back.run.dir = copy_to_resume(world, interleaved.run.dir, 4);
      expect_continues(run_on(world, back), back.run.dir, full, weights);
    }

    train::Config single = without_pipeline(c);
    single.run.dir = shared_temp_dir(world, "tessel-pp-resplit");
    if (world.rank() == 0) run_on(self, single);
    world.barrier();
    train::Config gpipe = relaid;
    gpipe.pipeline.schedule = "gpipe";
    gpipe.run.dir = copy_to_resume(world, single.run.dir, 4);
    expect_continues(run_on(world, gpipe), gpipe.run.dir, full, weights);

    if (P != 4) continue;
    auto half = world.split(world.rank() < 2 ? 0 : 1, world.rank());
    train::Config wide = c;  // pp 2 x dp 2: the global batch of plain dp 2
    wide.parallel.pp = 2;
    wide.pipeline.layout = "3,1";
    wide.run.dir = shared_temp_dir(world, "tessel-pp-resplit");
    const auto wide_full = run_on(world, wide);
    const auto wide_weights = fixture::final_weights(wide.run.dir);
    if (world.rank() == 0 && std::string(optimizer) == "muon") {
      nlohmann::json manifest;
      std::ifstream(wide.run.dir + "/checkpoints/step-00000004/manifest.json") >> manifest;
      EXPECT_FALSE(manifest["shards"].empty());  // not ASSERT: the other ranks go on to collectives
      for (const auto& shard : manifest["shards"])
        EXPECT_EQ(shard["name"].get<std::string>().rfind("stage", 0), 0u) << shard["name"];
    }
    train::Config plain = without_pipeline(wide);
    plain.run.dir = copy_to_resume(world, wide.run.dir, 4);
    if (world.rank() < 2)
      expect_continues(run_on(*half, plain), plain.run.dir, wide_full, wide_weights);
    world.barrier();
    plain.run.dir = shared_temp_dir(world, "tessel-pp-resplit");
    if (world.rank() < 2) run_on(*half, plain);
    world.barrier();
    wide.pipeline.layout = "1,3";
    wide.run.dir = copy_to_resume(world, plain.run.dir, 4);
    expect_continues(run_on(world, wide), wide.run.dir, wide_full, wide_weights);
  }
}

// PACI saves at a drain, where every stage has taken one step per window and no backward is
// in flight: its state is one consistent version, whichever stage holds it. A PACI checkpoint
// over pp = P stages resumed on one process continues bitwise as the same checkpoint resumed
// by 1F1B under its own split (the schedule may change at a resume), so the re-split loses
// nothing; the uninterrupted PACI run itself cannot be matched by another split, whose
// stages' staleness and clipping differ.
TEST(PipelineTrain, APaciCheckpointResumesOnOneProcessAsUnderItsOwnSplit) {
  comm::Communicator& world = comm::world();
  train::Config c = pipeline_config(world, "tessel-paci-resplit");
  c.parallel.pp = world.size();
  c.pipeline.schedule = "paci";
  c.train.eval_every = 0;
  c.train.checkpoint_every = 4;
  run_on(world, c);
  train::Config flush = c;
  flush.pipeline.schedule = "1f1b";
  flush.run.dir = copy_to_resume(world, c.run.dir, 4);
  const auto own_split = run_on(world, flush);
  const auto own_weights = fixture::final_weights(flush.run.dir);
  EXPECT_EQ(own_split.resumed_from, 4);
  const auto one = resume_on_one_process(world, flush, c.run.dir);
  if (world.rank() != 0) return;
  EXPECT_EQ(one.result.resumed_from, 4);
  fixture::expect_same_steps(one.result, own_split);
  fixture::expect_same_weights(fixture::final_weights(one.run_dir), own_weights);
}

// A tied head's checkpoint over pp = P stages (the embedding's optimizer state on the first
// stage) resumed on one process follows the uninterrupted pipeline run to rounding, as that run
// follows the single process (TiedHeadOverStagesFollowsTheSingleProcessRun: the tied weight's
// two gradient parts are summed in another order, 1e-5 relative on the loss over these few
// steps; a lost or misplaced state tensor moves it by far more).
TEST(PipelineTrain, ATiedHeadCheckpointResumesOnOneProcessToRounding) {
  comm::Communicator& world = comm::world();
  train::Config c = pipeline_config(world, "tessel-pp-tied-resplit");
  c.model.tied_head = true;
  c.parallel.pp = world.size();
  c.train.checkpoint_every = 4;
  const auto full = run_on(world, c);
  const auto one = resume_on_one_process(world, c, c.run.dir);
  if (world.rank() == 0) fixture::expect_follows_to_rounding(one.result, full, 4);
}

// An MoE block's expert state moves with its block: block 1's experts (and the expert
// optimizer's step counters) live on stage 0 under layout "3,1" and on stage 1 under "1,3"
// (np 4: ep 2, each expert's state saved by the rank holding it). 1F1B resumed under the other
// layout, and on np 2 also on one process, continues the uninterrupted run: losses, gradient
// norms, validation and weights bitwise, with clipping.
TEST(PipelineTrain, AnExpertsStateMovesWithItsBlockUnderAnotherSplit) {
  comm::Communicator& world = comm::world();
  train::Config c = pipeline_config(world, "tessel-ppmoe-resplit");
  for (const char* s : {"model.moe_experts=4", "model.moe_top_k=2", "model.moe_balance=eqb_lei"})
    train::apply_override(c, s);
  c.model.moe_layers = "1";
  c.parallel.pp = 2;
  c.parallel.ep = world.size() / 2;
  c.pipeline.schedule = "1f1b";
  c.pipeline.layout = "3,1";
  c.train.grad_clip = 0.5;  // below the norms, so that every step clips
  c.train.checkpoint_every = 4;
  const auto full = run_on(world, c);
  const auto weights = fixture::final_weights(c.run.dir);
  auto expect_continues_moe = [&](const train::TrainResult& resumed, const std::string& dir) {
    EXPECT_EQ(resumed.resumed_from, 4);
    const auto rest = fixture::after_step(full, 4);
    fixture::expect_same_steps(resumed, rest, /*norms_too=*/true);
    for (const auto& step : full.steps) EXPECT_GT(step.grad_norm, c.train.grad_clip);
    fixture::expect_same_weights(fixture::final_weights(dir), weights);
  };
  train::Config relaid = c;
  relaid.pipeline.layout = "1,3";
  relaid.run.dir = copy_to_resume(world, c.run.dir, 4);
  expect_continues_moe(run_on(world, relaid), relaid.run.dir);
  if (world.size() != 2) return;
  const auto one = resume_on_one_process(world, c, c.run.dir);
  if (world.rank() == 0) expect_continues_moe(one.result, one.run_dir);
}

// Stages that took different numbers of optimizer steps (no tessel schedule saves so: each
// saves where every stage has stepped once per step or window; the checkpoint is rewritten
// here, stage 1's AdamW counter one behind, its file's size and checksum updated) cannot
// continue as one optimizer: resuming on one process is refused naming both counters and the
// settings to keep, while the checkpoint's own split resumes it.
TEST(PipelineTrain, StagesWithDifferentStepCountsResumeOnlyUnderTheirSplit) {
  comm::Communicator& world = comm::world();
  train::Config c = pipeline_config(world, "tessel-pp-steps-differ");
  c.parallel.pp = world.size();
  c.train.checkpoint_every = 4;
  run_on(world, c);
  const std::string checkpoint = c.run.dir + "/checkpoints/step-00000004";
  if (world.rank() == 0) {
    fs::remove_all(c.run.dir + "/checkpoints/step-00000008");
    const std::string manifest_path = checkpoint + "/manifest.json";
    nlohmann::json manifest = nlohmann::json::parse(std::ifstream(manifest_path));
    bool rewritten = false;
    for (auto& f : manifest["files"]) {
      const std::string path = checkpoint + "/" + f["name"].get<std::string>();
      if (f["name"].get<std::string>().rfind("optimizer-", 0) != 0) continue;
      train::SafetensorsFile file = train::read_safetensors(path);
      for (auto& t : file.tensors)
        if (t.name == "stage1/adamw.step") {
          t.tensor.i32()[0] -= 1;
          uint32_t crc = 0;
          train::write_safetensors(path, file.tensors, file.metadata, &crc);
          f["crc32"] = crc;
          f["bytes"] = fs::file_size(path);
          rewritten = true;
        }
    }
    EXPECT_TRUE(rewritten);  // not ASSERT: the other ranks wait at the barrier below
    std::ofstream(manifest_path) << manifest.dump(2);
    comm::SingleCommunicator self;
    train::Config one = without_pipeline(c);
    one.run.dir = copy_to_resume(self, c.run.dir, 4);
    fixture::expect_input_error(
        [&] { run_on(self, one); },
        {checkpoint.substr(checkpoint.rfind('/')), "'stage0/adamw.step' and 'stage1/adamw.step'",
         "one tensor 'adamw.step'", "different numbers of optimizer steps",
         "resume with the checkpoint's parallel.pp and pipeline.layout"});
  }
  world.barrier();
  EXPECT_EQ(run_on(world, c).resumed_from, 4);
}

// Each rank's model holds only its stage's parameters (a tied embedding also on the last
// stage): the counts every rank reports at the start equal a model built with the stage's
// block range, and one dp replica's stages together hold the whole model once. pp = world
// (balanced, and with the last stage holding no blocks, so that its neighbour's blocks reach
// the end), and pp 2 x dp 2 on 4 ranks; interleaved pp 2 with 2 chunks per stage (blocks 0 and 2
// on the first, 1 and 3 on the second); tied and untied head.
TEST(PipelineTrain, EachRankHoldsOnlyItsStagesParameters) {
  comm::Communicator& world = comm::world();
  struct Split {
    int pp;
    std::string layout, schedule;
  };
  std::vector<Split> splits = {{world.size(), "", "1f1b"},
                               {world.size(), world.size() == 2 ? "4,0" : "1,2,1,0", "1f1b"},
                               {2, "1,1,1,1", "interleaved"}};
  if (world.size() == 4) splits.push_back({2, "", "1f1b"});
  for (const bool tied : {false, true})
    for (const auto& [pp, layout, schedule] : splits) {
      SCOPED_TRACE("pp " + std::to_string(pp) + ", layout '" + layout + "', " + schedule +
                   (tied ? ", tied head" : ""));
      train::Config c = pipeline_config(world, "tessel-pp-held");
      c.parallel.pp = pp;
      c.pipeline.layout = layout;
      c.pipeline.schedule = schedule;
      c.model.tied_head = tied;
      c.train.steps = 2;
      c.optim.warmup_steps = 1;
      c.train.eval_every = 0;
      run_on(world, c);
      nlohmann::json start;
      for (const auto& j : metrics_records(c.run.dir))
        if (start.is_null() && j.value("event", "") == "start") start = j;
      ASSERT_TRUE(start.contains("parameters_per_rank"));
      const auto held = start["parameters_per_rank"].get<std::vector<int64_t>>();
      ASSERT_EQ(held.size(), size_t(world.size()));

      const comm::Mesh mesh = comm::Mesh::build(world, {pp, world.size() / pp, 1, 1});
      const model::Gpt stage(c.model, uint64_t(c.run.seed), {},
                             train::pipeline_block_ranges(c, mesh));
      EXPECT_EQ(held[size_t(world.rank())], stage.num_parameters());
      EXPECT_LT(stage.num_parameters(), stage.total_parameters());
      int64_t replica = stage.num_parameters();  // summed over this dp replica's stages
      mesh.group(comm::Axis::pp).all_reduce(std::span<int64_t>(&replica, 1));
      const int64_t embed = c.model.vocab * c.model.width;
      EXPECT_EQ(replica, stage.total_parameters() + (tied ? embed : 0));
    }
}

// Each rank holds its own stage's optimizer state only. The stages together hold exactly
// the per-parameter state of the single-process optimizer, each tensor once, and so does a
// checkpoint, also when dp replicas of a stage hold the same state (pp 2 x dp 2, with ep 1
// and ep 2: a dense model with parallel.ep = 2 has two edp groups per stage) or each its own
// rows of it (Muon's ZeRO-1 momentum, saved as row shards); also interleaved, each stage's
// state covering both its chunks' blocks.
TEST(PipelineTrain, EachStageHoldsOnlyItsOwnOptimizerState) {
  comm::Communicator& world = comm::world();
  struct Layout {
    int pp, ep;
    const char* schedule;
  };
  std::vector<Layout> meshes = {{world.size(), 1, "1f1b"}, {2, 1, "interleaved"}};
  if (world.size() == 4) meshes.insert(meshes.end(), {{2, 1, "1f1b"}, {2, 2, "1f1b"}});
  for (const char* optimizer : {"adamw", "muon"})
    for (const auto& [pp, ep, schedule] : meshes) {
      SCOPED_TRACE(std::string(optimizer) + ", pp " + std::to_string(pp) + ", ep " +
                   std::to_string(ep) + ", " + schedule);
      train::Config c = pipeline_config(world, "tessel-pp-state");
      c.optim.name = optimizer;
      c.parallel.pp = pp;
      c.parallel.ep = ep;
      c.pipeline.schedule = schedule;
      c.train.eval_every = 0;
      c.train.save_final = true;
      run_on(world, c);

      model::Gpt model(c.model, uint64_t(c.run.seed));
      const auto stage_of =
          train::parameter_stages(model, train::pipeline_boundaries(c), c.parallel.pp);
      std::map<std::string, int> param_stage;
      for (size_t i = 0; i < stage_of.size(); ++i)
        param_stage[model.parameters()[i].name] = stage_of[i];
      // Per-parameter state tensors ("<kind>/<parameter>") by name: their sizes.
      auto per_parameter = [](std::vector<std::pair<std::string, int64_t>> named) {
        std::map<std::string, int64_t> out;
        for (auto& [name, numel] : named)
          if (name.find('/') != std::string::npos) {
            EXPECT_TRUE(out.emplace(name, numel).second) << name;
          }
        return out;
      };
      std::vector<std::pair<std::string, int64_t>> single;
      for (auto& st : optim::make_optimizer(c.optim, model.parameters(), nullptr, {})->state())
        single.emplace_back(st.name, st.tensor.numel());
      const auto whole = per_parameter(single);
      ASSERT_FALSE(whole.empty());
      int64_t whole_numel = 0;
      for (auto& [name, numel] : whole) whole_numel += numel;

      // "stage<s>/<kind>/<parameter>": the parameter is on stage s; the prefix dropped.
      auto strip = [&](const std::string& name) -> std::pair<std::string, int64_t> {
        const size_t slash = name.find('/');
        EXPECT_EQ(name.rfind("stage", 0), 0u) << name;
        const int s = std::stoi(name.substr(5, slash - 5));
        const std::string rest = name.substr(slash + 1);
        if (rest.find('/') != std::string::npos) {
          EXPECT_EQ(param_stage.at(rest.substr(rest.rfind('/') + 1)), s) << name;
        }
        return {rest, s};
      };

      const comm::Mesh mesh = comm::Mesh::build(world, {pp, world.size() / pp, 1, ep});
      auto mine = train::make_stage_optimizer(c, model, mesh, {});
      int64_t own_numel = 0, shard_numel = 0;  // ZeRO-1 row shards: each rank its own rows
      for (auto& st : mine->state()) {
        const auto [rest, s] = strip(st.name);
        EXPECT_EQ(s, mesh.coordinate(comm::Axis::pp)) << st.name;
        if (rest.find('/') != std::string::npos)
          (st.is_shard() ? shard_numel : own_numel) += st.tensor.numel();
      }
      mesh.group(comm::Axis::pp).all_reduce(std::span<int64_t>(&own_numel, 1));
      world.all_reduce(std::span<int64_t>(&shard_numel, 1));
      EXPECT_EQ(own_numel + shard_numel, whole_numel);

      train::CheckpointStore store(c.run.dir + "/checkpoints", 2);
      const auto latest = store.latest();
      ASSERT_TRUE(latest.has_value());
      std::vector<std::pair<std::string, int64_t>> saved;
      const auto loaded = train::CheckpointStore::load(*latest);
      for (const auto& t : loaded.optimizer)
        saved.emplace_back(strip(t.name).first, t.tensor.numel());
      std::set<std::string> sharded;  // the load checked that each one's shards cover it once
      for (const auto& s : loaded.shard_locations)
        if (sharded.insert(s.name).second)
          saved.emplace_back(strip(s.name).first, shape_numel(s.shape));
      EXPECT_EQ(per_parameter(saved), whole);
    }
}

// PACI's step records come only when a horizon drains, so the last stage prints the progress
// line of every logged step as its window finishes, with the loss the record gets later; no
// other rank prints step lines.
TEST(PipelineTrain, PaciLastStagePrintsEachLoggedWindow) {
  comm::Communicator& world = comm::world();
  train::Config c = pipeline_config(world, "tessel-pp-live");
  c.parallel.pp = world.size();
  c.pipeline.schedule = "paci";
  c.train.eval_every = 0;  // one horizon over the whole run
  c.train.log_every = 3;
  c.run.quiet = false;
  testing::internal::CaptureStdout();
  const auto result = run_on(world, c);
  const std::string out = testing::internal::GetCapturedStdout();
  std::vector<std::pair<int64_t, std::string>> printed;  // step, its loss as printed
  std::istringstream lines(out);
  for (std::string line; std::getline(lines, line);) {
    long long step = 0, steps = 0;
    char loss[32] = {};
    if (std::sscanf(line.c_str(), "step %lld/%lld | loss %31s", &step, &steps, loss) == 3)
      printed.emplace_back(step, loss);
  }
  if (world.rank() != world.size() - 1) {
    EXPECT_TRUE(printed.empty()) << out;
    return;
  }
  ASSERT_EQ(result.steps.size(), 8u);
  std::vector<std::pair<int64_t, std::string>> want;
  for (const int64_t step : {1, 3, 6, 8}) {  // the first, every log_every-th and the last
    char loss[32];
    std::snprintf(loss, sizeof loss, "%.4f", result.steps[size_t(step - 1)].loss);
    want.emplace_back(step, loss);
  }
  EXPECT_EQ(printed, want) << out;
}
