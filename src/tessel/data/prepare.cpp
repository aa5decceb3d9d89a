#include "tessel/data/prepare.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <string_view>
#include <type_traits>

#include "tessel/core/error.hpp"
#include "tessel/core/file_io.hpp"
#include "tessel/core/rng.hpp"
#include "tessel/data/bpe_tokenizer.hpp"
#include "tessel/data/byte_tokenizer.hpp"
#include "tessel/data/corpus.hpp"
#include "tessel/data/json_lines.hpp"
#include "tessel/data/packing.hpp"
#include "tessel/data/shard.hpp"
#include "tessel/data/token_file.hpp"

namespace tessel::data {

namespace fs = std::filesystem;

namespace {

constexpr std::string_view kTokenFilePrefix = "tokens:";  // the corpus of a raw token-id file
// The corpora named by a path after their prefix.
constexpr std::string_view kCorpusPrefixes[] = {"file:", "jsonl:", kTokenFilePrefix, "chat:"};
constexpr std::string_view kBpePrefix = "bpe:";  // --tokenizer bpe:DIR

// InputError for a corpus that is a PREFIX:PATH corpus's prefix alone ("file:"): said so, not
// taken for an unknown corpus name or a corpus other than tokens:PATH.
void check_names_a_file(const std::string& corpus) {
  if (std::find(std::begin(kCorpusPrefixes), std::end(kCorpusPrefixes), corpus) !=
      std::end(kCorpusPrefixes))
    input_error("corpus \"", corpus, "\" names no file (expected ", corpus, "PATH)");
}

std::string split_json(const SplitCounts& split, bool sft) {
  return detail::concat("{\"documents\": ", split.documents, ", \"tokens\": ", split.tokens,
                        sft ? detail::concat(", \"trained_tokens\": ", split.trained_tokens) : "",
                        ", \"path\": ", json_quote(fs::path(split.path).filename().string()), "}");
}

// Writes one split: the token shard of the chosen items and, for SFT samples, its loss-mask
// shard (packing.hpp), into a directory begin_output emptied of an earlier prepare's shards.
template <class Item>
SplitCounts write_split(const std::vector<Item>& items, const std::vector<size_t>& which,
                        const std::string& path, const Tokenizer& tokenizer) {
  constexpr bool sft = std::is_same_v<Item, SftSample>;
  ShardWriter writer(path, token_dtype_for_vocab(tokenizer.vocab_size()), tokenizer.vocab_size());
  std::optional<ShardWriter> mask;
  if constexpr (sft) mask.emplace(loss_mask_path(path), TokenDtype::u8, 2);
  SplitCounts counts;
  for (size_t i : which) {
    if constexpr (sft) {
      // Each run of equally flagged bytes is encoded apart, so that no token straddles
      // context and reply and every token takes its run's flag (bytes: one per byte).
      const SftSample& sample = items[i];
      std::vector<int32_t> ids, marks;
      for (size_t b = 0, e = 0; b < sample.text.size(); b = e) {
        while (e < sample.text.size() && sample.trained[e] == sample.trained[b]) ++e;
        const auto part = tokenizer.encode(std::string_view(sample.text).substr(b, e - b));
        ids.insert(ids.end(), part.begin(), part.end());
        marks.insert(marks.end(), part.size(), int32_t(sample.trained[b]));
      }
      writer.add_document(ids);
      mask->add_document(marks);
      counts.trained_tokens += std::count(marks.begin(), marks.end(), 1);
    } else {
      writer.add_document(tokenizer.encode(items[i]));
    }
  }
  // The mask first: a new token shard never stands without its mask.
  if (mask) mask->finish();
  writer.finish();
  counts.documents = writer.num_documents();
  counts.tokens = writer.num_tokens();
  counts.path = path;
  return counts;
}

// The BPE directory of a "bpe:DIR" tokenizer option; nullopt for "byte" or unset; InputError
// for anything else.
std::optional<std::string> bpe_directory(const PrepareOptions& options) {
  const std::string& name = options.tokenizer.value_or("byte");
  if (name == "byte") return std::nullopt;
  if (name.starts_with(kBpePrefix) && name.size() > kBpePrefix.size())
    return name.substr(kBpePrefix.size());
  input_error("prepare: --tokenizer must be byte or bpe:DIR, got \"", name, "\"");
}

// The shards prepare writes in output directory `out`: each split's token shard and its
// loss-mask shard (an SFT corpus's).
std::vector<fs::path> shard_files(const fs::path& out) {
  std::vector<fs::path> files;
  for (const char* split : {"train.tok", "val.tok"})
    files.insert(files.end(), {out / split, loss_mask_path((out / split).string())});
  return files;
}

// Every file prepare may write or remove in output directory `out`.
std::vector<fs::path> output_files(const fs::path& out) {
  std::vector<fs::path> files = shard_files(out);
  files.push_back(out / "dataset.json");
  for (const char* file : kBpeFiles) files.push_back(out / file);
  return files;
}

// The temporaries (`<file>.tmp.<pid>`: shard.hpp, file_io.hpp) of prepare's files in `out`
// that an earlier prepare, killed while it wrote them, left behind.
std::vector<fs::path> leftover_temporaries(const fs::path& out) {
  std::vector<std::string> names;
  for (const fs::path& file : output_files(out)) names.push_back(file.filename().string());
  std::vector<fs::path> found;
  for (const auto& entry : fs::directory_iterator(out)) {
    const auto target = temporary_file_target(entry.path().filename().string());
    if (entry.is_regular_file() && target &&
        std::find(names.begin(), names.end(), *target) != names.end())
      found.push_back(entry.path());
  }
  return found;
}

// The output directory, created, with an earlier prepare's files removed (durably) before
// anything is written: its description first, the BPE copies it made (never a vocabulary the
// user keeps there, e.g. train-bpe's) and dataset.json, which is written last
// (write_metadata); then its shards, loss masks and leftover temporaries. So a prepare cut
// short never leaves a new shard beside an old one (at most a train.tok without its val.tok,
// which the trainer refuses), nor shards that describe themselves as the old vocabulary's.
fs::path begin_output(const PrepareOptions& options, const std::optional<std::string>& bpe_dir) {
  const fs::path out(options.output_dir);
  std::error_code ec;
  fs::create_directories(out, ec);
  if (ec) input_error(options.output_dir, ": cannot create output directory: ", ec.message());
  if (bpe_dir && fs::equivalent(*bpe_dir, out, ec))
    input_error("prepare: --tokenizer bpe:", *bpe_dir,
                " is the output directory; keep the vocabulary elsewhere (prepare copies it "
                "there, and a later prepare replaces the copy)");
  check_corpus_outside(options.corpus, output_files(out), "prepare");  // it would write over it
  // Shards written into a run, a checkpoint or an export would be mistaken for its files (an
  // export over it is refused, a run's data.path there reads them).
  for (const char* file : {"config.toml", "checkpoints", "manifest.json", "model.safetensors"})
    if (fs::exists(out / file, ec))
      input_error("prepare: --out ", options.output_dir, " holds ", file,
                  ": it is a run's, a checkpoint's or an export's directory, not a data set's; "
                  "prepare into a directory of its own");
  const fs::path metadata = out / "dataset.json";
  bool bpe_copies = false;
  try {
    bpe_copies = fs::exists(metadata) && tokenizer_name(out.string()) == "bpe";
  } catch (const InputError&) {  // an unreadable description describes nothing to keep
  }
  // A vocabulary no prepare copied there (e.g. train-bpe's) is not taken over by the copy,
  // which a later prepare would remove.
  for (const char* file : kBpeFiles)
    if (bpe_dir && !bpe_copies && fs::exists(out / file))
      input_error("prepare: ", (out / file).string(),
                  " is a vocabulary that no dataset.json there names as prepare's copy "
                  "(train-bpe's, or a prepare cut short); prepare with --tokenizer bpe:DIR into "
                  "another --out, or move it first");
  std::vector<fs::path> earlier;
  if (bpe_copies)
    for (const char* file : kBpeFiles) earlier.push_back(out / file);
  earlier.push_back(metadata);
  // val.tok before train.tok, which is written first: a val.tok only ever stands beside the
  // train.tok of its own prepare.
  const std::vector<fs::path> shards = shard_files(out);
  earlier.insert(earlier.end(), shards.rbegin(), shards.rend());
  for (const fs::path& file : leftover_temporaries(out)) earlier.push_back(file);
  for (const fs::path& file : earlier)
    if (fs::remove(file, ec); ec)
      input_error(file.string(), ": cannot remove the earlier prepare's file: ", ec.message());
  fsync_path(out.string());
  return out;
}

// Copies the BPE files from `bpe_dir` into the output directory (after the shards).
void install_tokenizer_files(const std::optional<std::string>& bpe_dir, const fs::path& out) {
  if (!bpe_dir) return;
  for (const char* file : kBpeFiles)
    write_file_atomically((out / file).string(), read_file((fs::path(*bpe_dir) / file).string()));
}

// Which of n items (documents, or SFT samples) go to validation: a Fisher-Yates shuffle of
// the indices, whose first n_val are chosen.
std::vector<bool> validation_items(size_t n, const PrepareOptions& options, const char* kind) {
  if (!(options.val_fraction >= 0.0 && options.val_fraction < 1.0))
    input_error("--val-fraction must be in [0, 1), got ", options.val_fraction);
  if (n < 2)
    input_error("corpus \"", options.corpus, "\" has ", n, " ", kind, n == 1 ? "" : "s",
                "; a training and a validation split need at least 2");
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t(0));
  Rng rng(options.seed);
  for (size_t i = n - 1; i > 0; --i) std::swap(order[i], order[rng.below(i + 1)]);
  const size_t n_val =
      std::clamp<size_t>(size_t(std::llround(options.val_fraction * double(n))), 1, n - 1);
  std::vector<bool> val(n, false);
  for (size_t i = 0; i < n_val; ++i) val[order[i]] = true;
  return val;
}

// dataset.json beside the shards, into result.metadata_path. Its strings are json_quote'd: a
// path that is not UTF-8 gets U+FFFD instead of failing after the shards are written.
void write_metadata(const PrepareOptions& options, const std::string& tokenizer, int64_t vocab_size,
                    PrepareResult& result) {
  result.metadata_path = (fs::path(options.output_dir) / "dataset.json").string();
  const std::string json = detail::concat(
      "{\n  \"corpus\": ", json_quote(options.corpus), ",\n  \"format\": \"",
      result.sft ? "sft" : "text", "\",\n  \"tokenizer\": ", json_quote(tokenizer), ",\n",
      tokenizer == "bpe" ? detail::concat("  \"", kBpeChecksumsKey,
                                          "\": ", bpe_checksums_json(options.output_dir), ",\n")
                         : "",
      "  \"vocab_size\": ", vocab_size, ",\n  \"seed\": ", options.seed,
      ",\n  \"val_fraction\": ", options.val_fraction,
      ",\n  \"train\": ", split_json(result.train, result.sft),
      ",\n  \"val\": ", split_json(result.val, result.sft), "\n}\n");
  write_file_atomically(result.metadata_path, json);
}

// Both sets keep the corpus order.
template <class Item>
PrepareResult prepare_items(const std::vector<Item>& items, const PrepareOptions& options) {
  constexpr bool sft = std::is_same_v<Item, SftSample>;
  const std::vector<bool> is_val =
      validation_items(items.size(), options, sft ? "sample" : "document");
  for (size_t d = 0; d < items.size(); ++d) {
    if constexpr (sft)
      TESSEL_CHECK(!items[d].text.empty() && items[d].text.size() == items[d].trained.size(),
                   "corpus \"", options.corpus, "\" sample ", d, " is empty or mis-sized");
    else
      TESSEL_CHECK(!items[d].empty(), "corpus \"", options.corpus, "\" document ", d, " is empty");
  }
  const std::optional<std::string> bpe_dir = bpe_directory(options);
  std::unique_ptr<Tokenizer> tokenizer;
  if (bpe_dir)
    tokenizer = BpeTokenizer::from_directory(*bpe_dir);
  else
    tokenizer = std::make_unique<ByteTokenizer>();
  std::vector<size_t> train, val;
  for (size_t d = 0; d < items.size(); ++d) (is_val[d] ? val : train).push_back(d);
  const fs::path out = begin_output(options, bpe_dir);
  PrepareResult result;
  result.sft = sft;
  result.train = write_split(items, train, (out / "train.tok").string(), *tokenizer);
  result.val = write_split(items, val, (out / "val.tok").string(), *tokenizer);
  install_tokenizer_files(bpe_dir, out);
  write_metadata(options, tokenizer->name(), tokenizer->vocab_size(), result);
  return result;
}

// A "tokens:PATH" corpus, in two passes over the file: one counts its documents (and checks
// every id), the other writes each to its split.
PrepareResult prepare_token_file(const PrepareOptions& options) {
  if (!options.vocab || !options.eot)
    input_error(
        "prepare: a tokens:PATH corpus needs --vocab (the ids' vocabulary size) and --eot "
        "(the end-of-document id)");
  const std::string dtype = options.token_dtype.value_or("u16");
  if (options.tokenizer == "byte")
    input_error(
        "prepare: a tokens:PATH corpus takes --tokenizer bpe:DIR (the vocabulary of its "
        "ids) or none, not byte");
  const std::optional<std::string> bpe_dir = bpe_directory(options);
  if (bpe_dir) {
    const int64_t size = BpeTokenizer::from_directory(*bpe_dir)->vocab_size();
    if (size > *options.vocab)
      input_error("prepare: the BPE vocabulary in ", *bpe_dir, " has ", size,
                  " ids, more than --vocab ", *options.vocab);
  }
  const TokenFile file(options.corpus.substr(kTokenFilePrefix.size()),
                       parse_raw_token_dtype(dtype, "--token-dtype"), *options.vocab, *options.eot);
  const int64_t n = file.count_documents();
  if (n < 2)
    input_error("corpus \"", options.corpus, "\" has ", n, " document", n == 1 ? "" : "s",
                " (no --eot id ", *options.eot, " before its last token); a training and a ",
                "validation split need at least 2: are --eot and --token-dtype (", dtype,
                ") right?");
  const std::vector<bool> is_val = validation_items(size_t(n), options, "document");
  const fs::path out = begin_output(options, bpe_dir);
  const TokenDtype shard_dtype = token_dtype_for_vocab(*options.vocab);
  const std::string train_path = (out / "train.tok").string(),
                    val_path = (out / "val.tok").string();
  ShardWriter train(train_path, shard_dtype, *options.vocab),
      val(val_path, shard_dtype, *options.vocab);
  size_t d = 0;
  file.for_each_document([&](std::span<const int32_t> doc) {
    if (d == is_val.size()) input_error(file.path(), ": changed while it was read");
    (is_val[d++] ? val : train).add_document(doc);
  });
  if (d != is_val.size()) input_error(file.path(), ": changed while it was read");
  train.finish();
  val.finish();
  install_tokenizer_files(bpe_dir, out);
  PrepareResult result;
  result.train = {train.num_documents(), train.num_tokens(), 0, train_path};
  result.val = {val.num_documents(), val.num_tokens(), 0, val_path};
  write_metadata(
      options, bpe_dir ? "bpe" : detail::concat(kPretokenized, " ", dtype, ", eot ", *options.eot),
      *options.vocab, result);
  return result;
}

}  // namespace

std::vector<std::string> training_documents(const PrepareOptions& options) {
  check_names_a_file(options.corpus);
  if (options.corpus.starts_with(kTokenFilePrefix) || is_sft_corpus(options.corpus))
    input_error("corpus \"", options.corpus,
                "\": a vocabulary is learned from text (bible, fortunes, file:PATH or jsonl:PATH)");
  std::vector<std::string> documents = load_corpus(options.corpus);
  const std::vector<bool> is_val = validation_items(documents.size(), options, "document");
  std::vector<std::string> train;
  for (size_t d = 0; d < documents.size(); ++d)
    if (!is_val[d]) train.push_back(std::move(documents[d]));
  return train;
}

PrepareResult prepare_documents(const std::vector<std::string>& documents,
                                const PrepareOptions& options) {
  return prepare_items(documents, options);
}

PrepareResult prepare_samples(const std::vector<SftSample>& samples,
                              const PrepareOptions& options) {
  return prepare_items(samples, options);
}

void check_corpus_outside(const std::string& corpus, const std::vector<fs::path>& outputs,
                          const std::string& command) {
  std::error_code ec;
  for (std::string_view prefix : kCorpusPrefixes)
    if (corpus.starts_with(prefix))
      for (const fs::path& file : outputs)
        if (fs::equivalent(corpus.substr(prefix.size()), file, ec))
          input_error(command, ": corpus \"", corpus, "\" is ", file.string(), ", a file ", command,
                      " writes or removes in --out; ", command, " into another directory");
}

std::string corpus_directory_name(const std::string& corpus) {
  const size_t colon = corpus.find(':');
  if (colon == std::string::npos) return corpus;  // an unknown name is refused when loaded
  check_names_a_file(corpus);
  const std::string stem = fs::path(corpus.substr(colon + 1)).stem().string();
  if (stem.empty() || stem == "." || stem == "..")
    input_error("corpus \"", corpus, "\": its path names no output directory; pass --out");
  return stem;
}

void check_described_shard(const ShardReader& shard) {
  const fs::path path(shard.path()), metadata = path.parent_path() / "dataset.json";
  if (!fs::exists(metadata)) return;
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(read_file(metadata.string()));
  } catch (const nlohmann::json::exception& e) {
    input_error(metadata.string(), ": not valid JSON (", e.what(), "); prepare the data set again");
  }
  auto mismatch = [&](const std::string& recorded, const std::string& found) {
    input_error(metadata.string(), " does not describe ", shard.path(), ": it records ", recorded,
                " but the shard ", found,
                "; the description belongs to other shards (edited, or left by another "
                "prepare): prepare the data set again");
  };
  const std::string vocab = detail::concat("has a vocabulary of ", shard.vocab_size(), " ids");
  if (json.contains("vocab_size") && json["vocab_size"] != shard.vocab_size())
    mismatch("\"vocab_size\": " + json["vocab_size"].dump(), vocab);
  if (json.contains("tokenizer") && json["tokenizer"] == "byte" &&
      shard.vocab_size() != ByteTokenizer::kVocabSize)
    mismatch(detail::concat("\"tokenizer\": \"byte\" (", ByteTokenizer::kVocabSize, " ids)"),
             vocab);
  // The split's counts (split_json), under its shard's stem: "train", "val".
  const std::string split = path.stem().string();
  if (!json.contains(split) || !json[split].is_object()) return;
  const std::pair<const char*, int64_t> counts[] = {{"tokens", shard.num_tokens()},
                                                    {"documents", shard.num_documents()}};
  for (const auto& [key, count] : counts)
    if (json[split].contains(key) && json[split][key] != count)
      mismatch(detail::concat("\"", split, "\": {\"", key, "\": ", json[split][key].dump(), "}"),
               detail::concat("holds ", count, " ", key));
}

PrepareResult prepare_dataset(const PrepareOptions& options) {
  check_names_a_file(options.corpus);
  const bool tokens = options.corpus.starts_with(kTokenFilePrefix);
  if (!tokens && (options.vocab || options.eot || options.token_dtype))
    input_error("prepare: --vocab, --eot and --token-dtype describe a tokens:PATH corpus, not \"",
                options.corpus, "\"");
  if (tokens) return prepare_token_file(options);
  if (is_sft_corpus(options.corpus))
    return prepare_samples(load_sft_corpus(options.corpus), options);
  return prepare_documents(load_corpus(options.corpus), options);
}

}  // namespace tessel::data
