#pragma once
// A trained run's model outside training: the config a checkpoint holds, the whole model on
// one process (`tessel generate`, `tessel eval`), and its loss on a token shard.
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tessel/data/tokenizer.hpp"
#include "tessel/model/gpt.hpp"
#include "tessel/train/checkpoint.hpp"
#include "tessel/train/config.hpp"

namespace tessel::train {

// load_run_checkpoint for generate, eval and export, which also tells a run that has saved no
// checkpoint yet (its config.toml or metrics.jsonl is there, its checkpoints/ not) from a
// directory that is no run at all.
CheckpointStore::Loaded load_trained_checkpoint(const std::string& path);

// The resolved run config a loaded checkpoint holds (errors name its manifest).
Config checkpoint_config(const CheckpointStore::Loaded& loaded);

struct RunModel {
  std::string checkpoint;  // the checkpoint directory it came from
  int64_t step = 0;
  Config config;
  nlohmann::json record;            // its manifest's compatibility record (what the run trained on)
  std::unique_ptr<model::Gpt> gpt;  // every block and expert, whatever layout (dp, ep, pp) saved it
};

// Where the tokenizer of the model in `checkpoint` (a checkpoint directory, whose resolved
// config is `config` and compatibility record `record`) is: its run's own copy
// (checkpoint_tokenizer_dir), or for a run from before copies were kept or a checkpoint outside
// its run, those of its data.path directories (taken relative to this one) that are still the
// data sets the run trained on (their train.tok's tokens and documents are the record's); with
// none of them here, the first directory (the caller refuses or reads bytes). What generate
// decodes with, eval compares, export copies and train.init_from compares. InputError when
// data.path's data sets are here but each one changed: its tokenizer may be another.
// `advice` ends that message: another remedy the command offers (", or pass --tokenizer ...").
std::vector<std::string> model_tokenizer_dirs(const std::string& checkpoint, const Config& config,
                                              const nlohmann::json& record,
                                              const std::string& advice = "");

// The tokenizer of model_tokenizer_dirs' first directory, `dir` (data::load_tokenizer: null for
// ids without one), for `command` (generate, export). InputError when there is none because
// that directory, the run's data.path, does not exist from here; `advice` ends both messages.
struct ModelTokenizer {
  std::string dir;
  std::unique_ptr<data::Tokenizer> tokenizer;
};
ModelTokenizer model_tokenizer(const std::string& checkpoint, const Config& config,
                               const nlohmann::json& record, const std::string& command,
                               const std::string& advice);

// `path` is a checkpoint directory (step-N) or a run directory (its newest checkpoint that
// verifies, as for a resume). InputError naming the file on a damaged checkpoint.
RunModel load_run_model(const std::string& path);

struct Evaluation {
  int64_t sequences = 0;   // rows of train.seq_len tokens (SFT: packed rows)
  double loss_tokens = 0;  // tokens the loss counts (loss weight 1)
  double loss = 0;         // mean loss per counted token, nats
};

// The loss of `run`'s model on the first `max_sequences` rows (0 = all) of the token shard
// `shard`, cut as validation cuts them (the run's train.seq_len, train.micro_batch,
// data.attention_mask and data.overlong; an SFT shard's loss mask beside it is used). With
// the run's own val.tok and train.eval_sequences it is the run's validation loss at that
// checkpoint (bitwise for a run on one process; up to summation order for dp, cp or pp).
// InputError for a shard that check_data_shard refuses (a vocabulary beyond model.vocab, a
// dataset.json that describes other shards), that holds no full sequence, or whose rows hold
// no token the loss counts; DivergenceError naming the checkpoint for a loss that is not
// finite (a model with NaN weights), as a run's validation stops it.
Evaluation evaluate(RunModel& run, const data::ShardReader& shard, int64_t max_sequences);

}  // namespace tessel::train
