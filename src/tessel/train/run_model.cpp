#include "tessel/train/run_model.hpp"

#include <cmath>
#include <filesystem>
#include <map>

#include "tessel/core/error.hpp"
#include "tessel/data/loader.hpp"
#include "tessel/data/shard.hpp"
#include "tessel/data/tokenizer.hpp"
#include "tessel/train/batch_inputs.hpp"
#include "tessel/train/export.hpp"
#include "tessel/train/trainer.hpp"

namespace tessel::train {

CheckpointStore::Loaded load_trained_checkpoint(const std::string& path) {
  namespace fs = std::filesystem;
  const fs::path dir(path);
  if (fs::exists(dir / kExportModelFile) && !fs::exists(dir / "checkpoints") &&
      !fs::exists(dir / "manifest.json"))
    input_error(path, ": an export (", kExportModelFile,
                "), not a run or checkpoint directory; pass the run it was exported from");
  const bool run_files = fs::exists(dir / "config.toml") || fs::exists(dir / "metrics.jsonl");
  if (run_files && !fs::exists(dir / "checkpoints") && !fs::exists(dir / "manifest.json"))
    input_error(path,
                ": the run has no checkpoint yet (it saves one every train.checkpoint_every "
                "steps and at its end)");
  return load_run_checkpoint(path);
}

Config checkpoint_config(const CheckpointStore::Loaded& loaded) {
  return parse_stored_config(loaded.content.state.at("config").get<std::string>(),
                             loaded.dir + "/manifest.json");
}

RunModel load_run_model(const std::string& path) {
  const auto loaded = load_trained_checkpoint(path);
  RunModel run{loaded.dir, loaded.content.step, checkpoint_config(loaded),
               loaded.content.state.value("compatibility", nlohmann::json::object()), nullptr};
  run.gpt = std::make_unique<model::Gpt>(run.config.model, 0);
  for (const auto& p : run.gpt->parameters())
    restore_tensor(loaded.content.model, p.name, p.value, loaded.dir);
  return run;
}

namespace {

// Why data.path speaks for the model in `checkpoint`: the start of model_tokenizer_dirs' and
// model_tokenizer's refusals, before that path.
std::string without_copy(const std::string& checkpoint) {
  return detail::concat("no copy of the run's tokenizer is found (",
                        checkpoint_tokenizer_dir(checkpoint).empty()
                            ? "a checkpoint outside its run's checkpoints/"
                            : "a run from before runs kept one",
                        "), and its data.path ");
}

// The first remedy of those refusals for a checkpoint copied out of its run; a run that kept
// no copy has none to go back to.
std::string with_its_run(const std::string& checkpoint) {
  return checkpoint_tokenizer_dir(checkpoint).empty()
             ? "copy the checkpoint together with its run directory (whose tokenizer/ keeps the "
               "run's), or "
             : "";
}

}  // namespace

std::vector<std::string> model_tokenizer_dirs(const std::string& checkpoint, const Config& config,
                                              const nlohmann::json& record,
                                              const std::string& advice) {
  const std::string copy = checkpoint_tokenizer_dir(checkpoint);
  if (data::tokenizer_name(copy)) return {copy};
  const std::vector<std::string> dirs = data_paths(config.data);
  // Data prepared again in place (e.g. as bytes after BPE) would decode the model's ids as
  // another tokenizer's: the training shards the record counted tell it. The data sets of a
  // mixture all held the run's tokenizer (the trainer checks), so each one unchanged speaks
  // for the model; a changed one is left out, and refused only when none is left.
  std::vector<std::string> unchanged;
  std::string first_change;
  for (size_t d = 0; d < dirs.size(); ++d) {
    if (!std::filesystem::exists(dirs[d])) continue;
    const std::string tokens_key = data_set_key("", int64_t(d), " tokens");
    const std::string documents_key = data_set_key("", int64_t(d), " documents");
    const std::string shard = dirs[d] + "/train.tok";
    if (!record.contains(tokens_key) || !record[tokens_key].is_number_integer() ||
        !record.contains(documents_key) || !record[documents_key].is_number_integer()) {
      unchanged.push_back(dirs[d]);  // a record from before runs counted their shards
      continue;
    }
    const int64_t tokens = record[tokens_key].get<int64_t>(),
                  documents = record[documents_key].get<int64_t>();
    std::string now = "it holds no train.tok";
    if (std::filesystem::exists(shard)) {
      const data::ShardReader reader(shard);
      if (reader.num_tokens() == tokens && reader.num_documents() == documents) {
        unchanged.push_back(dirs[d]);
        continue;
      }
      now = detail::concat("its train.tok holds ", reader.num_tokens(), " tokens in ",
                           reader.num_documents(), " documents");
    }
    if (first_change.empty())
      first_change =
          detail::concat(dirs[d], " changed since the run: ", now, ", the run trained on ", tokens,
                         " in ", documents, " (the checkpoint's record)");
  }
  if (!unchanged.empty()) return unchanged;
  if (!first_change.empty())
    input_error(checkpoint, ": ", without_copy(checkpoint), first_change,
                ", so the tokenizer there may not be the model's; ", with_its_run(checkpoint),
                "put the data the run trained on back at data.path", advice);
  return {dirs[0]};  // none is here: the caller's to refuse
}

ModelTokenizer model_tokenizer(const std::string& checkpoint, const Config& config,
                               const nlohmann::json& record, const std::string& command,
                               const std::string& advice) {
  ModelTokenizer t;
  t.dir = model_tokenizer_dirs(checkpoint, config, record, advice)[0];
  t.tokenizer = data::load_tokenizer(t.dir, config.model.vocab);
  // Without a copy or data.path there is nothing to read the model's ids with (but bytes for
  // a model of 256 ids, which load_tokenizer gives).
  if (!t.tokenizer && !std::filesystem::exists(t.dir))
    input_error(checkpoint, ": ", command, " needs a tokenizer; ", without_copy(checkpoint), t.dir,
                " does not exist from here (a relative path is read from where the run "
                "started); ",
                with_its_run(checkpoint), "run ", command, " from the directory the run started in",
                advice);
  return t;
}

Evaluation evaluate(RunModel& run, const data::ShardReader& shard, int64_t max_sequences) {
  if (max_sequences < 0) input_error("eval: sequences = ", max_sequences, " must be >= 0");
  const Config& c = run.config;
  check_data_shard(shard, c.model.vocab);
  const auto batches = data::validation_batches(shard, c.train.seq_len, c.train.micro_batch,
                                                max_sequences, 0, 1, c.data.overlong);
  Evaluation e;
  double loss_sum = 0;
  std::map<int64_t, std::unique_ptr<model::Activations>> acts;  // by micro-batch rows
  for (const data::Batch& b : batches) {
    const BatchInputs in(b, c.data.attention_mask);
    auto& a = acts[b.B];
    if (!a) a = run.gpt->make_activations(b.B, b.T);
    loss_sum += run.gpt->forward(*a, in.inputs());
    e.loss_tokens += in.loss_weight_sum();
    e.sequences += b.B;
  }
  e.loss = e.loss_tokens > 0 ? loss_sum / e.loss_tokens : 0.0;
  // As a run's validation loss stops it: a NaN printed as a loss would pass for a result.
  if (!std::isfinite(e.loss))
    throw DivergenceError(
        detail::concat(run.checkpoint, " (step ", run.step, ") on ", shard.path(), ": the loss is ",
                       std::isnan(e.loss) ? "NaN" : "inf",
                       ": the model's weights are not finite (or its output overflows)"));
  return e;
}

}  // namespace tessel::train
