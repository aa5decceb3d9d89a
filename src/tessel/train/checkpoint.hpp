#pragma once
// Checkpoints: a directory per step under <run>/checkpoints/, holding
//   model-RRRRR-of-PPPPP.safetensors      rank R's share of the parameter values
//   optimizer-RRRRR-of-PPPPP.safetensors  rank R's share of the optimizer state
//   optimizer_shards-RRRRR-of-PPPPP.safetensors
//                                         rank R's row shards of optimizer state split over
//                                         ranks (ZeRO-1), keys "<name>[<row0>:<row1>]"; only
//                                         ranks that hold such state write one
//   manifest.json                         step, trainer state (data-loader position, ...),
//                                         the model config, every file with its size and
//                                         CRC-32, the tensor order — written LAST.
//   manifest.draft.json                   the manifest without its files, written by rank 0
//                                         when the save starts (phase one's record)
//   rank-RRRRR-of-PPPPP.done.json         rank R's files with their sizes and CRC-32, written
//                                         once they are durable (phase one's record)
// The P ranks of the saving job split the (replicated) tensors between them, balanced by
// bytes, so each writes 1/P of the state; tensors only some ranks hold (sharded experts)
// are written by the one rank that lists them as its own. A load merges the shares by
// tensor name, so a checkpoint of P ranks loads into any number of ranks. Row shards are
// never gathered: the manifest records which rows of which tensor each shard file holds, and
// restore_optimizer reads only the shard files that hold rows a rank asks for, so state
// saved over P ranks is re-cut on load for any other number.
//
// Asynchronous two-phase commit (spec section 4.2): save() hands the tensors to a
// background writer, which copies this rank's share into reusable host staging buffers,
// then writes and fsyncs its files into `step-N.incomplete/`. The training thread must
// call wait_staged() before it next changes those tensors, and poll() from time to time:
// it gathers every rank's result (non-blocking collectives on a communicator of the
// checkpointer's own), rank 0's writer then writes the manifest, renames the directory to
// `step-N/`, fsyncs `checkpoints/`, points `latest` at it and applies retention; a second
// agreement ends the save. At most one save is in flight. A crash at any moment leaves
// the previous checkpoint intact. Only the training threads advance the agreement, so a job
// that hangs or dies right after a save may never commit files that every rank wrote: the
// draft and done records let the next start commit it (recover_prepared). Loading verifies every
// checksum. `latest` is a pointer for people and scripts only: loads take the newest complete
// `step-N/` directory, so a stale or edited `latest` can neither hide newer checkpoints nor lead
// outside `checkpoints/`.
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "tessel/comm/communicator.hpp"
#include "tessel/train/safetensors.hpp"

namespace tessel::train {

// What a load reads: the whole checkpoint, or the model tensors alone (only their files are
// read and verified; the optimizer state, about twice the model with AdamW or Muon, is not).
enum class CheckpointParts { all, model };

// Rows [row0, row0 + tensor.shape()[0]) of the tensor `name`, which has `rows` rows in all;
// rows == 0: `tensor` is the whole tensor.
struct RowShard {
  std::string name;
  Tensor tensor;
  int64_t row0 = 0, rows = 0;
};

// A saved row shard: rows [row0, row1) of `name` (whole shape `shape`), in `file` (a path)
// under the key "<name>[<row0>:<row1>]"; `crc32` is the file's, verified when it is read.
struct ShardLocation {
  std::string name;
  Shape shape;
  int64_t row0 = 0, row1 = 0;
  std::string file;
  uint32_t crc32 = 0;
};

struct CheckpointContent {
  int64_t step = 0;
  std::vector<NamedTensor> model;      // the same list on every rank (split between them)
  std::vector<NamedTensor> optimizer;  // likewise
  // This rank's own tensors (written by it alone, listed after the replicated ones, in rank
  // order); no name may be listed by two ranks or be also replicated. Empty when loaded.
  std::vector<NamedTensor> own_model, own_optimizer;
  // This rank's row shards of optimizer state split over ranks (rows > 0), written by it
  // alone; over all ranks, the shards of a name cover its rows once, and it is not also
  // saved whole. Empty when loaded: `shard_locations` says where they lie (not read yet).
  std::vector<RowShard> optimizer_shards;
  std::vector<ShardLocation> shard_locations;
  nlohmann::json state;  // trainer state: loader position, config, ...
};

// The rank that writes each tensor: in order, each goes to the rank with the fewest bytes
// so far (lowest rank on ties). Deterministic for a tensor list and rank count.
std::vector<int> assign_writers(const std::vector<NamedTensor>& tensors, int ranks);

class CheckpointStore {
 public:
  // `root` is the checkpoints directory; the `keep` (>= 2) newest complete checkpoints
  // are kept.
  CheckpointStore(std::string root, int64_t keep);

  // Synchronous save: an AsyncCheckpointer over `group`, saved and waited for.
  // Collective over `group`.
  void save(comm::Communicator& group, const CheckpointContent& content);

  // Path of the newest complete checkpoint, if any: the `step-N` directory with a manifest
  // and the highest N (whatever `latest` says).
  std::optional<std::string> latest() const;

  // Reads and verifies the checkpoint at `dir` (sizes, checksums, manifest fields); the
  // error names the file that failed. Row-shard files are checked for presence and size
  // only: restore_optimizer reads (and checksums) the ones a rank needs.
  static CheckpointContent load(const std::string& dir,
                                CheckpointParts parts = CheckpointParts::all);

  struct Loaded {
    std::string dir;
    CheckpointContent content;
  };
  // The newest checkpoint that verifies, row-shard files' checksums included (they are read
  // here once, in chunks; the ranks read their own later): `latest()` first, then older
  // complete ones, passing over damaged ones (a file missing, of another size or checksum, a
  // manifest that does not parse, contradicts itself or names another step than its
  // directory), each reported through `warn` (a damaged newest checkpoint costs the steps
  // since the previous one, not the run). Any other failure (a format version this tessel does
  // not read, a file it cannot read) stops with an InputError naming the checkpoint: it may be
  // good, and a resume deletes what is passed over. `state_problem`, when set, checks the
  // trainer state the store does not interpret: what it returns (empty: nothing) is damage of
  // the manifest. nullopt when there is no checkpoint; when every one is damaged, an InputError
  // naming each with what failed in it.
  std::optional<Loaded> load_newest_valid(
      const std::function<void(const std::string&)>& warn,
      CheckpointParts parts = CheckpointParts::all,
      const std::function<std::string(const CheckpointContent&)>& state_problem = {}) const;

  // Deletes the complete checkpoints after `dir` (those load_newest_valid passed over as
  // damaged), so retention never keeps them in place of good ones.
  void discard_newer_than(const std::string& dir) const;

  // The step of the newest save that every rank finished writing but that was never
  // committed (the job hung or died first): a `step-N.incomplete/` above the newest complete
  // checkpoint that holds rank 0's draft and a done record of each of the draft's ranks, all
  // of step N and that rank count. Reads only.
  std::optional<int64_t> prepared() const;
  // Commits that save as the writer's commit would have (one manifest assembly) and returns
  // its step; nullopt when there is none. Rank 0, before sweep_leftovers (which removes every
  // other `.incomplete/`) and before any rank looks for a checkpoint. The load still verifies
  // it: a damaged one falls back as any does.
  std::optional<int64_t> recover_prepared() const;

  // Removes what a killed save leaves behind: `step-N.incomplete/` directories, the
  // `step-N.deleted/` of a deletion cut short (remove_checkpoint) and the
  // temporary files of atomic writes (`latest.tmp.<pid>`). Call before the first save.
  void sweep_leftovers() const;

  const std::string& root() const { return root_; }
  // Where the checkpoint of `step` lives (or will): <root>/step-NNNNNNNN.
  std::string step_dir(int64_t step) const;
  int64_t keep() const { return keep_; }

 private:
  std::string root_;
  int64_t keep_;
};

// load_newest_valid's `warn` for the command line: "tessel: warning: <why>" on stderr.
void warn_on_stderr(const std::string& why);

// The model tensors of a run, for what needs the weights alone (generate, export,
// train.init_from): `path` is a run directory (its newest checkpoint that verifies, damaged
// ones passed over with warn_on_stderr) or one checkpoint directory; an input error when there
// is none, or when the checkpoint does not verify. The optimizer state is not read.
CheckpointStore::Loaded load_run_checkpoint(const std::string& path);

class AsyncCheckpointer {
 public:
  // `group` is used by this checkpointer alone (its collectives run while the training
  // uses other communicators); every rank of it saves the same steps.
  AsyncCheckpointer(const CheckpointStore& store, comm::Communicator& group);
  // Joins the writer; a save not yet committed is abandoned (its directory stays
  // `.incomplete`: the next start commits it if every rank's files were written, else
  // removes it).
  ~AsyncCheckpointer();
  AsyncCheckpointer(const AsyncCheckpointer&) = delete;
  AsyncCheckpointer& operator=(const AsyncCheckpointer&) = delete;

  // Starts saving `content`, whose tensors view live state. Waits for the previous save
  // to be committed first (at most one in flight), then gathers the names of every rank's
  // own tensors (a blocking collective). The tensors must not change until wait_staged()
  // returns.
  void save(const CheckpointContent& content);
  // Blocks until the writer has copied this rank's share into the staging buffers.
  void wait_staged();
  bool staging() const;  // a copy is pending (wait_staged() would block)
  // Advances the commit protocol without blocking. Throws when the save failed on any
  // rank (on every rank: "checkpoint ... not saved: ...").
  void poll();
  // Blocks until the save in flight is committed; throws like poll().
  void wait();
  bool in_flight() const { return stage_ != Stage::idle; }
  // Step of the newest checkpoint this checkpointer committed (-1: none).
  int64_t last_committed() const { return last_committed_; }

  // Fault-injection hooks, called on the writer thread: after this rank's files of
  // `step` are durable (before its done record and the agreement), and after rank 0
  // committed `dir`.
  std::function<void(int64_t step)> on_files_written;
  std::function<void(const std::string& dir, int64_t step)> on_committed;

 private:
  enum class Stage { idle, writing, agree_files, committing, agree_commit };
  void advance(bool block);
  void writer_loop();
  void write_files();  // writer thread
  void commit();       // writer thread, rank 0
  [[noreturn]] void fail(const std::string& why);

  const CheckpointStore& store_;
  comm::Communicator& group_;
  const int rank_, ranks_;
  Stage stage_ = Stage::idle;
  int64_t last_committed_ = -1;

  // The job shared with the writer thread (guarded by mu_).
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false, job_write_ = false, job_commit_ = false;
  bool staged_ = true, done_ = true;
  std::string failure_;                  // writer failure of the current job
  CheckpointContent content_;            // views; this rank copies its share
  std::vector<std::string> names_[2];    // model, optimizer: the manifest's
  nlohmann::json shards_;                // the manifest's "shards": every rank's row shards
  nlohmann::json draft_;                 // rank 0's writer: the manifest less its "files"
  std::vector<NamedTensor> staging_[3];  // model, optimizer, row shards: reusable buffers
  // The agreements' buffers, written by the collective in flight: when it cannot be abandoned
  // (~AsyncCheckpointer, unwinding), they are left to the process exit, not freed under it.
  struct Agreement {
    std::vector<int64_t> record, gathered;  // [ok, (bytes, crc) per file], every rank's
    int64_t flag = 0;                       // rank 0 committed (1) or not (0), min over ranks
  };
  std::unique_ptr<Agreement> agreement_ = std::make_unique<Agreement>();
  std::unique_ptr<comm::Request> request_;  // the agreement in progress
  std::thread writer_;
};

// Copies the tensor called `name` in `from` into `to` (same shape and dtype), or throws
// an InputError naming `source` (the checkpoint) and the tensor.
void restore_tensor(const std::vector<NamedTensor>& from, const std::string& name, Tensor to,
                    const std::string& source);

// `name` without the "stage<s>/" a pipeline stage's optimizer puts before its state
// (make_stage_optimizer): the same under any stage split, and without a pipeline.
std::string stage_free_name(const std::string& name);

// Restores each of `wanted` (a whole tensor, or a row shard this rank holds) from the loaded
// checkpoint `from`, whether it saved that tensor whole or in row shards of any split: a
// checkpoint of P ranks resumes on any number. Reads each shard file holding wanted rows
// once, verifying its checksum, and no other. A tensor missing under its own name is taken
// from the one that has the same stage_free_name, so a checkpoint resumes under another
// pipeline stage split, or without a pipeline; a per-optimizer scalar that several stages
// saved (their step counters) must be equal in all of them unless `same_stage_split` (the
// run has the checkpoint's stage boundaries: each stage continues its own). InputError naming
// `source` (the checkpoint) or the file when a tensor is missing, stages' copies of it differ,
// or its rows, shape or dtype differ.
void restore_optimizer(const CheckpointContent& from, const std::vector<RowShard>& wanted,
                       const std::string& source, bool same_stage_split = true);

}  // namespace tessel::train
