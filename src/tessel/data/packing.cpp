#include "tessel/data/packing.hpp"

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <numeric>
#include <set>
#include <tuple>

#include "tessel/core/error.hpp"
#include "tessel/data/corpus.hpp"

namespace tessel::data {

namespace {

constexpr const char* kLossMaskSuffix = ".loss_mask.tok";

// Document d of `shard`: its first token and its length.
std::pair<int64_t, int64_t> document_span(const ShardReader& shard, int64_t d) {
  const auto starts = shard.doc_starts();
  const int64_t begin = int64_t(starts[size_t(d)]);
  const int64_t end =
      d + 1 < shard.num_documents() ? int64_t(starts[size_t(d + 1)]) : shard.num_tokens();
  return {begin, end - begin};
}

ShardReader open_loss_mask(const ShardReader& tokens) {
  ShardReader mask(loss_mask_path(tokens.path()));
  if (mask.vocab_size() != 2)
    input_error(mask.path(), ": a loss-mask shard has vocabulary 2, this one ", mask.vocab_size());
  const auto a = tokens.doc_starts(), b = mask.doc_starts();
  if (mask.num_tokens() != tokens.num_tokens() ||
      !std::equal(a.begin(), a.end(), b.begin(), b.end()))
    input_error(mask.path(), ": its documents differ from those of ", tokens.path(), " (",
                mask.num_tokens(), " tokens in ", mask.num_documents(), " documents against ",
                tokens.num_tokens(), " in ", tokens.num_documents(),
                "); prepare the data set again");
  return mask;
}

}  // namespace

std::string loss_mask_path(const std::string& token_shard_path) {
  std::filesystem::path p(token_shard_path);
  p.replace_extension(kLossMaskSuffix);
  return p.string();
}

bool has_loss_mask(const std::string& token_shard_path) {
  return std::filesystem::exists(loss_mask_path(token_shard_path));
}

void check_loss_mask_matches_format(const std::string& token_shard_path) {
  const std::string metadata =
      (std::filesystem::path(token_shard_path).parent_path() / "dataset.json").string();
  if (!std::filesystem::exists(metadata)) return;
  const nlohmann::json j = nlohmann::json::parse(read_file(metadata), nullptr, false);
  if (!j.is_object() || !j.contains("format") || (j["format"] != "sft" && j["format"] != "text"))
    return;  // older, or a format this version does not know
  const bool sft = j["format"] == "sft";
  if (has_loss_mask(token_shard_path) != sft)
    input_error(metadata, " says \"format\": \"", j["format"].get<std::string>(), "\" but ",
                loss_mask_path(token_shard_path), sft ? " is missing" : " exists",
                "; prepare the data set again");
}

std::vector<std::vector<int64_t>> pack_best_fit(std::span<const int64_t> lengths,
                                                int64_t capacity) {
  std::vector<int64_t> order(lengths.size());
  std::iota(order.begin(), order.end(), int64_t(0));
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return lengths[size_t(a)] > lengths[size_t(b)]; });
  std::vector<std::vector<int64_t>> rows;
  // (room left, row): lower_bound finds the least room that fits, then the older row.
  std::set<std::pair<int64_t, size_t>> open;
  for (int64_t i : order) {
    const int64_t n = lengths[size_t(i)];
    TESSEL_CHECK(n >= 1 && n <= capacity, "item ", i, " of length ", n, " does not fit rows of ",
                 capacity);
    auto it = open.lower_bound({n, 0});
    size_t row;
    int64_t room;
    if (it == open.end()) {
      row = rows.size();
      rows.emplace_back();
      room = capacity;
    } else {
      std::tie(room, row) = *it;
      open.erase(it);
    }
    rows[row].push_back(i);
    if (room - n > 0) open.emplace(room - n, row);
  }
  return rows;
}

const char* overlong_name(Overlong o) {
  return o == Overlong::cut ? "cut" : "drop";
}

PackedSamples::PackedSamples(const ShardReader& tokens, int64_t seq_len, Overlong overlong)
    : mask_(open_loss_mask(tokens)), T_(seq_len) {
  if (seq_len < 1) input_error(tokens.path(), ": seq_len must be >= 1, got ", seq_len);
  std::vector<int64_t> kept, lengths;
  std::vector<int32_t> marks;
  int64_t longer = 0;  // overlong_ counts only those placed under "cut"; the refusal counts all
  for (int64_t d = 0; d < tokens.num_documents(); ++d) {
    const auto [begin, n] = document_span(tokens, d);
    // A sample of T + 1 tokens fits: its last token is only a target.
    const bool too_long = n > T_ + 1;
    longer += too_long;
    if (too_long && overlong == Overlong::drop) {
      ++overlong_;
      continue;
    }
    // The cut sample's targets reach its token T (the last position's target).
    const int64_t r = std::min(n, T_ + 1);
    marks.resize(size_t(r));
    mask_.read(begin, r, marks.data());
    if (std::find(marks.begin() + 1, marks.end(), 1) == marks.end()) {
      ++untrained_;
      continue;
    }
    overlong_ += too_long;
    kept.push_back(d);
    lengths.push_back(std::min(n, T_));
  }
  samples_ = int64_t(kept.size());
  if (samples_ == 0)
    input_error(tokens.path(), ": no sample left to use at seq_len = ", seq_len, ": ", longer,
                " of its ", tokens.num_documents(), " samples are longer (data.overlong = \"",
                overlong_name(overlong), "\"",
                overlong == Overlong::cut ? ": cut to seq_len" : ": left out", "), ", untrained_,
                overlong == Overlong::cut ? "" : " of the others",
                " have no trained token within seq_len tokens");
  rows_ = pack_best_fit(lengths, T_);
  // Rows in the order of their first samples: the first rows (validation's, or training's
  // unshuffled) hold the corpus's first samples, not its longest.
  for (auto& row : rows_) std::sort(row.begin(), row.end());
  std::sort(rows_.begin(), rows_.end());
  for (auto& row : rows_) {
    int64_t used = 0;
    for (int64_t& i : row) used += lengths[size_t(i)], i = kept[size_t(i)];
    row_tokens_.push_back(used);
  }
}

Batch PackedSamples::batch(const ShardReader& tokens, std::span<const int64_t> rows) const {
  TESSEL_CHECK(
      tokens.num_tokens() == mask_.num_tokens() && tokens.num_documents() == mask_.num_documents(),
      tokens.path(), " is not the shard these rows were packed from");
  const int64_t T = T_;
  Batch b = make_batch(int64_t(rows.size()), T);
  b.padding.assign(b.tokens.size(), 0);
  std::vector<int32_t> ids, marks;
  for (size_t r = 0; r < rows.size(); ++r) {
    const int64_t base = int64_t(r) * T;
    int64_t t = 0;
    for (int64_t d : rows_.at(size_t(rows[r]))) {
      const auto [begin, n] = document_span(tokens, d);
      const int64_t m = std::min(n, T), with_target = std::min(n, T + 1);
      ids.resize(size_t(with_target));
      marks.resize(size_t(with_target));
      tokens.read(begin, with_target, ids.data());
      mask_.read(begin, with_target, marks.data());
      b.doc_starts[r].push_back(int32_t(t));
      for (int64_t j = 0; j < m; ++j) {
        // A whole sample's last position predicts nothing: its next token is another sample's.
        const bool target = j + 1 < with_target;
        b.tokens[size_t(base + t + j)] = ids[size_t(j)];
        b.targets[size_t(base + t + j)] = target ? ids[size_t(j + 1)] : 0;
        b.loss_mask[size_t(base + t + j)] = target ? float(marks[size_t(j + 1)]) : 0.0f;
      }
      t += m;
    }
    if (t < T) b.doc_starts[r].push_back(int32_t(t));  // the padding's own document
    for (; t < T; ++t) b.loss_mask[size_t(base + t)] = 0.0f, b.padding[size_t(base + t)] = 1;
  }
  return b;
}

}  // namespace tessel::data
