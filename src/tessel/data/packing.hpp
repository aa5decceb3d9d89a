#pragma once
// Packing SFT samples into training rows.
//
// Storage. An SFT data set (`tessel prepare` with an SFT corpus, sft_corpus.hpp) holds beside
// each token shard X.tok a loss-mask shard X.loss_mask.tok: a u8 shard of vocabulary 2 with
// the same documents, whose token i is 1 when token i of X.tok is trained on. A token shard
// with a loss-mask shard beside it is packed by the loader; one without is cut into windows.
//
// Samples longer than T + 1 tokens (T = seq_len; the last token of a sample is only a target)
// are left out (data.overlong = "drop", the default) or cut to their first T tokens ("cut"). Each
// sample is placed whole into one row of T positions by best-fit decreasing: samples in order of
// decreasing length (ties: lower index first), each into the open row with the least room that
// still fits it (ties: the older row), else into a new row. Then each row lists its samples in
// index order, and the rows are numbered in the order of their first samples, so the first rows
// hold the corpus's first samples. The rows are fixed for the data set, T and the policy; the
// loader shuffles rows, not samples. The positions after a row's last sample are padding: token 0,
// no loss, their own document, and marked in Batch::padding (MoE layers leave them out).
//
// Targets. Position t of a sample predicts the sample's token t + 1, counted in the loss when
// the loss-mask shard marks that token; the last position of a whole sample predicts nothing
// (its next token belongs to another sample), and neither does padding. A cut sample's last
// position predicts its token T. A sample with no counted target is left out. Under the
// causal-document attention mask with positions restarting at every document
// (train/batch_inputs.hpp), a packed row computes exactly what its samples compute one by one:
// no attention crosses a sample boundary.
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "tessel/data/batch.hpp"
#include "tessel/data/shard.hpp"

namespace tessel::data {

// "dir/train.tok" -> "dir/train.loss_mask.tok".
std::string loss_mask_path(const std::string& token_shard_path);
// Whether the token shard at `token_shard_path` belongs to an SFT data set.
bool has_loss_mask(const std::string& token_shard_path);
// Checks that the token shard has a loss-mask shard exactly when its directory's dataset.json
// says "format": "sft" (one without that file or key is not checked); InputError naming the
// missing or stray mask otherwise: SFT data trained as text would learn the prompts.
void check_loss_mask_matches_format(const std::string& token_shard_path);

// Best-fit decreasing as above: rows[i] lists the indices of the items in row i in placement
// order; every length must lie in [1, capacity].
std::vector<std::vector<int64_t>> pack_best_fit(std::span<const int64_t> lengths, int64_t capacity);

// What happens to an SFT sample longer than seq_len (config data.overlong).
enum class Overlong { drop, cut };
const char* overlong_name(Overlong o);  // "drop", "cut"

// The packed rows of one SFT token shard and its loss-mask shard.
class PackedSamples {
 public:
  // Opens and checks the loss-mask shard of `tokens` (vocabulary 2, the same token count and
  // document index; InputError naming the file otherwise) and packs rows of `seq_len`
  // positions. InputError when no sample is left.
  PackedSamples(const ShardReader& tokens, int64_t seq_len, Overlong overlong = Overlong::drop);

  int64_t rows() const { return int64_t(rows_.size()); }
  // Positions of row r that hold sample tokens (the rest is padding).
  int64_t row_tokens(int64_t r) const { return row_tokens_.at(size_t(r)); }
  int64_t samples() const { return samples_; }  // placed in rows
  // Samples longer than seq_len + 1: left out ("drop"), or placed cut ("cut").
  int64_t overlong() const { return overlong_; }
  int64_t untrained() const { return untrained_; }  // left out: no counted target

  // The given rows of `tokens` (the shard this object was built from) as a batch.
  Batch batch(const ShardReader& tokens, std::span<const int64_t> rows) const;

 private:
  ShardReader mask_;
  int64_t T_;
  std::vector<std::vector<int64_t>> rows_;  // sample (document) indices per row
  std::vector<int64_t> row_tokens_;
  int64_t samples_ = 0, overlong_ = 0, untrained_ = 0;
};

}  // namespace tessel::data
