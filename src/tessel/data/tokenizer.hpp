#pragma once
// What turns text into a model's token ids and back: the byte tokenizer (byte_tokenizer.hpp)
// or a byte-level BPE vocabulary (bpe_tokenizer.hpp). A prepared data directory names its own
// in dataset.json (prepare.hpp); load_tokenizer reads it from there, so sampling, `tessel
// generate` and prompts use the tokenizer the training data was made with.
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace tessel::data {

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual int32_t vocab_size() const = 0;  // one past the largest id
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // InputError for an id this tokenizer does not have, naming its position.
  virtual std::string decode(std::span<const int32_t> ids) const = 0;
  virtual std::string name() const = 0;  // as dataset.json records it: "byte", "bpe"
  // The id of a text that is exactly one token (a stop token), -1 for an empty one;
  // InputError naming `what` otherwise.
  int32_t single_token(std::string_view text, const std::string& what) const;
};

// The tokenizer of prepared data directory `dir`, by its dataset.json: "byte", or "bpe" with
// the vocabulary prepare copied beside the shards. A directory without dataset.json (shards
// written another way) is read as byte-level when `model_vocab` is 256. nullptr when the ids
// have no tokenizer tessel can apply (a tokens:PATH corpus prepared without --tokenizer).
// InputError for an unreadable dataset.json or tokenizer file.
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& dir, int64_t model_vocab);

// InputError naming two of `dirs` (prepared data directories, e.g. a mixture's) whose token
// ids come from different tokenizers: different dataset.json tokenizers, or BPE vocabularies
// whose files differ. Directories without dataset.json are not compared.
void check_same_tokenizer(const std::vector<std::string>& dirs);

}  // namespace tessel::data
