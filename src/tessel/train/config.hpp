#pragma once
// The run configuration. Configs are data: a TOML file, then `--set key=value`
// overrides, every key checked against the schema below (unknown keys and wrong
// types are errors naming the key), and the fully resolved config written into
// the run directory as `config.toml`.
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "tessel/data/packing.hpp"
#include "tessel/data/shard.hpp"
#include "tessel/data/tokenizer.hpp"
#include "tessel/model/gpt_config.hpp"
#include "tessel/optim/optimizer.hpp"
#include "tessel/train/fault.hpp"

namespace tessel::train {

struct RunConfig {
  std::string dir = "runs/default";  // run directory: config, metrics, checkpoints
  int64_t seed = 1234;
  int64_t threads = 0;  // threads per rank; 0 = cores / ranks on this machine
  bool quiet = false;   // no progress lines (tests)
};

// How a packed training row attends: causal_document = only inside each document, with
// positions restarting at every document start (a packed row computes what its documents
// would compute one by one); causal = across the whole row, positions 0..T-1.
enum class AttentionMaskKind { causal_document, causal };

struct DataConfig {
  // Directory with train.tok and val.tok (`tessel prepare`); with train.loss_mask.tok and
  // val.loss_mask.tok beside them an SFT data set (data/packing.hpp). Several, comma-separated:
  // a mixture (data/mixture.hpp), with `weights` their shares of the training sequences.
  std::string path = "data/bible";
  std::string weights;  // comma-separated, one per path; "" = one data set
  bool shuffle = true;
  AttentionMaskKind attention_mask = AttentionMaskKind::causal_document;
  data::Overlong overlong = data::Overlong::drop;  // SFT samples longer than train.seq_len
};

// data.path's directories (more than one: a mixture; InputError for one listed twice) and
// data.weights' shares of them as given ({1} for one directory without weights); InputError
// unless there is one positive share per directory with a finite sum, each at least
// data::kMinShare of it. data::normalized_weights
// normalizes them.
std::vector<std::string> data_paths(const DataConfig& data);
std::vector<double> data_weights(const DataConfig& data);
// Each directory's short name in logs and metrics: its last path component, or the whole
// path where two directories share that.
std::vector<std::string> data_names(const DataConfig& data);

struct TrainLoopConfig {
  int64_t steps = 1000;
  int64_t seq_len = 256;
  int64_t micro_batch = 8;  // sequences per micro-batch per rank
  int64_t accum = 1;        // micro-batches per step per rank (gradient accumulation)
  double grad_clip = 1.0;   // global-norm clip; <= 0 disables
  // Skip the update of a step whose gradient norm exceeds spike_factor x the median of the
  // last spike_window steps' norms (optim/spike_filter.hpp); 0 = never.
  double spike_factor = 0;
  int64_t spike_window = 50;
  model::Recompute recompute = model::Recompute::none;  // activation recomputation
  int64_t log_every = 10;
  int64_t eval_every = 200;  // 0 = only at the end
  int64_t eval_sequences = 64;
  int64_t checkpoint_every = 0;  // 0 = no periodic checkpoints (see save_final)
  bool save_final = true;        // checkpoint after the last step
  int64_t keep_checkpoints = 2;
  bool checkpoint_async = true;             // background writer; false = training waits for it
  std::string checkpoint_policy = "fixed";  // fixed | young | daly (checkpoint_interval.hpp)
  double mtbf_seconds = 86400;  // mean time between failures for young/daly until one is seen
  bool fast_start = true;       // synthetic warm-up beside the data warm-up; cached GEMM peak
  bool resume = true;     // continue from the run directory's latest checkpoint when there is one
  std::string init_from;  // fine-tuning: start from this run's (checkpoint's) model weights
  int64_t sample_tokens = 200;  // text sample printed at the end; 0 = none
  std::string sample_prompt = "And God said";
  std::string sample_stop;  // the text of one token that ends the sample (e.g. "\n"); "" = none
  double sample_temperature = 0.8;
  int64_t sample_top_k = 40;
};

// How a sequence is cut into chunks over the cp ranks (attention/cp_layout.hpp): zigzag = 2 * cp
// chunks, rank r holding r and 2 cp - 1 - r; contiguous = cp_chunks consecutive chunks per rank;
// balanced = cp_chunks chunks per rank placed by their attention work under each micro-batch's
// mask.
enum class CpLayoutKind { zigzag, contiguous, balanced };

struct ParallelConfig {
  int64_t dp = 0;  // 0 = world size / (pp * cp)
  int64_t pp = 1;
  int64_t cp = 1;
  CpLayoutKind cp_layout = CpLayoutKind::zigzag;
  int64_t cp_chunks = 4;  // chunks per cp rank (contiguous, balanced)
  int64_t ep = 1;
  double bucket_mb = 4.0;           // gradient all-reduce bucket size
  bool overlap_grad_reduce = true;  // start each bucket's all-reduce as the backward ends it

  static constexpr double kBytesPerMiB = 1024.0 * 1024.0;
  // bucket_mb in bytes, as the gradient reducers take it (validate keeps it in [4, 2^40]).
  int64_t bucket_bytes() const { return int64_t(bucket_mb * kBytesPerMiB); }
};

// Pipeline parallelism over the pp axis (pipeline_trainer.hpp, docs/training.md).
struct PipelineConfig {
  std::string schedule;     // gpipe | 1f1b | interleaved | zb-h1 | paci; "" = 1f1b when pp > 1
  int64_t chunks = 0;       // interleaved: model chunks per stage (v); 0 = 2
  int64_t paci_k = 0;       // PACI: local backwards per local step; 0 = train.accum
  bool paci_stash = false;  // PACI: inconsistent backwards use their forward's weights
  double paci_predict = 0;  // PACI: stale forwards extrapolate this share of the last step
  std::string layout;       // blocks per (virtual) stage ("3,2"); "" = balanced by compute
};

struct MfuConfig {
  double peak_gflops = 0.0;  // per rank; 0 = measure with the GEMM benchmark at start
};
// The smallest mfu.peak_gflops other than 0 (1 kFLOP/s), far below any machine's peak: a
// smaller one (a denormal such as 1e-310) makes the MFU overflow to infinity.
inline constexpr double kMinPeakGflops = 1e-6;

// The model of the README demo: a byte-level GPT of a few million parameters.
model::GptConfig default_model();

struct Config {
  RunConfig run;
  DataConfig data;
  model::GptConfig model = default_model();
  TrainLoopConfig train;
  optim::OptimizerConfig optim;
  ParallelConfig parallel;
  PipelineConfig pipeline;
  MfuConfig mfu;
  FaultConfig fault;
};

// A config value as TOML reads it, from a file or a --set value.
using ConfigValue = std::variant<int64_t, double, bool, std::string>;

// One key of the schema: its dotted name, help text, and how to read/write it.
struct ConfigKey {
  std::string name;
  std::string help;
  std::string type;  // "int", "float", "bool", "string" or "a|b|c" for choices
  // Takes a value of the key's type (an int64_t, a finite double, a bool or a string); throws
  // InputError for a name outside a choice's.
  std::function<void(Config&, const ConfigValue&)> set;
  std::function<std::string(const Config&)> get;  // value as TOML text
};
const std::vector<ConfigKey>& config_schema();
// Whether `a` and `b`, texts of config key `key` as ConfigKey::get writes them, are the same
// setting: a float key's by value (an older tessel wrote 1.0000000000000001e-05 where it now
// writes 1e-05), a string's by its decoded text ('gelu' = "gelu"), any other's as text.
bool same_config_text(const std::string& key, const std::string& a, const std::string& b);
// The string a config string's TOML text ('gelu', "gelu") holds; nullopt when the text is not
// exactly one TOML string.
std::optional<std::string> config_string_value(const std::string& text);

// The most threads per rank a config (run.threads) or `tessel run --threads` may ask for.
inline constexpr int64_t kMaxThreads = 4096;
// The most train.steps: far beyond a real run, and times a real global batch far within int64.
inline constexpr int64_t kMaxSteps = int64_t(1) << 40;
// The most of train.steps x micro-batches per step (train.accum, or PACI's pipeline.paci_k) x
// pipeline.chunks: a pipeline numbers its micro-batches up to the first two's product and its
// message tags multiply that by the chunks, all in int64.
inline constexpr int64_t kMaxMicroBatchOps = int64_t(1) << 62;
// The most tokens a run reads, train.steps x dp x micro-batches per step (train.accum, or
// PACI's pipeline.paci_k) x train.micro_batch x train.seq_len (checked by job_mesh, which knows
// dp): the loader's sequence numbers and the logs' token counts stay in int64. The same bound
// as kMaxMicroBatchOps, on another product.
inline constexpr int64_t kMaxRunTokens = int64_t(1) << 62;

// Loads `path` (TOML; empty = defaults only), applies `overrides` ("key=value"),
// validates the result. Errors name the file and key.
Config load_config(const std::string& path, const std::vector<std::string>& overrides);
// The same from TOML text; `source` names it in errors.
Config parse_config(const std::string& text, const std::string& source,
                    const std::vector<std::string>& overrides);
// A config a run wrote (a checkpoint's, or <run.dir>/config.toml), without the checks across
// keys: it passed those of the version that wrote it, and a later version may refuse a setting
// that one accepted, which must not make the run unreadable. The model is still validated.
Config parse_stored_config(const std::string& text, const std::string& source);
// Applies one "key=value" override.
void apply_override(Config& config, const std::string& assignment);
// Checks cross-field constraints (sequence vs model.max_seq, positive sizes...).
void validate(const Config& config);

// Under train.checkpoint_policy = "fixed": whether step `step` (1-based) saves a checkpoint,
// every train.checkpoint_every steps and the last one when train.save_final.
bool fixed_policy_saves(const TrainLoopConfig& train, int64_t step);

// The tokenizer of the run's token ids (data::load_tokenizer of data.path's first directory:
// a mixture's data sets share one vocabulary); nullptr when they have none tessel can apply.
std::unique_ptr<data::Tokenizer> data_tokenizer(const Config& c);
// InputError unless `shard` (a data directory's train.tok or val.tok) is the one its
// dataset.json describes (data::check_described_shard) and holds ids a model of `model_vocab`
// reads: what training and eval check of every shard before they read it.
void check_data_shard(const data::ShardReader& shard, int64_t model_vocab);
// A run's copy of its data's tokenizer (data::save_tokenizer, written when the run starts), so
// that generate, eval and fine-tuning know what its ids mean: <run.dir>/tokenizer; and that of
// the run a checkpoint directory (<run.dir>/checkpoints/step-N, any spelling of it) belongs
// to, "" for a checkpoint directory outside a run's checkpoints/.
std::string run_tokenizer_dir(const std::string& run_dir);
std::string checkpoint_tokenizer_dir(const std::string& checkpoint_dir);

// InputError naming run.dir when it is empty or it, the nearest of its parents that exists, or
// its `checkpoints` is not a directory (so the run could not create its files there). Reads
// the filesystem, so not part of validate: a checkpoint's stored config is validated on other
// machines too.
void check_run_dir(const std::string& dir);
// The resolved config as TOML text (every key, grouped by table).
std::string to_toml(const Config& config);

}  // namespace tessel::train
