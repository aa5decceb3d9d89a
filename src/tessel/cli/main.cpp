// tessel — the command-line front end. Subcommands:
//   prepare     text, token-id or SFT corpus -> token shards (train.tok, val.tok; SFT: loss
//               masks too)
//   train       train a GPT (one process, or under mpirun: data parallel)
//   generate    sample text from a run's latest checkpoint
//   eval        a run's checkpoint's loss on a prepared data set
//   bench-gemm  this machine's GEMM peak, the denominator of MFU
//   run         supervise a training job: launch it under mpirun, relaunch it on failure
//   ett-report  a run's effective training time: ett.json, ett.html, ett_trace.json
//   export      consolidate a checkpoint into one safetensors file and its config
//   simulate    GPipe, 1F1B, PACI and ZB-H1 simulated from a pipeline run's measured stage
//               costs
#include <CLI/CLI.hpp>
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <thread>

#include "tessel/comm/world.hpp"
#include "tessel/core/error.hpp"
#include "tessel/core/threading.hpp"
#include "tessel/data/bpe_tokenizer.hpp"
#include "tessel/data/bpe_trainer.hpp"
#include "tessel/data/mixture.hpp"
#include "tessel/data/packing.hpp"
#include "tessel/data/prepare.hpp"
#include "tessel/data/tokenizer.hpp"
#include "tessel/kernels/cpu/gemm_peak.hpp"
#include "tessel/model/generate.hpp"
#include "tessel/model/gpt.hpp"
#include "tessel/train/batch_inputs.hpp"
#include "tessel/train/checkpoint.hpp"
#include "tessel/train/config.hpp"
#include "tessel/train/ett.hpp"
#include "tessel/train/export.hpp"
#include "tessel/train/pipeline_profile.hpp"
#include "tessel/train/run_model.hpp"
#include "tessel/train/supervisor.hpp"
#include "tessel/train/trainer.hpp"

using namespace tessel;

namespace {

std::string schema_help() {
  std::ostringstream os;
  os << "Config keys (TOML tables [run], [data], [model], [train], [optim], [parallel],\n"
        "[pipeline], [mfu], [fault]; override any with --set key=value). Defaults shown:\n\n";
  train::Config defaults;
  for (const auto& k : train::config_schema()) {
    std::string left = "  " + k.name + " = " + k.get(defaults);
    if (left.size() < 44) left.resize(44, ' ');
    os << left << " " << k.help << " (" << k.type << ")\n";
  }
  return os.str();
}

int run_prepare(const data::PrepareOptions& opts) {
  auto r = data::prepare_dataset(opts);
  auto split = [&](const data::SplitCounts& c) {
    return detail::concat(c.documents, r.sft ? " sample" : " document", c.documents == 1 ? "" : "s",
                          " / ", c.tokens, c.tokens == 1 ? " token" : " tokens",
                          r.sft ? detail::concat(" (", c.trained_tokens, " trained)") : "", " -> ",
                          c.path);
  };
  std::printf("prepared %s%s: train %s; val %s\n", opts.corpus.c_str(),
              r.sft ? " (SFT: loss masks beside the shards)" : "", split(r.train).c_str(),
              split(r.val).c_str());
  return 0;
}

int run_train_bpe(const data::PrepareOptions& split, int64_t vocab_size, const std::string& out) {
  const std::string& corpus = split.corpus;
  // Checked before the learning: a directory that describes the tokenizer of its token ids
  // (prepared shards, a run's or an export's copy) keeps what it describes.
  for (const char* metadata : data::kTokenizerMetadataFiles)
    if (std::filesystem::exists(std::filesystem::path(out) / metadata))
      input_error("train-bpe: --out ", out, " holds ", metadata,
                  ", the description of the tokenizer its token ids were made with (a prepared "
                  "data set, or a run's or an export's tokenizer copy); write the vocabulary to "
                  "another directory");
  std::vector<std::filesystem::path> outputs;  // what write_bpe_files replaces
  for (const char* file : data::kBpeFiles) outputs.push_back(std::filesystem::path(out) / file);
  data::check_corpus_outside(corpus, outputs, "train-bpe");
  const auto merges = data::learn_bpe_merges(data::training_documents(split), vocab_size - 257);
  const int64_t size = data::write_bpe_files(out, merges);
  std::printf(
      "learned %zu merge%s from %s%s: vocabulary of %lld ids -> %s/vocab.json, %s/merges.txt\n",
      merges.size(), merges.size() == 1 ? "" : "s", corpus.c_str(),
      size < vocab_size ? " (no pair occurs twice any more)" : "", static_cast<long long>(size),
      out.c_str(), out.c_str());
  return 0;
}

int run_generate(const std::string& run_dir, const std::string& tokenizer_dir,
                 const std::string& prompt, int64_t tokens, double temperature, int64_t top_k,
                 uint64_t seed, const std::string& stop) {
  model::check_temperature_range(temperature, "generate: temperature");
  model::check_sampling(temperature, top_k);  // before the prompt is printed
  const train::RunModel run = train::load_run_model(run_dir);
  // The tokenizer: --tokenizer's (the run's own, where it kept one), else the model's.
  std::string source = tokenizer_dir;
  std::unique_ptr<data::Tokenizer> tokenizer;
  if (!source.empty()) {
    if (!data::tokenizer_name(source))
      input_error("--tokenizer ", source,
                  ": no tokenizer there (a prepared data directory, a run's tokenizer/ or a "
                  "directory with vocab.json and merges.txt)");
    // The advice is not to prepare again: the run's copy already decodes its ids.
    const std::string copy = train::checkpoint_tokenizer_dir(run.checkpoint);
    data::check_same_tokenizer({copy, source},
                               detail::concat("generate decodes with the run's own copy in ", copy,
                                              ": leave out --tokenizer, or pass one that holds "
                                              "the same tokenizer"));
    tokenizer = data::load_tokenizer(source, run.config.model.vocab);
  } else {
    train::ModelTokenizer model =
        train::model_tokenizer(run.checkpoint, run.config, run.record, "generate",
                               ", or pass --tokenizer with the data directory the run trained on");
    source = model.dir;
    tokenizer = std::move(model.tokenizer);
  }
  if (!tokenizer)
    input_error(run.checkpoint, ": generate needs a tokenizer; ", source,
                " holds token ids without one (prepare them with --tokenizer bpe:DIR, or pass "
                "--tokenizer with a directory that has the vocabulary)");
  const model::Gpt& gpt = *run.gpt;
  const data::Tokenizer& tok = *tokenizer;
  const int32_t stop_token = tok.single_token(stop, "--stop");
  const std::vector<int32_t> ids = tok.encode_text(prompt, "--prompt");
  // The prompt, then each token as it is drawn.
  auto print = [&tok](std::span<const int32_t> part) {
    const std::string text = tok.decode(part);
    std::fwrite(text.data(), 1, text.size(), stdout);
    std::fflush(stdout);
  };
  print(ids);
  Rng rng{seed};
  try {
    model::generate(
        gpt, ids, tokens, float(temperature), top_k, rng, stop_token,
        [&print](int32_t token) { print(std::span<const int32_t>(&token, 1)); }, tok.vocab_size());
  } catch (const DivergenceError& e) {  // the checkpoint that holds the broken model
    std::printf("\n");
    throw DivergenceError(detail::concat(run.checkpoint, " (step ", run.step, "): ", e.what()));
  }
  std::printf("\n");
  return 0;
}

int run_bench_gemm(int64_t size, double seconds, int threads, bool json) {
  if (threads > 0) set_num_threads(threads);
  double gflops = kernels::measure_gemm_peak_gflops(size, seconds);
  if (json)
    std::printf("%s\n",
                nlohmann::json{{"size", size}, {"threads", num_threads()}, {"gflops", gflops}}
                    .dump()
                    .c_str());
  else
    std::printf("sgemm %lldx%lldx%lld, %d thread(s): %.1f GFLOP/s\n", static_cast<long long>(size),
                static_cast<long long>(size), static_cast<long long>(size), num_threads(), gflops);
  return 0;
}

// Exit status kExitTtrOverBound when a failure's TTR exceeded `max_ttr` (the report is
// written anyway).
int run_ett_report(const std::string& run_dir, double max_ttr) {
  train::EttReport r = train::write_ett_report(run_dir, max_ttr);
  std::printf(
      "%s: W %.3f s over %zu attempt(s), ETT %.2f%%, TTS %.3f s, NoF %d%s, MFU %s, "
      "goodput %s\nwrote %s/ett.json, %s/ett.html, %s/ett_trace.json\n",
      run_dir.c_str(), r.wall, r.attempts.size(), 100 * r.ett, r.tts, r.nof,
      r.nof ? (" (" + train::nof_by_cause_text(r) + ")").c_str() : "",
      train::mfu_percent_text(r.mfu).c_str(),
      r.goodput ? train::mfu_percent_text(r.goodput).c_str() : "n/a", run_dir.c_str(),
      run_dir.c_str(), run_dir.c_str());
  if (!r.attempts.empty() && r.attempts.back().open)
    std::printf(
        "attempt %d has no exit record: still running, or killed (counted up to its last "
        "record; a later attempt counts it as failed)\n",
        r.attempts.back().index);
  for (const auto& a : r.attempts)
    if (a.cut_line)
      std::printf(
          "attempt %d: the last line of its log is cut short (being written, or the process "
          "died writing it) and left out\n",
          a.index);
  auto over = train::ttr_over_bound(r);
  for (int i : over)
    std::fprintf(stderr,
                 "tessel: TTR of failure %d (attempt %d) was %.3f s, over --max-ttr %.3f s\n",
                 i + 1, r.failed_attempts[size_t(i)], r.ttr[size_t(i)], max_ttr);
  return over.empty() ? 0 : kExitTtrOverBound;
}

int run_export(const std::string& checkpoint, const std::string& out_dir) {
  train::ExportResult r = train::export_checkpoint(checkpoint, out_dir);
  // "out/" and "out" alike print out/model.safetensors.
  std::string out = out_dir;
  while (out.size() > 1 && out.back() == '/') out.pop_back();
  std::printf(
      "exported %s (step %lld): %lld tensors, %llu bytes -> %s/model.safetensors, "
      "%s/config.toml%s\n",
      r.checkpoint.c_str(), static_cast<long long>(r.step), static_cast<long long>(r.tensors),
      static_cast<unsigned long long>(r.bytes), out.c_str(), out.c_str(),
      r.tokenizer ? (", " + out + "/tokenizer/").c_str() : "");
  return 0;
}

// `sequences`: rows to evaluate, 0 = all, unset = the run's train.eval_sequences. Without
// `data_dir`, each of the run's data sets; for a mixture also their loss weighted by
// data.weights, which is what the run's validation reports. `data_dir` may list several
// (comma-separated), weighted by `weights_text` or equally.
int run_eval(const std::string& run_dir, const std::string& data_dir,
             const std::string& weights_text, const std::string& split,
             std::optional<int64_t> sequences, bool json) {
  train::RunModel run = train::load_run_model(run_dir);
  // The run's data sets and shares, or those given, checked by data.path's and data.weights'
  // rules; given without weights, equal shares.
  train::DataConfig given = run.config.data;
  if (!weights_text.empty() && data_dir.empty())
    input_error("--weights needs --data (the run's data sets have their data.weights)");
  if (!data_dir.empty()) {
    given.path = data_dir;
    given.weights = weights_text;
  }
  // The keys' errors name data.path / data.weights: say which flags they came from.
  auto as_flags = [&](auto check) {
    try {
      return check();
    } catch (const InputError& e) {
      if (data_dir.empty()) throw;
      input_error("--data / --weights (checked as data.path / data.weights): ", e.what());
    }
  };
  const std::vector<std::string> dirs = as_flags([&] { return train::data_paths(given); });
  if (!weights_text.empty() && dirs.size() == 1)
    input_error("--weights needs several --data directories");
  const bool equal = !data_dir.empty() && weights_text.empty();
  const std::vector<double> weights = as_flags([&] {
    return data::normalized_weights(equal ? std::vector<double>(dirs.size(), 1.0)
                                          : train::data_weights(given));
  });
  std::vector<data::ShardReader> shards;
  for (const auto& dir : dirs) {  // all checked before any evaluation: a typo costs no time
    const std::string shard = dir + "/" + split + ".tok";
    if (!std::filesystem::exists(shard))
      input_error(shard, ": no such shard",
                  data_dir.empty() ? " (the run's data.path, taken relative to this directory; "
                                     "pass --data)"
                                   : "");
    shards.emplace_back(shard);
    train::check_data_shard(shards.back(), run.config.model.vocab);
    // A run trained with a plain causal mask: its packed SFT samples would see each other.
    if (data::has_loss_mask(shard))
      train::check_packed_samples_mask(shard, run.config.data.attention_mask);
  }
  // The model reads the ids of its own tokenizer.
  std::vector<std::string> with_run_data =
      train::model_tokenizer_dirs(run.checkpoint, run.config, run.record);
  with_run_data.insert(with_run_data.end(), dirs.begin(), dirs.end());
  data::check_same_tokenizer(with_run_data);
  const char* weighted_by = data_dir.empty()       ? "data.weights"
                            : weights_text.empty() ? "equal shares"
                                                   : "--weights";
  nlohmann::json data_sets = nlohmann::json::array();
  std::vector<double> losses;
  for (size_t d = 0; d < dirs.size(); ++d) {
    const std::string& shard = shards[d].path();
    const train::Evaluation e =
        train::evaluate(run, shards[d], sequences.value_or(run.config.train.eval_sequences));
    losses.push_back(e.loss);
    const double bits = e.loss / std::log(2.0), perplexity = std::exp(e.loss);
    data_sets.push_back(
        {{"shard", shard},
         {"sequences", e.sequences},
         {"loss_tokens", int64_t(e.loss_tokens)},  // a count: loss weights are 0 or 1
         {"loss", e.loss},
         {"bits_per_token", bits},
         {"perplexity", perplexity}});
    if (dirs.size() > 1) data_sets.back()["weight"] = weights[d];
    if (!json)
      std::printf(
          "%s (step %lld) on %s: %lld sequence%s, %.0f loss token%s: %.4f nats/token "
          "(%.3f bits), perplexity %.3f\n",
          run.checkpoint.c_str(), static_cast<long long>(run.step), shard.c_str(),
          static_cast<long long>(e.sequences), e.sequences == 1 ? "" : "s", e.loss_tokens,
          e.loss_tokens == 1 ? "" : "s", e.loss, bits, perplexity);
  }
  const double mixture = data::mixture_mean(weights, losses);
  const double bits = mixture / std::log(2.0), perplexity = std::exp(mixture);
  if (!json && dirs.size() > 1)
    std::printf(
        "%s (step %lld) on the mixture of %zu data sets (weighted by %s): "
        "%.4f nats/token (%.3f bits), perplexity %.3f\n",
        run.checkpoint.c_str(), static_cast<long long>(run.step), dirs.size(), weighted_by, mixture,
        bits, perplexity);
  if (!json) return 0;
  nlohmann::json out = {{"checkpoint", run.checkpoint}, {"step", run.step}};
  if (dirs.size() == 1) {
    out.update(data_sets[0]);
  } else {
    out.update({{"loss", mixture},
                {"bits_per_token", bits},
                {"perplexity", perplexity},
                {"data_sets", data_sets}});
  }
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

int run_simulate(const std::string& run_dir, int64_t skip, int64_t steps, int64_t micro_batches,
                 int chunks, double link_latency, double link_bandwidth, bool json) {
  if (chunks == 1)
    input_error(
        "simulate --chunks must be 0 (an interleaved run's own, else 2) or >= 2 "
        "(one chunk per stage is 1f1b), got 1");
  const train::PipelineProfile p = train::read_pipeline_profile(run_dir, skip);
  const int64_t M = micro_batches > 0 ? micro_batches : p.micro_batches;
  const pipeline::LinkCosts link{link_latency, link_bandwidth, p.message_bytes};
  if (chunks == 0) chunks = p.chunks > 1 ? p.chunks : 2;  // an interleaved run's own v
  const auto sims = train::simulate_schedules(p.costs, M, steps, link, chunks);
  auto simulated = [&sims](const std::string& name) {
    return std::find_if(sims.begin(), sims.end(), [&](const auto& s) { return s.name == name; });
  };
  const double one_f_one_b = simulated("1f1b")->step_seconds;
  if (json) {
    nlohmann::json out = {{"run",
                           {{"schedule", p.schedule},
                            {"micro_batches", p.micro_batches},
                            {"chunks", p.chunks},
                            {"averaged_steps", {p.first_step, p.last_step}},
                            {"step_seconds", p.step_seconds}}},
                          {"micro_batches", M},
                          {"chunks", chunks},
                          {"steps", steps},
                          {"link",
                           {{"latency", link.latency},
                            {"bandwidth", link.bandwidth},
                            {"message_bytes", link.bytes},
                            {"seconds_per_message", link.transfer()}}}};
    for (const auto& c : p.costs)
      out["stage_costs"].push_back({{"forward", c.forward},
                                    {"backward", c.backward},
                                    {"weight", c.weight},
                                    {"step", c.step}});
    for (const auto& s : sims)
      out["simulated"][s.name] = {{"step_seconds", s.step_seconds},
                                  {"bubble", s.bubble},
                                  {"throughput_vs_1f1b", one_f_one_b / s.step_seconds},
                                  {"peak_activations", s.peak_activations}};
    std::printf("%s\n", out.dump(2).c_str());
    return 0;
  }
  std::printf("%s: %s, %zu stages, %lld micro-batches per step; steps %lld-%lld averaged\n",
              run_dir.c_str(), p.schedule.c_str(), p.costs.size(),
              static_cast<long long>(p.micro_batches), static_cast<long long>(p.first_step),
              static_cast<long long>(p.last_step));
  std::printf(
      "stage  forward/micro-batch  backward/micro-batch  of which W  optimizer step  "
      "(seconds)\n");
  for (size_t s = 0; s < p.costs.size(); ++s)
    std::printf("%5zu  %19.4f  %20.4f  %10.4f  %14.4f\n", s, p.costs[s].forward,
                p.costs[s].backward, p.costs[s].weight, p.costs[s].step);
  std::printf("measured %s step: %.4f s\n", p.schedule.c_str(), p.step_seconds);
  std::printf(
      "simulated, %lld steps of %lld micro-batches (PACI: K = %lld; interleaved: %d chunks "
      "per stage), ",
      static_cast<long long>(steps), static_cast<long long>(M), static_cast<long long>(M), chunks);
  if (link.bandwidth > 0)
    std::printf("%.0f-byte messages taking %.6f s each over every link:\n", link.bytes,
                link.transfer());
  else if (link.transfer() > 0)
    std::printf("messages taking %.6f s each over every link:\n", link.transfer());
  else
    std::printf("free links (set --link-latency, --link-bandwidth):\n");
  std::printf(
      "schedule     step (s)  bubble  throughput vs 1f1b  peak activations per stage "
      "(interleaved: chunk forwards, 1/v of a stage's each)\n");
  for (const auto& s : sims) {
    std::string peaks;
    for (int64_t a : s.peak_activations) peaks += (peaks.empty() ? "" : " ") + std::to_string(a);
    std::printf("%-11s  %8.4f  %6.3f  %18.3f  %s\n", s.name.c_str(), s.step_seconds, s.bubble,
                one_f_one_b / s.step_seconds, peaks.c_str());
  }
  if (simulated("interleaved") == sims.end() && p.costs.size() == 1)
    std::printf("interleaved: not simulated, it needs at least 2 stages (the run has 1)\n");
  else if (simulated("interleaved") == sims.end())
    std::printf(
        "interleaved: not simulated, %lld micro-batches per step are not divisible by the "
        "%zu stages (set --micro-batches)\n",
        static_cast<long long>(M), p.costs.size());
  if (simulated("zb-h1") == sims.end())
    std::printf(
        "zb-h1: not simulated, the run measured no W (weight-gradient) ops; a run with "
        "pipeline.schedule = \"zb-h1\" measures them\n");
  return 0;
}

// The arguments of `tessel train` that `tessel run` passes on to every attempt.
std::vector<std::string> train_arguments(const std::string& config_path,
                                         const std::vector<std::string>& overrides) {
  std::vector<std::string> args;
  if (!config_path.empty()) args = {"--config", config_path};
  for (const auto& o : overrides) args.insert(args.end(), {"--set", o});
  return args;
}

// CLI::Range with NaN refused: Range lets it through (every comparison with NaN is false).
CLI::Validator finite_range(double min, double max) {
  const CLI::Validator not_nan(
      [](std::string& v) -> std::string {
        char* end = nullptr;
        return std::isnan(std::strtod(v.c_str(), &end)) ? "must be a number, got " + v : "";
      },
      "");
  return not_nan & CLI::Range(min, max);
}

// 0 (off) or a value within finite_range(min, max).
CLI::Validator zero_or_finite_range(double min, double max) {
  return CLI::Validator(
      [range = finite_range(min, max)](std::string& v) -> std::string {
        char* end = nullptr;
        if (std::strtod(v.c_str(), &end) == 0 && end != v.c_str() && *end == '\0') return "";
        std::string copy = v;
        const std::string error = range(copy);
        return error.empty() ? "" : error + " (or 0)";
      },
      "");
}

}  // namespace

int main(int argc, char** argv) {
  train::ProcessTimes times;
  times.started_ns = train::monotonic_ns();
  auto guard = comm::init_communication(&argc, &argv);
  times.comm_ready_ns = train::monotonic_ns();
  comm::Communicator& world = guard.world();
  CLI::App app{
      "tessel: distributed training of transformer language models.\n"
      "Quick start: tessel prepare && tessel train --config configs/default.toml\n"
      "Data parallel: scripts/launch.sh 2 train --config configs/default.toml"};
  app.require_subcommand(1);

  data::PrepareOptions prep;
  prep.corpus = "bible";
  auto* prepare = app.add_subcommand(
      "prepare",
      "turn a text corpus, a token-id file or an SFT corpus (conversations) into token shards");
  prepare
      ->add_option("--corpus", prep.corpus,
                   "text: bible (Debian bible-kjv, one document per chapter), fortunes (one per "
                   "fortune), file:PATH (documents separated by blank lines) or jsonl:PATH "
                   "(JSON Lines, a document's {\"text\": ...} per line); token ids from "
                   "another tokenizer: tokens:PATH (raw ids, e.g. nanoGPT's train.bin, with "
                   "--vocab and --eot); SFT, trained "
                   "on the assistant replies only (docs/sft.md): bible-quotes (\"Quote Genesis "
                   "1:3.\" -> the verse) or chat:PATH (JSON Lines, {\"messages\": [{\"role\", "
                   "\"content\"}, ...]} or {\"prompt\", \"response\"} per line)")
      ->capture_default_str();
  // An empty --out would fall back to the default directory, which the user did not name (an
  // empty --data of eval to the run's data.path, an empty --config, as an unset "$CFG", to the
  // default config); an empty --run or RUN_DIR names no run, and would read and write the root
  // directory's files ("" + "/ett").
  const auto must_name = [](std::string what, std::string type) {
    return CLI::Validator(
        [what](std::string& v) -> std::string { return v.empty() ? "must name " + what : ""; },
        type);
  };
  const CLI::Validator directory = must_name("a directory", "DIR");
  const CLI::Validator file = must_name("a file", "FILE");
  prepare
      ->add_option("--out", prep.output_dir,
                   "output directory; default: data/ and the corpus's name, or its file's "
                   "without the extension (bible -> data/bible, file:notes.txt -> data/notes)")
      ->check(directory);
  prepare->add_option(
      "--vocab", prep.vocab,
      "tokens:PATH: vocabulary size of the ids (model.vocab must be at least this)");
  prepare->add_option("--eot", prep.eot,
                      "tokens:PATH: the end-of-document id; each document ends with it "
                      "(GPT-2: 50256)");
  prepare->add_option("--token-dtype", prep.token_dtype,
                      "tokens:PATH: little-endian id type of the file: u16 (the default), u32 "
                      "or i32");
  prepare->add_option(
      "--tokenizer", prep.tokenizer,
      "byte (the default for text) or bpe:DIR, a byte-level BPE vocabulary: DIR holds GPT-2-style "
      "vocab.json and merges.txt, copied beside the shards so that samples and generate decode "
      "with them; with tokens:PATH, the vocabulary of its ids (default: none, ids only)");
  prepare->add_option("--val-fraction", prep.val_fraction, "share of documents (samples) held out")
      ->capture_default_str();
  const CLI::Validator uint64_seed(  // CLI11 would wrap -1 and clamp 2^64 to 2^64 - 1
      [](std::string& v) -> std::string {
        uint64_t seed = 0;
        const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), seed);
        if (ec == std::errc() && end == v.data() + v.size()) return "";
        return "must be an integer from 0 to 18446744073709551615";
      },
      "UINT64");
  prepare->add_option("--seed", prep.seed, "seed of the train/validation split")
      ->check(uint64_seed)
      ->capture_default_str();

  data::PrepareOptions bpe_split;  // which documents prepare would hold out: not learned from
  bpe_split.corpus = "bible";
  std::string bpe_out;
  int64_t bpe_vocab = 1024;
  auto* train_bpe = app.add_subcommand(
      "train-bpe",
      "learn a byte-level BPE vocabulary (GPT-2's vocab.json and merges.txt) from a text "
      "corpus, for prepare --tokenizer bpe:DIR");
  train_bpe->add_option("--corpus", bpe_split.corpus, "a text corpus, as for prepare --corpus")
      ->capture_default_str();
  train_bpe
      ->add_option("--val-fraction", bpe_split.val_fraction,
                   "leave out the validation documents prepare holds out with the same "
                   "--val-fraction and --seed, so the vocabulary never sees them")
      ->capture_default_str();
  train_bpe->add_option("--seed", bpe_split.seed, "seed of that split (as prepare --seed)")
      ->check(uint64_seed)
      ->capture_default_str();
  train_bpe
      ->add_option("--vocab-size", bpe_vocab,
                   "ids in all: the 256 bytes, the merges and <|endoftext|> (model.vocab must be "
                   "at least this)")
      ->check(CLI::Range(int64_t(257), int64_t(1) << 20))
      ->capture_default_str();
  train_bpe
      ->add_option("--out", bpe_out,
                   "output directory; default: data/bpe- and the corpus's name, as for prepare "
                   "(bible -> data/bpe-bible); not a prepared data set or a run's tokenizer/ "
                   "(their ids were made with the vocabulary there)")
      ->check(directory);

  std::string config_path;
  std::vector<std::string> overrides;
  bool help_config = false;
  auto* trainc = app.add_subcommand(
      "train", "train a GPT (under mpirun: data, pipeline, context and expert parallel)");
  trainc->add_option("--config", config_path, "TOML config file (configs/*.toml)")->check(file);
  trainc->add_option("--set", overrides, "override a config key: --set train.steps=100")
      ->take_all();
  trainc->add_flag("--help-config", help_config, "list every config key with its default");

  std::string run_dir = "runs/default", prompt = "And God said";
  int64_t gen_tokens = 200, top_k = 40;
  uint64_t gen_seed = 1;
  double temperature = 0.8;
  auto* gen = app.add_subcommand("generate", "sample text from a run's latest checkpoint");
  gen->add_option("--run", run_dir,
                  "run directory (its newest checkpoint) or one checkpoint directory")
      ->check(directory)
      ->capture_default_str();
  gen->add_option("--prompt", prompt, "prompt text")->capture_default_str();
  gen->add_option("--tokens", gen_tokens, "tokens to generate")
      ->check(CLI::Range(int64_t(0), model::kMaxGeneratedTokens))
      ->capture_default_str();
  gen->add_option("--temperature", temperature, "0 = greedy")->capture_default_str();
  gen->add_option("--top-k", top_k, "sample among the k likeliest; 0 = all")->capture_default_str();
  gen->add_option("--seed", gen_seed, "sampling seed")->check(uint64_seed)->capture_default_str();
  std::string gen_stop, gen_tokenizer;
  gen->add_option("--stop", gen_stop,
                  "text of one token that ends generation once drawn, e.g. --stop $'\\n' after "
                  "a fine-tuned reply (docs/sft.md)");
  gen->add_option("--tokenizer", gen_tokenizer,
                  "where the tokenizer is, for a run that kept no copy of its own: a prepared "
                  "data directory or a vocabulary directory (vocab.json, merges.txt); default: "
                  "the run's tokenizer/, else its data.path; a byte-level model without one "
                  "uses bytes");

  std::string eval_run = "runs/default", eval_data, eval_weights, eval_split = "val";
  std::optional<int64_t> eval_sequences;
  bool eval_json = false;
  auto* evalc = app.add_subcommand(
      "eval", "the loss of a run's latest checkpoint on a prepared data set (one process)");
  evalc
      ->add_option("--run", eval_run,
                   "run directory (its newest checkpoint) or one checkpoint "
                   "directory")
      ->check(directory)
      ->capture_default_str();
  evalc
      ->add_option("--data", eval_data,
                   "prepared data set directory, or several comma-separated (each, then their "
                   "loss weighted by --weights); default: the run's data.path (a mixture: each "
                   "of its data sets, then their loss weighted by data.weights)")
      ->check(directory);
  evalc->add_option("--weights", eval_weights,
                    "with several --data directories: their comma-separated shares in the "
                    "weighted loss (as data.weights); default: equal");
  evalc->add_option("--split", eval_split, "which shard: val or train")
      ->check(CLI::IsMember({"val", "train"}))
      ->capture_default_str();
  const CLI::Validator count(  // CLI::NonNegativeNumber names its bound, DBL_MAX, in 300 digits
      [](std::string& v) -> std::string {
        int64_t n = 0;
        const auto [end, ec] = std::from_chars(v.data(), v.data() + v.size(), n);
        if (ec == std::errc() && end == v.data() + v.size() && n >= 0) return "";
        return "must be an integer from 0 to 9223372036854775807, got " + v;
      },
      "INT>=0");
  evalc
      ->add_option("--sequences", eval_sequences,
                   "sequences of train.seq_len tokens from the shard's start (of an SFT data set: "
                   "packed rows), 0 = all; default: "
                   "the run's train.eval_sequences (then it repeats the run's validation loss)")
      ->check(count);
  evalc->add_flag("--json", eval_json, "print JSON");

  int64_t gemm_size = 1024;
  double gemm_seconds = 1.0;
  int gemm_threads = 0;
  bool gemm_json = false;
  auto* bench = app.add_subcommand("bench-gemm", "measure the sgemm peak (MFU denominator)");
  bench->add_option("--size", gemm_size, "matrix size")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 15))
      ->capture_default_str();
  bench->add_option("--seconds", gemm_seconds, "measuring time")
      ->check(finite_range(0.01, 3600.0))
      ->capture_default_str();
  bench->add_option("--threads", gemm_threads, "threads; 0 = OMP_NUM_THREADS or all cores")
      ->check(CLI::Range(int64_t(0), train::kMaxThreads));
  bench->add_flag("--json", gemm_json, "print JSON");

  train::SuperviseOptions sup;
  std::string sup_config;
  std::vector<std::string> sup_overrides;
  auto* runc = app.add_subcommand(
      "run", "supervise a training job: launch it on --np MPI ranks, relaunch it on failure");
  runc->add_option("--np", sup.ranks, "MPI ranks")->capture_default_str();
  runc->add_option("--max-restarts", sup.max_restarts, "relaunches after a failure")
      ->capture_default_str();
  runc->add_option("--threads", sup.threads, "threads per rank; 0 = cores / ranks")
      ->check(CLI::Range(int64_t(0), train::kMaxThreads))
      ->capture_default_str();
  runc->add_option("--launcher", sup.launcher, "MPI launcher")->capture_default_str();
  runc->add_option("--hang-timeout", sup.hang_timeout,
                   "seconds without progress after which the job counts as hung: killed and "
                   "relaunched (cause hang in the ETT report). Progress is any line of the "
                   "attempt's ETT log (each training step, each phase change) or a beat inside "
                   "validation and the start-up delay, so it must exceed the longest single "
                   "step, checkpoint load or write, MPI start-up with model and data loader "
                   "build, GEMM peak measurement and sample, and 10 s (a rank failing alone "
                   "waits that long before it aborts); 0 = off (the default: no timeout fits "
                   "every model and machine)")
      ->capture_default_str();
  runc->add_option("--kill-grace", sup.kill_grace,
                   "seconds the job gets after a forwarded stop signal, or after the SIGTERM to "
                   "a hung job, before its process group gets SIGKILL; in (0, 1e6]")
      ->capture_default_str();
  runc->add_option("--config", sup_config, "TOML config file, as for train")->check(file);
  double max_ttr = 0;
  const std::string max_ttr_help =
      "recovery-time objective in seconds: exit status 3 if a failure's TTR (wasted steps + "
      "detection + the next attempt's start-up) exceeded it";
  runc->add_option("--max-ttr", max_ttr,
                   max_ttr_help +
                       " and the job succeeded (a job that fails for good exits "
                       "with its own status); 0 = none")
      ->check(finite_range(0.0, 1e9));
  runc->add_option("--set", sup_overrides, "override a config key, as for train")->take_all();

  std::string report_dir;
  auto* report = app.add_subcommand(
      "ett-report", "effective training time of a run: ett.json, ett.html, ett_trace.json");
  report->add_option("RUN_DIR", report_dir, "run directory")->required()->check(directory);
  report->add_option("--max-ttr", max_ttr, max_ttr_help + "; 0 = none")
      ->check(finite_range(0.0, 1e9));

  std::string export_from, export_to;
  auto* exportc = app.add_subcommand(
      "export",
      "consolidate a checkpoint into OUT/model.safetensors, OUT/config.toml and OUT/tokenizer/");
  exportc->add_option("CHECKPOINT", export_from, "checkpoint directory, or a run directory")
      ->required()
      ->check(directory);
  exportc
      ->add_option("OUT", export_to,
                   "output directory: new, empty, or an earlier export (it writes "
                   "model.safetensors, config.toml and, where the run kept one, tokenizer/)")
      ->required()
      ->check(directory);

  std::string sim_run;
  int64_t sim_skip = 10, sim_steps = 100, sim_micro = 0;
  int sim_chunks = 0;
  double sim_latency = 0, sim_bandwidth = 0;
  bool sim_json = false;
  auto* simc = app.add_subcommand(
      "simulate",
      "GPipe, 1F1B, interleaved 1F1B, PACI(K = M) and (from a run that measured its W ops) "
      "ZB-H1 simulated from the stage costs a pipeline run measured");
  simc->add_option(
          "RUN_DIR", sim_run,
          "run directory of a pipeline run (parallel.pp > 1, or a pipeline.schedule at pp = 1: "
          "one stage)")
      ->required()
      ->check(directory);
  simc->add_option("--skip", sim_skip,
                   "leave out the last attempt's first steps (warm-up; a PACI horizon that "
                   "begins among them whole)")
      ->check(CLI::Range(int64_t(0), int64_t(1) << 40))
      ->capture_default_str();
  simc->add_option("--steps", sim_steps, "steps to simulate")
      ->check(CLI::Range(int64_t(1), int64_t(1) << 20))
      ->capture_default_str();
  simc->add_option("--micro-batches", sim_micro,
                   "micro-batches per step, M (and PACI's K); 0 = the run's")
      ->check(CLI::Range(int64_t(0), int64_t(1) << 20))
      ->capture_default_str();
  simc->add_option("--chunks", sim_chunks,
                   "interleaved 1F1B's model chunks per stage, v (each 1/v of the stage's "
                   "costs); 0 = an interleaved run's own, else 2")
      ->check(CLI::Range(0, 1 << 10))
      ->capture_default_str();
  simc->add_option("--link-latency", sim_latency,
                   "seconds per activation or gradient message between stages, before its bytes")
      ->check(finite_range(0.0, 1e6))
      ->capture_default_str();
  // At least 1 byte/s: a slower link (1e-300) made each message take ~1e304 s, and the
  // simulated steps overflow to infinity.
  simc->add_option("--link-bandwidth", sim_bandwidth,
                   "bytes per second of every link, 1 to 1e18 (a message is the micro-batch's "
                   "f32 residual stream, from the run's config); 0 = no transfer time")
      ->check(zero_or_finite_range(1.0, 1e18))
      ->capture_default_str();
  simc->add_flag("--json", sim_json, "print JSON");

  // CLI11 answers an unknown first word with "A subcommand is required".
  if (argc > 1 && argv[1][0] != '-' &&
      app.get_subcommands([&](CLI::App* sub) { return sub->check_name(argv[1]); }).empty()) {
    if (world.rank() == 0)
      std::cerr << "tessel: error: unknown subcommand '" << argv[1]
                << "' (tessel --help lists them)\n";
    return kExitInputError;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return world.rank() == 0 ? app.exit(e) : (e.get_exit_code() ? 1 : 0);
  }

  try {
    if (*prepare) {
      if (prep.output_dir.empty())
        prep.output_dir = "data/" + data::corpus_directory_name(prep.corpus);
      return world.rank() == 0 ? run_prepare(prep) : 0;
    }
    if (*train_bpe) {
      if (bpe_out.empty()) bpe_out = "data/bpe-" + data::corpus_directory_name(bpe_split.corpus);
      return world.rank() == 0 ? run_train_bpe(bpe_split, bpe_vocab, bpe_out) : 0;
    }
    if (*trainc) {
      if (help_config) {
        if (world.rank() == 0) std::printf("%s", schema_help().c_str());
        return 0;
      }
      train::Config config = train::load_config(config_path, overrides);
      train::Trainer trainer(std::move(config), world, times);
      trainer.run();
      return 0;
    }
    if (*runc) {
      // Its own mpirun, started from inside an MPI job (even of one rank), would fail.
      if (comm::launched_by_mpi())
        input_error("tessel run starts its own MPI job; run it without mpirun");
      train::check_supervise_options(sup);  // before the lock below creates run.dir
      const train::Config job = train::load_config(sup_config, sup_overrides);  // validates
      train::job_mesh(job, sup.ranks);  // a mesh --np ranks cannot hold: refused here, too
      sup.run_dir = job.run.dir;
      train::check_run_dir(sup.run_dir);  // before the supervisor writes its ETT log there
      // Held until the report is written: a second `tessel run` or a plain `tessel train` on
      // this directory is refused at once, before it picks an attempt index.
      const train::RunDirLock supervising(sup.run_dir, train::kSupervisorLock);
      sup.train_args = train_arguments(sup_config, sup_overrides);
      sup.binary = std::filesystem::read_symlink("/proc/self/exe").string();
      const int earlier_attempts = train::count_attempts(sup.run_dir);
      const int status = train::supervise(sup);
      const int attempts = train::count_attempts(sup.run_dir);
      // A finished run started again trained nothing and recorded no attempt, nor did a
      // start refused for bad input: with no earlier log there is nothing to report.
      if (attempts == 0) {
        if (status == 0)
          std::printf("%s: no ETT attempt recorded; no report\n", sup.run_dir.c_str());
        return status;
      }
      // A job that failed for good is when its report is wanted most. The exit status stays the
      // job's (after a success: the report's, 3 for --max-ttr), and a report that cannot be
      // made (a damaged attempt log) is warned about, not taken for the job's failure. A start
      // refused for bad input recorded no attempt: an earlier job's report stays as it was.
      if (status != 0 && attempts == earlier_attempts) return status;
      try {
        const int report = run_ett_report(sup.run_dir, max_ttr);
        return status == 0 ? report : status;
      } catch (const std::exception& e) {
        std::fprintf(stderr, "tessel run: no ETT report: %s\n", e.what());
      }
      return status;
    }
    if (*report) return world.rank() == 0 ? run_ett_report(report_dir, max_ttr) : 0;
    if (*exportc) return world.rank() == 0 ? run_export(export_from, export_to) : 0;
    if (*simc)
      return world.rank() == 0 ? run_simulate(sim_run, sim_skip, sim_steps, sim_micro, sim_chunks,
                                              sim_latency, sim_bandwidth, sim_json)
                               : 0;
    if (*evalc)
      return world.rank() == 0 ? run_eval(eval_run, eval_data, eval_weights, eval_split,
                                          eval_sequences, eval_json)
                               : 0;
    if (*gen)
      return world.rank() == 0 ? run_generate(run_dir, gen_tokenizer, prompt, gen_tokens,
                                              temperature, top_k, gen_seed, gen_stop)
                               : 0;
    if (*bench) return run_bench_gemm(gemm_size, gemm_seconds, gemm_threads, gemm_json);
  } catch (const std::exception& e) {
    // One line naming the file or field, and a non-zero exit.
    const int code = exit_status(e);
    if (world.size() == 1) {
      std::fprintf(stderr, "tessel: error: %s\n", e.what());
      return code;
    }
    // Several ranks usually fail alike (same config, same files): rank 0 speaks for all
    // and aborts the job, so peers never wait in a collective. A rank that fails alone
    // gives rank 0 a moment to do so first (10 s: on a loaded machine the abort can take
    // seconds to reach its peers), then reports itself.
    if (world.rank() != 0) std::this_thread::sleep_for(std::chrono::seconds(10));
    if (world.rank() == 0)
      std::fprintf(stderr, "tessel: error: %s\n", e.what());
    else
      std::fprintf(stderr, "tessel: error (rank %d): %s\n", world.rank(), e.what());
    std::fflush(stderr);
    world.abort(code);
  }
  return 0;
}
