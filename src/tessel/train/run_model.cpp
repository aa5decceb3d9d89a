#include "tessel/train/run_model.hpp"

#include <filesystem>
#include <map>

#include "tessel/core/error.hpp"
#include "tessel/data/loader.hpp"
#include "tessel/data/shard.hpp"
#include "tessel/data/tokenizer.hpp"
#include "tessel/train/batch_inputs.hpp"
#include "tessel/train/export.hpp"

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
  RunModel run{loaded.dir, loaded.content.step, checkpoint_config(loaded), nullptr};
  run.gpt = std::make_unique<model::Gpt>(run.config.model, 0);
  for (const auto& p : run.gpt->parameters())
    restore_tensor(loaded.content.model, p.name, p.value, loaded.dir);
  return run;
}

std::vector<std::string> model_tokenizer_dirs(const std::string& checkpoint, const Config& config) {
  const std::string copy = checkpoint_tokenizer_dir(checkpoint);
  return data::tokenizer_name(copy) ? std::vector<std::string>{copy} : data_paths(config.data);
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
  return e;
}

}  // namespace tessel::train
