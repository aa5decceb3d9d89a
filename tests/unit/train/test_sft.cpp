// The spec's SFT checks (specs/ett_checkpoint.md section 7) on packed loader rows through the
// model: a packed row gives the loss and gradients of its samples run one by one; prompt-token
// labels do not matter; no attention crosses a sample boundary; a row without loss tokens adds
// nothing and no NaN.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <numeric>

#include "support/expect_input_error.hpp"
#include "support/mpi_train_fixture.hpp"
#include "tessel/comm/single_communicator.hpp"
#include "tessel/core/rng.hpp"
#include "tessel/data/loader.hpp"
#include "tessel/data/packing.hpp"
#include "tessel/data/sft_corpus.hpp"
#include "tessel/model/gpt.hpp"
#include "tessel/moe/config.hpp"
#include "tessel/train/batch_inputs.hpp"
#include "tessel/train/checkpoint.hpp"
#include "tessel/train/export.hpp"

namespace tessel::train {
namespace {

namespace fs = std::filesystem;

constexpr int64_t kT = 256;

model::GptConfig tiny_model(model::PositionType positions) {
  model::GptConfig c;
  c.vocab = 256;
  c.layers = 2;
  c.width = 32;
  c.heads = 4;
  c.kv_heads = 2;
  c.mlp = model::MlpType::swiglu;
  c.positions = positions;
  c.tied_head = false;
  c.max_seq = kT;
  return c;
}

// An SFT data set of random conversations, prepared once per test binary.
const std::string& sft_dataset() {
  static const std::string dir = [] {
    const std::string d = fixture::temp_dir("tessel-sft");
    data::PrepareOptions o;
    o.corpus = "chat:test";
    o.output_dir = d;
    o.val_fraction = 0.1;
    data::prepare_samples(fixture::synthetic_conversations(60, 4), o);
    return d;
  }();
  return dir;
}

// Row `row` of the training split, packed to kT positions.
data::Batch packed_row(int64_t row) {
  const data::ShardReader tokens(sft_dataset() + "/train.tok");
  const data::PackedSamples packed(tokens, kT);
  const int64_t r[1] = {row};
  return packed.batch(tokens, r);
}

// The first `count` rows that pack two samples or more (and end in padding, if `padded`).
std::vector<data::Batch> shared_rows(size_t count, bool padded = false) {
  const data::ShardReader tokens(sft_dataset() + "/train.tok");
  const data::PackedSamples packed(tokens, kT);
  std::vector<data::Batch> rows;
  for (int64_t r = 0; r < packed.rows() && rows.size() < count; ++r) {
    const int64_t ids[1] = {r};
    data::Batch b = packed.batch(tokens, ids);
    const size_t samples = b.doc_starts[0].size() - (packed.row_tokens(r) < kT ? 1 : 0);
    if (samples >= 2 && (!padded || packed.row_tokens(r) < kT)) rows.push_back(std::move(b));
  }
  return rows;
}

// Loss sum, gradients and logits of one batch through a fresh model of `seed`.
struct Pass {
  double loss = 0;
  std::vector<float> grads, logits;
};

Pass run(const model::GptConfig& config, const std::vector<data::Batch>& batches) {
  model::Gpt gpt(config, 99);
  gpt.zero_grads();
  Pass p;
  for (const data::Batch& b : batches) {
    const BatchInputs in(b, AttentionMaskKind::causal_document);
    auto acts = gpt.make_activations(b.B, b.T);
    p.loss += gpt.forward(*acts, in.inputs());
    gpt.backward(*acts, 1.0f);
    const float* l = acts->logits.f32();
    p.logits.insert(p.logits.end(), l, l + acts->logits.numel());
  }
  const Tensor g = gpt.flat_grads();
  p.grads.assign(g.f32(), g.f32() + g.numel());
  return p;
}

// max |a - b| / max |b|.
double relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < b.size(); ++i) {
    diff = std::max(diff, double(std::fabs(a[i] - b[i])));
    scale = std::max(scale, double(std::fabs(b[i])));
  }
  return diff / scale;
}

// The samples of row 0 of `b` (its document pieces before any padding), each as a batch of
// its own: one row of the sample's length, with the targets and loss weights packing gave it.
std::vector<data::Batch> one_by_one(const data::Batch& b) {
  std::vector<data::Batch> alone;
  const auto& starts = b.doc_starts[0];
  for (size_t k = 0; k < starts.size(); ++k) {
    const int64_t begin = starts[k], end = k + 1 < starts.size() ? starts[k + 1] : b.T;
    const bool any_loss = std::any_of(b.loss_mask.begin() + begin, b.loss_mask.begin() + end,
                                      [](float w) { return w != 0; });
    if (!any_loss) continue;  // padding
    data::Batch s = data::make_batch(1, end - begin);
    std::copy(b.tokens.begin() + begin, b.tokens.begin() + end, s.tokens.begin());
    std::copy(b.targets.begin() + begin, b.targets.begin() + end, s.targets.begin());
    std::copy(b.loss_mask.begin() + begin, b.loss_mask.begin() + end, s.loss_mask.begin());
    s.doc_starts[0] = {0};
    alone.push_back(std::move(s));
  }
  return alone;
}

class Sft : public ::testing::TestWithParam<model::PositionType> {};

TEST_P(Sft, APackedRowGivesTheLossAndGradientsOfItsSamplesOneByOne) {
  const model::GptConfig config = tiny_model(GetParam());
  const auto rows = shared_rows(4);
  ASSERT_EQ(rows.size(), 4u) << "too few rows pack two samples: the test would show nothing";
  for (const data::Batch& b : rows) {
    const auto alone = one_by_one(b);
    ASSERT_GE(alone.size(), 2u);
    const Pass packed = run(config, {b}), separate = run(config, alone);
    EXPECT_NEAR(packed.loss, separate.loss, 1e-5 * std::fabs(separate.loss));
    EXPECT_LT(relative_difference(packed.grads, separate.grads), 1e-5);
  }
}

TEST_P(Sft, PromptTokenLabelsDoNotChangeTheLossOrGradients) {
  const model::GptConfig config = tiny_model(GetParam());
  const data::Batch b = packed_row(0);
  data::Batch relabelled = b;
  Rng rng(3);
  int changed = 0;
  for (size_t i = 0; i < b.targets.size(); ++i)
    if (b.loss_mask[i] == 0.0f) relabelled.targets[i] = int32_t(rng.below(256)), ++changed;
  ASSERT_GT(changed, 0);
  const Pass x = run(config, {b}), y = run(config, {relabelled});
  EXPECT_EQ(x.loss, y.loss);
  EXPECT_EQ(x.grads, y.grads);
}

TEST_P(Sft, NoAttentionCrossesASampleBoundary) {
  const model::GptConfig config = tiny_model(GetParam());
  // A row with two samples or more: change every token of its first sample.
  const auto rows = shared_rows(1);
  ASSERT_EQ(rows.size(), 1u);
  const data::Batch& b = rows[0];
  const int64_t second = b.doc_starts[0][1];
  data::Batch changed = b;
  for (int64_t t = 0; t < second; ++t) changed.tokens[size_t(t)] = (b.tokens[size_t(t)] + 7) % 256;
  const Pass x = run(config, {b}), y = run(config, {changed});
  const size_t V = 256;
  // The first sample's logits move; every position after it is bitwise the same.
  EXPECT_NE(std::vector<float>(x.logits.begin(), x.logits.begin() + second * int64_t(V)),
            std::vector<float>(y.logits.begin(), y.logits.begin() + second * int64_t(V)));
  EXPECT_EQ(std::vector<float>(x.logits.begin() + second * int64_t(V), x.logits.end()),
            std::vector<float>(y.logits.begin() + second * int64_t(V), y.logits.end()));
}

TEST_P(Sft, ARowWithoutLossTokensAddsNothingAndNoNaN) {
  const model::GptConfig config = tiny_model(GetParam());
  const data::Batch b = packed_row(0);
  // Two extra rows: the same tokens with every loss weight 0, and pure padding.
  data::Batch three = data::make_batch(3, kT);
  for (int64_t r = 0; r < 3; ++r) {
    if (r < 2) {
      std::copy(b.tokens.begin(), b.tokens.end(), three.tokens.begin() + r * kT);
      std::copy(b.targets.begin(), b.targets.end(), three.targets.begin() + r * kT);
    }
    three.doc_starts[size_t(r)] = r < 2 ? b.doc_starts[0] : std::vector<int32_t>{0};
  }
  std::fill(three.loss_mask.begin() + kT, three.loss_mask.end(), 0.0f);
  std::copy(b.loss_mask.begin(), b.loss_mask.end(), three.loss_mask.begin());
  const Pass one = run(config, {b}), with_empty = run(config, {three});
  EXPECT_TRUE(std::isfinite(with_empty.loss));
  EXPECT_TRUE(std::all_of(with_empty.grads.begin(), with_empty.grads.end(),
                          [](float g) { return std::isfinite(g); }));
  EXPECT_NEAR(with_empty.loss, one.loss, 1e-6 * std::fabs(one.loss));
  EXPECT_LT(relative_difference(with_empty.grads, one.grads), 1e-6);
  // A batch of padding alone: loss 0, gradients 0.
  data::Batch pad = data::make_batch(1, kT);
  std::fill(pad.loss_mask.begin(), pad.loss_mask.end(), 0.0f);
  pad.doc_starts[0] = {0};
  const Pass nothing = run(config, {pad});
  EXPECT_EQ(nothing.loss, 0.0);
  EXPECT_TRUE(
      std::all_of(nothing.grads.begin(), nothing.grads.end(), [](float g) { return g == 0.0f; }));
}

// MoE blocks route the sample tokens only: dropless and without balancing losses, a packed row
// still equals its samples one by one; with the aux, z and LEI losses and a capacity, rows of
// padding added to a batch change nothing (they would without Batch::padding).
model::GptConfig tiny_moe(moe::Balance balance, double capacity) {
  model::GptConfig c = tiny_model(model::PositionType::rotary);
  c.moe_layers = "all";
  c.moe.experts = 4;
  c.moe.top_k = 2;
  c.moe.balance = balance;
  c.moe.capacity = capacity;
  c.moe.z_coeff = 1e-3;
  return c;
}

TEST(SftMoe, APackedRowGivesTheLossAndGradientsOfItsSamplesOneByOne) {
  const model::GptConfig config = tiny_moe(moe::Balance::none, 0.0);
  const auto rows = shared_rows(2, /*padded=*/true);
  ASSERT_EQ(rows.size(), 2u);
  for (const data::Batch& b : rows) {
    ASSERT_GT(std::count(b.padding.begin(), b.padding.end(), 1), 0) << "a row with padding";
    const Pass packed = run(config, {b}), separate = run(config, one_by_one(b));
    EXPECT_NEAR(packed.loss, separate.loss, 1e-5 * std::fabs(separate.loss));
    EXPECT_LT(relative_difference(packed.grads, separate.grads), 1e-5);
  }
}

TEST(SftMoe, PaddingIsNotRoutedOrBalanced) {
  for (moe::Balance balance : {moe::Balance::aux, moe::Balance::lei}) {
    SCOPED_TRACE(moe::to_string(balance));
    const model::GptConfig config = tiny_moe(balance, 1.0);
    const data::Batch one = packed_row(0);
    ASSERT_LT(std::count(one.padding.begin(), one.padding.end(), 1), kT) << "a sample in the row";
    // The row twice, then a row of padding alone: three rows hold what two hold.
    data::Batch three = data::make_batch(3, kT), two = data::make_batch(2, kT);
    for (data::Batch* b : {&three, &two}) {
      b->padding.assign(size_t(b->B * kT), 1);
      std::fill(b->loss_mask.begin(), b->loss_mask.end(), 0.0f);
      for (int64_t r = 0; r < b->B; ++r) b->doc_starts[size_t(r)] = {0};
      for (int64_t r = 0; r < 2; ++r) {
        std::copy(one.tokens.begin(), one.tokens.end(), b->tokens.begin() + r * kT);
        std::copy(one.targets.begin(), one.targets.end(), b->targets.begin() + r * kT);
        std::copy(one.loss_mask.begin(), one.loss_mask.end(), b->loss_mask.begin() + r * kT);
        std::copy(one.padding.begin(), one.padding.end(), b->padding.begin() + r * kT);
        b->doc_starts[size_t(r)] = one.doc_starts[0];
      }
    }
    const Pass x = run(config, {two}), y = run(config, {three});
    EXPECT_NEAR(y.loss, x.loss, 1e-6 * std::fabs(x.loss));
    EXPECT_LT(relative_difference(y.grads, x.grads), 1e-6);
    // Without the padding marks the router sees the padding, and the gradients move.
    data::Batch unmarked = three;
    unmarked.padding.clear();
    EXPECT_GT(relative_difference(run(config, {unmarked}).grads, x.grads), 1e-4);
  }
}

INSTANTIATE_TEST_SUITE_P(Positions, Sft,
                         ::testing::Values(model::PositionType::rotary,
                                           model::PositionType::learned),
                         [](const auto& info) {
                           return info.param == model::PositionType::rotary ? "Rotary" : "Learned";
                         });

// The tiny trainer config on the SFT data set, rows of 128 positions.
Config sft_config(const std::string& run_dir) {
  Config c = fixture::tiny_config(sft_dataset(), run_dir);
  c.model.max_seq = c.train.seq_len = 128;
  c.train.steps = 30;
  c.train.micro_batch = 2;
  c.train.accum = 2;
  return c;
}

// Fine-tuning trains on the replies and its tokens/s counts the packed tokens, never padding.
TEST(SftTraining, LossFallsAndThroughputCountsNoPadding) {
  const Config c = sft_config(fixture::temp_dir("tessel-sft-run"));
  const TrainResult r = fixture::train_run(c);
  ASSERT_EQ(r.steps.size(), 30u);
  EXPECT_LT(r.steps.back().loss, r.steps.front().loss - 1.0);
  // The loader's step tokens, recounted from its batches: positions before each row's padding.
  data::DataLoader loader(c.data.path + "/train.tok",
                          {c.train.seq_len, c.train.micro_batch, c.train.accum, 0, 1,
                           uint64_t(c.run.seed), c.data.shuffle});
  std::ifstream in(c.run.dir + "/metrics.jsonl");
  int64_t step = 0, padded_steps = 0;
  for (std::string line; std::getline(in, line);) {
    const auto j = nlohmann::json::parse(line);
    if (!j.contains("tokens_per_s")) continue;
    int64_t tokens = 0;
    for (int m = 0; m < c.train.accum; ++m) {
      const data::Batch b = loader.next();
      for (int64_t row = 0; row < b.B; ++row) {
        const auto& starts = b.doc_starts[size_t(row)];
        const bool padded =
            std::all_of(b.tokens.begin() + row * b.T + starts.back(),
                        b.tokens.begin() + (row + 1) * b.T, [](int32_t t) { return t == 0; });
        tokens += padded ? starts.back() : b.T;
      }
    }
    padded_steps += tokens < loader.sequences_per_step() * c.train.seq_len;
    EXPECT_NEAR(j["tokens_per_s"].get<double>() * j["step_seconds"].get<double>(), double(tokens),
                1e-6 * double(tokens))
        << "step " << step + 1;
    ++step;
  }
  EXPECT_EQ(step, 30);
  EXPECT_GT(padded_steps, 0) << "no step had padding: the check shows nothing";
  // The start record reports the validation split's packing as well: the packer's counts.
  std::ifstream again(c.run.dir + "/metrics.jsonl");
  std::string first;
  std::getline(again, first);
  const auto start = nlohmann::json::parse(first);
  ASSERT_EQ(start.value("event", ""), "start");
  const data::PackedSamples val(data::ShardReader(c.data.path + "/val.tok"), c.train.seq_len);
  const auto& reported = start["sft"]["validation"];
  EXPECT_EQ(reported["samples"], val.samples());
  EXPECT_EQ(reported["rows"], val.rows());
  EXPECT_EQ(reported["overlong"], val.overlong());
  EXPECT_EQ(reported["untrained"], val.untrained());
  EXPECT_EQ(reported["rows_per_data_set"], c.train.eval_sequences);
}

TEST(SftTraining, ACausalMaskOverPackedSamplesIsRefused) {
  Config c = sft_config(fixture::temp_dir("tessel-sft-run"));
  c.data.attention_mask = AttentionMaskKind::causal;
  fixture::expect_input_error([&] { fixture::train_run(c); },
                              {"SFT data set", "causal_document", "attend to each other"});
}

// An SFT data set whose loss-mask shards are gone would train as text, prompts included: its
// dataset.json says "sft", so the run is refused naming the missing shard. Likewise a stray
// mask beside text.
TEST(SftTraining, LossMasksMissingFromAnSftDataSetAreRefused) {
  const std::string copy = fixture::temp_dir("tessel-sft-no-masks");
  fs::copy(sft_dataset(), copy, fs::copy_options::recursive | fs::copy_options::overwrite_existing);
  for (const char* shard : {"train", "val"}) fs::remove(copy + "/" + shard + ".loss_mask.tok");
  Config c = sft_config(fixture::temp_dir("tessel-sft-run"));
  c.data.path = copy;
  fixture::expect_input_error(
      [&] { fixture::train_run(c); },
      {copy + "/dataset.json", "\"sft\"", copy + "/train.loss_mask.tok is missing"});
  const std::string text = fixture::make_dataset(fixture::temp_dir("tessel-sft-stray-mask"));
  fs::copy_file(sft_dataset() + "/val.loss_mask.tok", text + "/val.loss_mask.tok");
  c.data.path = text;
  fixture::expect_input_error([&] { fixture::train_run(c); }, {text + "/val.loss_mask.tok exists"});
}

// train.init_from: the run starts from the checkpoint's weights (its first loss is what those
// weights give on its first batch, computed here without the trainer), refuses another model
// shape, and a resume of the fine-tuning run continues from its own checkpoint, not the init.
TEST(SftTraining, InitFromStartsFromTheCheckpointWeights) {
  comm::SingleCommunicator self;
  Config pre = fixture::tiny_config(fixture::shared_dataset(self), fixture::temp_dir("tessel-pre"));
  pre.model.max_seq = 128;
  pre.train.steps = 10;
  fixture::train_run(pre);

  Config tune = sft_config(fixture::temp_dir("tessel-tune"));
  tune.train.init_from = pre.run.dir;
  tune.train.steps = 6;
  tune.train.checkpoint_every = 3;
  const TrainResult tuned = fixture::train_run(tune);

  const auto loaded = load_run_checkpoint(pre.run.dir);
  model::Gpt gpt(tune.model, 0);
  for (const auto& p : gpt.parameters())
    restore_tensor(loaded.content.model, p.name, p.value, loaded.dir);
  data::DataLoader loader(tune.data.path + "/train.tok",
                          {tune.train.seq_len, tune.train.micro_batch, tune.train.accum, 0, 1,
                           uint64_t(tune.run.seed), tune.data.shuffle});
  double sum = 0, count = 0;
  for (int m = 0; m < tune.train.accum; ++m) {
    const data::Batch b = loader.next();
    const BatchInputs in(b, AttentionMaskKind::causal_document);
    auto acts = gpt.make_activations(b.B, b.T);
    sum += gpt.forward(*acts, in.inputs());
    count += in.loss_weight_sum();
  }
  EXPECT_NEAR(tuned.steps.front().loss, sum / count, 1e-6 * sum / count);
  // A random start is far from it.
  Config scratch = tune;
  scratch.train.init_from.clear();
  scratch.run.dir = fixture::temp_dir("tessel-scratch");
  EXPECT_GT(std::fabs(fixture::train_run(scratch).steps.front().loss - tuned.steps.front().loss),
            0.1);

  // The resume takes the run's own step-3 checkpoint, not the init again.
  fixture::expect_resume_continues_bitwise(self, tune, 3, [&] {
    std::filesystem::remove_all(tune.run.dir + "/checkpoints/step-00000006");
  });

  // Every differing model key is named at once; training settings such as init_std may differ.
  Config other = sft_config(fixture::temp_dir("tessel-tune"));
  other.train.init_from = pre.run.dir;
  other.model.width = 64;
  other.model.bias = true;
  other.model.init_std = 0.05;
  fixture::expect_input_error([&] { fixture::train_run(other); },
                              {"train.init_from", "model.width = 32 (this run: 64)",
                               "model.bias = false (this run: true)"});
  other.model.width = 32;
  other.model.bias = false;
  EXPECT_EQ(fixture::train_run(other).steps.size(), 30u) << "init_std may differ";
  other.run.dir = fixture::temp_dir("tessel-tune");
  other.train.init_from = pre.run.dir + "/nowhere";
  fixture::expect_input_error([&] { fixture::train_run(other); },
                              {"train.init_from = ", "nowhere"});
  // An export, and a base run that has saved no checkpoint yet, are named as generate names
  // them.
  const std::string exported = fixture::temp_dir("tessel-export") + "/out";
  export_checkpoint(pre.run.dir, exported);
  other.train.init_from = exported;
  fixture::expect_input_error([&] { fixture::train_run(other); },
                              {"train.init_from = " + exported, "an export (model.safetensors)",
                               "pass the run it was exported from"});
  const std::string starting = fixture::temp_dir("tessel-pre");
  fs::copy_file(pre.run.dir + "/config.toml", starting + "/config.toml");
  other.train.init_from = starting;
  fixture::expect_input_error([&] { fixture::train_run(other); },
                              {"train.init_from = " + starting, "the run has no checkpoint yet"});
}

// A base checkpoint copied out of its run has no copy of the run's tokenizer beside it: its
// data.path's speaks for it, checked against the checkpoint's record as generate checks it.
TEST(SftTraining, InitFromACopiedCheckpointChecksItsDataPath) {
  const std::string data = fixture::make_dataset(fixture::temp_dir("tessel-pre-data") + "/text");
  Config pre = fixture::tiny_config(data, fixture::temp_dir("tessel-pre"));
  pre.model.max_seq = 128;
  pre.train.steps = 6;
  fixture::train_run(pre);
  const std::string loose = fixture::temp_dir("tessel-loose") + "/step";
  fs::copy(pre.run.dir + "/checkpoints/step-00000006", loose, fs::copy_options::recursive);
  Config tune = sft_config(fixture::temp_dir("tessel-tune"));
  tune.train.init_from = loose;
  tune.train.steps = 6;
  EXPECT_EQ(fixture::train_run(tune).steps.size(), 6u);
  fixture::make_other_dataset(data);  // prepared again: not the shards the base trained on
  tune.run.dir = fixture::temp_dir("tessel-tune");
  fixture::expect_input_error([&] { fixture::train_run(tune); },
                              {"train.init_from: " + loose + ": no copy of the run's tokenizer",
                               data + " changed since the run"});
}

// A restarted attempt before the run's first checkpoint starts from the checkpoint the first
// attempt took (init.json), not from a newer one the base run saved since; a pinned checkpoint
// that is gone is an error that says how to start over.
TEST(SftTraining, InitFromIsPinnedAcrossAttempts) {
  comm::SingleCommunicator self;
  Config pre = fixture::tiny_config(fixture::shared_dataset(self), fixture::temp_dir("tessel-pre"));
  pre.model.max_seq = 128;
  pre.train.steps = 4;
  pre.train.checkpoint_every = 2;
  pre.optim.warmup_steps = 1;
  fixture::train_run(pre);  // checkpoints at 2 and 4

  Config tune = sft_config(fixture::temp_dir("tessel-tune"));
  tune.train.init_from = pre.run.dir;
  tune.train.steps = 2;
  tune.optim.warmup_steps = 1;
  tune.train.save_final = false;  // a run that never saved: its restart inits again
  const TrainResult first = fixture::train_run(tune);
  std::ifstream in(tune.run.dir + "/init.json");
  const auto pin = nlohmann::json::parse(in);
  EXPECT_EQ(pin["step"], 4);
  EXPECT_EQ(pin["init_from"], pre.run.dir);

  // The base run moves on to step 6; the restart still starts from step 4.
  pre.train.steps = 6;
  fixture::train_run(pre);
  const TrainResult again = fixture::train_run(tune);
  EXPECT_EQ(again.resumed_from, -1);
  EXPECT_EQ(again.steps.front().loss, first.steps.front().loss);
  // A fresh run with the same init_from takes step 6.
  Config fresh = tune;
  fresh.run.dir = fixture::temp_dir("tessel-tune");
  EXPECT_NE(fixture::train_run(fresh).steps.front().loss, first.steps.front().loss);

  std::filesystem::remove_all(pin["checkpoint"].get<std::string>());
  fixture::expect_input_error([&] { fixture::train_run(tune); },
                              {"first attempt started from", "init.json", "remove"});
  // A fresh start (train.resume = false) does not read the pin: it takes step 6 (and pins it).
  Config unpinned = tune;
  unpinned.train.resume = false;
  EXPECT_NE(fixture::train_run(unpinned).steps.front().loss, first.steps.front().loss);

  // The run's first checkpoint ends the pin: from then on a restart resumes.
  std::filesystem::remove(tune.run.dir + "/init.json");
  tune.train.save_final = true;
  fixture::train_run(tune);
  EXPECT_TRUE(std::filesystem::exists(tune.run.dir + "/checkpoints/step-00000002"));
  EXPECT_FALSE(std::filesystem::exists(tune.run.dir + "/init.json"));
}

TEST(SftTraining, SwitchingDataKindsIsRefused) {
  // A run on text data cannot resume on an SFT data set (and the reverse).
  comm::SingleCommunicator self;
  Config text = sft_config(fixture::temp_dir("tessel-sft-run"));
  text.data.path = fixture::shared_dataset(self);
  text.train.steps = 2;
  text.optim.warmup_steps = 1;
  fixture::train_run(text);
  Config sft = text;
  sft.data.path = sft_dataset();
  sft.train.steps = 4;
  fixture::expect_input_error([&] { fixture::train_run(sft); },
                              {"trained on a text data set", "is an SFT data set"});
  // Nor with another data.overlong (it decides the rows). Rows of 64 tokens leave samples out,
  // so the packed rows change too: the setting is named, not the rows.
  Config tuned = sft_config(fixture::temp_dir("tessel-sft-run"));
  tuned.model.max_seq = tuned.train.seq_len = 64;
  tuned.train.steps = 2;
  tuned.optim.warmup_steps = 1;
  fixture::train_run(tuned);
  tuned.data.overlong = data::Overlong::cut;
  tuned.train.steps = 4;
  fixture::expect_input_error([&] { fixture::train_run(tuned); },
                              {"checkpoint has data.overlong = drop but this run has cut"});
}

}  // namespace
}  // namespace tessel::train
