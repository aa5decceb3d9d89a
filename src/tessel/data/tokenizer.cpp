#include "tessel/data/tokenizer.hpp"

#include <unistd.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "tessel/core/error.hpp"
#include "tessel/core/file_io.hpp"
#include "tessel/data/bpe_tokenizer.hpp"
#include "tessel/data/byte_tokenizer.hpp"
#include "tessel/data/corpus.hpp"

namespace tessel::data {

namespace fs = std::filesystem;

std::vector<int32_t> Tokenizer::encode_text(std::string_view text, const std::string& what) const {
  try {
    return encode(text);
  } catch (const InputError& e) {
    input_error(what, ": ", e.what());
  }
}

int32_t Tokenizer::single_token(std::string_view text, const std::string& what) const {
  if (text.empty()) return -1;
  const std::vector<int32_t> ids = encode_text(text, what);
  if (ids.size() != 1)  // the text as a JSON string: escaped, so the error stays one line
    input_error(what, " must be one token of the ", name(), " tokenizer; ",
                nlohmann::json(std::string(text))
                    .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace),
                " is ", ids.size(), " tokens");
  return ids[0];
}

std::optional<std::string> tokenizer_name(const std::string& dir) {
  if (dir.empty()) return std::nullopt;
  for (const char* file : {"dataset.json", "tokenizer.json"}) {
    const fs::path metadata = fs::path(dir) / file;
    if (!fs::exists(metadata)) continue;
    try {
      return nlohmann::json::parse(read_file(metadata.string())).at("tokenizer").get<std::string>();
    } catch (const nlohmann::json::exception& e) {
      input_error(metadata.string(), ": no \"tokenizer\" string (", e.what(), ")");
    }
  }
  if (fs::exists(fs::path(dir) / kBpeFiles[0]) && fs::exists(fs::path(dir) / kBpeFiles[1]))
    return "bpe";
  return std::nullopt;
}

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
  else if (!name.starts_with(kPretokenized))
    input_error(dir, ": unknown tokenizer \"", name, "\"");
  if (tokenizer && tokenizer->vocab_size() > model_vocab)
    input_error(dir, ": its ", name, " tokenizer has ", tokenizer->vocab_size(),
                " ids, more than model.vocab = ", model_vocab);
  return tokenizer;
}

void save_tokenizer(const std::string& data_dir, const std::string& to_dir) {
  const std::optional<std::string> name = tokenizer_name(data_dir);
  if (!name) return;
  // Built beside it, then renamed into place: a reader sees the old copy, none, or the new
  // one whole, never a vocabulary of one tokenizer with the name of another.
  const fs::path target = fs::path(to_dir).lexically_normal();
  const fs::path staging = target.string() + ".tmp." + std::to_string(::getpid());
  std::error_code ec;
  fs::remove_all(staging, ec);
  fs::create_directories(staging, ec);
  if (ec) input_error(staging.string(), ": cannot create directory: ", ec.message());
  if (*name == "bpe")
    for (const char* file : kBpeFiles)
      write_file_atomically((staging / file).string(),
                            read_file((fs::path(data_dir) / file).string()));
  // Pretokenized ids get their name too, so that no older copy speaks for them.
  write_file_atomically((staging / "tokenizer.json").string(),
                        nlohmann::json{{"tokenizer", *name}}.dump() + "\n");
  fs::remove_all(target, ec);
  fs::rename(staging, target, ec);
  if (ec) input_error(target.string(), ": cannot put the tokenizer copy in place: ", ec.message());
  fsync_path(target.parent_path().empty() ? "." : target.parent_path().string());
}

void check_same_tokenizer(const std::vector<std::string>& dirs) {
  std::optional<std::string> first_dir, first_name;
  for (const std::string& dir : dirs) {
    const std::optional<std::string> name = tokenizer_name(dir);
    if (!name || name->starts_with(kPretokenized)) continue;
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
