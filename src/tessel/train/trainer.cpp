#include "tessel/train/trainer.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string_view>
#include <thread>

#include "tessel/comm/mesh.hpp"
#include "tessel/core/error.hpp"
#include "tessel/core/file_io.hpp"
#include "tessel/core/memory.hpp"
#include "tessel/core/threading.hpp"
#include "tessel/core/timer.hpp"
#include "tessel/data/loader.hpp"
#include "tessel/data/packing.hpp"
#include "tessel/data/tokenizer.hpp"
#include "tessel/kernels/cpu/gemm_peak.hpp"
#include "tessel/model/generate.hpp"
#include "tessel/model/gpt.hpp"
#include "tessel/moe/layer.hpp"
#include "tessel/optim/grad_clip.hpp"
#include "tessel/optim/lr_schedule.hpp"
#include "tessel/optim/spike_filter.hpp"
#include "tessel/parallel/expert_parallel.hpp"
#include "tessel/parallel/expert_sharding.hpp"
#include "tessel/train/batch_inputs.hpp"
#include "tessel/train/checkpoint.hpp"
#include "tessel/train/checkpoint_interval.hpp"
#include "tessel/train/ett.hpp"
#include "tessel/train/fault.hpp"
#include "tessel/train/metrics.hpp"
#include "tessel/train/moe_metrics.hpp"
#include "tessel/train/pipeline_trainer.hpp"
#include "tessel/train/run_model.hpp"

namespace fs = std::filesystem;

namespace tessel::train {

namespace {

// The job's ranks on this machine: Open MPI's local size; 0 = not known (another launcher).
int known_local_ranks(int world_size) {
  if (const char* env = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE"))
    return std::max(1, std::atoi(env));
  return world_size == 1 ? 1 : 0;
}

int machine_cores() {
  return int(std::max(1u, std::thread::hardware_concurrency()));
}

}  // namespace

int auto_threads_per_rank(int world_size) {
  if (const char* env = std::getenv("OMP_NUM_THREADS")) {
    int n = std::atoi(env);
    if (n > 0) return n;
  }
  const int local = known_local_ranks(world_size);
  return std::max(1, machine_cores() / (local > 0 ? local : world_size));
}

std::string format_duration(double seconds) {
  constexpr double kMaxHours = 1e6;  // lround overflows long past 9.2e18 s; an ETA this far is moot
  seconds = std::max(0.0, seconds);
  if (!(seconds < kMaxHours * 3600)) return ">1000000h";
  const long s = std::lround(seconds);
  char buf[32];
  if (s >= 3600)
    std::snprintf(buf, sizeof buf, "%ldh%02ldm", s / 3600, (s / 60) % 60);
  else
    std::snprintf(buf, sizeof buf, "%ldm%02lds", s / 60, s % 60);
  return buf;
}

namespace {

// A config value of a compatibility record as a user wrote it: strings without quotes.
std::string json_text(const nlohmann::json& v) {
  return v.is_string() ? v.get<std::string>() : v.dump();
}

// The process mesh for the start line: dp always, the other degrees where above 1.
std::string mesh_text(const comm::MeshShape& m) {
  std::string text = "dp=" + std::to_string(m.dp);
  for (auto [name, degree] : {std::pair{"pp", m.pp}, {"cp", m.cp}, {"ep", m.ep}})
    if (degree > 1) text += detail::concat(", ", name, "=", degree);
  return text;
}

// Whether a checkpoint's compatibility record holds this run's value of `key` (config keys
// compared as same_config_text does: floats by value, strings by their decoded text).
bool same_setting(const std::string& key, const nlohmann::json& have, const nlohmann::json& want) {
  return have.is_string() && want.is_string()
             ? same_config_text(key, have.get<std::string>(), want.get<std::string>())
             : have == want;
}

// More gradient all-reduces per step than this are worth a warning at start (4 MiB buckets
// reach it at a 4 GiB gradient). configs/tiny.toml on 2 local ranks: 1 ms a step with one
// bucket, 22 ms with 1818, 17 s with 47264 (one per gradient).
constexpr int64_t kManyGradientBuckets = 1000;

// The compatibility record's entry of the data sets' normalized shares (data.weights), "1.0"
// for one data set.
constexpr const char* kDataWeightsKey = "data sets (normalized data.weights)";

// Config keys of the compatibility record added after checkpoints without them were written,
// each with the setting every earlier tessel ran as. A key added from now on goes here, and
// its value never changes (one that earlier tessels had with other values: kRecordedLaterKeys).
const std::map<std::string, std::string> kAddedKeys = {{"model.attention_window", "0"},
                                                       {kDataWeightsKey, "1.0"},
                                                       {"model.moe_lei_margin", "'midpoint'"},
                                                       {"model.moe_lei_loss", "'centered_fsq'"},
                                                       {"model.moe_hist_bins", "1000"}};

// same_setting, where model.moe_layers compares the blocks it names in this run's model ("all",
// "0,1" and "1,0" are one setting on 2 blocks; a different model.layers is a mismatch of its
// own).
bool same_model_setting(const std::string& key, const nlohmann::json& have,
                        const nlohmann::json& want, const model::GptConfig& model) {
  if (key == "model.moe_layers" && have.is_string())
    if (const auto listed = config_string_value(have.get<std::string>())) {
      model::GptConfig old = model;
      old.moe_layers = *listed;
      try {
        return old.moe_mask() == model.moe_mask();
      } catch (const InputError&) {  // names a block this model does not have
        return false;
      }
    }
  return same_setting(key, have, want);
}

// Config keys an older tessel had but did not record (it compared them with nothing): an older
// checkpoint's stored config says what it ran as.
const std::set<std::string> kRecordedLaterKeys = {"data.attention_mask"};

// "" when this run's `value` of config key `key` matches a compatibility record written by an
// older tessel that had no such key, else why not: the older tessel ran as kAddedKeys says, or
// for kRecordedLaterKeys as the checkpoint's stored config (its manifest's `state`) says.
std::string absent_key_mismatch(const std::string& key, const nlohmann::json& value,
                                const nlohmann::json& state) {
  if (kRecordedLaterKeys.count(key) && state.contains("config") && state["config"].is_string()) {
    Config stored;
    try {
      stored = parse_stored_config(state["config"].get<std::string>(), "its stored config");
    } catch (const InputError& e) {
      return detail::concat(" has no ", key, " in its compatibility record, and ", e.what());
    }
    for (const auto& k : config_schema())
      if (k.name == key) {
        const nlohmann::json old = k.get(stored);
        if (same_setting(key, old, value)) return "";
        return detail::concat(" has ", key, " = ", json_text(old),
                              " (in its stored config) but this run has ", json_text(value));
      }
  }
  const auto added = kAddedKeys.find(key);
  if (added == kAddedKeys.end())
    return detail::concat(" has no ", key,
                          " in its compatibility record (written by an older tessel)");
  const nlohmann::json old(added->second);
  if (same_setting(key, old, value)) return "";
  return detail::concat(" has no ", key, " in its compatibility record: an older tessel wrote ",
                        "it, which ran as ", key, " = ", json_text(old), ", and this run has ",
                        json_text(value));
}

// Why a checkpoint's trainer state cannot be resumed from (empty when it can): the resume
// reads a compatibility record and the spike filter's norms (numbers, when kept), and the
// data-loader position must be the one save() records, the start of the step after the
// checkpoint's: saves come between steps, so any other position is an edited or damaged
// manifest, and resuming there would replay or skip data.
std::string resume_state_problem(const CheckpointContent& content) {
  try {
    if (!content.state.at("compatibility").is_object())
      return "the compatibility record is not an object";
    if (const auto norms = content.state.find("spike_norms");
        norms != content.state.end() &&
        (!norms->is_array() ||
         !std::all_of(norms->begin(), norms->end(), [](const auto& v) { return v.is_number(); })))
      return "spike_norms is not a list of numbers";
    const nlohmann::json& loader = content.state.at("loader");
    const int64_t step = loader.at("step").get<int64_t>(),
                  micro = loader.at("micro").get<int64_t>();
    if (step == content.step && micro == 0) return "";
    return detail::concat("data loader position step ", step, ", micro-batch ", micro,
                          " is not where a checkpoint of step ", content.step,
                          " leaves the loader (step ", content.step,
                          ", micro-batch 0); resuming there would replay or skip data");
  } catch (const nlohmann::json::exception& e) {
    return detail::concat("malformed trainer state (", e.what(), ")");
  }
}

// Rank 0's `text` on every rank.
std::string broadcast_text(comm::Communicator& group, const std::string& text) {
  int64_t n = int64_t(text.size());
  group.broadcast(std::span<int64_t>(&n, 1), 0);
  std::vector<uint8_t> bytes(text.begin(), text.end());
  bytes.resize(size_t(n));
  group.broadcast(bytes, 0);
  return std::string(bytes.begin(), bytes.end());
}

// This attempt's index, the same on every rank: `tessel run` passes it in
// TESSEL_ETT_ATTEMPT; otherwise rank 0 counts the run directory's attempt logs.
int agree_attempt(comm::Communicator& world, const std::string& run_dir) {
  int64_t attempt = 0;
  if (world.rank() == 0) {
    const char* env = std::getenv("TESSEL_ETT_ATTEMPT");
    attempt = env ? std::atoll(env) : count_attempts(run_dir);
  }
  world.broadcast(std::span<int64_t>(&attempt, 1), 0);
  return int(attempt);
}

// Marks a supervised start's ETT log as withdrawn (no attempt of the job): `tessel run`, which
// opened the log, removes it when it finds the mark (attempt_withdrawn, ett.hpp).
void mark_withdrawn(const std::string& log, const char* reason) {
  append_json_line(log, {{"event", "withdrawn"}, {"t", monotonic_ns()}, {"reason", reason}});
}

// A supervised start refused before its Attempt existed (a mesh the world cannot hold, another
// run holding the directory's lock): rank 0 marks the log `tessel run` opened for it.
void withdraw_supervised_start(const std::string& run_dir, int rank, const char* reason) {
  const char* index = std::getenv("TESSEL_ETT_ATTEMPT");
  if (rank != 0 || !index) return;
  try {
    mark_withdrawn(attempt_path(run_dir, std::atoi(index)), reason);
  } catch (const std::exception&) {  // the refusal itself is the error to report
  }
}

// Marks, between two members of Trainer::State, where one start-up leaf ends and the next
// begins (members are built in declaration order).
struct PhaseMark {
  PhaseMark(EttLedger& ledger, Phase phase) { ledger.enter(phase); }
};

// The compatibility record's entry of a pipeline run: the stage split it saved with. Recorded,
// not compared (restore_optimizer finds each stage's state under any split), so that an older
// tessel, which compares it, still resumes the checkpoint with the same split.
constexpr const char* kPipelineKey = "pipeline stage boundaries (parallel.pp, pipeline.layout)";
// Beside it under the interleaved schedule (the boundaries are then the virtual stages', which
// the same blocks per stage at another pp could repeat); recorded, not compared, either.
constexpr const char* kPipelineChunksKey = "pipeline chunks per stage (pipeline.chunks)";
// Written into every checkpoint's compatibility record: renaming it breaks resuming them.
constexpr std::string_view kGlobalBatchKey =
    "global batch (sequences per step: dp * accum * micro_batch)";
// The compatibility record's entry of a run on SFT data sets (each one's packed rows); text
// runs have none, so their older checkpoints still resume.
std::string sft_rows_key(int64_t d) {
  return data_set_key("SFT packed rows of ", d, "");
}

// Every data set's shard of `split` ("train" or "val"), in data.path's order.
std::vector<std::string> split_shards(const DataConfig& data, const std::string& split) {
  std::vector<std::string> shards;
  for (const auto& dir : data_paths(data)) shards.push_back(dir + "/" + split + ".tok");
  return shards;
}

// This dp rank's validation batches of every data set, in data.path's order.
struct ValidationSet {
  std::vector<data::Batch> batches;
  std::vector<int64_t> data_set;  // of each batch
};

// Checked at start-up with the training shards (`loader`'s), before any step: each data set's
// val.tok has its train.tok's vocabulary and dtype (else a mismatched pair fails at the first
// validation, or is validated as other ids, silently), and both are the shards their
// dataset.json describes and that the model reads (check_data_shard).
ValidationSet validation_set(const Config& c, const comm::Mesh& mesh,
                             const data::DataLoader& loader) {
  ValidationSet v;
  const auto shards = split_shards(c.data, "val");
  for (size_t d = 0; d < shards.size(); ++d) {
    const data::ShardReader val(shards[d]);
    const data::ShardReader& train = loader.shard(int64_t(d));
    if (val.vocab_size() != train.vocab_size() || val.dtype() != train.dtype())
      input_error(val.path(), ": token vocabulary ", val.vocab_size(), " (",
                  data::token_dtype_name(val.dtype()), ") but ", train.path(), " has ",
                  train.vocab_size(), " (", data::token_dtype_name(train.dtype()),
                  "): the two shards come from different prepares; prepare the data set again");
    check_data_shard(train, c.model.vocab);
    check_data_shard(val, c.model.vocab);
    for (auto& b : data::validation_batches(val, c.train.seq_len, c.train.micro_batch,
                                            c.train.eval_sequences, mesh.coordinate(comm::Axis::dp),
                                            mesh.size(comm::Axis::dp), c.data.overlong)) {
      v.batches.push_back(std::move(b));
      v.data_set.push_back(int64_t(d));
    }
  }
  return v;
}

// Shares as one exact text ("0.75,0.25"): what the compatibility record compares.
std::string weights_text(const std::vector<double>& weights) {
  std::string text;
  for (double w : weights) text += detail::concat(text.empty() ? "" : ",", json_text(w));
  return text;
}

// Model keys that train.init_from may change from `have` to `want` (their compatibility
// texts): how training treats the weights, not what they compute (and under rotary positions,
// the context length). Expert choice computes another function (its gates are the raw router
// scores), so switching to or from it is not a training setting.
bool init_may_differ(const std::string& key, const nlohmann::json& have, const nlohmann::json& want,
                     const model::GptConfig& model) {
  auto expert_choice = [](const nlohmann::json& v) {
    return v.is_string() && v.get<std::string>().find("expert_choice") != std::string::npos;
  };
  if (key == "model.moe_balance" && expert_choice(have) != expert_choice(want)) return false;
  static const std::set<std::string> training_settings = {
      "model.init_std",      "model.moe_aux_coeff",  "model.moe_balance",  "model.moe_bias_rate",
      "model.moe_capacity",  "model.moe_drop",       "model.moe_eqb_step", "model.moe_hist_bins",
      "model.moe_lei_coeff", "model.moe_lei_kernel", "model.moe_lei_loss", "model.moe_lei_margin",
      "model.moe_lei_width", "model.moe_z_coeff"};
  const bool rotary = model.positions == model::PositionType::rotary;
  return training_settings.count(key) > 0 ||
         (rotary && (key == "model.max_seq" || key == "model.rope_theta"));
}

}  // namespace

// Data set 0 keeps the name it had before mixtures, so single-data-set checkpoints still resume.
std::string data_set_key(const std::string& prefix, int64_t d, const std::string& fact) {
  return prefix + (d == 0 ? "data.path" : detail::concat("data.path[", d, "]")) + "/train.tok" +
         fact;
}

struct Trainer::Attempt {
  bool supervised = std::getenv("TESSEL_ETT_ATTEMPT") != nullptr;  // by `tessel run`
  int64_t t0;  // when this attempt began (process start, or the trainer's construction)
  // Rank 0's locks of the run directory (ett.hpp), held for the run: two runs writing one
  // directory would interleave checkpoints, metrics and attempt logs. Under `tessel run` the
  // supervisor holds supervisor.lock; a plain run takes it first, before the job's lock.
  RunDirLock supervisor_lock;
  RunDirLock lock;
  int index;
  EttLedger ledger;  // rank 0 writes the attempt's ETT log
  // The exit line's status: 0 once run() completed, exit_status of what it threw, 1 when it
  // never ran.
  int status = 1;

  Attempt(const std::string& run_dir, comm::Communicator& w, const ProcessTimes& times)
      : t0(times.started_ns >= 0 ? times.started_ns : monotonic_ns()),
        supervisor_lock(w.rank() == 0 && !supervised ? RunDirLock(run_dir, kSupervisorLock)
                                                     : RunDirLock()),
        lock(w.rank() == 0 ? RunDirLock(run_dir, kJobLock) : RunDirLock()),
        index(agree_attempt(w, run_dir)),
        ledger(w.rank() == 0 ? EttLedger(run_dir, index, !supervised, t0) : EttLedger()) {}

  // The exit line, however the attempt ends (also when building the State threw). `tessel
  // run` writes it itself, after the job's teardown.
  ~Attempt() {
    if (!supervised && ledger.active()) try {
        ledger.event({{"event", "exit"}, {"status", status}});
      } catch (const std::exception&) {
      }
  }

  // A start refused for bad input, or one with nothing to train, is no attempt of the job:
  // left in the ledger it would count as a failure or add its time to W (and move the
  // observed MTBF and the fault injector's attempt count). Rank 0 removes its log; a
  // supervised attempt's log belongs to `tessel run`, which removes it when it finds this
  // mark (attempt_withdrawn, ett.hpp). Nothing more is recorded either way.
  void withdraw(const char* reason) {
    if (!ledger.active()) return;
    if (supervised)
      mark_withdrawn(ledger.path(), reason);
    else
      remove_attempt(ledger.path());
    ledger = EttLedger();
  }
};

struct Trainer::State {
  Config config;
  comm::Communicator& world;
  bool is_root;
  int64_t t0;
  int attempt;
  EttLedger& ledger;
  PhaseMark build_mark;
  comm::Mesh mesh;
  comm::Communicator& dp;
  // With context parallelism the cp ranks of a dp rank split each sequence: the loss, the
  // gradients, the MoE balancing sums and metrics sum over dp x cp (the ranks with this
  // pipeline stage); expert gradients over edp x cp.
  comm::Communicator& grad_group;
  model::Gpt model;
  // MoE token exchange (ep group), balancing sums (dp x cp), micro-batch sums (cp); the
  // sample's: every cp rank generates whole sequences.
  parallel::ExpertParallelComm experts, sample_experts;
  MoeMetrics moe_step, moe_val;
  // Dense over dp and experts over edp: the whole model's, or a pipeline stage's
  // (pipeline_trainer.hpp).
  std::unique_ptr<parallel::ExpertShardedOptimizer> optimizer;
  optim::LrSchedule schedule;
  optim::SpikeFilter spikes;
  parallel::ExpertShardedGradients grads;  // all-reduces and clipping
  std::map<std::pair<int64_t, int64_t>, std::unique_ptr<model::Activations>> acts;  // by B, T
  std::jthread warmup;  // fast start: the synthetic step, beside the data warm-up below
  std::exception_ptr warmup_failure;
  PhaseMark data_mark;
  data::DataLoader loader;
  std::unique_ptr<PipelineTrainer> pipeline;  // parallel.pp > 1 or pipeline.schedule set
  ValidationSet validation;
  CheckpointStore store;
  std::unique_ptr<comm::Communicator> ckpt_comm;  // the checkpointer's own collectives
  AsyncCheckpointer checkpointer;
  FaultInjector faults;
  // The data's tokenizer (data_tokenizer; null when it has none), and the final sample's
  // prompt and stop token when train.sample_tokens > 0.
  std::unique_ptr<data::Tokenizer> tokenizer;
  std::vector<int32_t> sample_prompt;
  int32_t sample_stop = -1;
  int64_t start_step = 0;
  int64_t resumed_from = -1;
  std::string initialized_from;  // train.init_from's checkpoint, when it started the weights
  nlohmann::json init_pin;       // what init.json records of it (rank 0 writes it)
  State(Config c, comm::Communicator& w, comm::MeshShape shape, const ProcessTimes& times,
        Attempt& a)
      : config(std::move(c)),
        world(w),
        is_root(w.rank() == 0),
        t0(a.t0),
        attempt(a.index),
        ledger(a.ledger),
        build_mark(mark_start(times)),
        mesh(comm::Mesh::build(w, shape)),
        dp(mesh.group(comm::Axis::dp)),
        grad_group(mesh.group(comm::Axis::dp_cp)),
        model(config.model, uint64_t(config.run.seed), parallel::expert_shard(mesh),
              pipeline_block_ranges(config, mesh)),
        experts(mesh.group(comm::Axis::ep), grad_group, &mesh.group(comm::Axis::cp)),
        sample_experts(mesh.group(comm::Axis::ep), grad_group, nullptr),
        moe_step(model),
        moe_val(model),
        optimizer(pipeline_enabled(config)
                      ? make_stage_optimizer(config, model, mesh, qkv_blocks())
                      : std::make_unique<parallel::ExpertShardedOptimizer>(
                            config.optim, model.dense_parameters(), model.expert_parameters(), dp,
                            mesh.group(comm::Axis::edp), qkv_blocks())),
        schedule(optim::lr_schedule(config.optim, config.train.steps)),
        spikes(config.train.spike_factor, config.train.spike_window),
        grads(model, grad_group, mesh.group(comm::Axis::edp_cp), mesh.group(comm::Axis::ep),
              config.parallel.bucket_bytes()),
        warmup(config.train.fast_start ? std::jthread([this] { synthetic_step(); })
                                       : std::jthread()),
        data_mark(ledger, Phase::data_warmup),
        loader(split_shards(config.data, "train"), data_weights(config.data),
               data::LoaderOptions{config.train.seq_len, config.train.micro_batch,
                                   micro_batches_per_step(config), mesh.coordinate(comm::Axis::dp),
                                   mesh.size(comm::Axis::dp), uint64_t(config.run.seed),
                                   config.data.shuffle, config.data.overlong}),
        pipeline(pipeline_enabled(config) ? std::make_unique<PipelineTrainer>(
                                                config, mesh, model, loader, *optimizer, schedule)
                                          : nullptr),
        validation(validation_set(config, mesh, loader)),
        store(config.run.dir + "/checkpoints", config.train.keep_checkpoints),
        ckpt_comm(w.split(0, w.rank())),
        checkpointer(store, *ckpt_comm),
        faults(config.fault, attempt, w.rank(), attempt_path(config.run.dir, attempt), t0) {
    model.set_expert_comm(&experts);
    const auto dirs = data_paths(config.data);
    data::check_same_tokenizer(dirs);  // a mixture's ids must mean the same text
    if (loader.packed()) check_packed_samples_mask(dirs[0], config.data.attention_mask);
    for (int64_t d = 0; d < loader.sources(); ++d) {
      const bool sft = loader.packed(d);
      if (data::has_loss_mask(dirs[size_t(d)] + "/val.tok") != sft)
        input_error(dirs[size_t(d)], ": ", sft ? "train.tok" : "val.tok",
                    " has a loss-mask shard and ", sft ? "val.tok" : "train.tok",
                    " has none; prepare the data set again");
    }
    // Loaded now, sample or not: a bad vocabulary fails before the run copies it.
    tokenizer = data_tokenizer(config);
    if (config.train.sample_tokens > 0) {  // encoded now: bad text fails before the training
      if (tokenizer) {
        sample_prompt =
            tokenizer->encode_text(config.train.sample_prompt, "config key 'train.sample_prompt'");
        sample_stop =
            tokenizer->single_token(config.train.sample_stop, "config key 'train.sample_stop'");
      }
    }
    checkpointer.on_files_written = [this](int64_t step) { faults.in_checkpoint_write(step); };
    checkpointer.on_committed = [this](const std::string& dir, int64_t step) {
      // From now on a restart resumes from the run's own checkpoint: the init pin is done.
      if (is_root && !initialized_from.empty()) {
        std::error_code ignored;
        fs::remove(config.run.dir + "/init.json", ignored);
      }
      faults.after_commit(dir, step);
    };
  }

  // A resumed run's ids must mean the same text as before. Once rank 0 has recovered or swept
  // what the last job left (prepare_checkpoints).
  void check_resumed_tokenizer() const {
    if (!config.train.resume || !store.latest()) return;
    try {
      data::check_same_tokenizer({run_tokenizer_dir(config.run.dir), data_paths(config.data)[0]});
    } catch (const InputError& e) {
      input_error("the run's checkpoints were trained on the ids of ", config.run.dir,
                  "/tokenizer, and data.path holds another tokenizer's: use data prepared with "
                  "it, or a new run.dir (",
                  e.what(), ")");
    }
  }

  // What a killed run left, before any rank looks for a checkpoint: rank 0 commits a save that
  // every rank finished writing (the job hung or died before agreeing on it), then removes
  // half-written checkpoints and temporary files of atomic writes. Collective: the other ranks
  // wait for it (and stop with its error).
  void prepare_checkpoints() {
    std::string failure;
    if (is_root) {
      try {
        if (const auto step = store.recover_prepared()) {
          const std::string dir = store.step_dir(*step);
          std::fprintf(stderr,
                       "tessel: the save of step %lld was written by every rank but not "
                       "committed (its job ended before the commit); recovered it as %s\n",
                       static_cast<long long>(*step), dir.c_str());
          // The run has a checkpoint of its own now, as after any commit: the init pin is done.
          std::error_code ignored;
          fs::remove(config.run.dir + "/init.json", ignored);
          faults.after_commit(dir, *step);  // fault.corrupt_step strikes a recovered save too
        }
        store.sweep_leftovers();
        remove_temporary_files(config.run.dir);
      } catch (const std::exception& e) {
        failure = e.what();
      }
    }
    agree(failure, config.run.dir + ": rank 0 could not clean up after the last job");
  }

  // The leaves before the trainer existed: MPI start-up and config parsing (CLI).
  PhaseMark mark_start(const ProcessTimes& times) {
    if (times.started_ns >= 0) ledger.enter(Phase::comm_init, -1, times.started_ns);
    if (times.comm_ready_ns >= 0) ledger.enter(Phase::other, -1, times.comm_ready_ns);
    PhaseMark build(ledger, Phase::model_build);
    // fault.init_delay_seconds: a slow cold start, one that progresses (as a compilation
    // does, kernel by kernel): a beat each second keeps it apart from a hang.
    using Clock = std::chrono::steady_clock;
    const Clock::time_point end =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(
                           std::chrono::duration<double>(config.fault.init_delay_seconds));
    while (Clock::now() < end) {
      std::this_thread::sleep_until(std::min(end, Clock::now() + std::chrono::seconds(1)));
      ledger.beat();
    }
    return build;
  }

  // Fast start, beside the data warm-up of the main thread: allocates (and so first-touches)
  // the training micro-batch's activations, and runs one forward and backward on a
  // synthetic one-row batch (starts the thread pools, warms the kernels) with activations
  // of its own. Only the gradients change, and every step zeroes them first. Not for MoE
  // models (their backward feeds the first balance update), under context parallelism, nor
  // for pipeline stages (they hold part of the model).
  void synthetic_step() {
    try {
      set_num_threads(int(config.run.threads));
      // A pipeline stage holds only its blocks and trains on activations of its own
      // (pipeline_stage.hpp): its first micro-batch warms the kernels.
      if (pipeline_enabled(config)) return;
      activations(config.train.micro_batch, config.train.seq_len / config.parallel.cp);
      const auto& moe = model.moe_blocks();
      if (config.parallel.cp > 1 || std::find(moe.begin(), moe.end(), true) != moe.end()) return;
      const int64_t T = config.train.seq_len;
      std::vector<int32_t> tokens(static_cast<size_t>(T)), targets(tokens), positions(tokens);
      std::vector<float> mask(size_t(T), 1.0f);
      for (int64_t i = 0; i < T; ++i) {
        tokens[size_t(i)] = int32_t(i % config.model.vocab);
        targets[size_t(i)] = int32_t((i + 1) % config.model.vocab);
        positions[size_t(i)] = int32_t(i);
      }
      auto a = model.make_activations(1, T, config.train.recompute);
      model.forward(*a, {1, T, tokens.data(), positions.data(), targets.data(), mask.data()});
      model.backward(*a, 1.0f);
    } catch (...) {
      warmup_failure = std::current_exception();
    }
  }

  void finish_warmup() {
    if (!warmup.joinable()) return;
    ledger.enter(Phase::warmup);
    warmup.join();
    if (warmup_failure) std::rethrow_exception(warmup_failure);
  }

  // optim.qkv_split: the row blocks of every fused QKV weight.
  std::map<std::string, std::vector<int64_t>> qkv_blocks() const {
    const auto& m = config.model;
    auto blocks = optim::qkv_row_blocks(config.optim.qkv_split, m.heads * m.head_dim(),
                                        m.num_kv_heads() * m.head_dim(), m.head_dim());
    std::map<std::string, std::vector<int64_t>> out;
    if (!blocks.empty())
      for (int64_t i = 0; i < m.layers; ++i)
        out["blocks." + std::to_string(i) + ".attn.qkv.weight"] = blocks;
    return out;
  }

  model::Activations& activations(int64_t rows, int64_t T) {
    auto& a = acts[{rows, T}];
    if (!a) a = model.make_activations(rows, T, config.train.recompute);
    return *a;
  }

  void log(const std::string& line) const {
    if (is_root && !config.run.quiet) {  // fwrite: a sample may hold NUL bytes
      std::fwrite(line.data(), 1, line.size(), stdout);
      std::fputc('\n', stdout);
      std::fflush(stdout);
    }
  }

  // What must match between a checkpoint and the run that resumes it, by config key:
  // the model, everything that decides the data order, and the optimizer. The data order
  // depends on the layout only through the global batch (data/loader.hpp), so dp, accum
  // and micro_batch may change if their product does: the optimizer state is stored whole
  // or in row shards, and restore_optimizer re-cuts it for the new dp group. The pipeline's
  // stage split may change too (kPipelineKey).
  nlohmann::json compatibility() const {
    // data.attention_mask decides what each position attends to and its position index.
    static const std::set<std::string> order_keys = {"run.seed", "data.shuffle", "train.seq_len",
                                                     "optim.name", "data.attention_mask"};
    nlohmann::json keys;
    for (const auto& k : config_schema())
      if (k.name.rfind("model.", 0) == 0 || order_keys.count(k.name)) keys[k.name] = k.get(config);
    keys[std::string(kGlobalBatchKey)] = loader.sequences_per_step();
    keys[kDataWeightsKey] = weights_text(loader.weights());
    for (int64_t d = 0; d < loader.sources(); ++d) {
      keys[data_set_key("", d, " tokens")] = loader.shard(d).num_tokens();
      keys[data_set_key("", d, " documents")] = loader.shard(d).num_documents();
    }
    if (pipeline) keys[kPipelineKey] = pipeline_boundaries(config);
    if (pipeline_chunks(config) > 1) keys[kPipelineChunksKey] = pipeline_chunks(config);
    if (loader.packed()) {
      for (int64_t d = 0; d < loader.sources(); ++d) keys[sft_rows_key(d)] = loader.windows(d);
      keys["data.overlong"] = data::overlong_name(config.data.overlong);
    }
    return keys;
  }

  void save(int64_t step) {
    CheckpointContent content;
    content.step = step;
    // Each expert once: the first edp x cp rank of each ep index writes the ep rank's experts (and
    // their optimizer state). A pipeline stage's dense parameters and optimizer state (held
    // by its ranks alone) once: the stage's lead writes them; its experts likewise by the
    // stage's first edp x cp rank of each ep index. ZeRO-1 row shards: each dp (edp) rank
    // writes its own; the ranks that differ only in cp hold the same ones, the first writes.
    const bool writes_experts = mesh.coordinate(comm::Axis::edp_cp) == 0;
    auto state = optimizer->split_state();
    if (!pipeline) {
      for (const auto& p : model.dense_parameters()) content.model.push_back({p.name, p.value});
      for (auto& st : state.replicated) content.optimizer.push_back({st.name, st.tensor});
    } else if (stage_lead()) {
      for (const auto& p : pipeline->own_dense_parameters())
        content.own_model.push_back({p.name, p.value});
      for (auto& st : state.replicated) content.own_optimizer.push_back({st.name, st.tensor});
    }
    if (writes_experts) {
      for (const auto& p : model.expert_parameters())
        content.own_model.push_back({p.name, p.value});
      for (auto& st : state.own) content.own_optimizer.push_back({st.name, st.tensor});
    }
    if (mesh.coordinate(comm::Axis::cp) == 0)
      for (auto& st : state.shards)
        content.optimizer_shards.push_back({st.name, st.tensor, st.row0, st.rows});
    auto ls = loader.state();
    content.state = {{"compatibility", compatibility()},
                     {"loader", {{"step", ls.step}, {"micro", ls.micro}}},
                     {"spike_norms", spikes.history()},
                     {"config", to_toml(config)}};
    checkpointer.save(content);
    if (!config.train.checkpoint_async) checkpointer.wait();
  }

  // Rank 0 picks a checkpoint with `pick` and every rank loads that one, so the ranks can
  // never start from different ones; any failure stops all. nullopt when rank 0 found none.
  std::optional<CheckpointStore::Loaded> load_agreed(
      const std::function<std::optional<CheckpointStore::Loaded>()>& pick,
      CheckpointParts parts = CheckpointParts::all) {
    std::string chosen, failure;
    std::optional<CheckpointStore::Loaded> loaded;  // rank 0's, reused below
    if (is_root) {
      try {
        loaded = pick();
        if (loaded) chosen = loaded->dir;
      } catch (const std::exception& e) {
        failure = e.what();
      }
    }
    std::string agreed =
        broadcast_text(world, failure.empty() ? "ok:" + chosen : "error:" + failure);
    if (agreed.rfind("error:", 0) == 0) input_error(agreed.substr(6));
    chosen = agreed.substr(3);
    if (chosen.empty()) return std::nullopt;
    if (!is_root) {
      try {
        loaded = CheckpointStore::Loaded{chosen, CheckpointStore::load(chosen, parts)};
      } catch (const std::exception& e) {
        failure = e.what();
      }
    }
    agree(failure, chosen + ": another rank could not read this checkpoint");
    return loaded;
  }

  // Every rank stops with an InputError when `failure` is set on any: its own message, or
  // `elsewhere` where another rank failed.
  void agree(const std::string& failure, const std::string& elsewhere) {
    if (!comm::all_agree(world, failure.empty()))
      input_error(failure.empty() ? elsewhere : failure);
  }

  // Continues from the run directory's newest checkpoint that verifies, when there is one.
  void resume() {
    const auto loaded = load_agreed([this] {
      return store.load_newest_valid(warn_on_stderr, CheckpointParts::all, resume_state_problem);
    });
    if (!loaded) return;
    const std::string& chosen = loaded->dir;
    const CheckpointContent& content = loaded->content;
    nlohmann::json want = compatibility();
    const nlohmann::json& have = content.state.at("compatibility");
    const std::string sft_key = sft_rows_key(0);
    if (have.contains(sft_key) != want.contains(sft_key))
      input_error(
          chosen, ": checkpoint was trained on ",
          have.contains(sft_key) ? "an SFT data set" : "a text data set (or by an older tessel)",
          " but this run's data.path ", config.data.path, " is ",
          want.contains(sft_key) ? "an SFT data set" : "a text data set", "; use a new run.dir");
    bool same_stage_split = true;
    for (const char* key : {kPipelineKey, kPipelineChunksKey}) {
      same_stage_split = same_stage_split &&
                         have.value(key, nlohmann::json()) == want.value(key, nlohmann::json());
      want.erase(key);  // any stage split resumes: restore_optimizer maps the stages
    }
    // Config keys first: a changed setting is named, not the facts it changes (an SFT data
    // set's packed rows under another data.overlong).
    const auto is_config_key = [](const std::string& key) {
      const auto& schema = config_schema();
      return std::any_of(schema.begin(), schema.end(),
                         [&](const auto& k) { return k.name == key; });
    };
    for (const bool config_keys : {true, false})
      for (const auto& [key, value] : want.items())
        if (is_config_key(key) != config_keys) {
          continue;
        } else if (!have.contains(key)) {
          const std::string why = absent_key_mismatch(key, value, content.state);
          if (!why.empty()) input_error(chosen, ": checkpoint", why, "; use a new run.dir");
        } else if (!same_model_setting(key, have[key], value, config.model)) {
          input_error(chosen, ": checkpoint has ", key, " = ", json_text(have[key]),
                      " but this run has ", json_text(value),
                      key == kGlobalBatchKey
                          ? " (under PACI pipeline.paci_k, when set, counts as accum)"
                          : "",
                      "; resume with the checkpoint's setting or use a new run.dir");
        }
    // Only a resume that is accepted drops the damaged newer ones: the run redoes those steps.
    if (is_root) store.discard_newer_than(chosen);
    finish_warmup();  // its forward reads the weights restored here
    ledger.enter(Phase::checkpoint_load);
    for (auto p : model.parameters()) restore_tensor(content.model, p.name, p.value, chosen);
    // Row shards come from the files that hold this rank's rows, which only it reads.
    std::vector<RowShard> wanted;
    for (auto& st : optimizer->state()) wanted.push_back({st.name, st.tensor, st.row0, st.rows});
    std::string failure;
    try {
      restore_optimizer(content, wanted, chosen, same_stage_split);
    } catch (const std::exception& e) {
      failure = e.what();
    }
    agree(failure, chosen + ": another rank could not restore its optimizer state");
    const auto& ls = content.state.at("loader");
    loader.restore({ls.at("step").get<int64_t>(), ls.at("micro").get<int64_t>()});
    // Older checkpoints have none: their run did not skip. PACI keeps no window: a later
    // resume without it must not compare with norms from before its PACI steps.
    if (!per_stage_updates())
      spikes.restore(content.state.value("spike_norms", std::vector<double>{}));
    start_step = resumed_from = content.step;
    faults.starts_from(start_step);
    ledger.event({{"event", "resume"}, {"step", content.step}, {"dir", chosen}});
  }

  // Fine-tuning: a run that did not resume starts from the model weights of train.init_from
  // (a run directory's newest valid checkpoint, or a checkpoint directory), with a fresh
  // optimizer and data order. The model keys must match but for init_may_differ's. The
  // checkpoint taken is pinned in <run.dir>/init.json until the run's first checkpoint, so a
  // restarted attempt before it starts from the same weights even if the base run saved newer
  // ones since (a fresh start with train.resume = false does not read the pin).
  void init_weights() {
    const std::string& from = config.train.init_from;
    const std::string pin_path = config.run.dir + "/init.json";
    bool used_pin = false;  // rank 0's, for its start line
    const auto loaded = load_agreed(
        [&]() -> std::optional<CheckpointStore::Loaded> {
          std::string dir = from, pinned;
          if (config.train.resume && fs::exists(pin_path)) {
            std::ifstream in(pin_path);
            const auto pin = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
            if (!pin.is_object() || !pin.contains("init_from") || !pin["init_from"].is_string() ||
                !pin.contains("checkpoint") || !pin["checkpoint"].is_string())
              input_error(pin_path,
                          ": not a pin of train.init_from (a JSON object with the strings "
                          "\"init_from\" and \"checkpoint\"); remove it to start from ",
                          from);
            if (pin["init_from"] == from) dir = pinned = pin["checkpoint"].get<std::string>();
            used_pin = !pinned.empty();
          }
          try {
            return load_trained_checkpoint(dir);  // names an export, a run without one yet
          } catch (const InputError& e) {
            if (pinned.empty()) input_error("train.init_from = ", from, ": ", e.what());
            input_error("train.init_from = ", from, ": this run's first attempt started from ",
                        pinned, " (", pin_path, "), which no longer loads: ", e.what(), "; remove ",
                        pin_path, " to start from the newest checkpoint again");
          }
        },
        CheckpointParts::model);
    const std::string& dir = loaded->dir;
    try {  // the base model read the ids of its own tokenizer
      std::vector<std::string> with_base = model_tokenizer_dirs(
          dir, checkpoint_config(*loaded), loaded->content.state.at("compatibility"));
      for (const auto& d : data_paths(config.data)) with_base.push_back(d);
      data::check_same_tokenizer(with_base);
    } catch (const InputError& e) {
      input_error("train.init_from: ", e.what());
    }
    const nlohmann::json& have = loaded->content.state.at("compatibility");
    const nlohmann::json want = compatibility();  // a named object: items() refers into it
    std::string differences;
    for (const auto& [key, value] : want.items()) {
      if (key.rfind("model.", 0) != 0 ||
          init_may_differ(key, have.value(key, nlohmann::json()), value, config.model))
        continue;
      if (!have.contains(key)) {
        const std::string why = absent_key_mismatch(key, value, loaded->content.state);
        if (!why.empty()) input_error("train.init_from: ", dir, why);
      } else if (!same_model_setting(key, have[key], value, config.model))
        differences += detail::concat(differences.empty() ? "" : ", ", key, " = ",
                                      json_text(have[key]), " (this run: ", json_text(value), ")");
    }
    if (!differences.empty())
      input_error("train.init_from: ", dir, " holds another model: ", differences,
                  "; fine-tuning keeps the model of the checkpoint");
    finish_warmup();  // its forward reads the weights restored here
    ledger.enter(Phase::checkpoint_load);
    for (auto p : model.parameters()) restore_tensor(loaded->content.model, p.name, p.value, dir);
    initialized_from = dir + (used_pin ? " (pinned by init.json)" : "");
    init_pin = {{"init_from", from}, {"checkpoint", dir}, {"step", loaded->content.step}};
    ledger.event({{"event", "init"}, {"step", loaded->content.step}, {"dir", dir}});
  }

  // Each data set's validation loss, in data.path's order.
  std::vector<double> validate() {
    const int64_t data_sets = loader.sources();
    std::vector<double> sums(size_t(2 * data_sets), 0.0);  // [loss sum, loss tokens] per data set
    moe_val.clear();
    if (pipeline) {
      sums = pipeline->validation_sums(validation.batches, validation.data_set, data_sets, moe_val,
                                       [&] { ledger.beat(); });
    } else {
      // Every forward exchanges tokens over the ep group: its ranks run as many as the one
      // with the most validation batches, the others on batches without loss tokens.
      const auto& batches = validation.batches;
      int64_t rounds = int64_t(batches.size());
      mesh.group(comm::Axis::ep).all_reduce(std::span<int64_t>(&rounds, 1), comm::ReduceOp::max);
      const data::Batch idle = idle_batch(config.train.seq_len);
      for (int64_t i = 0; i < rounds; ++i) {
        const bool real = i < int64_t(batches.size());
        const data::Batch& b = real ? batches[size_t(i)] : idle;
        const RankBatchInputs rank_in(b, config, mesh.group(comm::Axis::cp));  // as in training
        const model::ModelInputs& in = rank_in.inputs();
        const double loss_sum = model.forward(activations(in.B, in.T), in);
        ledger.beat();
        if (!real) continue;
        const auto d = size_t(validation.data_set[size_t(i)]);
        sums[2 * d] += loss_sum;
        sums[2 * d + 1] += rank_in.loss_weight_sum();
        moe_val.add(activations(in.B, in.T));
      }
    }
    grad_group.all_reduce(std::span<double>(sums));
    if (!moe_val.empty() && !pipeline) grad_group.all_reduce(moe_val.values());  // pipeline: done
    std::vector<double> losses;
    for (int64_t d = 0; d < data_sets; ++d) {
      const double tokens = sums[size_t(2 * d + 1)];
      losses.push_back(tokens > 0 ? sums[size_t(2 * d)] / tokens : 0.0);
    }
    return losses;
  }

  // Rank 0's text sample, on the ranks samples() names. With ep = 1 and no pipeline rank 0
  // runs alone; with sharded experts each ep group generates together; a pipeline's windows
  // pass through its stages. The same prompt, seed and length everywhere.
  std::string sample() {
    const data::Tokenizer& tok = *tokenizer;
    Rng rng(uint64_t(config.run.seed) + 1);
    const auto& t = config.train;
    const int64_t ids_of_tokenizer = tok.vocab_size();  // never a padding id of the model
    model.set_expert_comm(sharded_experts() ? &sample_experts : nullptr);
    const auto ids =
        pipeline
            ? model::generate(
                  [this](std::span<const int32_t> w) { return pipeline->next_token_logits(w); },
                  config.model.max_seq, sample_prompt, t.sample_tokens, float(t.sample_temperature),
                  t.sample_top_k, rng, sample_stop, nullptr, ids_of_tokenizer)
            : model::generate(model, sample_prompt, t.sample_tokens, float(t.sample_temperature),
                              t.sample_top_k, rng, sample_stop, nullptr, ids_of_tokenizer);
    model.set_expert_comm(&experts);
    return tok.decode(ids);
  }

  // PACI: each stage updates on its own, with its own gradient norm.
  bool per_stage_updates() const {
    return pipeline && pipeline_schedule(config) == pipeline::ScheduleKind::paci;
  }

  // The first rank of a pipeline stage's replicas (dp and cp coordinate 0): it writes the
  // stage's checkpoint tensors, prints PACI's progress lines (on the last stage) and runs
  // the sample's forwards through the stages (its pp group holds rank 0).
  bool stage_lead() const {
    return mesh.coordinate(comm::Axis::dp) == 0 && mesh.coordinate(comm::Axis::cp) == 0;
  }

  bool sharded_experts() const {
    return mesh.size(comm::Axis::ep) > 1 && !model.expert_parameters().empty();
  }

  // Whether this rank takes part in the end-of-run sample. A pipeline with ep-sharded MoE
  // generates on every rank, decided from the whole model: a stage without MoE blocks still
  // passes the windows of its pp neighbours that run expert all-to-alls.
  bool samples() const {
    if (!pipeline) return is_root || sharded_experts();
    const std::vector<bool>& moe = model.moe_blocks();  // the whole model's, on every stage
    const bool any_moe = std::find(moe.begin(), moe.end(), true) != moe.end();
    return stage_lead() || (mesh.size(comm::Axis::ep) > 1 && any_moe);
  }
};

comm::MeshShape job_mesh(const Config& config, int world_size) {
  // The config caps each degree at 2^24, so each fits an int; their products are taken in 64
  // bits (MeshShape::world_size, the automatic dp here).
  const ParallelConfig& par = config.parallel;
  comm::MeshShape shape{int(par.pp), int(par.dp), int(par.cp), int(par.ep)};
  if (shape.dp == 0) {
    if (world_size % (par.pp * par.cp) != 0)
      input_error("mesh pp=", par.pp, " x cp=", par.cp, " needs a multiple of ", par.pp * par.cp,
                  " processes (parallel.dp = 0 takes world / (pp x cp)), but the world has ",
                  world_size);
    shape.dp = int(world_size / (par.pp * par.cp));
  }
  shape.validate(world_size);
  // Each factor is capped (config.cpp), their product is not. Divided in turn, so that
  // nothing overflows: the quotient is 0 exactly when the product exceeds the bound.
  int64_t room = kMaxRunTokens;
  for (const int64_t factor :
       {config.train.steps, int64_t(shape.dp), micro_batches_per_step(config),
        config.train.micro_batch, config.train.seq_len})
    room /= factor;
  if (room == 0)
    input_error("train.steps x dp x ",
                config.pipeline.paci_k > 0 ? "pipeline.paci_k" : "train.accum",
                " x train.micro_batch x train.seq_len (the tokens this run reads) is larger than "
                "tessel supports (",
                kMaxRunTokens, "); lower train.steps or the batch");
  if (config.fault.kill_rank >= world_size)
    input_error("config key 'fault.kill_rank' = ", config.fault.kill_rank,
                " is not a rank of this job (world size ", world_size, ")");
  return shape;
}

Trainer::Trainer(Config config, comm::Communicator& world, ProcessTimes times) {
  comm::MeshShape shape;
  try {  // before the run directory is locked: a refused mesh or rank leaves nothing there
    shape = job_mesh(config, world.size());
  } catch (const InputError&) {  // under `tessel run`: no attempt of the job
    withdraw_supervised_start(config.run.dir, world.rank(), "bad input");
    throw;
  }
  check_run_dir(config.run.dir);  // before the attempt's ETT log is created in it
  int threads =
      config.run.threads > 0 ? int(config.run.threads) : auto_threads_per_rank(world.size());
  set_num_threads(threads);
  config.run.threads = num_threads();  // what the pools run, after OpenBLAS's cap
  config.parallel.dp = shape.dp;
  try {
    attempt_ = std::make_unique<Attempt>(config.run.dir, world, times);
  } catch (const InputError&) {  // the run directory is locked, or its ett/ is unusable
    withdraw_supervised_start(config.run.dir, world.rank(), "bad input");
    throw;
  }
  try {
    s_ = std::make_unique<State>(std::move(config), world, shape, times, *attempt_);
    State& s = *s_;
    s.prepare_checkpoints();
    s.check_resumed_tokenizer();
    s.ledger.enter(Phase::checkpoint_load);
    if (s.config.train.resume)
      s.resume();
    else if (s.store.latest())
      // A fresh run here would mix its checkpoints with the old run's (and retention,
      // which keeps the highest steps, could delete the new ones).
      input_error(s.config.run.dir,
                  ": holds checkpoints of an earlier run but train.resume = "
                  "false; choose a new run.dir or remove ",
                  s.config.run.dir, "/checkpoints");
    if (s.resumed_from < 0) model::check_trainable(s.config.model);
    if (s.resumed_from < 0 && !s.config.train.init_from.empty()) s.init_weights();
    s.finish_warmup();
    // A resume or an init loaded a whole checkpoint on every rank; the steps never hold that
    // much.
    if (s.resumed_from >= 0 || !s.initialized_from.empty()) release_free_memory();
    s.ledger.enter(Phase::other);
    const bool trains = s.start_step < s.config.train.steps;
    if (!trains) attempt_->withdraw("nothing to train");
    // Written only once the run is accepted, so a rejected run leaves the directory as it
    // was, and only when it trains: a run with nothing to train keeps the config that trained.
    if (s.is_root && trains) {
      fs::create_directories(s.config.run.dir);
      write_file_atomically(s.config.run.dir + "/config.toml", to_toml(s.config));
      data::save_tokenizer(data_paths(s.config.data)[0], run_tokenizer_dir(s.config.run.dir));
      if (!s.initialized_from.empty())
        write_file_atomically(s.config.run.dir + "/init.json", s.init_pin.dump(2) + "\n");
    }
    world.barrier();
  } catch (const InputError&) {
    s_.reset();
    attempt_->withdraw("bad input");
    throw;
  }
}

Trainer::~Trainer() = default;

TrainResult Trainer::run() {
  try {
    TrainResult result = run_steps();
    attempt_->status = 0;
    return result;
  } catch (const std::exception& e) {
    attempt_->status = exit_status(e);  // for the ledger's exit line
    throw;
  }
}

TrainResult Trainer::run_steps() {
  State& s = *s_;
  const Config& c = s.config;
  TrainResult result;
  result.resumed_from = s.resumed_from;

  // The MFU denominator: every rank measures GEMM at once (as they will compute). With
  // train.fast_start a restart reuses the peak its run directory measured before.
  s.ledger.enter(Phase::warmup);
  double peak = c.mfu.peak_gflops;
  if (peak <= 0) {
    const std::string cache = c.run.dir + "/gemm_peak.json";
    const nlohmann::json key = {{"ranks", s.world.size()}, {"threads", num_threads()}};
    double cached[2] = {0, 0};  // found, value (rank 0's)
    if (s.is_root && c.train.fast_start && fs::exists(cache)) {
      std::ifstream in(cache);
      auto j = nlohmann::json::parse(in, nullptr, false);
      // A peak too small for a finite MFU (a hand-edited file) is measured again.
      if (j.is_object() && j.value("key", nlohmann::json()) == key &&
          j["peak_gflops"].is_number() && j["peak_gflops"].get<double>() >= kMinPeakGflops)
        cached[0] = 1, cached[1] = j["peak_gflops"].get<double>();
    }
    s.world.broadcast(std::span<double>(cached, 2), 0);
    if (cached[0] > 0) {
      peak = cached[1];
    } else {
      double measured = kernels::measure_gemm_peak_gflops(1024, 0.5);  // as `tessel bench-gemm`
      s.world.all_reduce(std::span<double>(&measured, 1));
      peak = measured / s.world.size();
      if (s.is_root && c.train.fast_start)
        write_file_atomically(cache, nlohmann::json{{"key", key}, {"peak_gflops", peak}}.dump());
    }
  }
  result.peak_gflops = peak;

  const auto& mc = c.model;
  const double flops_tok = flops_per_token(s.model.matmul_parameters(), mc.layers, mc.heads,
                                           mc.head_dim(), c.train.seq_len);
  const double hardware_flops_tok =
      flops_tok + (c.train.recompute == model::Recompute::blocks
                       ? recompute_flops_per_token(s.model.block_matmul_parameters(), mc.layers,
                                                   mc.heads, mc.head_dim(), c.train.seq_len)
                       : 0.0);
  // Input positions per step; an SFT data set's padding is not counted (tokens/s and MFU).
  const int64_t global_tokens = s.loader.sequences_per_step() * c.train.seq_len;
  const bool packed = s.loader.packed();
  auto step_tokens = [&](int64_t step) { return s.loader.step_tokens(step - 1); };  // from 1
  // An SFT run's packing, summed over its data sets.
  int64_t samples = 0, rows = 0, overlong = 0, untrained = 0;
  for (int64_t d = 0; packed && d < s.loader.sources(); ++d) {
    samples += s.loader.packed(d)->samples(), rows += s.loader.packed(d)->rows();
    overlong += s.loader.packed(d)->overlong(), untrained += s.loader.packed(d)->untrained();
  }
  // A packing's counts in words, the training split's and the validation split's (which
  // validation reads up to train.eval_sequences rows of per data set).
  auto packing_text = [&](int64_t n_samples, int64_t n_rows, int64_t n_overlong,
                          int64_t n_untrained) {
    return detail::concat(n_samples, n_samples == 1 ? " sample" : " samples", " packed into ",
                          n_rows, n_rows == 1 ? " row; " : " rows; ", n_overlong,
                          c.data.overlong == data::Overlong::cut
                              ? " cut to seq_len"
                              : " too long for seq_len left out (data.overlong)",
                          ", ", n_untrained, " without a trained token left out");
  };
  nlohmann::json sft_validation;
  std::string sft;
  if (packed && s.is_root) {
    int64_t val_samples = 0, val_rows = 0, val_overlong = 0, val_untrained = 0;
    for (const std::string& shard : split_shards(c.data, "val")) {
      const data::PackedSamples p(data::ShardReader(shard), c.train.seq_len, c.data.overlong);
      val_samples += p.samples(), val_rows += p.rows();
      val_overlong += p.overlong(), val_untrained += p.untrained();
    }
    sft_validation = {{"samples", val_samples},
                      {"rows", val_rows},
                      {"overlong", val_overlong},
                      {"untrained", val_untrained},
                      {"rows_per_data_set", c.train.eval_sequences}};
    sft = detail::concat(
        " (SFT: ", packing_text(samples, rows, overlong, untrained),
        "; validation: ", packing_text(val_samples, val_rows, val_overlong, val_untrained),
        c.train.eval_sequences > 0
            ? detail::concat(", at most ", c.train.eval_sequences, " rows per data set read")
            : "",
        ")");
  }
  // Each data set's share, rows and how often the whole run reads it over; the start line
  // names them for a mixture.
  const std::vector<std::string> data_dirs = data_paths(c.data),
                                 data_set_names = data_names(c.data);
  nlohmann::json data_sets = nlohmann::json::array();
  std::string mixture;
  for (int64_t d = 0; d < s.loader.sources(); ++d) {
    const double weight = s.loader.weights()[size_t(d)];
    const double epochs = double(c.train.steps * s.loader.sequences_per_step()) * weight /
                          double(s.loader.windows(d));
    data_sets.push_back({{"path", data_dirs[size_t(d)]},
                         {"weight", weight},
                         {"rows", s.loader.windows(d)},
                         {"epochs", epochs}});
    if (s.loader.sources() == 1) continue;
    char share[96];
    std::snprintf(share, sizeof share, " %.1f %% (%.3g epochs)", 100 * weight, epochs);
    mixture += (d == 0 ? ", mixture of " + std::to_string(s.loader.sources()) + " data sets: "
                       : std::string(", ")) +
               data_set_names[size_t(d)] + share;
  }
  // A pipeline stage allocates its micro-batches' activations as its schedule needs them.
  const int64_t activation_bytes =
      s.pipeline ? 0
                 : s.activations(c.train.micro_batch, c.train.seq_len / c.parallel.cp).tensor_bytes;
  char activations[96] = "";
  if (!s.pipeline)
    std::snprintf(activations, sizeof activations,
                  ", activations %.1f MiB per micro-batch (train.recompute = %s)",
                  double(activation_bytes) / double(1 << 20), to_string(c.train.recompute));
  // More threads than cores make every rank wait on the others' threads: steps crawl.
  // Said only where this machine's rank count is known.
  const int here = known_local_ranks(s.world.size());
  const std::string oversubscribed =
      here > 0 && num_threads() * here > machine_cores()
          ? detail::concat(" (warning: ", here, " rank(s) x ", num_threads(),
                           " thread(s) on this machine's ", machine_cores(),
                           " cores; expect slow steps, ",
                           num_threads() > 1 ? "set run.threads" : "run fewer ranks", ")")
          : "";
  s.log("tessel: " + std::to_string(s.model.total_parameters()) + " parameters (" +
        std::to_string(s.model.num_parameters()) + " on rank 0), " +
        std::to_string(s.world.size()) + " rank(s) x " + std::to_string(num_threads()) +
        " thread(s)" + oversubscribed + ", " + mesh_text(s.mesh.shape()) + ", " +
        (packed ? "up to " : "") + std::to_string(global_tokens) + " tokens/step" + sft + mixture +
        std::string(activations) + ", GEMM peak " + std::to_string(int(peak)) +
        " GFLOP/s per rank" +
        (s.resumed_from >= 0 ? ", resumed at step " + std::to_string(s.resumed_from) : "") +
        (s.initialized_from.empty() ? "" : ", weights from " + s.initialized_from));
  // A relaunch resumes from the newest checkpoint; without interim ones (an adaptive policy
  // needs checkpoint_every >= 1) it has only step 0.
  if (attempt_->supervised && c.train.checkpoint_every == 0)
    s.log(
        "tessel: warning: train.checkpoint_every = 0 saves no checkpoint before the end, so a "
        "relaunch after a failure starts again from step 0; set train.checkpoint_every (e.g. "
        "100) to resume near the failure");
  // Allowed (a dense config keeps its MoE twin's layout), but it shards nothing.
  const std::vector<bool>& moe_blocks = s.model.moe_blocks();
  if (s.is_root && c.parallel.ep > 1 &&
      std::find(moe_blocks.begin(), moe_blocks.end(), true) == moe_blocks.end())
    warn_on_stderr(detail::concat("parallel.ep = ", c.parallel.ep,
                                  " on a model without MoE blocks (model.moe_layers) shards "
                                  "nothing: the run is plain data parallel"));
  // Each bucket is its own all-reduce, paying MPI's latency every step: a tiny bucket_mb (the
  // documented floor is one gradient) turns a step into hundreds of thousands of them.
  const int64_t buckets = s.grads.num_buckets();
  if (s.is_root && s.grad_group.size() > 1 && buckets > kManyGradientBuckets)
    warn_on_stderr(detail::concat("parallel.bucket_mb = ", c.parallel.bucket_mb, " cuts rank 0's ",
                                  s.model.num_parameters(), " gradients into ", buckets,
                                  " all-reduces per step; each pays the network's latency, so "
                                  "expect slow steps (the default is 4 MiB)"));

  std::optional<MetricsLog> metrics_log;  // rank 0 writes the run's metrics (none: no step)
  if (s.is_root && s.start_step < c.train.steps)
    metrics_log.emplace(c.run.dir + "/metrics.jsonl", s.resumed_from);
  auto write_metrics = [&](const nlohmann::json& j) {
    if (metrics_log) metrics_log->write(j);
  };

  // What each rank holds (expert shards, pipeline stages): one all-gather at the start.
  const int64_t held = s.model.num_parameters();
  std::vector<int64_t> per_rank(size_t(s.world.size()));
  s.world.all_gather(std::span<const int64_t>(&held, 1), per_rank);
  nlohmann::json start = {{"event", "start"},
                          {"parameters", s.model.total_parameters()},
                          {"rank_parameters", s.model.num_parameters()},
                          {"parameters_per_rank", per_rank},
                          {"matmul_parameters", s.model.matmul_parameters()},
                          {"flops_per_token", flops_tok},
                          {"hardware_flops_per_token", hardware_flops_tok},
                          {"peak_gflops", peak},
                          {"ranks", s.world.size()},
                          {"threads", num_threads()},
                          {"start_step", s.start_step}};
  if (!s.pipeline) start["activation_bytes"] = activation_bytes;
  start["data"] = data_sets;
  if (packed)
    start["sft"] = {
        {"samples", samples},     {"rows", rows},
        {"overlong", overlong},   {"overlong_policy", data::overlong_name(c.data.overlong)},
        {"untrained", untrained}, {"validation", sft_validation}};
  write_metrics(start);
  // Checkpoint interval: fixed multiples of train.checkpoint_every, or (young, daly) from
  // the blocking time of the previous save and the MTBF, decided by rank 0 for all ranks.
  const bool adaptive = c.train.checkpoint_policy != "fixed";
  double mtbf = c.train.mtbf_seconds;
  if (adaptive && s.is_root) {
    try {
      EttReport seen = analyze_ett(c.run.dir);
      mtbf = observed_mtbf(seen).value_or(mtbf);
    } catch (const InputError& e) {  // a damaged ledger must not stop the training
      warn_on_stderr(detail::concat("no observed MTBF (", e.what(),
                                    "); the checkpoint interval uses train.mtbf_seconds"));
    }
  }
  int64_t next_save = -1, decide_at = -1;  // adaptive: the next save; the step deciding it
  if (adaptive) next_save = s.start_step + c.train.checkpoint_every;
  double blocking = 0;  // seconds training waited for checkpoints since the last decision
  auto block_on = [&](auto&& wait) {
    Timer t;
    wait();
    blocking += t.seconds();
  };

  Timer run_timer;
  double train_seconds = 0;
  bool mfu_warned = false;
  auto log_step = [&](int64_t step) {
    return step % c.train.log_every == 0 || step == c.train.steps || step == s.start_step + 1;
  };
  // PACI's step records come once a horizon drains (at validation, checkpoints, the end), so
  // the last stage, which computes the loss, prints its progress lines as its windows finish.
  const bool paci = s.pipeline && pipeline_schedule(c) == pipeline::ScheduleKind::paci;
  if (paci && !c.run.quiet && s.stage_lead())  // called on the last stage
    s.pipeline->on_window = [&](int64_t step, double loss, double grad_norm, double seconds) {
      if (!log_step(step)) return;
      std::printf(
          "step %5lld/%lld | loss %.4f | lr %.2e | last stage's grad norm %.3f | %.0f tok/s\n",
          static_cast<long long>(step), static_cast<long long>(c.train.steps), loss,
          s.schedule.lr(step), grad_norm, double(step_tokens(step)) / seconds);
      std::fflush(stdout);
    };
  for (int64_t step = s.start_step; step < c.train.steps; ++step) {
    s.ledger.enter(Phase::productive, step + 1);
    s.checkpointer.poll();  // twice per step: a commit needs a few rounds
    Timer step_timer;
    double stats[2] = {0, 0};  // loss sum, loss tokens
    double grad_norm = 0;
    bool skipped = false;     // a gradient spike, not applied
    double spike_median = 0;  // the median norm it was compared with
    double cp_imbalance = 0;  // mean over the micro-batches (cp > 1)
    // No pipeline: seconds from the end of the last backward to the reduced gradients, and
    // seconds inside that backward starting and progressing bucket all-reduces.
    double grad_wait = 0, grad_start = 0;
    // The schedule counts updates from 1 (update 1 is the first warm-up step).
    const double lr = s.schedule.lr(step + 1);
    auto wait_staged = [&] {
      if (!s.checkpointer.staging()) return;  // the snapshot must not see this update
      s.ledger.enter(Phase::checkpoint_blocking, step + 1);  // inside the step: tagged with it
      block_on([&] { s.checkpointer.wait_staged(); });
      s.ledger.enter(Phase::productive, step + 1);
    };
    // Whether to apply the update of gradient norm `norm`: not a gradient spike's
    // (train.spike_factor). PACI's stages step on their own, each with its own norm: they
    // never skip (config validation) and their norms stay out of the spike window.
    auto decide_update = [&](double norm) {
      if (!s.per_stage_updates()) skipped = s.spikes.skip(norm, &spike_median);
      wait_staged();
      return !skipped;
    };
    // A non-finite gradient norm stops the run (exit 4), the moment a user wants to resume
    // from the newest good step: a save still in flight is of an earlier, finite step, so it is
    // committed first where every rank stops together (a collective).
    auto diverged = [&](bool every_rank) {
      std::string save_failed;  // the divergence stays the error (exit 4) whatever the save did
      if (every_rank) try {
          s.checkpointer.wait();
        } catch (const InputError& e) {  // agreed by every rank: all catch it here
          save_failed = std::string("; the save in flight failed: ") + e.what();
        }
      return " (newest checkpoint: " + s.store.latest().value_or("none") + save_failed +
             "; a lower optim.lr or a tighter train.grad_clip may avoid it)";
    };
    std::optional<PipelineStep> piped;
    nlohmann::json ep_skew;  // MoE without pipeline: max / median over the ep group
    if (s.pipeline) {
      // A save started at a PACI drain commits inside the horizon that follows (its polls are
      // non-blocking collectives), not only after it: a failure in the horizon keeps it. Its
      // failure, agreed by every rank, is raised once the horizon is over.
      std::exception_ptr save_failed;
      auto after_update = [&](int64_t update) {
        // A PACI stage's own update N is its step N; a flush step ends after the step records'
        // collective, so its fault strikes below, as without a pipeline.
        if (s.per_stage_updates()) s.faults.after_step(update);
        s.ledger.beat();  // rank 0's progress, seen by tessel run
        try {
          s.checkpointer.poll();
        } catch (const InputError&) {
          save_failed = std::current_exception();
        }
      };
      piped = s.pipeline->step(
          step, {.gradient_scale = [&](int64_t update) { return s.faults.gradient_scale(update); },
                 .before_update = [&](int64_t, double norm) { return decide_update(norm); },
                 .diverged = diverged,
                 .after_update = after_update});
      if (save_failed) std::rethrow_exception(save_failed);
      stats[0] = piped->loss_sum, stats[1] = piped->loss_tokens, grad_norm = piped->grad_norm;
    } else {
      s.model.zero_grads();
      s.moe_step.clear();
      const uint64_t a2a_bytes = s.mesh.group(comm::Axis::ep).traffic().bytes.all_to_all;
      try {
        for (int64_t m = 0; m < c.train.accum; ++m) {
          data::Batch batch = s.loader.next();
          const RankBatchInputs rank_in(batch, c, s.mesh.group(comm::Axis::cp));
          const model::ModelInputs& in = rank_in.inputs();
          model::Activations& acts = s.activations(in.B, in.T);
          stats[0] += s.model.forward(acts, in);
          stats[1] += rank_in.loss_weight_sum();
          cp_imbalance += rank_in.cp_imbalance() / double(c.train.accum);
          // The step's last backward finishes each gradient; its buckets' all-reduce starts
          // then.
          acts.on_grads_final = nullptr;
          if (m + 1 == c.train.accum && c.parallel.overlap_grad_reduce)
            acts.on_grads_final = [&](model::GradsFinal f) {
              Timer start_timer;
              s.grads.start_from(f);
              grad_start += start_timer.seconds();
            };
          s.model.backward(acts, 1.0f);
          if (!s.moe_step.empty()) s.moe_step.add(acts);
        }
      } catch (const moe::RouterOverflow& e) {  // met on this rank alone: no collective
        throw DivergenceError("step " + std::to_string(step + 1) + ": " + e.what() +
                              diverged(false));
      }
      Timer reduce_timer;  // the stats' all-reduce below also moves started buckets on
      s.grad_group.all_reduce(std::span<double>(stats, 2));
      if (!s.moe_step.empty()) {
        ep_skew = s.moe_step.ep_skew_json(s.mesh.group(comm::Axis::ep));
        s.moe_step.add_all_to_all_bytes(
            double(s.mesh.group(comm::Axis::ep).traffic().bytes.all_to_all - a2a_bytes));
        s.grad_group.all_reduce(s.moe_step.values());
      }
      TESSEL_CHECK(stats[1] > 0, "a training step without loss tokens");
      s.grads.reduce(float(1.0 / stats[1]) * s.faults.gradient_scale(step + 1));
      grad_wait = reduce_timer.seconds();
      grad_norm = s.grads.clip(c.train.grad_clip);
      if (!std::isfinite(grad_norm))  // every rank: the norm is global
        optim::check_finite_grad_norm(grad_norm, "step " + std::to_string(step + 1),
                                      diverged(true));
      if (decide_update(grad_norm)) {
        s.optimizer->step(s.schedule.scale(step + 1));
        s.model.update_balance();  // MoE balancing: beta from this step's micro-batches
      } else {
        s.model.discard_balance();  // the spike's loads must not reach the next update
      }
    }
    if (!s.per_stage_updates()) s.faults.after_step(step + 1);
    s.checkpointer.poll();
    double dt = piped ? piped->seconds : step_timer.seconds();
    train_seconds += dt;

    StepRecord rec;
    rec.step = step + 1;
    rec.loss = stats[0] / stats[1];
    rec.lr = lr;
    rec.grad_norm = grad_norm;
    rec.tokens_per_s = double(step_tokens(rec.step)) / dt;
    rec.tflops_per_rank = rec.tokens_per_s / s.world.size() * flops_tok / 1e12;
    rec.mfu = rec.tflops_per_rank * 1e3 / peak;
    rec.hfu = rec.mfu * hardware_flops_tok / flops_tok;
    rec.skipped = skipped;
    if (rec.mfu > 1.0 && !mfu_warned) {  // said once: the denominator is wrong, not the run
      mfu_warned = true;
      s.log(detail::concat(
          "tessel: warning: step ", rec.step, ": MFU ", std::llround(100 * rec.mfu),
          "% is above 100%: the GEMM peak of ", peak, " GFLOP/s per rank is too low (",
          c.mfu.peak_gflops > 0 ? "mfu.peak_gflops"
                                : "measured while the machine was busy? fast start keeps it in " +
                                      c.run.dir + "/gemm_peak.json for restarts",
          "); set mfu.peak_gflops, or remove gemm_peak.json to measure again"));
    }
    result.steps.push_back(rec);
    nlohmann::json record = {{"step", rec.step},
                             {"loss", rec.loss},
                             {"lr", rec.lr},
                             {"grad_norm", rec.grad_norm},
                             {"tokens_per_s", rec.tokens_per_s},
                             {"tflops_per_rank", rec.tflops_per_rank},
                             {"mfu", rec.mfu},
                             {"hfu", rec.hfu},
                             {"step_seconds", dt}};
    if (c.parallel.cp > 1 && !piped) record["cp_imbalance"] = cp_imbalance;
    if (s.grad_group.size() > 1 && !piped) {
      record["grad_wait_seconds"] = grad_wait;
      record["grad_start_seconds"] = grad_start;
    }
    if (skipped) record["skipped"] = {{"spike_median", spike_median}};
    if (piped) record["pipeline"] = piped->metrics;
    if (const MoeMetrics* moe = piped ? (piped->moe ? &*piped->moe : nullptr)
                                      : (s.moe_step.empty() ? nullptr : &s.moe_step)) {
      record["moe"] = moe->step_json();
      record["all_to_all_bytes"] = moe->all_to_all_bytes();
    }
    if (!ep_skew.is_null()) record["ep_skew"] = ep_skew;
    write_metrics(record);
    if (skipped)
      s.log(detail::concat("step ", rec.step, ": gradient norm ", grad_norm, " is ",
                           spike_median > 0 ? grad_norm / spike_median : INFINITY,
                           "x the median of the last ", c.train.spike_window, " steps (",
                           spike_median,
                           "): update skipped (train.spike_factor = ", c.train.spike_factor, ")"));
    bool last = rec.step == c.train.steps;
    if (!paci && log_step(rec.step)) {
      double per_step = train_seconds / double(rec.step - s.start_step);
      char hfu[32] = "";
      if (hardware_flops_tok != flops_tok)
        std::snprintf(hfu, sizeof hfu, " (HFU %.1f%%)", 100 * rec.hfu);
      char line[256];
      std::snprintf(line, sizeof line,
                    "step %5lld/%lld | loss %.4f | lr %.2e | grad norm %.3f | %.0f tok/s | "
                    "MFU %.1f%%%s | ETA %s",
                    static_cast<long long>(rec.step), static_cast<long long>(c.train.steps),
                    rec.loss, lr, grad_norm, rec.tokens_per_s, 100 * rec.mfu, hfu,
                    format_duration(per_step * double(c.train.steps - rec.step)).c_str());
      s.log(line);
    }
    if ((c.train.eval_every > 0 && rec.step % c.train.eval_every == 0) || last) {
      s.ledger.enter(Phase::eval);
      const std::vector<double> losses = s.validate();
      const double val = data::mixture_mean(s.loader.weights(), losses);
      result.validation.emplace_back(rec.step, val);
      result.data_set_validation.push_back(losses);
      nlohmann::json val_record = {{"step", rec.step}, {"val_loss", val}};
      std::string per_data_set;
      if (losses.size() > 1)
        for (size_t d = 0; d < losses.size(); ++d) {
          val_record["val_loss_by_data_set"][data_set_names[d]] = losses[d];
          char loss[32];
          std::snprintf(loss, sizeof loss, " %.4f", losses[d]);
          per_data_set += (d == 0 ? " | " : ", ") + data_set_names[d] + loss;
        }
      if (!s.moe_val.empty()) val_record["moe"] = s.moe_val.validation_json();
      write_metrics(val_record);
      char line[128];
      std::snprintf(line, sizeof line, "step %5lld | validation loss %.4f nats/token (%.3f bits)",
                    static_cast<long long>(rec.step), val, val / std::log(2.0));
      s.log(line + per_data_set);
      // The update made the model non-finite: the next step's gradient norm would stop the
      // run, but the last step has none, and its checkpoint would hold the broken weights.
      if (!std::isfinite(val))
        throw DivergenceError("step " + std::to_string(rec.step) + "'s validation loss is " +
                              (std::isnan(val) ? "NaN" : "inf") +
                              "; stopping before its checkpoint" + diverged(true));
    }
    if (adaptive && rec.step == decide_at) {
      int64_t interval = 0;
      const double step_seconds = train_seconds / double(rec.step - s.start_step);
      if (s.is_root)
        interval = checkpoint_interval_steps(c.train.checkpoint_policy, c.train.checkpoint_every,
                                             blocking, mtbf, step_seconds);
      s.world.broadcast(std::span<int64_t>(&interval, 1), 0);
      next_save = decide_at - 1 + interval;
      write_metrics({{"event", "checkpoint_interval"},
                     {"step", rec.step},
                     {"blocking_seconds", blocking},
                     {"mtbf_seconds", mtbf},
                     {"step_seconds", step_seconds},
                     {"interval_steps", interval}});
    }
    if (adaptive ? rec.step == next_save || (last && c.train.save_final)
                 : fixed_policy_saves(c.train, rec.step)) {
      s.ledger.enter(last ? Phase::shutdown : Phase::checkpoint_blocking);
      blocking = 0;
      block_on([&] { s.save(rec.step); });
      decide_at = rec.step + 1;  // once the next step has waited for the staging copy
      s.log("step " + std::to_string(rec.step) + " | checkpoint " +
            (c.train.checkpoint_async ? "started" : "saved") + " in " + c.run.dir + "/checkpoints");
    }
  }
  s.ledger.enter(Phase::shutdown);
  s.checkpointer.wait();
  const bool trained = s.start_step < c.train.steps;
  if (!trained)
    s.log("nothing to train: " + c.run.dir + " already holds step " + std::to_string(s.start_step) +
          " of train.steps = " + std::to_string(c.train.steps) +
          " (raise train.steps to continue, or choose a new run.dir)");
  // No sample of a model this call did not train (`tessel generate` samples a finished run).
  if (trained && c.train.sample_tokens > 0 && !s.tokenizer)
    s.log(
        "no sample: data.path's token ids have no tokenizer (a tokens:PATH corpus prepared "
        "without --tokenizer bpe:DIR, or shards without dataset.json for a model.vocab other "
        "than 256); set train.sample_tokens = 0 to silence this");
  if (trained && c.train.sample_tokens > 0 && s.tokenizer && s.samples()) {
    result.sample = s.sample();
    if (!result.sample.empty()) s.log("sample:\n" + result.sample);
  }
  int64_t peak_memory = peak_resident_bytes();
  s.world.all_reduce(std::span<int64_t>(&peak_memory, 1), comm::ReduceOp::max);
  result.peak_resident_bytes = peak_memory;
  const auto skipped_steps = std::count_if(result.steps.begin(), result.steps.end(),
                                           [](const StepRecord& r) { return r.skipped; });
  s.log("done in " + format_duration(run_timer.seconds()) + ", peak resident memory " +
        std::to_string(peak_memory >> 20) + " MiB (the largest rank's)" +
        (skipped_steps > 0
             ? detail::concat(", ", skipped_steps, " update(s) skipped as gradient spikes")
             : "") +
        (metrics_log ? "; metrics in " + c.run.dir + "/metrics.jsonl" : ""));
  return result;
}

}  // namespace tessel::train
