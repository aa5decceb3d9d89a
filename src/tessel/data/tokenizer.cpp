#include "tessel/data/tokenizer.hpp"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>

#include "tessel/core/error.hpp"
#include "tessel/core/file_io.hpp"
#include "tessel/data/bpe_tokenizer.hpp"
#include "tessel/data/byte_tokenizer.hpp"
#include "tessel/data/corpus.hpp"
#include "tessel/data/json_lines.hpp"

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
    input_error(what, " must be one token of the ", name(), " tokenizer; ", json_quote(text),
                " is ", ids.size(), " tokens",
                text.find("\\n") != std::string_view::npos
                    ? " (a backslash and an n: a newline is \"\\n\" in double quotes in TOML, "
                      "--set 'train.sample_stop=\"\\n\"', or $'\\n' in the shell)"
                    : "");
  return ids[0];
}

namespace {

// A directory's description of its tokenizer: the first of kTokenizerMetadataFiles that
// exists, parsed.
struct TokenizerMetadata {
  fs::path path;
  nlohmann::json json;
};

std::optional<TokenizerMetadata> read_metadata(const std::string& dir) {
  if (dir.empty()) return std::nullopt;
  for (const char* file : kTokenizerMetadataFiles) {
    const fs::path metadata = fs::path(dir) / file;
    if (!fs::exists(metadata)) continue;
    try {
      nlohmann::json json = nlohmann::json::parse(read_file(metadata.string()));
      json.at("tokenizer").get<std::string>();
      return TokenizerMetadata{metadata, std::move(json)};
    } catch (const nlohmann::json::exception& e) {
      input_error(metadata.string(), ": no \"tokenizer\" string (", e.what(), ")");
    }
  }
  return std::nullopt;
}

// tokenizer_name of `dir`, whose metadata is `metadata`.
std::optional<std::string> name_of(const std::string& dir,
                                   const std::optional<TokenizerMetadata>& metadata) {
  if (metadata) return metadata->json.at("tokenizer").get<std::string>();
  if (!dir.empty() && fs::exists(fs::path(dir) / kBpeFiles[0]) &&
      fs::exists(fs::path(dir) / kBpeFiles[1]))
    return "bpe";
  return std::nullopt;
}

nlohmann::json bpe_checksums(const std::string& dir) {
  nlohmann::json sums = nlohmann::json::object();
  for (const char* file : kBpeFiles) sums[file] = file_crc32((fs::path(dir) / file).string());
  return sums;
}

// InputError when the BPE files in `dir` are not those its metadata recorded: replaced after
// prepare or after the run copied them. Metadata written before the checksums were recorded
// has none, and is not checked.
void check_bpe_checksums(const std::string& dir, const std::optional<TokenizerMetadata>& metadata) {
  if (!metadata || !metadata->json.contains(kBpeChecksumsKey)) return;
  if (metadata->json.at(kBpeChecksumsKey) != bpe_checksums(dir))
    input_error(dir, ": ", kBpeFiles[0], " / ", kBpeFiles[1],
                " are not the vocabulary its ids were made with (their checksums differ from ",
                metadata->path.filename().string(), "'s ", kBpeChecksumsKey,
                "; replaced afterwards, e.g. by train-bpe --out?): ",
                metadata->path.filename() == "dataset.json"
                    ? "restore them, or prepare the data again"
                    : "restore them from the data set the run trained on");
}

}  // namespace

std::string bpe_checksums_json(const std::string& dir) {
  return bpe_checksums(dir).dump();
}

std::optional<std::string> tokenizer_name(const std::string& dir) {
  return name_of(dir, read_metadata(dir));
}

std::unique_ptr<Tokenizer> load_tokenizer(const std::string& dir, int64_t model_vocab) {
  std::unique_ptr<Tokenizer> tokenizer;
  const std::optional<TokenizerMetadata> metadata = read_metadata(dir);
  const std::optional<std::string> named = name_of(dir, metadata);
  if (!named) {
    if (model_vocab == ByteTokenizer::kVocabSize) tokenizer = std::make_unique<ByteTokenizer>();
    return tokenizer;
  }
  const std::string& name = *named;
  if (name == "byte")
    tokenizer = std::make_unique<ByteTokenizer>();
  else if (name == "bpe") {
    tokenizer = BpeTokenizer::from_directory(dir);
    check_bpe_checksums(dir, metadata);
  } else if (!name.starts_with(kPretokenized))
    input_error(dir, ": unknown tokenizer \"", name, "\"");
  if (tokenizer && tokenizer->vocab_size() > model_vocab)
    input_error(dir, ": its ", name, " tokenizer has ", tokenizer->vocab_size(),
                " ids, more than model.vocab = ", model_vocab);
  return tokenizer;
}

void save_tokenizer(const std::string& data_dir, const std::string& to_dir) {
  const std::optional<TokenizerMetadata> metadata = read_metadata(data_dir);
  const std::optional<std::string> name = name_of(data_dir, metadata);
  if (!name) return;
  if (*name == "bpe") check_bpe_checksums(data_dir, metadata);
  // Built beside it, then renamed into place: a reader sees the old copy, none, or the new
  // one whole, never a vocabulary of one tokenizer with the name of another.
  const fs::path target = fs::path(to_dir).lexically_normal();
  const fs::path staging = target.string() + ".tmp." + std::to_string(::getpid());
  std::error_code ec;
  fs::remove_all(staging, ec);
  try {
    fs::create_directories(staging, ec);
    if (ec) input_error(staging.string(), ": cannot create directory: ", ec.message());
    nlohmann::json description = {{"tokenizer", *name}};
    if (*name == "bpe") {
      for (const char* file : kBpeFiles)
        write_file_atomically((staging / file).string(),
                              read_file((fs::path(data_dir) / file).string()));
      description[kBpeChecksumsKey] = bpe_checksums(staging.string());
    }
    // Pretokenized ids get their name too, so that no older copy speaks for them.
    write_file_atomically((staging / kTokenizerMetadataFiles[1]).string(),
                          description.dump() + "\n");
    fs::remove_all(target, ec);
    fs::rename(staging, target, ec);
    if (ec)
      input_error(target.string(), ": cannot put the tokenizer copy in place: ", ec.message());
  } catch (...) {  // no half-built copy left beside the target
    fs::remove_all(staging, ec);
    throw;
  }
  fsync_path(target.parent_path().empty() ? "." : target.parent_path().string());
}

bool is_saved_tokenizer_file(std::string_view name) {
  return name == kTokenizerMetadataFiles[1] ||
         std::find(std::begin(kBpeFiles), std::end(kBpeFiles), name) != std::end(kBpeFiles);
}

void check_same_tokenizer(const std::vector<std::string>& dirs, const std::string& advice) {
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
                  *name == *first_name ? " vocabularies that differ" : " and " + *first_name, "); ",
                  advice);
  }
}

}  // namespace tessel::data
