#include "tessel/data/tokenizer.hpp"

#include <filesystem>
#include <nlohmann/json.hpp>

#include "tessel/core/error.hpp"
#include "tessel/data/bpe_tokenizer.hpp"
#include "tessel/data/byte_tokenizer.hpp"
#include "tessel/data/corpus.hpp"

namespace tessel::data {

namespace fs = std::filesystem;

int32_t Tokenizer::single_token(std::string_view text, const std::string& what) const {
  if (text.empty()) return -1;
  const std::vector<int32_t> ids = encode(text);
  if (ids.size() != 1)
    input_error(what, " must be one token of the ", name(), " tokenizer; \"", text, "\" is ",
                ids.size(), " tokens");
  return ids[0];
}

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& dir, int64_t model_vocab) {
  const fs::path metadata = fs::path(dir) / "dataset.json";
  std::unique_ptr<Tokenizer> tokenizer;
  if (!fs::exists(metadata)) {
    if (model_vocab == ByteTokenizer::kVocabSize) tokenizer = std::make_unique<ByteTokenizer>();
    return tokenizer;
  }
  std::string name;
  try {
    name = nlohmann::json::parse(read_file(metadata.string())).at("tokenizer").get<std::string>();
  } catch (const nlohmann::json::exception& e) {
    input_error(metadata.string(), ": no \"tokenizer\" string (", e.what(), ")");
  }
  if (name == "byte")
    tokenizer = std::make_unique<ByteTokenizer>();
  else if (name == "bpe")
    tokenizer = std::make_unique<BpeTokenizer>((fs::path(dir) / "vocab.json").string(),
                                               (fs::path(dir) / "merges.txt").string());
  else if (!name.starts_with("pretokenized"))
    input_error(metadata.string(), ": unknown tokenizer \"", name, "\"");
  if (tokenizer && tokenizer->vocab_size() > model_vocab)
    input_error(dir, ": its ", name, " tokenizer has ", tokenizer->vocab_size(),
                " ids, more than model.vocab = ", model_vocab);
  return tokenizer;
}

}  // namespace tessel::data
