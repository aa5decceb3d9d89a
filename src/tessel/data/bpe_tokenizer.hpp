#pragma once
// Byte-level BPE in the layout of GPT-2's tokenizer files (Hugging Face's vocab.json and
// merges.txt), so a model can be trained on, prompted with and sampled in the ids of such a
// vocabulary.
//
// Encoding: the text is cut into pieces (gpt2_pretokenize); each piece's bytes become the
// vocabulary's byte symbols (GPT-2's map of the 256 bytes to printable code points), and
// adjacent symbols are merged by merges.txt, lowest rank (earliest line) first, until no
// adjacent pair has a merge; each resulting symbol is one id. Decoding concatenates the
// tokens' strings and maps their symbols back to bytes.
//
// The tables are checked when loaded, so that encoding can never fail and decoding is
// unambiguous: every token is one or more byte symbols (specials such as "<|endoftext|>" too:
// printable ASCII stands for itself), so no two tokens decode to the same bytes; every byte
// symbol has an id; every merge joins two tokens that exist by then (byte symbols or results of
// earlier merges) into a token of vocab.json that no earlier merge made. Tables that BPE training
// writes pass (each merge makes one new token); these rules are also what lets bpe_merge
// take merges one at a time and still equal the reference's pass-per-rank result.
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tessel/data/tokenizer.hpp"

namespace tessel::data {

// GPT-2's pre-tokenization: the text as consecutive pieces, each the first alternative of
//   's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
// that matches where the previous piece ended (so a run of spaces before a word leaves its
// last space to the word). \p{L}, \p{N} and \s are Unicode's general categories L and N and
// property White_Space (ICU). InputError for text that is not UTF-8, naming the byte offset.
std::vector<std::string_view> gpt2_pretokenize(std::string_view text);

// The vocabulary's symbol of byte b in [0, 256) (GPT-2's map: the printable Latin-1 bytes
// stand for themselves, the others for U+0100, U+0101, ... in byte order), as UTF-8.
std::string bpe_byte_symbol(int b);

// The merge of an adjacent pair of ids: its rank (line order in merges.txt) and the id made.
struct BpeMerge {
  int32_t rank;
  int32_t id;
};
// Keyed by bpe_pair_key(left id, right id).
using BpeMergeTable = std::unordered_map<uint64_t, BpeMerge>;
inline uint64_t bpe_pair_key(int32_t left, int32_t right) {
  return (uint64_t(uint32_t(left)) << 32) | uint32_t(right);
}

// Replaces every occurrence of the adjacent pair `pair` (bpe_pair_key) in `ids` by `made`,
// left to right (in "aaa" only the first two a's merge).
void bpe_merge_pair(std::vector<int32_t>& ids, uint64_t pair, int32_t made);

// The symbols of one piece after all merges: the adjacent pair of lowest rank merges first,
// the leftmost of equal ones, until no pair has a merge (a heap over a linked list, n log n).
std::vector<int32_t> bpe_merge(std::vector<int32_t> ids, const BpeMergeTable& merges);
namespace naive {
// The reference's loop (GPT-2's encoder.py): find the lowest-ranked pair, merge all its
// occurrences left to right, repeat. Quadratic in the piece's length.
std::vector<int32_t> bpe_merge(std::vector<int32_t> ids, const BpeMergeTable& merges);
}  // namespace naive

// A vocabulary directory's files, under GPT-2's names: vocab.json, then merges.txt.
inline constexpr const char* kBpeFiles[2] = {"vocab.json", "merges.txt"};

class BpeTokenizer final : public Tokenizer {
 public:
  // vocab.json: one JSON object {"token": id, ...}; merges.txt: UTF-8 text (a leading
  // byte-order mark is dropped), an optional "#version" line, then "left right" per line
  // (GPT-2's files). InputError naming the file (and line) for anything the rules at the top
  // of this file refuse, quoting a token escaped and cut to a readable length.
  BpeTokenizer(const std::string& vocab_json, const std::string& merges_txt);
  // The vocabulary in directory `dir` (kBpeFiles).
  static std::unique_ptr<BpeTokenizer> from_directory(const std::string& dir);

  int32_t vocab_size() const override { return vocab_size_; }
  std::vector<int32_t> encode(std::string_view text) const override;
  std::string decode(std::span<const int32_t> ids) const override;
  std::string name() const override { return "bpe"; }
  // The id of GPT-2's "<|endoftext|>" when the vocabulary has it, else -1.
  int32_t end_of_text() const { return end_of_text_; }

 private:
  // Appends the ids of one pre-tokenized piece to `out` (through the cache).
  void append_piece(std::string_view piece, std::vector<int32_t>& out) const;

  int32_t vocab_size_ = 0;
  int32_t end_of_text_ = -1;
  int32_t byte_id_[256];                  // the id of each byte's symbol
  std::vector<std::string> bytes_of_id_;  // [vocab_size] each token's bytes; "" = no token
  std::vector<bool> has_token_;           // [vocab_size]
  BpeMergeTable merges_;
  // Pieces repeat (words): their ids are kept. Not thread-safe, like the tokenizer's users.
  mutable std::unordered_map<std::string, std::vector<int32_t>> piece_cache_;
};

}  // namespace tessel::data
