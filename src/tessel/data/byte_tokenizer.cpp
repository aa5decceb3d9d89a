#include "tessel/data/byte_tokenizer.hpp"

#include "tessel/core/error.hpp"

namespace tessel::data {

std::vector<int32_t> ByteTokenizer::encode(std::string_view text) const {
  std::vector<int32_t> ids(text.size());
  for (size_t i = 0; i < text.size(); ++i) ids[i] = int32_t(static_cast<unsigned char>(text[i]));
  return ids;
}

std::string ByteTokenizer::decode(std::span<const int32_t> ids) const {
  std::string text(ids.size(), '\0');
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= kVocabSize)
      input_error("byte tokenizer: token id ", ids[i], " at position ", i, " is outside [0, ",
                  kVocabSize, ")");
    text[i] = char(static_cast<unsigned char>(ids[i]));
  }
  return text;
}

}  // namespace tessel::data
