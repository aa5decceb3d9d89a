#include "tessel/data/loader.hpp"

#include <algorithm>
#include <numeric>

#include "tessel/core/error.hpp"
#include "tessel/core/rng.hpp"

namespace tessel::data {

namespace {

// Checks seq_len and that the shard holds at least one window of seq_len + 1 tokens; returns W.
int64_t count_windows(const ShardReader& shard, int64_t seq_len) {
  if (seq_len < 1) input_error(shard.path(), ": seq_len must be >= 1, got ", seq_len);
  const int64_t w = shard.num_tokens() > 0 ? (shard.num_tokens() - 1) / seq_len : 0;
  if (w < 1)
    input_error(shard.path(), ": shard holds ", shard.num_tokens(),
                " tokens, too few for one sequence of seq_len ", seq_len, " (needs ", seq_len + 1,
                "): train with a smaller train.seq_len, or prepare more text (for val.tok, a "
                "larger --val-fraction)");
  return w;
}

void check_layout(int64_t micro_batch, int64_t accum, int64_t dp_rank, int64_t dp_size) {
  if (micro_batch < 1) input_error("data loader: micro_batch must be >= 1, got ", micro_batch);
  if (accum < 1) input_error("data loader: accum must be >= 1, got ", accum);
  if (dp_size < 1) input_error("data loader: dp_size must be >= 1, got ", dp_size);
  if (dp_rank < 0 || dp_rank >= dp_size)
    input_error("data loader: dp_rank ", dp_rank, " outside [0, dp_size = ", dp_size, ")");
}

}  // namespace

Batch batch_from_windows(const ShardReader& shard, std::span<const int64_t> windows,
                         int64_t seq_len) {
  const int64_t T = seq_len;
  Batch b = make_batch(int64_t(windows.size()), T);
  std::vector<int32_t> row(size_t(T + 1));
  const auto starts = shard.doc_starts();
  for (size_t r = 0; r < windows.size(); ++r) {
    const int64_t first = windows[r] * T;
    TESSEL_CHECK(windows[r] >= 0 && first + T < shard.num_tokens(), "window ", windows[r],
                 " of seq_len ", T, " outside the shard");
    shard.read(first, T + 1, row.data());
    std::copy(row.begin(), row.end() - 1, b.tokens.begin() + int64_t(r) * T);
    std::copy(row.begin() + 1, row.end(), b.targets.begin() + int64_t(r) * T);
    // Document starts in [first, first + T]: those below first + T begin a document inside
    // the row; any above first masks the target that precedes it.
    auto& ds = b.doc_starts[r];
    ds.push_back(0);
    for (auto it = std::lower_bound(starts.begin(), starts.end(), uint64_t(first));
         it != starts.end() && int64_t(*it) <= first + T; ++it) {
      const int64_t offset = int64_t(*it) - first;
      if (offset > 0) b.loss_mask[r * T + offset - 1] = 0.0f;
      if (offset > 0 && offset < T) ds.push_back(int32_t(offset));
    }
  }
  return b;
}

namespace {

std::optional<PackedSamples> pack_if_sft(const ShardReader& shard, int64_t seq_len,
                                         Overlong overlong) {
  check_loss_mask_matches_format(shard.path());
  if (!has_loss_mask(shard.path())) return std::nullopt;
  return PackedSamples(shard, seq_len, overlong);
}

// A shard's rows: its packed samples' (an SFT data set), else its windows'.
int64_t count_rows(const ShardReader& shard, const std::optional<PackedSamples>& packed,
                   int64_t seq_len) {
  return packed ? packed->rows() : count_windows(shard, seq_len);
}

// The given rows of a shard as a batch, packed or cut as count_rows counted them.
Batch shard_rows_batch(const ShardReader& shard, const std::optional<PackedSamples>& packed,
                       std::span<const int64_t> rows, int64_t seq_len) {
  return packed ? packed->batch(shard, rows) : batch_from_windows(shard, rows, seq_len);
}

}  // namespace

DataLoader::Source::Source(const std::string& path, const LoaderOptions& options, uint64_t s)
    : shard(path),
      packed(pack_if_sft(shard, options.seq_len, options.overlong)),
      rows(count_rows(shard, packed, options.seq_len)),
      seed(s) {}

int64_t DataLoader::Source::row_of(int64_t i, bool shuffle) {
  if (!shuffle) return i % rows;
  const int64_t epoch = i / rows;
  if (epoch != perm_epoch) {
    perm.resize(size_t(rows));
    std::iota(perm.begin(), perm.end(), int64_t(0));
    Rng rng(seed ^ (0x9e3779b97f4a7c15ull * uint64_t(epoch + 1)));
    for (int64_t j = rows - 1; j > 0; --j)
      std::swap(perm[size_t(j)], perm[rng.below(uint64_t(j + 1))]);
    perm_epoch = epoch;
  }
  return perm[size_t(i % rows)];
}

namespace {

std::vector<double> one_weight_per_shard(const std::vector<std::string>& shard_paths,
                                         std::vector<double> weights) {
  if (weights.size() != shard_paths.size())
    input_error("data mixture: ", shard_paths.size(), " data sets but ", weights.size(),
                " weights; give one weight per data set");
  return weights;
}

}  // namespace

DataLoader::DataLoader(const std::string& shard_path, const LoaderOptions& options)
    : DataLoader(std::vector<std::string>{shard_path}, {1.0}, options) {}

DataLoader::DataLoader(const std::vector<std::string>& shard_paths, std::vector<double> weights,
                       const LoaderOptions& options)
    : mixture_(one_weight_per_shard(shard_paths, std::move(weights))), options_(options) {
  check_layout(options.micro_batch, options.accum, options.dp_rank, options.dp_size);
  for (size_t d = 0; d < shard_paths.size(); ++d) {
    sources_.push_back(std::make_unique<Source>(shard_paths[d], options,
                                                options.seed ^ (0x632be59bd9b4e019ull * d)));
    const Source &first = *sources_.front(), &added = *sources_.back();
    if (bool(added.packed) != bool(first.packed))
      input_error(added.shard.path(),
                  ": a mixture's data sets must all be SFT data sets or all "
                  "text ones, but ",
                  first.shard.path(), " is ", first.packed ? "SFT" : "text", " and this one ",
                  added.packed ? "SFT" : "text");
    if (added.shard.vocab_size() != first.shard.vocab_size())
      input_error(added.shard.path(), ": token vocabulary ", added.shard.vocab_size(), " but ",
                  first.shard.path(), " has ", first.shard.vocab_size(),
                  "; a mixture's data sets must share one tokenizer");
  }
}

const DataLoader::Source& DataLoader::at(int64_t source) const {
  TESSEL_CHECK(source >= 0 && source < sources(), "data set ", source, " of ", sources());
  return *sources_[size_t(source)];
}

int64_t DataLoader::step_tokens(int64_t step) {
  const int64_t G = sequences_per_step();
  if (!sources_.front()->packed) return G * options_.seq_len;
  int64_t n = 0;
  for (int64_t i = 0; i < G; ++i) {
    const Row r = row_of(step * G + i);
    n += packed(r.source)->row_tokens(r.row);
  }
  return n;
}

int64_t DataLoader::sequences_per_step() const {
  return options_.dp_size * options_.accum * options_.micro_batch;
}

DataLoader::Row DataLoader::row_of(int64_t g) {
  const MixtureOrder::Slot slot = mixture_.locate(g);
  return {slot.source, sources_[size_t(slot.source)]->row_of(slot.index, options_.shuffle)};
}

Batch DataLoader::batch_of(std::span<const Row> rows) const {
  const int64_t T = options_.seq_len;
  // Each data set's rows as one batch of its own, then each row to its place.
  std::vector<std::vector<int64_t>> of_source(sources_.size());
  for (const Row& r : rows) of_source[size_t(r.source)].push_back(r.row);
  if (sources_.size() == 1) return shard_rows_batch(shard(), sources_[0]->packed, of_source[0], T);
  Batch b = make_batch(int64_t(rows.size()), T);
  std::vector<int64_t> taken(sources_.size(), 0);
  std::vector<Batch> parts(sources_.size());
  for (size_t d = 0; d < sources_.size(); ++d)
    if (!of_source[d].empty())
      parts[d] = shard_rows_batch(sources_[d]->shard, sources_[d]->packed, of_source[d], T);
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto d = size_t(rows[i].source);
    copy_row(parts[d], taken[d]++, b, int64_t(i));
  }
  return b;
}

Batch DataLoader::next() {
  const int64_t mb = options_.micro_batch;
  const int64_t base =
      state_.step * sequences_per_step() + (options_.dp_rank * options_.accum + state_.micro) * mb;
  std::vector<Row> rows(static_cast<size_t>(mb));
  for (int64_t i = 0; i < mb; ++i) rows[size_t(i)] = row_of(base + i);
  if (++state_.micro == options_.accum) {
    state_.micro = 0;
    ++state_.step;
  }
  return batch_of(rows);
}

void DataLoader::restore(const LoaderState& state) {
  if (state.step < 0 || state.micro < 0 || state.micro >= options_.accum)
    input_error("data loader state: step ", state.step, ", micro ", state.micro,
                " is not a position of a loader with accum = ", options_.accum);
  state_ = state;
}

std::vector<Batch> validation_batches(const std::string& shard_path, int64_t seq_len,
                                      int64_t micro_batch, int64_t max_sequences, int64_t dp_rank,
                                      int64_t dp_size, Overlong overlong) {
  return validation_batches(ShardReader(shard_path), seq_len, micro_batch, max_sequences, dp_rank,
                            dp_size, overlong);
}

std::vector<Batch> validation_batches(const ShardReader& shard, int64_t seq_len,
                                      int64_t micro_batch, int64_t max_sequences, int64_t dp_rank,
                                      int64_t dp_size, Overlong overlong) {
  const auto packed = pack_if_sft(shard, seq_len, overlong);
  const int64_t w = count_rows(shard, packed, seq_len);
  check_layout(micro_batch, 1, dp_rank, dp_size);
  const int64_t n = max_sequences > 0 ? std::min(max_sequences, w) : w;
  const int64_t q = n / dp_size, rem = n % dp_size;
  const int64_t begin = dp_rank * q + std::min(dp_rank, rem);
  const int64_t end = begin + q + (dp_rank < rem ? 1 : 0);
  std::vector<Batch> batches;
  std::vector<int64_t> windows;
  for (int64_t first = begin; first < end; first += micro_batch) {
    windows.resize(size_t(std::min(micro_batch, end - first)));
    std::iota(windows.begin(), windows.end(), first);
    batches.push_back(shard_rows_batch(shard, packed, windows, seq_len));
  }
  return batches;
}

}  // namespace tessel::data
