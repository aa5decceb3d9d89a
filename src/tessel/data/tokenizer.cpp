#include "tessel/data/tokenizer.hpp"

#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>

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

namespace {

// The tokenizer dataset.json in `dir` names; nullopt without dataset.json.
std::optional<std::string> tokenizer_name(const std::string& dir) {
  const fs::path metadata = fs::path(dir) / "dataset.json";
  if (!fs::exists(metadata)) return std::nullopt;
  try {
    return nlohmann::json::parse(read_file(metadata.string())).at("tokenizer").get<std::string>();
  } catch (const nlohmann::json::exception& e) {
    input_error(metadata.string(), ": no \"tokenizer\" string (", e.what(), ")");
  }
}

}  // namespace

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& dir, int64_t model_vocab) {
  std::unique_ptr<Tokenizer> tokenizer;
  const std::optional<std::string> named = tokenizer_name(dir);
  if (!named) {
    if (model_vocab == ByteTokenizer::kVocabSize) tokenizer = std::make_unique<ByteTokenizer>();
    return tokenizer;
  }
  const std::string& name = *named;
  if (name == "byte")
    tokenizer = std::make_unique<ByteTokenizer>();
  else if (name == "bpe")
    tokenizer = BpeTokenizer::from_directory(dir);
  else if (!name.starts_with("pretokenized"))
    input_error(dir, "/dataset.json: unknown tokenizer \"", name, "\"");
  if (tokenizer && tokenizer->vocab_size() > model_vocab)
    input_error(dir, ": its ", name, " tokenizer has ", tokenizer->vocab_size(),
                " ids, more than model.vocab = ", model_vocab);
  return tokenizer;
}

void check_same_tokenizer(const std::vector<std::string>& dirs) {
  std::optional<std::string> first_dir, first_name;
  for (const std::string& dir : dirs) {
    const std::optional<std::string> name = tokenizer_name(dir);
    if (!name) continue;
    if (!first_dir) {
      first_dir = dir, first_name = name;
      continue;
    }
    bool same = name == first_name;
    for (const char* file : kBpeFiles)
      if (same && *name == "bpe")
        same = read_file((fs::path(dir) / file).string()) ==
               read_file((fs::path(*first_dir) / file).string());
    if (!same)
      input_error(dir, " and ", *first_dir, " hold ids of different tokenizers (", *name,
                  *name == *first_name ? " vocabularies that differ" : " and " + *first_name,
                  "); prepare them with the same one");
  }
}

}  // namespace tessel::data
