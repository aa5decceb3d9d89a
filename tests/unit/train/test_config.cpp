#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>

#include "support/expect_input_error.hpp"
#include "support/train_fixture.hpp"
#include "tessel/core/error.hpp"
#include "tessel/train/config.hpp"

using namespace tessel;
using fixture::expect_input_error;
using train::Config;

namespace {

std::string write_file(const std::string& name, const std::string& text) {
  std::string path = fixture::temp_dir("tessel-config") + "/" + name;
  std::ofstream(path) << text;
  return path;
}

}  // namespace

TEST(Config, FileAndOverridesApplyInOrder) {
  std::string path = write_file("a.toml", "[model]\nwidth = 64\nheads = 4\n[train]\nsteps = 300\n");
  Config c = train::load_config(path, {"train.steps=400", "model.mlp=swiglu"});
  EXPECT_EQ(c.model.width, 64);
  EXPECT_EQ(c.model.heads, 4);
  EXPECT_EQ(c.train.steps, 400);
  EXPECT_EQ(c.model.mlp, model::MlpType::swiglu);
  EXPECT_EQ(c.model.layers, train::default_model().layers);  // untouched default
}

TEST(Config, ResolvedTomlRoundTrips) {
  Config c = train::load_config("", {"model.width=96", "model.heads=6", "optim.lr=0.0123",
                                     "train.sample_prompt=He said \"hi\"", "data.shuffle=false"});
  c.train.sample_prompt += "\n\tand then\x01 \\ left";
  c.train.sample_stop = "\n";  // configs/sft.toml's: a leading newline must survive
  std::string text = train::to_toml(c);
  Config back = train::parse_config(text, "resolved.toml", {});
  EXPECT_EQ(train::to_toml(back), text);
  EXPECT_EQ(back.optim.lr, 0.0123);
  EXPECT_EQ(back.train.sample_prompt, "He said \"hi\"\n\tand then\x01 \\ left");
  EXPECT_EQ(back.train.sample_stop, "\n");
  EXPECT_FALSE(back.data.shuffle);
}

// A config a run wrote is read without the checks across keys, which a later version may have
// tightened (a run that set parallel.cp_chunks beside zigzag, or optim.ns_steps = 2 with a
// restart before step 2, was accepted once): eval, generate, export and simulate still read it.
// Its model is still checked.
TEST(Config, AStoredConfigIsReadEvenWhereTodaysChecksRefuseIt) {
  Config c = train::load_config("", {});
  c.parallel.cp = 2;
  c.parallel.cp_chunks = 3;
  c.optim.ns_steps = 2;
  c.optim.ns_restarts = "2";
  const std::string text = train::to_toml(c);
  expect_input_error([&] { train::parse_config(text, "stored.toml", {}); }, {"optim.ns_restarts"});
  const Config back = train::parse_stored_config(text, "stored.toml");
  EXPECT_EQ(back.parallel.cp_chunks, 3);
  EXPECT_EQ(back.optim.ns_steps, 2);
  EXPECT_EQ(train::to_toml(back), text);
  c = train::load_config("", {});
  c.model.heads = 7;  // does not divide the width
  expect_input_error([&] { train::parse_stored_config(train::to_toml(c), "stored.toml"); },
                     {"heads"});
}

// Checkpoints' compatibility records hold settings as TOML text: a string's quoting, a float's
// digits may differ between versions of the writer, the setting may not.
TEST(Config, SameSettingComparesValuesNotSpelling) {
  EXPECT_TRUE(train::same_config_text("model.mlp", "'gelu'", "\"gelu\""));
  EXPECT_TRUE(train::same_config_text("optim.name", "'muon'", "\"muon\""));
  EXPECT_TRUE(train::same_config_text("model.moe_layers", "'0,1'", "\"0,1\""));
  EXPECT_FALSE(train::same_config_text("model.mlp", "'gelu'", "\"swiglu\""));
  EXPECT_FALSE(train::same_config_text("model.mlp", "'gelu'", "\"gelu"));  // not TOML
  EXPECT_TRUE(train::same_config_text("optim.lr", "1e-05", "1.0000000000000001e-05"));
  EXPECT_FALSE(train::same_config_text("optim.lr", "1e-05", "2e-05"));
  EXPECT_FALSE(train::same_config_text("model.width", "64", "96"));
}

TEST(Config, UnknownKeysAreRejected) {
  std::string path = write_file("b.toml", "[model]\nwidht = 64\n");
  expect_input_error([&] { train::load_config(path, {}); }, {path, "model.widht", "unknown"});
  expect_input_error([&] { train::load_config("", {"train.stepz=3"}); }, {"train.stepz"});
  expect_input_error([&] { train::load_config("", {"nokey"}); }, {"key=value"});
}

// An unknown table is refused as an unknown key is, also without keys; a key is no table.
TEST(Config, UnknownTablesAreRejected) {
  for (const auto& [text, message] :
       {std::pair{"[trian]\n", "t.toml:1: unknown config table [trian]"},
        std::pair{"[train]\nsteps = 5\n[train.sub]\n",
                  "t.toml:3: unknown config table [train.sub]"},
        std::pair{"[train.steps]\n",
                  "t.toml:1: config key 'train.steps' expects an integer, got a table"},
        std::pair{"train = { sub = {} }\n", "t.toml:1: unknown config table [train.sub]"},
        // One with keys names its first key, as written (a dotted key or under a header).
        std::pair{"trian.steps = 5\n", "t.toml:1: unknown config key 'trian.steps'"},
        std::pair{"[trian]\nsteps = 5\n", "t.toml:2: unknown config key 'trian.steps'"}})
    expect_input_error([&] { train::parse_config(text, "t.toml", {}); }, {message});
  EXPECT_EQ(train::parse_config("[train]\n[model]\nwidth = 64\n", "t.toml", {}).model.width, 64);
}

// A value is read by TOML's rules in a file and in --set alike: the same setting, or the same
// refusal (after where it comes from: "f.toml:2: " or "--set: ").
TEST(Config, FileAndSetReadValuesAlike) {
  const std::pair<const char*, std::vector<const char*>> cases[] = {
      {"run.seed",
       {"1_000", "0x10", "0o10", "0b11", "+5", "-3", "9223372036854775807", "1e3", "1.5", "inf",
        "true", "abc", "=5", "1 2", "[1]"}},
      {"train.grad_clip",
       {"0.5", "+2.5", "1_000.5", "3", "0x10", "1e-320", "5e-324", "-5e-324", "0e-400", "0.0",
        "1e-400", "-1e-400", "1_0e-4_00", "inf", "-inf", "nan", "false", "x"}},
      {"run.quiet", {"true", "false", "True", "1", "yes"}}};
  for (const auto& [key, values] : cases)
    for (const std::string value : values) {
      SCOPED_TRACE(std::string(key) + " = " + value);
      const std::string whole(key);
      const size_t dot = whole.find('.');
      const std::string table = whole.substr(0, dot), name = whole.substr(dot + 1);
      const std::string text = "[" + table + "]\n" + name + " = " + value;
      std::string from_file, from_set;
      try {
        from_file = train::to_toml(train::parse_config(text, "f.toml", {}));
      } catch (const InputError& e) {
        from_file = e.what();
      }
      try {
        from_set = train::to_toml(train::load_config("", {std::string(key) + "=" + value}));
      } catch (const InputError& e) {
        from_set = e.what();
      }
      const std::string at_line = "f.toml:2: ", at_set = "--set: ";
      if (from_file.rfind(at_line, 0) == 0 && from_set.rfind(at_set, 0) == 0)
        EXPECT_EQ(from_file.substr(at_line.size()), from_set.substr(at_set.size()));
      else if (from_file.rfind("f.toml:2:", 0) == 0)  // a TOML syntax error, in toml++'s words
        EXPECT_EQ(from_set.rfind("--set: config key '" + std::string(key) + "'", 0), 0u)
            << from_file << " | " << from_set;
      else
        EXPECT_EQ(from_file, from_set);
    }
  // The values themselves, against what TOML says they are.
  auto set = [](const std::string& assignment) { return train::load_config("", {assignment}); };
  EXPECT_EQ(set("run.seed=1_000").run.seed, 1000);
  EXPECT_EQ(set("run.seed=0x10").run.seed, 16);
  EXPECT_EQ(set("run.seed=0o10").run.seed, 8);
  EXPECT_EQ(set("run.seed=0b11").run.seed, 3);
  EXPECT_EQ(set("run.seed=+5").run.seed, 5);
  EXPECT_EQ(set("train.grad_clip=5e-324").train.grad_clip,
            std::numeric_limits<double>::denorm_min());
  EXPECT_EQ(set("train.grad_clip=1e-320").train.grad_clip, 1e-320);
  EXPECT_EQ(set("train.grad_clip=3").train.grad_clip, 3.0);
  // A nonzero literal that would read as 0 or inf is refused, not trained with clipping off.
  for (const char* value : {"1e-400", "-1e-400", "1e400"})
    expect_input_error([&] { set(std::string("train.grad_clip=") + value); },
                       {std::string("--set: config key 'train.grad_clip' = ") + value +
                        " is outside a double's range"});
  expect_input_error([&] { train::parse_config("[optim]\nlr = 1e-400\n", "f.toml", {}); },
                     {"f.toml:2: config key 'optim.lr' = 1e-400 is outside a double's range"});
  // The literal is found by code points: text before it on its line may hold UTF-8 (the keys
  // of a table are read in order, grad_clip before the unknown key).
  expect_input_error(
      [&] {
        train::parse_config("train = { \"\xc3\xa9\xc3\xa9\" = 1, grad_clip = 1e-400 }\n", "f.toml",
                            {});
      },
      {"f.toml:1: config key 'train.grad_clip' = 1e-400 is outside a double's range"});
  // A float is no integer, wherever it is given.
  expect_input_error([&] { train::parse_config("[run]\nseed = 1e3\n", "f.toml", {}); },
                     {"f.toml:2: config key 'run.seed' expects an integer, got a float"});
  expect_input_error(
      [&] { set("run.seed==5"); },
      {"--set: config key 'run.seed': expected an integer as TOML writes one", "got '=5'"});
  // C's spellings that TOML refuses say so.
  expect_input_error([&] { set("optim.momentum=.95"); },
                     {"--set: config key 'optim.momentum': expected a number as TOML writes one "
                      "(0.95, 1e-3, 1_000.5), got '.95'"});
  // A byte-order mark is no column: the literal on line 1 is still read whole.
  expect_input_error(
      [&] { train::parse_config("\xEF\xBB\xBFtrain.grad_clip = 1e-400\n", "f.toml", {}); },
      {"f.toml:1: config key 'train.grad_clip' = 1e-400 is outside a double's range"});
}

// The optimizer's string settings are choice keys as the model's enums are: the same error,
// in a file and in --set, and --help-config lists their names.
TEST(Config, OptimizerNamesAreChoiceKeys) {
  expect_input_error([] { train::parse_config("[optim]\nname = 'sgd'\n", "f.toml", {}); },
                     {"f.toml:2: config key 'optim.name': expected one of adamw|muon|dion2|dion3, "
                      "got 'sgd'"});
  for (const auto& [key, names] : {std::pair{"optim.momentum_form", "sum|lerp"},
                                   std::pair{"optim.lr_rule", "spectral_norm|rms_norm|keller"},
                                   std::pair{"optim.ns_coefficients", "keller|polar_express|you"},
                                   std::pair{"optim.ns_normalize", "frobenius|aol"},
                                   std::pair{"optim.selection_scope", "local|global"},
                                   std::pair{"optim.muon_mode", "sharded|replicated|allgather"},
                                   std::pair{"optim.qkv_split", "none|blocks|heads"}}) {
    expect_input_error(
        [&] { train::load_config("", {std::string(key) + "=x"}); },
        {"--set: config key '" + std::string(key) + "': expected one of " + names + ", got 'x'"});
    const auto& schema = train::config_schema();
    const auto entry = std::find_if(schema.begin(), schema.end(),
                                    [&](const train::ConfigKey& k) { return k.name == key; });
    ASSERT_NE(entry, schema.end());
    EXPECT_EQ(entry->type, names);
  }
  EXPECT_EQ(train::load_config("", {"optim.qkv_split=heads"}).optim.qkv_split, "heads");
}

TEST(Config, WrongTypesAndValuesNameTheKey) {
  std::string path = write_file("c.toml", "[train]\nsteps = \"many\"\n");
  expect_input_error([&] { train::load_config(path, {}); }, {path, "train.steps"});
  expect_input_error([&] { train::load_config("", {"train.steps=1.5"}); }, {"train.steps"});
  expect_input_error([&] { train::load_config("", {"model.norm=batchnorm"}); },
                     {"model.norm", "layernorm|rmsnorm"});
  expect_input_error([&] { train::load_config("", {"run.quiet=yes"}); }, {"run.quiet"});
  expect_input_error([&] { train::load_config("", {"train.micro_batch=0"}); },
                     {"train.micro_batch"});
  expect_input_error([&] { train::load_config("", {"train.keep_checkpoints=1"}); },
                     {"train.keep_checkpoints"});
  EXPECT_EQ(train::load_config("", {"train.keep_checkpoints=0"}).train.keep_checkpoints, 0);
  expect_input_error([&] { train::load_config("", {"run.threads=5000"}); },
                     {"run.threads", "4096"});
  // An integer key's range error prints the integer (not 1e+06).
  expect_input_error([&] { train::load_config("", {"optim.ns_steps=1000000"}); },
                     {"optim.ns_steps = 1000000 is out of range"});
  expect_input_error([&] { train::load_config("", {"optim.ns_gram_min=-1000000"}); },
                     {"optim.ns_gram_min = -1000000 is out of range"});
  expect_input_error([&] { train::load_config("", {"train.eval_every=-1000000"}); },
                     {"'train.eval_every' must not be negative, got -1000000"});
  // A peak so small (a denormal) that the MFU overflowed to infinity, which metrics.jsonl held
  // as null; 0 (measure) and the smallest allowed are accepted.
  for (const char* peak : {"1e-310", "9e-7", "-1"})
    expect_input_error([&] { train::load_config("", {std::string("mfu.peak_gflops=") + peak}); },
                       {"'mfu.peak_gflops' = ", "must be 0 (measure) or >= 1e-06"});
  for (const double peak : {0.0, train::kMinPeakGflops})
    EXPECT_EQ(train::load_config("", {"mfu.peak_gflops=" + std::to_string(peak)}).mfu.peak_gflops,
              peak);
}

TEST(Config, SequenceLongerThanTheModelAllows) {
  expect_input_error(
      [&] {
        train::load_config("", {"train.seq_len=300", "model.max_seq=256"});
      },
      {"train.seq_len", "model.max_seq"});
}

// Context parallelism cuts each sequence into 2 * cp zigzag chunks.
TEST(Config, ContextParallelNeedsEvenChunks) {
  expect_input_error(
      [&] {
        train::load_config("", {"parallel.cp=3", "train.seq_len=64"});
      },
      {"parallel.cp", "train.seq_len"});
  EXPECT_EQ(train::load_config("", {"parallel.cp=4", "train.seq_len=64"}).parallel.cp, 4);
  // contiguous and balanced: cp_chunks chunks per rank.
  expect_input_error(
      [&] {
        train::load_config("", {"parallel.cp=2", "parallel.cp_layout=balanced",
                                "parallel.cp_chunks=3", "train.seq_len=64"});
      },
      {"parallel.cp_chunks", "train.seq_len"});
  EXPECT_EQ(train::load_config("", {"parallel.cp=2", "parallel.cp_layout=balanced",
                                    "parallel.cp_chunks=3", "train.seq_len=48"})
                .parallel.cp_layout,
            train::CpLayoutKind::balanced);
  expect_input_error([&] { train::load_config("", {"parallel.cp_chunks=0"}); },
                     {"parallel.cp_chunks"});
  // Set where it means nothing (zigzag's 2 chunks per rank), it is refused; at cp = 1 the
  // layout keys are ignored, so a cp config runs as its own one-rank reference.
  expect_input_error(
      [&] {
        train::load_config("", {"parallel.cp=2", "parallel.cp_chunks=3"});
      },
      {"parallel.cp_chunks", "zigzag"});
  EXPECT_EQ(train::load_config("", {"parallel.cp_layout=contiguous", "parallel.cp_chunks=3"})
                .parallel.cp_chunks,
            3);
  expect_input_error([&] { train::load_config("", {"parallel.cp_layout=spiral"}); },
                     {"parallel.cp_layout", "spiral"});
  // MoE blocks compose with cp (and ep inside dp).
  EXPECT_EQ(train::load_config("", {"parallel.cp=2", "train.seq_len=64", "model.moe_layers=all",
                                    "parallel.ep=2", "parallel.dp=2"})
                .parallel.cp,
            2);
  // ... except the sequence-wise aux loss, whose sums are per sequence on one rank.
  expect_input_error(
      [&] {
        train::load_config("", {"parallel.cp=2", "train.seq_len=64", "model.moe_layers=all",
                                "model.moe_balance=seq_aux"});
      },
      {"parallel.cp", "seq_aux"});
  EXPECT_EQ(train::load_config("", {"model.moe_layers=all", "model.moe_balance=seq_aux"})
                .model.moe.balance,
            moe::Balance::seq_aux);
  expect_input_error(
      [&] {
        train::load_config(
            "", {"model.moe_layers=all", "model.moe_balance=seq_aux", "model.moe_score=sigmoid"});
      },
      {"seq_aux", "softmax"});
  // Expert choice composes with cp and ep (its selection gathers the micro-batch's scores);
  // it has no later token to drop by position.
  EXPECT_EQ(
      train::load_config("", {"parallel.cp=2", "train.seq_len=64", "model.moe_layers=all",
                              "parallel.ep=2", "parallel.dp=2", "model.moe_balance=expert_choice"})
          .model.moe.balance,
      moe::Balance::expert_choice);
  expect_input_error(
      [&] {
        train::load_config("", {"model.moe_layers=all", "model.moe_balance=expert_choice",
                                "model.moe_drop=position"});
      },
      {"expert_choice", "model.moe_drop", "probability"});
}

// qb_hist: a named balance with its bin count, 1000 by default; fewer than 2 bins are refused
// by name (whatever the balance, as model.moe_eqb_step's range is).
TEST(Config, QbHistIsANamedBalanceWithItsBinCount) {
  const train::Config hist =
      train::load_config("", {"model.moe_layers=all", "model.moe_balance=qb_hist"});
  EXPECT_EQ(hist.model.moe.balance, moe::Balance::qb_hist);
  EXPECT_EQ(hist.model.moe.hist_bins, 1000);
  EXPECT_EQ(train::load_config(
                "", {"model.moe_layers=all", "model.moe_balance=qb_hist", "model.moe_hist_bins=64"})
                .model.moe.hist_bins,
            64);
  expect_input_error(
      [&] {
        train::load_config(
            "", {"model.moe_layers=all", "model.moe_balance=qb_hist", "model.moe_hist_bins=1"});
      },
      {"model.moe_hist_bins = 1", "[2, 1048576]"});
}

// LEI's margin and loss: named choices, midpoint and centered_fsq by default; exact_margin
// ranks the micro-batch's tokens on one rank, so not under cp; the identity kernel uses no
// margin, so none may be set beside it.
TEST(Config, LeiMarginAndLossAreNamedChoices) {
  const train::Config lei =
      train::load_config("", {"model.moe_layers=all", "model.moe_balance=lei"});
  EXPECT_EQ(lei.model.moe.lei_margin, moe::LeiMargin::midpoint);
  EXPECT_EQ(lei.model.moe.lei_loss, moe::LeiLoss::centered_fsq);
  const train::Config set =
      train::load_config("", {"model.moe_lei_margin=topk_plus_one", "model.moe_lei_loss=totalvio"});
  EXPECT_EQ(set.model.moe.lei_margin, moe::LeiMargin::topk_plus_one);
  EXPECT_EQ(set.model.moe.lei_loss, moe::LeiLoss::totalvio);
  expect_input_error([&] { train::load_config("", {"model.moe_lei_margin=top_k"}); },
                     {"model.moe_lei_margin", "top_k", "midpoint|topk|topk_plus_one|exact_margin"});
  expect_input_error([&] { train::load_config("", {"model.moe_lei_loss=mse"}); },
                     {"model.moe_lei_loss", "mse", "centered_fsq|fsq|maxvio|totalvio"});
  const std::vector<std::string> exact_cp = {"parallel.cp=2", "train.seq_len=64",
                                             "model.moe_layers=all", "model.moe_balance=eqb_lei",
                                             "model.moe_lei_margin=exact_margin"};
  expect_input_error([&] { train::load_config("", exact_cp); },
                     {"parallel.cp", "model.moe_lei_margin", "exact_margin"});
  const std::vector<std::string> exact(exact_cp.begin() + 2, exact_cp.end());
  EXPECT_EQ(train::load_config("", exact).model.moe.lei_margin, moe::LeiMargin::exact_margin);
  // The identity kernel uses no margin: one set beside it is refused, not ignored.
  std::vector<std::string> identity = exact;
  identity.push_back("model.moe_lei_kernel=identity");
  expect_input_error([&] { train::load_config("", identity); },
                     {"model.moe_lei_margin", "identity"});
  identity.pop_back();
  identity.pop_back();
  identity.push_back("model.moe_lei_kernel=identity");
  EXPECT_EQ(train::load_config("", identity).model.moe.lei_kernel, moe::LeiKernel::identity);
}

// Gradient-spike skipping and its fault are whole-step settings: refused under PACI, and the
// schedule settings are checked where they apply.
TEST(Config, SpikeSkippingAndScheduleSettings) {
  // Under PACI each stage steps with its own norm; the flush schedules share one.
  for (const char* key : {"train.spike_factor=5", "fault.spike_step=3"}) {
    expect_input_error(
        [&] {
          train::load_config("", {key, "parallel.pp=2", "pipeline.schedule=paci",
                                  "model.tied_head=false", "train.accum=2"});
        },
        {std::string(key).substr(0, std::string(key).find('=')), "PACI", "flush schedule"});
    EXPECT_EQ(train::load_config("", {key, "parallel.pp=2"}).parallel.pp, 2);
    EXPECT_EQ(train::load_config("", {key, "parallel.pp=2", "pipeline.schedule=gpipe"}).parallel.pp,
              2);
  }
  expect_input_error([] { train::load_config("", {"train.spike_factor=0.5"}); },
                     {"train.spike_factor = 0.5"});
  expect_input_error([] { train::load_config("", {"train.steps=9223372036854775807"}); },
                     {"'train.steps' = 9223372036854775807", "larger than tessel supports"});
  EXPECT_EQ(train::load_config("", {"train.steps=1099511627776"}).train.steps, int64_t(1) << 40);
  // Micro-batch numbers (train.steps x per step) times pipeline.chunks stay within 2^62.
  EXPECT_EQ(
      train::load_config("", {"train.steps=1099511627776", "train.accum=4194304"}).train.accum,
      int64_t(1) << 22);
  expect_input_error(
      [] {
        train::load_config("", {"train.steps=1099511627776", "train.accum=4194305"});
      },
      {"'train.steps' = 1099511627776 times 'train.accum' = 4194305", "4611686018427387904"});
  expect_input_error(
      [] {
        train::load_config("",
                           {"train.steps=1099511627776", "parallel.pp=2", "pipeline.schedule=paci",
                            "model.tied_head=false", "pipeline.paci_k=16777216"});
      },
      {"'pipeline.paci_k' = 16777216", "larger than tessel supports"});
  expect_input_error(
      [] {
        train::load_config(
            "", {"train.steps=1099511627776", "parallel.pp=2", "pipeline.schedule=interleaved",
                 "train.accum=2097152", "pipeline.chunks=4"});
      },
      {"'train.accum' = 2097152 times 'pipeline.chunks' = 4", "larger than tessel supports"});
  // Counts whose products size buffers or meshes: refused before anything multiplies them.
  for (const char* key :
       {"pipeline.paci_k=16777217", "pipeline.chunks=4611686018427387904",
        "parallel.pp=9223372036854775807", "parallel.cp=16777217", "parallel.ep=16777217",
        "parallel.dp=4294967298", "parallel.cp_chunks=9223372036854775807"}) {
    const std::string name = std::string(key).substr(0, std::string(key).find('='));
    expect_input_error(
        [&] {
          train::load_config("", {key, "pipeline.schedule=paci", "model.tied_head=false"});
        },
        {"'" + name + "'", "larger than tessel supports"});
  }
  expect_input_error([] { train::load_config("", {"train.spike_factor=-2"}); },
                     {"train.spike_factor = -2"});
  EXPECT_EQ(train::load_config("", {"train.spike_factor=5"}).train.spike_factor, 5);
  expect_input_error(
      [] {
        train::load_config("", {"optim.schedule=wsd", "optim.decay_fraction=0"});
      },
      {"optim.decay_fraction = 0"});
  // Checked without wsd too: config.toml holds no value that fails once wsd is chosen.
  expect_input_error([] { train::load_config("", {"optim.decay_fraction=-5"}); },
                     {"optim.decay_fraction = -5"});
}

// data.path lists a mixture's directories, data.weights one positive share per directory.
TEST(Config, DataMixturesNeedOnePositiveWeightPerDataSet) {
  auto load = [](std::string path, std::string weights) {
    return train::load_config("", {"data.path=" + path, "data.weights=" + weights});
  };
  EXPECT_EQ(train::data_weights(load("a", "").data), std::vector<double>{1.0});
  expect_input_error([&] { load("a", "7"); }, {"'data.weights' = \"7\"", "several data sets"});
  const auto mixture = load(" data/web , data/code,x/code/,/ ", "3, 1,4,2");
  EXPECT_EQ(train::data_paths(mixture.data),
            (std::vector<std::string>{"data/web", "data/code", "x/code/", "/"}));
  EXPECT_EQ(train::data_weights(mixture.data), (std::vector<double>{3, 1, 4, 2}));
  // Two directories named code: their whole paths tell them apart; "/" has no last component.
  EXPECT_EQ(train::data_names(mixture.data),
            (std::vector<std::string>{"web", "data/code", "x/code/", "/"}));
  expect_input_error([&] { load("data/a,b,./data/a/", "1,1,1"); },
                     {"data.path", "lists ./data/a/ twice", "larger share in data.weights"});
  // An existing directory is the same data set however its path is spelled.
  const std::string dir = fixture::temp_dir("tessel-config-data");
  std::filesystem::create_directory(dir + "/set");
  std::filesystem::create_directory_symlink(dir + "/set", dir + "/link");
  const std::string relative = std::filesystem::relative(dir + "/set").string();
  expect_input_error([&] { load(relative + "," + dir + "/set", "1,1"); },
                     {"data.path", "lists " + dir + "/set twice"});
  expect_input_error([&] { load(dir + "/set," + dir + "/link", "1,1"); },
                     {"data.path", "lists " + dir + "/link twice"});
  expect_input_error([&] { load("a,b", "1e308,1e308"); }, {"data.weights", "sum overflows"});
  expect_input_error([&] { load("a,b", ""); },
                     {"data.weights", "0 weights for the 2 data sets", "one weight per data set"});
  expect_input_error([&] { load("a,b", "1,2,3"); }, {"3 weights for the 2 data sets"});
  expect_input_error([&] { load("a,b", "1,0"); }, {"data.weights", "'0' is not a number > 0"});
  // Any positive number as TOML writes one; but a share below data::kMinShare would leave its
  // data set all but unread, as a weight of 0 would.
  EXPECT_EQ(train::data_weights(load("a,b", "5e-324,5e-324").data),
            (std::vector<double>{5e-324, 5e-324}));
  EXPECT_EQ(train::data_weights(load("a,b", "0x10,1_0").data), (std::vector<double>{16, 10}));
  EXPECT_EQ(train::data_weights(load("a,b", "2e-6,1").data), (std::vector<double>{2e-6, 1}));
  expect_input_error([&] { load("a,b", "0x1p3,1"); }, {"'0x1p3' is not a number > 0"});
  expect_input_error([&] { load("data/bible,data/fortunes", "1e-300,1"); },
                     {"data.weights", "data set bible's share is 1e-300",
                      "below the smallest, 1e-06", "leave it out of data.path"});
  expect_input_error([&] { load("a,b,c", "1,1e-6,1"); }, {"data set b's share is 5e-07"});
  expect_input_error([&] { load("a,b", "1,-1"); }, {"data.weights", "'-1' is not a number > 0"});
  expect_input_error([&] { load("a,,b", "1,1,1"); }, {"data.path", "'' is an empty item"});
  expect_input_error([&] { load("", ""); }, {"data.path", "empty"});
}

// --set takes a value that starts with a quote as one TOML string, as a config file would;
// any other value as written.
TEST(Config, QuotedOverridesAreTomlStrings) {
  Config c =
      train::load_config("", {"run.dir='runs/q2'", "train.sample_stop=\"\\n\"",
                              "train.sample_prompt=\"a\\tb \\\"c\\\"\"", "model.mlp=\"swiglu\""});
  EXPECT_EQ(c.run.dir, "runs/q2");
  EXPECT_EQ(c.train.sample_stop, "\n");
  EXPECT_EQ(c.train.sample_prompt, "a\tb \"c\"");
  EXPECT_EQ(c.model.mlp, model::MlpType::swiglu);
  c = train::load_config("", {"train.sample_prompt=say \"hi\"", "run.dir=runs/it's"});
  EXPECT_EQ(c.train.sample_prompt, "say \"hi\"");
  EXPECT_EQ(c.run.dir, "runs/it's");
  for (std::string bad : {"run.dir=\"runs/q3", "run.dir='runs/q3", "train.sample_prompt=\"x\" y",
                          "run.dir=\"a\" \"b\"", "run.dir=\"a\"\nother = 1"})
    expect_input_error([&] { train::load_config("", {bad}); },
                       {"--set " + bad.substr(0, bad.find('=')), "TOML string"});
  // A config file's string is taken as it stands, quotes inside it included.
  const std::string path = write_file("q.toml", "[train]\nsample_prompt = '\"quoted\"'\n");
  EXPECT_EQ(train::load_config(path, {}).train.sample_prompt, "\"quoted\"");
  // A quoted string for a number or bool key is refused as in a file, with the same words.
  const std::string file = write_file("s.toml", "[train]\nsteps = \"7\"\n");
  expect_input_error([&] { train::load_config(file, {}); },
                     {file + ":2: config key 'train.steps' expects an integer, got a string"});
  for (std::string bad : {"train.steps=\"7\"", "optim.lr='0.1'", "run.quiet=\"true\""})
    expect_input_error([&] { train::load_config("", {bad}); },
                       {"--set: config key '" + bad.substr(0, bad.find('=')) + "' expects ",
                        "got a quoted string"});
  // An array or a date is no value of any key; a list is one string.
  const std::string array = write_file("a.toml", "[model]\nmoe_layers = [0, 1]\n");
  expect_input_error([&] { train::load_config(array, {}); },
                     {array + ":2: config key 'model.moe_layers' expects a string, got an array",
                      "comma-separated string"});
  const std::string date = write_file("d.toml", "[train]\nsteps = 2026-12-06\n");
  expect_input_error([&] { train::load_config(date, {}); },
                     {"'train.steps' expects an integer, got a date or time"});
  const std::string choice = write_file("c.toml", "[model]\nmlp = 1\n");
  expect_input_error([&] { train::load_config(choice, {}); },
                     {"'model.mlp' expects one of \"gelu\", \"swiglu\" (a string), got an "
                      "integer"});
}

// run.dir must be a directory or creatable as one: empty, a file, or below a file is an
// input error naming the key and the file in the way.
TEST(Config, RunDirectoryMustBeADirectory) {
  expect_input_error([&] { train::check_run_dir(""); }, {"run.dir", "empty"});
  const std::string file = write_file("not-a-dir", "x");
  for (const std::string& dir : {file, file + "/runs/x"})
    expect_input_error([&] { train::check_run_dir(dir); },
                       {"run.dir", dir, file, "not a directory"});
  const std::string fresh = fixture::temp_dir("tessel-config-run") + "/a/b";
  EXPECT_NO_THROW(train::check_run_dir(fresh));  // created later, with its parents
  EXPECT_NO_THROW(train::check_run_dir(fixture::temp_dir("tessel-config-run")));
}

TEST(Config, MissingAndMalformedFiles) {
  expect_input_error([&] { train::load_config("/nonexistent/x.toml", {}); },
                     {"/nonexistent/x.toml", "not found"});
  const std::string dir = fixture::temp_dir("tessel-config-dir");
  expect_input_error([&] { train::load_config(dir, {}); }, {dir, "is a directory"});
  std::string path = write_file("d.toml", "[model\nwidth = 3\n");
  expect_input_error([&] { train::load_config(path, {}); }, {path + ":1"});
}

TEST(Config, ModelFieldsAreValidated) {
  expect_input_error(
      [&] {
        train::load_config("", {"model.width=100", "model.heads=3"});
      },
      {"model.heads"});
  // The model computes in f32: a positive double that is 0 or inf there is refused.
  for (const char* key : {"model.norm_eps=1e-300", "model.init_std=1e300"})
    expect_input_error([&] { train::load_config("", {key}); }, {"outside the float range"});
  EXPECT_EQ(train::load_config("", {"model.norm_eps=1e-30"}).model.norm_eps, 1e-30);
  // A window is a length: at most the longest sequence tessel supports (a window near 2^63
  // overflowed the mask's arithmetic, a silently wrong attention).
  expect_input_error([&] { train::load_config("", {"model.attention_window=16777217"}); },
                     {"model.attention_window", "16777216"});
  EXPECT_EQ(train::load_config("", {"model.attention_window=16777216"}).model.attention_window,
            16777216);
  // MoE settings are checked without MoE blocks too: config.toml holds no broken setting.
  expect_input_error([&] { train::load_config("", {"model.moe_experts=0"}); },
                     {"model.moe_experts"});
}

// Values that pass a sign check but not what uses them: a fault at a step without a checkpoint,
// a bucket under one gradient, a sampling temperature that is inf as a float, an endless
// sample, bytes that config.toml cannot hold.
TEST(Config, ValuesAreCheckedForWhatUsesThem) {
  // A fault that strikes a checkpoint, at a step that saves none (fixed policy), would never
  // strike; with an adaptive policy the saves are not known in advance. Nor would any fault
  // beyond the last step, under any policy.
  const std::vector<std::string> saves = {"train.steps=30", "train.checkpoint_every=4",
                                          "optim.warmup_steps=2"};
  auto with = [&](std::vector<std::string> more) {
    more.insert(more.begin(), saves.begin(), saves.end());
    return train::load_config("", more);
  };
  expect_input_error(
      [&] {
        with({"fault.kill_in=checkpoint_write", "fault.kill_steps=8,5"});
      },
      {"fault.kill_steps", "names step 5", "saves no checkpoint"});
  expect_input_error([&] { with({"fault.corrupt_step=31"}); },
                     {"fault.corrupt_step", "names step 31", "beyond train.steps = 30"});
  for (const char* key : {"fault.kill_steps=5,31", "fault.hang_steps=31", "fault.spike_step=31"})
    expect_input_error(
        [&] {
          with({"train.checkpoint_policy=young", key});
        },
        {std::string(key).substr(0, std::string(key).find('=')), "names step 31",
         "beyond train.steps = 30: the fault would never strike"});
  EXPECT_EQ(with({"fault.hang_steps=30"}).fault.hang_steps, "30");
  EXPECT_EQ(with({"fault.kill_in=checkpoint_write", "fault.kill_steps=0,8,30"}).fault.kill_steps,
            "0,8,30");
  EXPECT_EQ(with({"fault.kill_steps=5"}).fault.kill_steps, "5");  // after the step's update
  EXPECT_EQ(with({"fault.corrupt_step=30"}).fault.corrupt_step, 30);
  expect_input_error(
      [&] {
        with({"fault.corrupt_step=30", "train.save_final=false"});
      },
      {"fault.corrupt_step", "names step 30"});  // the last step saves nothing
  EXPECT_EQ(with({"train.checkpoint_policy=young", "fault.kill_in=checkpoint_write",
                  "fault.kill_steps=5"})
                .fault.kill_steps,
            "5");
  expect_input_error([&] { train::load_config("", {"parallel.bucket_mb=1e-7"}); },
                     {"parallel.bucket_mb"});
  expect_input_error([&] { train::load_config("", {"parallel.bucket_mb=1e300"}); },
                     {"parallel.bucket_mb"});
  EXPECT_EQ(train::load_config("", {"parallel.bucket_mb=0.0001"}).parallel.bucket_mb, 0.0001);
  expect_input_error([&] { train::load_config("", {"train.sample_temperature=1e39"}); },
                     {"train.sample_temperature", "float range"});
  expect_input_error([&] { train::load_config("", {"train.sample_tokens=4294967297"}); },
                     {"train.sample_tokens", "1048576"});
  expect_input_error([&] { train::load_config("", {"train.sample_prompt=ab\xfe"}); },
                     {"train.sample_prompt", "not valid UTF-8"});
  EXPECT_EQ(train::load_config("", {"train.sample_prompt=\xc3\xbf"}).train.sample_prompt,
            "\xc3\xbf");
}

// A run keeps its tokenizer in <run.dir>/tokenizer; a checkpoint directory finds it however it
// is spelled, and one outside a run's checkpoints/ has none.
TEST(Config, ACheckpointFindsItsRunsTokenizerCopy) {
  namespace fs = std::filesystem;
  const std::string expected = (fs::absolute("runs/a").lexically_normal() / "tokenizer").string();
  for (const char* spelled :
       {"runs/a/checkpoints/step-00000005", "runs/a/checkpoints/step-00000005/",
        "./runs/a/checkpoints/../checkpoints/step-00000005"})
    EXPECT_EQ(train::checkpoint_tokenizer_dir(spelled), expected) << spelled;
  EXPECT_EQ(train::checkpoint_tokenizer_dir("step-00000005"), "");
  EXPECT_EQ(train::checkpoint_tokenizer_dir("/models/step-00000005"), "");
  EXPECT_EQ(train::run_tokenizer_dir("runs/a"), "runs/a/tokenizer");
}
