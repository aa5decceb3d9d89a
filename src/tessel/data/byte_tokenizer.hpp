#pragma once
// Byte-level tokenizer: every byte of the UTF-8 text is one token, so the vocabulary is
// exactly 256 ids and any text round-trips. It needs no training and no vocabulary file,
// which makes it the default for the built-in corpora.
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace tessel::data {

class ByteTokenizer {
 public:
  static constexpr int32_t kVocabSize = 256;

  int32_t vocab_size() const { return kVocabSize; }
  // text [n bytes] -> ids [n], id = the byte's unsigned value.
  std::vector<int32_t> encode(std::string_view text) const;
  // ids [n] -> text [n bytes]; an id outside [0, 256) is an InputError naming its position.
  std::string decode(std::span<const int32_t> ids) const;
  // The id of a one-byte text (a stop token), -1 for an empty one; InputError naming `what`
  // for a longer text.
  int32_t single_token(std::string_view text, const std::string& what) const;
};

}  // namespace tessel::data
