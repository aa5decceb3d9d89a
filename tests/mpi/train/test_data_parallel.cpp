// Data parallelism on real MPI ranks: the dp run follows the single-process run
// that accumulates the same global batch, repeats bitwise, and resumes bitwise.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>

#include "support/mpi_train_fixture.hpp"
#include "support/pipeline_fixture.hpp"
#include "support/train_fixture.hpp"
#include "tessel/comm/single_communicator.hpp"
#include "tessel/comm/world.hpp"
#include "tessel/core/error.hpp"
#include "tessel/model/gpt.hpp"
#include "tessel/train/trainer.hpp"

using namespace tessel;
using fixture::expect_resume_continues_bitwise;
using fixture::run_on;
using fixture::shared_temp_dir;
namespace fs = std::filesystem;

namespace {

// `c`'s global batch of P ranks on one process: P times the micro-batches accumulated.
train::TrainResult run_on_one_process(train::Config c, int P) {
  c.train.accum *= P;
  c.run.dir = fixture::temp_dir("tessel-dp-ref");
  comm::SingleCommunicator self;
  return run_on(self, c);
}

// Every step's loss and every validation loss of `a` within 1e-5 relative of `ref`'s (only
// summation orders differ), and as many of each.
void expect_losses_near(const train::TrainResult& a, const train::TrainResult& ref) {
  ASSERT_EQ(a.steps.size(), ref.steps.size());
  for (size_t i = 0; i < a.steps.size(); ++i)
    EXPECT_NEAR(a.steps[i].loss, ref.steps[i].loss, 1e-5 * ref.steps[i].loss) << "step " << i + 1;
  ASSERT_EQ(a.validation.size(), ref.validation.size());
  for (size_t i = 0; i < a.validation.size(); ++i)
    EXPECT_NEAR(a.validation[i].second, ref.validation[i].second, 1e-5 * ref.validation[i].second);
}

// Each validation's loss on each data set of a mixture, within 1e-5 relative of `ref`'s.
void expect_data_set_losses_near(const train::TrainResult& a, const train::TrainResult& ref) {
  ASSERT_EQ(a.data_set_validation.size(), ref.data_set_validation.size());
  for (size_t i = 0; i < a.data_set_validation.size(); ++i) {
    ASSERT_EQ(a.data_set_validation[i].size(), ref.data_set_validation[i].size());
    for (size_t d = 0; d < a.data_set_validation[i].size(); ++d)
      EXPECT_NEAR(a.data_set_validation[i][d], ref.data_set_validation[i][d],
                  1e-5 * ref.data_set_validation[i][d])
          << "validation " << i << ", data set " << d;
  }
}

}  // namespace

TEST(DataParallel, FollowsSingleRankAccumulationAndRepeatsBitwise) {
  comm::Communicator& world = comm::world();
  const int P = world.size();
  std::string data = fixture::shared_dataset(world);
  train::Config dist = fixture::tiny_config(data, shared_temp_dir(world, "tessel-dp-run"));
  dist.train.accum = 1;
  auto a = run_on(world, dist);
  dist.run.dir = shared_temp_dir(world, "tessel-dp-run");
  auto b = run_on(world, dist);

  auto ref = run_on_one_process(dist, P);

  ASSERT_EQ(a.steps.size(), 50u);
  ASSERT_EQ(ref.steps.size(), 50u);
  double worst = 0;
  for (size_t i = 0; i < a.steps.size(); ++i) {
    worst = std::max(worst, std::abs(a.steps[i].loss - ref.steps[i].loss) / ref.steps[i].loss);
    EXPECT_EQ(a.steps[i].loss, b.steps[i].loss) << "step " << i + 1 << " not repeatable";
    // Only the summation order differs (MPI tree vs sequential accumulation).
    EXPECT_NEAR(a.steps[i].loss, ref.steps[i].loss, 1e-5 * std::abs(ref.steps[i].loss))
        << "step " << i + 1;
  }
  if (world.rank() == 0) std::printf("largest relative loss difference: %.3g\n", worst);
  EXPECT_LT(a.steps.back().loss, a.steps.front().loss - 1.0);
}

// Context parallelism: cp = 2 (with dp = P / 2) follows the single process that accumulates
// the same global batch, for causal and causal-document masks (the latter also within a
// 5-token model.attention_window) and every chunk layout, and repeats bitwise; a leftover
// model.moe_balance = "seq_aux" is ignored by the dense model.
TEST(ContextParallel, TrainingFollowsSingleRankLoss) {
  comm::Communicator& world = comm::world();
  const int P = world.size();
  const std::string data = fixture::shared_dataset(world);
  const struct {
    const char* name;
    train::AttentionMaskKind mask;
    int64_t window;
  } cases[] = {{"causal", train::AttentionMaskKind::causal, 0},
               {"causal_document", train::AttentionMaskKind::causal_document, 0},
               {"causal_document, window 5", train::AttentionMaskKind::causal_document, 5}};
  double unwindowed_final = 0;  // the causal_document reference's final loss
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    train::Config single = fixture::tiny_config(data, fixture::temp_dir("tessel-cp-ref"));
    single.train.steps = 20;
    single.train.accum = P / 2;
    single.data.attention_mask = c.mask;
    single.model.attention_window = c.window;
    comm::SingleCommunicator self;
    const auto ref = run_on(self, single);
    ASSERT_EQ(ref.steps.size(), 20u);
    if (c.window > 0)  // the window takes effect: the loss leaves the unwindowed one's
      EXPECT_GT(std::abs(ref.steps.back().loss - unwindowed_final), 1e-3);
    else
      unwindowed_final = ref.steps.back().loss;
    for (train::CpLayoutKind layout : {train::CpLayoutKind::zigzag, train::CpLayoutKind::contiguous,
                                       train::CpLayoutKind::balanced}) {
      SCOPED_TRACE(int(layout));
      train::Config dist = single;
      dist.train.accum = 1;
      dist.parallel.cp = 2;
      dist.parallel.cp_layout = layout;
      // Refused under cp with MoE blocks; a model without them has nothing to balance.
      dist.model.moe.balance = moe::Balance::seq_aux;
      dist.run.dir = shared_temp_dir(world, "tessel-cp-run");
      const auto a = run_on(world, dist);
      dist.run.dir = shared_temp_dir(world, "tessel-cp-run");
      const auto b = run_on(world, dist);
      ASSERT_EQ(a.steps.size(), 20u);
      for (size_t i = 0; i < a.steps.size(); ++i) {
        EXPECT_EQ(a.steps[i].loss, b.steps[i].loss) << "step " << i + 1 << " not repeatable";
        EXPECT_NEAR(a.steps[i].loss, ref.steps[i].loss, 1e-4) << "step " << i + 1;
      }
      EXPECT_LT(a.steps.back().loss, a.steps.front().loss - 0.5);
      // Validation splits each sequence over the cp ranks too.
      ASSERT_EQ(a.validation.size(), ref.validation.size());
      EXPECT_NEAR(a.validation.back().second, ref.validation.back().second, 1e-4);
    }
  }
}

// SFT (packed samples, loss on the replies only, padded rows): the loss divides by the global
// count of trained tokens, so dp = P, and cp = 2 (which splits padded tails over its ranks),
// follow one process accumulating the same global batch. Training and validation.
TEST(Sft, DataAndContextParallelFollowSingleRankAccumulation) {
  comm::Communicator& world = comm::world();
  const int P = world.size();
  train::Config single =
      fixture::tiny_config(fixture::shared_sft_dataset(world), fixture::temp_dir("tessel-sft"));
  single.model.max_seq = single.train.seq_len = 128;
  single.train.steps = 12;
  single.train.eval_every = 6;
  single.train.accum = P;
  comm::SingleCommunicator self;
  const auto ref = run_on(self, single);
  ASSERT_EQ(ref.steps.size(), 12u);
  EXPECT_LT(ref.steps.back().loss, ref.steps.front().loss - 0.5);
  for (const int cp : {1, 2}) {
    SCOPED_TRACE("cp = " + std::to_string(cp));
    train::Config dist = single;
    dist.parallel.cp = cp;
    dist.train.accum = cp;  // dp = P / cp ranks of cp micro-batches: the same global batch
    dist.run.dir = shared_temp_dir(world, "tessel-sft-run");
    expect_losses_near(run_on(world, dist), ref);
  }
}

// A mixture of two data sets 2 : 1 over P ranks follows the single process that accumulates
// the same global batch, each data set's validation loss too, and resumes bitwise.
TEST(DataParallel, AMixtureFollowsSingleRankAccumulationAndResumesBitwise) {
  comm::Communicator& world = comm::world();
  const std::string run = shared_temp_dir(world, "tessel-dp-mixture");
  train::Config c = fixture::tiny_config(fixture::shared_dataset(world), run);
  c.data.path += "," + fixture::shared_other_dataset(world);
  c.data.weights = "2,1";
  c.train.steps = 20;
  c.train.eval_every = 10;
  c.train.checkpoint_every = 10;
  const auto full = expect_resume_continues_bitwise(
      world, c, 10, [&] { fs::remove_all(run + "/checkpoints/step-00000020"); });
  const auto ref = run_on_one_process(c, world.size());
  expect_losses_near(full, ref);
  ASSERT_EQ(full.data_set_validation.size(), 2u);
  ASSERT_EQ(full.data_set_validation[0].size(), 2u);
  expect_data_set_losses_near(full, ref);
}

TEST(DataParallel, ResumeContinuesBitwise) {
  comm::Communicator& world = comm::world();
  std::string run = shared_temp_dir(world, "tessel-dp-resume");
  train::Config c = fixture::tiny_config(fixture::shared_dataset(world), run);
  c.train.checkpoint_every = 25;
  expect_resume_continues_bitwise(world, c, 25,
                                  [&] { fs::remove_all(run + "/checkpoints/step-00000050"); });
}

TEST(DataParallel, ADamagedNewestCheckpointResumesAllRanksFromThePreviousOne) {
  comm::Communicator& world = comm::world();
  std::string run = shared_temp_dir(world, "tessel-dp-damaged");
  train::Config c = fixture::tiny_config(fixture::shared_dataset(world), run);
  c.train.checkpoint_every = 25;  // checkpoints at 25 and 50
  expect_resume_continues_bitwise(world, c, 25, [&] {
    char shard[64];  // rank 0's share of the optimizer state
    std::snprintf(shard, sizeof shard, "optimizer-00000-of-%05d.safetensors", world.size());
    std::string damaged = run + "/checkpoints/step-00000050/" + shard;
    fs::resize_file(damaged, fs::file_size(damaged) - 1);
  });
}

// The same for a flipped byte in a ZeRO-1 row-shard file (same size, wrong checksum): rank 0's
// pick checksums the shard files, so every rank falls back to the previous checkpoint.
TEST(DataParallel, ADamagedRowShardFileResumesAllRanksFromThePreviousOne) {
  comm::Communicator& world = comm::world();
  std::string run = shared_temp_dir(world, "tessel-dp-damaged-shard");
  train::Config c = fixture::tiny_config(fixture::shared_dataset(world), run);
  c.optim.name = "muon";
  c.train.steps = 20;
  c.train.checkpoint_every = 10;
  expect_resume_continues_bitwise(world, c, 10, [&] {
    char shard[64];  // the last rank's row shards
    std::snprintf(shard, sizeof shard, "optimizer_shards-%05d-of-%05d.safetensors",
                  world.size() - 1, world.size());
    std::fstream f(run + "/checkpoints/step-00000020/" + shard,
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-1, std::ios::end);
    f.put('\x55');
  });
}

// A version-2 checkpoint (before row shards: the Muon state saved whole, as replicated mode
// still saves it) resumes a ZeRO-1 sharded run, each rank cutting its rows from the whole
// tensors: the same losses as the uninterrupted replicated run, bitwise.
TEST(DataParallel, AVersion2CheckpointResumesAShardedRun) {
  comm::Communicator& world = comm::world();
  std::string run = shared_temp_dir(world, "tessel-dp-v2");
  train::Config c = fixture::tiny_config(fixture::shared_dataset(world), run);
  c.optim.name = "muon";
  c.optim.muon_mode = "replicated";
  c.train.steps = 20;
  c.train.checkpoint_every = 10;
  const auto whole = run_on(world, c);
  if (world.rank() == 0) {
    fs::remove_all(run + "/checkpoints/step-00000020");
    const std::string manifest = run + "/checkpoints/step-00000010/manifest.json";
    nlohmann::json m = nlohmann::json::parse(std::ifstream(manifest));
    ASSERT_EQ(m.value("shards", nlohmann::json::array()).size(), 0u);
    m["version"] = 2;
    m.erase("shards");
    std::ofstream(manifest) << m.dump();
  }
  world.barrier();
  c.optim.muon_mode = "sharded";
  const auto resumed = run_on(world, c);
  EXPECT_EQ(resumed.resumed_from, 10);
  ASSERT_EQ(resumed.steps.size(), 10u);
  for (size_t i = 0; i < 10; ++i) EXPECT_EQ(resumed.steps[i].loss, whole.steps[10 + i].loss) << i;
}

// Dion3 (ZeRO-1 sharded state, per-head QKV blocks) through the trainer: the loss falls and a
// resume from the middle checkpoint (its row-shard optimizer state) continues bitwise.
TEST(DataParallel, Dion3ResumeContinuesBitwise) {
  comm::Communicator& world = comm::world();
  std::string run = shared_temp_dir(world, "tessel-dp-dion3");
  train::Config c = fixture::tiny_config(fixture::shared_dataset(world), run);
  c.optim.name = "dion3";
  c.optim.qkv_split = "heads";
  c.optim.ns_gram_min = 8;
  c.train.steps = 20;
  c.train.checkpoint_every = 10;
  const auto full = expect_resume_continues_bitwise(
      world, c, 10, [&] { fs::remove_all(run + "/checkpoints/step-00000020"); });
  EXPECT_LT(full.steps.back().loss, full.steps.front().loss - 0.5);
}

// A GPT with MoE blocks: experts spread over every rank (parallel.ep = world) trains like
// ep = 1 and like one process accumulating the same global batch (EQB's quantile is exact
// over the pooled micro-batches, LEI counts per micro-batch), up to summation order.
namespace {

// The MoE config of the expert-parallel tests: 4 experts in every block, EQB + LEI.
train::Config moe_config(comm::Communicator& world, const std::string& stem) {
  train::Config c =
      fixture::tiny_config(fixture::shared_dataset(world), shared_temp_dir(world, stem));
  for (const char* s : {"model.moe_layers=all", "model.moe_experts=4", "model.moe_top_k=2",
                        "model.moe_shared=8", "model.moe_balance=eqb_lei", "train.steps=12"})
    train::apply_override(c, s);
  return c;
}

// Every "moe" record of a run's metrics.jsonl (steps and validations): each block's `field`
// (records without it: null).
std::vector<nlohmann::json> moe_field(const std::string& run_dir, const char* field) {
  std::ifstream in(run_dir + "/metrics.jsonl");
  std::vector<nlohmann::json> out;
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (!j.contains("moe")) continue;
    nlohmann::json values = nlohmann::json::array();
    for (const auto& block : j["moe"]) values.push_back(block.value(field, nlohmann::json()));
    out.push_back({{"step", j["step"]}, {"validation", j.contains("val_loss")}, {field, values}});
  }
  return out;
}

// `field` of every training step record of a run's metrics.jsonl.
std::vector<nlohmann::json> step_field(const std::string& run_dir, const char* field) {
  std::ifstream in(run_dir + "/metrics.jsonl");
  std::vector<nlohmann::json> out;
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (j.contains("loss") && j.contains("step") && !j.contains("val_loss"))
      out.push_back(j.value(field, nlohmann::json()));
  }
  return out;
}

std::vector<nlohmann::json> moe_loads(const std::string& run_dir) {
  return moe_field(run_dir, "loads");
}

}  // namespace

// Each rank holds only its ep shard of the experts (and their optimizer state): expert
// gradients sum over edp, the optimizer of the experts runs over edp, the clipping norm sums
// each expert parameter's squares over the ep ranks, validation runs through the token exchange.
// With AdamW and with Muon (ZeRO-1 sharded over dp for the dense matrices, over edp for the
// experts). A mixture's validation under expert parallelism: the ep ranks run idle forwards where
// one holds more validation batches (of either data set); each data set's loss still follows the
// single process that accumulates the same global batch.
TEST(DataParallel, ExpertParallelMoeValidatesEachDataSetOfAMixture) {
  comm::Communicator& world = comm::world();
  const int P = world.size();
  train::Config c = moe_config(world, "tessel-ep-mixture");
  c.data.path += "," + fixture::shared_other_dataset(world);
  c.data.weights = "1,2";
  c.train.eval_every = 6;
  c.train.eval_sequences = 2 * P + 1;  // uneven over the ranks, in each data set
  const auto ref = run_on_one_process(c, P);
  c.parallel.ep = P;
  const auto ep = run_on(world, c);
  expect_losses_near(ep, ref);
  ASSERT_EQ(ep.data_set_validation.size(), 2u);
  ASSERT_EQ(ep.data_set_validation[0].size(), 2u);
  expect_data_set_losses_near(ep, ref);
}

TEST(DataParallel, ExpertParallelMoeFollowsEp1AndSingleRank) {
  comm::Communicator& world = comm::world();
  const int P = world.size();
  for (const char* optimizer : {"adamw", "muon"}) {
    SCOPED_TRACE(optimizer);
    train::Config c = moe_config(world, "tessel-ep-run");
    c.optim.name = optimizer;
    c.train.eval_every = 6;
    // Uneven: rank 0 holds one validation batch more; its ep peers run one without loss tokens.
    c.train.eval_sequences = 2 * P + 1;
    auto ep1 = run_on(world, c);
    auto ref = run_on_one_process(c, P);
    ASSERT_EQ(ref.steps.size(), 12u);
    // ep = P (edp of 1), and with 4 ranks ep = 2 (edp of 2: expert gradients are reduced).
    std::vector<int> ep_sizes = {P};
    if (P == 4) ep_sizes.push_back(2);
    for (int ep_size : ep_sizes) {
      SCOPED_TRACE("ep = " + std::to_string(ep_size));
      train::Config ep = c;
      ep.parallel.ep = ep_size;
      ep.run.dir = shared_temp_dir(world, "tessel-ep-run");
      auto epP = run_on(world, ep);
      ASSERT_EQ(epP.steps.size(), 12u);
      for (size_t i = 0; i < epP.steps.size(); ++i) {
        // 1e-5 relative, as the dense test: only summation orders differ (and the GEMM row
        // blocking of the experts), and no routing decision sits that close to a tie here.
        EXPECT_NEAR(epP.steps[i].loss, ep1.steps[i].loss, 1e-5 * ep1.steps[i].loss)
            << "step " << i + 1;
        EXPECT_NEAR(epP.steps[i].loss, ref.steps[i].loss, 1e-5 * ref.steps[i].loss)
            << "step " << i + 1;
        EXPECT_NEAR(epP.steps[i].grad_norm, ref.steps[i].grad_norm, 1e-5 * ref.steps[i].grad_norm)
            << "step " << i + 1;
      }
      ASSERT_EQ(epP.validation.size(), 2u);
      for (size_t i = 0; i < 2; ++i)
        EXPECT_NEAR(epP.validation[i].second, ref.validation[i].second,
                    1e-5 * ref.validation[i].second);
      // The MoE metrics count the same routing: per-block expert loads of every step and of
      // the validation set (idle forwards not counted) equal ep = 1's exactly. Every step
      // reports the EP skew: max / median >= 1 over the ep group, exactly 1 at ep = 1.
      if (world.rank() == 0) {
        EXPECT_EQ(moe_loads(ep.run.dir), moe_loads(c.run.dir));
        for (const auto& [dir, one] : {std::pair{ep.run.dir, false}, {c.run.dir, true}}) {
          const auto skews = step_field(dir, "ep_skew");
          ASSERT_EQ(skews.size(), 12u);
          for (const auto& s : skews)
            for (const char* key : {"expert_time", "recv_bytes"}) {
              const double v = s.at(key).get<double>();
              EXPECT_GE(v, 1.0) << key;
              if (one) {
                EXPECT_EQ(v, 1.0) << key;
              }
            }
        }
      }
    }
  }
}

// Context parallelism with MoE blocks: each cp rank routes the tokens of its chunks, the
// balancing sums run over dp x cp and the per-micro-batch terms over cp, expert gradients sum
// over edp x cp. So cp = 2 (dp = P / 2; with 4 ranks also ep = 2: experts sharded inside each
// cp coordinate) follows one process accumulating the same global batch: losses, gradient
// norms, validation and the experts' loads, for EQB + LEI, aux + z-loss, qb_avg, qb_hist
// (its range and counts over dp x cp, as EQB's counts), Sinkhorn selection (its column sums
// over the cp parts) and expert choice (each expert's top-C over the micro-batch's gathered
// scores), and with expert capacity 1 (dropped by position over the whole micro-batch: the
// same drops).
TEST(ContextParallel, MoeFollowsSingleRankAccumulation) {
  comm::Communicator& world = comm::world();
  const int P = world.size();
  for (const auto& [balance, capacity] : {std::pair<const char*, const char*>{"eqb_lei", "0"},
                                          {"aux", "0"},
                                          {"qb_avg", "0"},
                                          {"qb_hist", "0"},
                                          {"sinkhorn", "0"},
                                          {"expert_choice", "0"},
                                          {"eqb_lei", "1"}}) {
    SCOPED_TRACE(std::string(balance) + ", capacity " + capacity);
    train::Config c = moe_config(world, "tessel-cp-moe");
    train::apply_override(c, std::string("model.moe_balance=") + balance);
    train::apply_override(c, std::string("model.moe_capacity=") + capacity);
    // Expert choice has no drop policy but by score.
    if (std::string(balance) != "expert_choice")
      train::apply_override(c, "model.moe_drop=position");
    c.model.moe.z_coeff = 0.001;
    c.data.attention_mask = train::AttentionMaskKind::causal_document;
    c.train.eval_every = 6;
    // Uneven: dp rank 0 holds one validation batch more; with ep = 2 its ep peer (and that
    // peer's cp partner) runs one without loss tokens.
    c.train.eval_sequences = 2 * P + 1;
    c.train.sample_tokens = 8;  // with ep = 2 every rank generates, each ep group together
    // Capacity, Sinkhorn and expert choice count per forward: the validation batches must
    // group the sequences as one process's do (whole micro-batches per dp rank, no idle
    // forward).
    if (std::string(capacity) != "0" || std::string(balance) == "sinkhorn" ||
        std::string(balance) == "expert_choice")
      c.train.eval_sequences = 4 * c.train.micro_batch;
    train::Config one = c;
    one.train.accum *= P / 2;
    one.run.dir = fixture::temp_dir("tessel-cp-moe-ref");
    comm::SingleCommunicator self;
    const auto ref = run_on(self, one);
    ASSERT_EQ(ref.steps.size(), 12u);
    EXPECT_LT(ref.steps.back().loss, ref.steps.front().loss - 0.5);
    std::vector<int> ep_sizes = {1};
    if (P == 4) ep_sizes.push_back(2);
    for (int ep : ep_sizes) {
      SCOPED_TRACE("ep = " + std::to_string(ep));
      train::Config cp = c;
      cp.parallel.cp = 2;
      cp.parallel.ep = ep;
      cp.run.dir = shared_temp_dir(world, "tessel-cp-moe");
      const auto a = run_on(world, cp);
      expect_losses_near(a, ref);
      if (world.rank() == 0) {
        EXPECT_EQ(a.sample, ref.sample);
      }
      for (size_t i = 0; i < a.steps.size(); ++i)
        EXPECT_NEAR(a.steps[i].grad_norm, ref.steps[i].grad_norm, 1e-5 * ref.steps[i].grad_norm)
            << "step " << i + 1;
      if (world.rank() == 0) {
        EXPECT_EQ(moe_loads(cp.run.dir), moe_loads(one.run.dir));
        // Per-micro-batch statistics count the whole micro-batch (its cp parts summed). With
        // ep = 2 MaxVio pools the ep group's micro-batches, unlike the one process.
        if (ep == 1) {
          EXPECT_EQ(moe_field(cp.run.dir, "maxvio_micro"), moe_field(one.run.dir, "maxvio_micro"));
          EXPECT_EQ(moe_field(cp.run.dir, "dropped_cf1"), moe_field(one.run.dir, "dropped_cf1"));
          EXPECT_EQ(moe_field(cp.run.dir, "dropped_cf1_25"),
                    moe_field(one.run.dir, "dropped_cf1_25"));
        }
        EXPECT_EQ(moe_field(cp.run.dir, "dropped"), moe_field(one.run.dir, "dropped"));
        if (std::string(capacity) != "0") {  // capacity 1 binds: some step drops
          bool drops = false;
          for (const auto& r : moe_field(one.run.dir, "dropped"))
            for (const auto& block : r["dropped"]) drops = drops || block.get<double>() > 0;
          EXPECT_TRUE(drops);
        }
      }
    }
  }
}

// Activation recomputation (train.recompute = blocks) changes nothing over the layouts whose
// forward communicates: dp = P, cp = 2 (the recomputed attention exchanges keys and values
// again), experts over every rank (the recomputed MoE layers exchange tokens again) and both
// (cp = 2 with MoE blocks, experts over the dp ranks of each cp coordinate). The
// same losses, norms, validation and MoE loads, bitwise.
TEST(DataParallel, RecomputationEqualsKeepingTheCachesBitwise) {
  comm::Communicator& world = comm::world();
  const int P = world.size();
  const std::string data = fixture::shared_dataset(world);
  train::Config dense = fixture::tiny_config(data, shared_temp_dir(world, "tessel-rc"));
  dense.train.steps = 12;
  dense.train.eval_every = 6;
  train::Config cp = dense;
  cp.parallel.cp = 2;
  cp.data.attention_mask = train::AttentionMaskKind::causal_document;
  train::Config ep = moe_config(world, "tessel-rc");
  ep.parallel.ep = P;
  ep.train.eval_every = 6;
  train::Config cp_moe = ep;  // the recomputed MoE layers sum and gather over the cp ranks again
  cp_moe.parallel.cp = 2;
  cp_moe.parallel.ep = P / 2;
  cp_moe.model.moe.capacity = 1.0;
  for (train::Config c : {dense, cp, ep, cp_moe}) {
    SCOPED_TRACE("cp = " + std::to_string(c.parallel.cp) +
                 ", ep = " + std::to_string(c.parallel.ep));
    c.run.dir = shared_temp_dir(world, "tessel-rc");
    const auto kept = run_on(world, c);
    const std::string kept_dir = c.run.dir;
    c.train.recompute = model::Recompute::blocks;
    c.run.dir = shared_temp_dir(world, "tessel-rc");
    const auto recomputed = run_on(world, c);
    ASSERT_EQ(kept.steps.size(), 12u);
    fixture::expect_same_steps(recomputed, kept);
    if (world.rank() == 0) {
      EXPECT_EQ(moe_loads(c.run.dir), moe_loads(kept_dir));
    }
  }
}

// SFT with MoE blocks, experts over every rank: each rank routes its rows without their padding
// (unit_train's SftMoe tests show that it is left out), so the token exchange carries different
// counts per rank, and the run follows one process accumulating the same global batch, EQB +
// LEI balancing included. Also with cp = 2 (experts over the dp ranks of each cp coordinate),
// where a rank's chunks may hold only padding.
TEST(Sft, ExpertParallelMoeFollowsSingleRank) {
  comm::Communicator& world = comm::world();
  const int P = world.size();
  train::Config c = moe_config(world, "tessel-sft-ep");
  c.data.path = fixture::shared_sft_dataset(world);
  c.model.max_seq = c.train.seq_len = 128;
  c.train.eval_every = 6;
  const auto ref = run_on_one_process(c, P);
  for (const int cp : {1, 2}) {
    SCOPED_TRACE("cp = " + std::to_string(cp));
    train::Config dist = c;
    dist.parallel.cp = cp;
    dist.parallel.ep = P / cp;
    dist.train.accum = cp;  // dp = P / cp ranks of cp micro-batches: the same global batch
    dist.run.dir = shared_temp_dir(world, "tessel-sft-ep");
    expect_losses_near(run_on(world, dist), ref);
  }
}

// With sharded experts a resumed run repeats the uninterrupted one bitwise; also under cp = 2
// (each expert written once, by the first of its edp x cp ranks).
TEST(DataParallel, ExpertShardedMoeResumesBitwise) {
  comm::Communicator& world = comm::world();
  for (const int cp : {1, 2}) {
    SCOPED_TRACE("cp = " + std::to_string(cp));
    train::Config c = moe_config(world, "tessel-ep-resume");
    c.parallel.cp = cp;
    c.parallel.ep = world.size() / cp;
    c.train.steps = 20;
    c.train.checkpoint_every = 10;
    expect_resume_continues_bitwise(
        world, c, 10, [&] { fs::remove_all(c.run.dir + "/checkpoints/step-00000020"); });
  }
}

// A checkpoint of ep = P ranks holds every expert (and its optimizer state) exactly once under
// its global name, and one process with all experts resumes from it: the losses follow the
// uninterrupted ep = P run (1e-5 relative; a missing or misplaced expert changes them by far
// more).
TEST(DataParallel, ExpertShardedCheckpointHoldsEveryExpertOnceAndLoadsOnOneProcess) {
  comm::Communicator& world = comm::world();
  const int P = world.size();
  train::Config c = moe_config(world, "tessel-ep-ckpt");
  c.parallel.ep = P;
  c.train.steps = 20;
  c.train.checkpoint_every = 10;
  const auto full = run_on(world, c);
  if (world.rank() == 0) {
    const std::string dir = c.run.dir + "/checkpoints/step-00000010";
    std::ifstream in(dir + "/manifest.json");
    const auto manifest = nlohmann::json::parse(in);
    auto count = [&](const char* kind, const std::string& name) {
      const auto& names = manifest["tensors"][kind];
      return std::count(names.begin(), names.end(), name);
    };
    const model::Gpt whole(c.model, 0);
    ASSERT_EQ(whole.expert_parameters().size(), 2u * 4u * 2u);  // blocks x experts x matrices
    for (const Parameter& p : whole.parameters()) {
      EXPECT_EQ(count("model", p.name), 1) << p.name;
      const bool expert = p.name.find(".moe.experts.") != std::string::npos;
      EXPECT_EQ(count("optimizer", (expert ? "experts/adamw.m/" : "adamw.m/") + p.name), 1)
          << p.name;
    }
    fs::remove_all(c.run.dir + "/checkpoints/step-00000020");
    train::Config one = c;
    one.parallel.ep = 1;
    one.train.accum = P;
    comm::SingleCommunicator self;
    fixture::expect_follows_to_rounding(run_on(self, one), full, 10);
  }
  world.barrier();
}

// Spec "save with P, load with P′": a checkpoint of P ranks (Dion3: ZeRO-1 sharded momentum
// and second moments, saved as each rank's row shards, none whole) resumes on P ranks
// bitwise, and on one process (and with P = 4 on 2 ranks) that accumulates the same global
// batch; a one-process checkpoint resumes on P ranks. The row shards are re-cut on load; the
// data order depends only on the global batch. Across rank counts the resumed run follows the
// uninterrupted one up to summation order (1e-5 relative; a wrong data position or a lost
// optimizer shard changes the loss by far more).
namespace {
void resumes_with_a_different_data_parallel_size(const std::string& optimizer) {
  comm::Communicator& world = comm::world();
  const int P = world.size();
  train::Config c = fixture::tiny_config(fixture::shared_dataset(world), "");
  c.optim.name = optimizer;
  c.optim.selection_scope = "global";  // `local` selects per shard: it depends on dp by design
  c.optim.ns_gram_min = 8;
  c.train.steps = 20;
  c.train.checkpoint_every = 10;
  comm::SingleCommunicator self;
  train::Config wide = c, narrow = c;  // P ranks x accum 1, and 1 rank x accum P
  narrow.train.accum = P;

  // P ranks save and resume bitwise, each from its own row shards.
  wide.run.dir = shared_temp_dir(world, "tessel-dp-reshard");
  const std::string newest = wide.run.dir + "/checkpoints/step-00000020";
  auto full = expect_resume_continues_bitwise(world, wide, 10, [&] { fs::remove_all(newest); });
  const bool zero1 = optimizer != "adamw";  // the Muon family's sharded mode
  nlohmann::json manifest;
  std::ifstream(wide.run.dir + "/checkpoints/step-00000010/manifest.json") >> manifest;
  for (const auto& name : manifest["tensors"]["optimizer"])
    EXPECT_FALSE(zero1 && name.get<std::string>().rfind(optimizer + ".m/", 0) == 0) << name;
  std::set<std::string> sharded;
  for (const auto& shard : manifest["shards"]) sharded.insert(shard["name"].get<std::string>());
  EXPECT_EQ(sharded.empty(), !zero1);
  for (int r = 0; r < P; ++r) {
    char file[80];
    std::snprintf(file, sizeof file, "/optimizer_shards-%05d-of-%05d.safetensors", r, P);
    EXPECT_EQ(fs::exists(wide.run.dir + "/checkpoints/step-00000010" + file), zero1) << file;
  }

  // P ranks save, one process resumes (rank 0; the others wait); with P = 4, 2 ranks too.
  if (world.rank() == 0) {
    fs::remove_all(newest);
    narrow.run.dir = wide.run.dir;
    fixture::expect_follows_to_rounding(run_on(self, narrow), full, 10);
  }
  world.barrier();
  if (P == 4) {
    auto half = world.split(world.rank() < 2 ? 0 : 1, world.rank());
    if (world.rank() < 2) {
      if (world.rank() == 0) fs::remove_all(newest);
      half->barrier();
      train::Config two = wide;
      two.train.accum = 2;
      const auto resumed = run_on(*half, two);
      if (world.rank() == 0) fixture::expect_follows_to_rounding(resumed, full, 10);
    }
    world.barrier();
  }

  // One process saves, P ranks resume.
  narrow.run.dir = shared_temp_dir(world, "tessel-dp-reshard");
  if (world.rank() == 0) {
    full = run_on(self, narrow);
    fs::remove_all(narrow.run.dir + "/checkpoints/step-00000020");
  }
  world.barrier();
  wide.run.dir = narrow.run.dir;
  auto resumed = run_on(world, wide);
  if (world.rank() == 0) fixture::expect_follows_to_rounding(resumed, full, 10);

  // The same checkpoint on P ranks split as dp P/2 x cp 2 (accum 2: the same global batch):
  // nothing saved depends on how a sequence was split.
  if (world.rank() == 0) fs::remove_all(narrow.run.dir + "/checkpoints/step-00000020");
  world.barrier();
  train::Config cp = wide;
  cp.parallel.cp = 2;
  cp.train.accum = 2;
  resumed = run_on(world, cp);
  if (world.rank() == 0) fixture::expect_follows_to_rounding(resumed, full, 10);

  // A different global batch changes the data order: refused, naming the record's key.
  train::Config other = wide;
  other.train.accum = 2;
  other.run.dir = wide.run.dir;
  try {
    run_on(world, other);
    ADD_FAILURE() << "a different global batch resumed";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find("global batch"), std::string::npos) << e.what();
  }
}

}  // namespace

// Optimizer state is saved whole, dion3's sharded momentum as row shards, and a checkpoint
// moves between P ranks, fewer ranks and one process, and to context parallelism.
TEST(DataParallel, ResumesWithADifferentDataParallelSize) {
  for (const char* optimizer : {"dion3", "adamw"}) {
    SCOPED_TRACE(optimizer);
    resumes_with_a_different_data_parallel_size(optimizer);
  }
}

// parallel.overlap_grad_reduce starts each bucket's all-reduce during the step's last backward
// (small buckets, so many start early); the results are bitwise those of reducing after the
// backward: losses, gradient norms and validation, with accumulation (a bucket started after the
// first micro-batch would miss the second's gradients), a tied head (final only after the
// embedding), learned positions, cp = 2, and MoE blocks: experts over all ranks (ep = P) under
// recomputation, and over half of them (ep = P / 2: the experts' own range is reduced over 2
// ranks) with aux_global balancing, whose backward runs a blocking all-reduce over dp x cp while
// buckets are pending there. Rank 0 records the time spent starting buckets in the backward:
// none when reducing after it.
TEST(DataParallel, OverlappedGradientReduceEqualsReducingAfterTheBackwardBitwise) {
  comm::Communicator& world = comm::world();
  const int P = world.size();
  const std::string data = fixture::shared_dataset(world);
  train::Config dense = fixture::tiny_config(data, shared_temp_dir(world, "tessel-ov"));
  for (const char* s :
       {"train.steps=8", "train.eval_every=4", "train.accum=2", "parallel.bucket_mb=0.004",
        "model.tied_head=true", "model.positions=learned"})
    train::apply_override(dense, s);
  train::Config cp = dense;
  cp.parallel.cp = 2;
  cp.data.attention_mask = train::AttentionMaskKind::causal_document;
  train::Config ep = moe_config(world, "tessel-ov");
  for (const char* s : {"train.steps=8", "train.eval_every=4", "train.accum=2",
                        "parallel.bucket_mb=0.004", "train.recompute=blocks"})
    train::apply_override(ep, s);
  ep.parallel.ep = P;
  train::Config ep_half = ep;
  ep_half.parallel.ep = P / 2;
  ep_half.train.recompute = model::Recompute::none;
  train::apply_override(ep_half, "model.moe_balance=aux_global");
  for (train::Config c : {dense, cp, ep, ep_half}) {
    SCOPED_TRACE("cp = " + std::to_string(c.parallel.cp) +
                 ", ep = " + std::to_string(c.parallel.ep));
    c.parallel.overlap_grad_reduce = false;
    c.run.dir = shared_temp_dir(world, "tessel-ov");
    const auto after = run_on(world, c);
    const std::string after_dir = c.run.dir;
    c.parallel.overlap_grad_reduce = true;
    c.run.dir = shared_temp_dir(world, "tessel-ov");
    const auto overlapped = run_on(world, c);
    ASSERT_EQ(after.steps.size(), 8u);
    fixture::expect_same_steps(overlapped, after);
    if (world.rank() == 0) {
      for (const auto& [dir, overlap] : {std::pair{after_dir, false}, {c.run.dir, true}}) {
        const auto starts = step_field(dir, "grad_start_seconds");
        ASSERT_EQ(starts.size(), 8u);
        for (const auto& t : starts) {
          if (overlap) {
            EXPECT_GT(t.get<double>(), 0.0);
          } else {
            EXPECT_EQ(t.get<double>(), 0.0);
          }
        }
        for (const auto& w : step_field(dir, "grad_wait_seconds")) EXPECT_GT(w.get<double>(), 0.0);
      }
    }
  }
}
