#pragma once
// Learning a byte-level BPE vocabulary from a corpus (`tessel train-bpe`), written in GPT-2's
// file layout so that BpeTokenizer (bpe_tokenizer.hpp) and other tools read it.
//
// The documents are cut into pieces by gpt2_pretokenize and counted; every piece starts as its
// bytes. Each round merges the adjacent pair that occurs most often over all pieces (weighted
// by their counts; ties go to the lower (left id, right id)), in every piece, left to right.
// Ids: bytes 0-255 are their value, merge r makes id 256 + r. A pair whose joined string is
// already a token is never merged (so each merge makes one new token, as BpeTokenizer
// requires). Learning stops early when no pair occurs at least twice.
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace tessel::data {

// A merge as the strings of its two tokens, in the vocabulary's symbols ("Ġ" + "the").
using BpeMergeStrings = std::pair<std::string, std::string>;

// Up to `merges` merges learned from `documents`, in order. InputError for merges < 0.
std::vector<BpeMergeStrings> learn_bpe_merges(const std::vector<std::string>& documents,
                                              int64_t merges);
namespace naive {
// The same by recounting every pair of every piece each round (quadratic; the twin the fast
// version, which updates only the pieces a merge touches, is tested against).
std::vector<BpeMergeStrings> learn_bpe_merges(const std::vector<std::string>& documents,
                                              int64_t merges);
}  // namespace naive

// Writes the kBpeFiles in dir, and no other file: vocab.json (the 256 byte symbols with their
// byte values as ids, each merge's token as 256 + its rank, then "<|endoftext|>") and
// merges.txt ("#version: 0.2", then one "left right" line per merge), creating dir. Returns the
// vocabulary size, 257 + merges. InputError when dir cannot be written.
int64_t write_bpe_files(const std::string& dir, const std::vector<BpeMergeStrings>& merges);

}  // namespace tessel::data
