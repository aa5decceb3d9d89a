#pragma once
// The training data loader: fixed-length sequences cut from a token shard, shuffled per
// epoch, and sharded over data-parallel ranks and gradient-accumulation micro-batches.
//
// Sequences. A shard of N tokens holds W = (N - 1) / T non-overlapping windows of T + 1
// tokens; window w covers tokens [w*T, w*T + T] (consecutive windows share one token: the
// last target of one is the first input of the next). A window gives a row of T inputs
// (tokens [w*T, w*T + T)) and T targets (tokens [w*T + 1, w*T + T]).
//
// Order. Global sequence g belongs to epoch e = g / W and is window perm_e[g % W]. perm_e is
// the Fisher-Yates shuffle of 0..W-1 (for i = W-1 down to 1: swap p[i], p[Rng.below(i + 1)])
// drawn from tessel::Rng(seed ^ (0x9e3779b97f4a7c15 * (e + 1))); with shuffle off it is the
// identity. The order depends only on the shard, T, the seed and g, never on the layout.
//
// Sharding. Step s consumes global sequences [s*G, (s+1)*G) with G = dp_size * accum *
// micro_batch; micro-batch m (0 <= m < accum) of data-parallel rank r holds sequences
// s*G + (r*accum + m)*micro_batch + [0, micro_batch).
//
// SFT data sets (a loss-mask shard beside the token shard, packing.hpp): the same order and
// sharding over the data set's packed rows instead of windows (W = the number of rows), and
// only the positions packing.hpp names count in the loss.
//
// Mixtures (several data sets with weights, mixture.hpp): global sequence g is sequence i of
// data set d as MixtureOrder places it, and within d the order above applies to i, with d's
// own windows and seed ^ (0x632be59bd9b4e019 * d). Data set 0's order is that of a loader of
// it alone, and the sharding over ranks and micro-batches is unchanged.
//
// Documents and the loss. doc_starts[b] lists the offsets in row b where a document begins
// (always 0 first: the row's first token starts the row's first, possibly partial, document);
// attention masks are built from them. loss_mask[b*T + t] is 0 when the target of position t
// is the first token of a document, because under a document mask nothing the position sees
// predicts the next document; every other position is 1.
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "tessel/data/batch.hpp"
#include "tessel/data/mixture.hpp"
#include "tessel/data/packing.hpp"
#include "tessel/data/shard.hpp"

namespace tessel::data {

struct LoaderOptions {
  int64_t seq_len = 0;  // T
  int64_t micro_batch = 1;
  int64_t accum = 1;  // micro-batches per step on each rank
  int64_t dp_rank = 0;
  int64_t dp_size = 1;
  uint64_t seed = 0;
  bool shuffle = true;
  Overlong overlong = Overlong::drop;  // SFT data sets: samples longer than seq_len
};

// Where a loader stands: the step and the micro-batch within it that next() returns.
struct LoaderState {
  int64_t step = 0;
  int64_t micro = 0;
  bool operator==(const LoaderState&) const = default;
};

class DataLoader {
 public:
  // Opens and validates the shard (and its loss-mask shard when there is one); InputError for
  // seq_len < 1, a shard with fewer than seq_len + 1 tokens or an SFT shard without a sample
  // to train on (naming the file), or a bad micro_batch / accum / dp layout.
  DataLoader(const std::string& shard_path, const LoaderOptions& options);
  // A mixture: data set d (its shard shard_paths[d]) gets the share weights[d] of the
  // sequences. The same checks per shard; InputError unless there is one positive weight per
  // shard, and unless the shards are all text or all SFT data sets of one vocabulary size.
  DataLoader(const std::vector<std::string>& shard_paths, std::vector<double> weights,
             const LoaderOptions& options);

  // This rank's next micro-batch [micro_batch, seq_len]; after accum of them, the next step.
  Batch next();
  LoaderState state() const { return state_; }
  // Resumes at a state from state(); the batches that follow are bitwise those that followed.
  void restore(const LoaderState& state);

  int64_t sources() const { return int64_t(sources_.size()); }  // data sets
  // Data set `source`'s W (its packed rows, an SFT data set).
  int64_t windows(int64_t source = 0) const { return at(source).rows; }
  int64_t sequences_per_step() const;  // G
  // Positions of step `step`'s G rows (over all ranks) that hold data: G * seq_len, less an
  // SFT data set's padding. What tokens/s and MFU count.
  int64_t step_tokens(int64_t step);
  // Data set `source`'s packed rows; null for a text data set.
  const PackedSamples* packed(int64_t source = 0) const {
    return at(source).packed ? &*at(source).packed : nullptr;
  }
  struct Row {
    int64_t source = 0;  // data set
    int64_t row = 0;     // its window (packed row of an SFT data set)
    bool operator==(const Row&) const = default;
  };
  // Where global sequence g >= 0 comes from.
  Row row_of(int64_t g);
  const ShardReader& shard(int64_t source = 0) const { return at(source).shard; }
  // The data sets' shares, normalized (one data set: {1}).
  const std::vector<double>& weights() const { return mixture_.weights(); }
  const LoaderOptions& options() const { return options_; }

 private:
  struct Source {
    Source(const std::string& path, const LoaderOptions& options, uint64_t seed);
    ShardReader shard;
    std::optional<PackedSamples> packed;
    int64_t rows;
    uint64_t seed;
    int64_t perm_epoch = -1;  // the epoch perm holds
    std::vector<int64_t> perm;
    int64_t row_of(int64_t i, bool shuffle);  // its i-th sequence
  };
  const Source& at(int64_t source) const;
  Batch batch_of(std::span<const Row> rows) const;  // the rows, in order, as one batch

  std::vector<std::unique_ptr<Source>> sources_;
  MixtureOrder mixture_;
  LoaderOptions options_;
  LoaderState state_;
};

// Rows built from the given windows of the shard: B = windows.size(), T = seq_len.
Batch batch_from_windows(const ShardReader& shard, std::span<const int64_t> windows,
                         int64_t seq_len);

// This rank's share of the first max_sequences windows (all when max_sequences <= 0; packed
// rows of an SFT data set), in window order and unshuffled, as micro-batches of up to micro_batch
// rows (the last may be smaller; a rank may get none). The ranks split the sequences into
// contiguous ranges whose sizes differ by at most one, so the union over ranks is exactly those
// windows whatever dp_size is; sum the loss over ranks and divide by the total of loss_mask.
std::vector<Batch> validation_batches(const std::string& shard_path, int64_t seq_len,
                                      int64_t micro_batch, int64_t max_sequences, int64_t dp_rank,
                                      int64_t dp_size, Overlong overlong = Overlong::drop);
// The same from a shard already open (opening one reads and checks every token).
std::vector<Batch> validation_batches(const ShardReader& shard, int64_t seq_len,
                                      int64_t micro_batch, int64_t max_sequences, int64_t dp_rank,
                                      int64_t dp_size, Overlong overlong = Overlong::drop);

}  // namespace tessel::data
