#pragma once
// A small byte-level BPE vocabulary for the tokenizer tests, written by data::write_bpe_files
// (bytes 0-255, merge r as 256 + r, then "<|endoftext|>"), and GPT-2's byte symbols.
#include <string>
#include <utility>
#include <vector>

#include "tessel/data/bpe_trainer.hpp"

namespace tessel::fixture {

// GPT-2's symbol of byte b as UTF-8, written out here independently of the tokenizer: the
// printable Latin-1 bytes are themselves, the others take U+0100, U+0101, ... in byte order.
inline std::string gpt2_byte_symbol(int b) {
  auto printable = [](int x) {
    return (x >= 33 && x <= 126) || (x >= 161 && x <= 172) || x >= 174;
  };
  int code = b;
  if (!printable(b)) {
    code = 256;
    for (int x = 0; x < b; ++x) code += printable(x) ? 0 : 1;
  }
  std::string s;
  if (code < 0x80) {
    s.push_back(char(code));
  } else {  // two bytes cover everything below U+0800
    s.push_back(char(0xC0 | (code >> 6)));
    s.push_back(char(0x80 | (code & 0x3F)));
  }
  return s;
}

// English merges ("Ġ" is the space's symbol), each making a new token from earlier ones.
inline const std::vector<std::pair<std::string, std::string>>& english_merges() {
  static const std::vector<std::pair<std::string, std::string>> merges = {
      {"t", "h"},   {"th", "e"},   {"Ġ", "the"}, {"a", "n"},   {"an", "d"}, {"Ġ", "and"},
      {"i", "n"},   {"Ġ", "in"},   {"o", "f"},   {"Ġ", "of"},  {"e", "r"},  {"Ġ", "t"},
      {"Ġt", "h"},  {"L", "O"},    {"LO", "R"},  {"LOR", "D"}, {"Ġ", "s"},  {"Ġs", "a"},
      {"Ġsa", "i"}, {"Ġsai", "d"}, {"Ċ", "Ċ"},   {"h", "e"},   {"Ġ", "he"}, {"e", "d"}};
  return merges;
}

}  // namespace tessel::fixture
