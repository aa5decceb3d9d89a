#pragma once
// Byte-level tokenizer: every byte of the UTF-8 text is one token, so the vocabulary is
// exactly 256 ids and any text round-trips. It needs no training and no vocabulary file,
// which makes it the default for the built-in corpora.
#include "tessel/data/tokenizer.hpp"

namespace tessel::data {

class ByteTokenizer final : public Tokenizer {
 public:
  static constexpr int32_t kVocabSize = 256;

  int32_t vocab_size() const override { return kVocabSize; }
  // text [n bytes] -> ids [n], id = the byte's unsigned value.
  std::vector<int32_t> encode(std::string_view text) const override;
  // ids [n] -> text [n bytes]; an id outside [0, 256) is an InputError naming its position.
  std::string decode(std::span<const int32_t> ids) const override;
  std::string name() const override { return "byte"; }
};

}  // namespace tessel::data
