#pragma once
// Checkpoints: a directory per step under <run>/checkpoints/, holding
//   model.safetensors      parameter values (replicated over dp, written by rank 0)
//   optimizer.safetensors  optimizer state (replicated under plain data parallelism)
//   manifest.json          step, trainer state (data-loader position, ...), the model
//                          config, and every file with its size and CRC-32 — written LAST.
// Two-phase commit: files go into `step-N.incomplete/`, all ranks agree that their
// writes succeeded, rank 0 writes the manifest, renames the directory to `step-N/`
// and then points `latest` at it. A crash at any moment leaves the previous
// checkpoint intact and `latest` valid. Loading verifies every checksum.
// (Issue #8 moves the writing to a background thread; the layout stays.)
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "tessel/comm/communicator.hpp"
#include "tessel/train/safetensors.hpp"

namespace tessel::train {

struct CheckpointContent {
  int64_t step = 0;
  std::vector<NamedTensor> model;
  std::vector<NamedTensor> optimizer;
  nlohmann::json state;  // trainer state: loader position, config, ...
};

class CheckpointStore {
 public:
  // `root` is the checkpoints directory; keep >= 2 newest complete checkpoints are kept.
  CheckpointStore(std::string root, int64_t keep);

  // Collective over `group` (every rank calls it). Rank 0 writes the files.
  void save(comm::Communicator& group, const CheckpointContent& content);

  // Path of the newest complete checkpoint, if any. Follows `latest`; when that is
  // missing or incomplete, falls back to the newest directory with a manifest.
  std::optional<std::string> latest() const;

  // Reads and verifies the checkpoint at `dir` (sizes, checksums, manifest fields).
  static CheckpointContent load(const std::string& dir);

  struct Loaded {
    std::string dir;
    CheckpointContent content;
  };
  // The newest checkpoint that verifies: `latest()` first, then older complete ones,
  // each failure reported through `warn` (a damaged newest checkpoint costs the steps
  // since the previous one, not the run). nullopt when there is no checkpoint; when
  // every one fails, rethrows the newest one's error.
  std::optional<Loaded> load_newest_valid(
      const std::function<void(const std::string&)>& warn) const;

  // Deletes the complete checkpoints after `dir` (those load_newest_valid passed over as
  // damaged), so retention never keeps them in place of good ones.
  void discard_newer_than(const std::string& dir) const;

 private:
  std::string root_;
  int64_t keep_;
};

// Copies the tensor called `name` in `from` into `to` (same shape and dtype), or throws
// an InputError naming `source` (the checkpoint) and the tensor.
void restore_tensor(const std::vector<NamedTensor>& from, const std::string& name, Tensor to,
                    const std::string& source);

// CRC-32 (zlib) of a file's bytes; InputError if it cannot be read.
uint32_t file_crc32(const std::string& path);

}  // namespace tessel::train
