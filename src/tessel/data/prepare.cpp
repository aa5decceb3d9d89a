#include "tessel/data/prepare.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <numeric>
#include <optional>
#include <type_traits>

#include "tessel/core/error.hpp"
#include "tessel/core/file_io.hpp"
#include "tessel/core/rng.hpp"
#include "tessel/data/byte_tokenizer.hpp"
#include "tessel/data/corpus.hpp"
#include "tessel/data/packing.hpp"
#include "tessel/data/shard.hpp"

namespace tessel::data {

namespace fs = std::filesystem;

namespace {

std::string json_string(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\r':
        out += "\\r";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out.push_back(char(c));
        }
    }
  }
  return out + "\"";
}

std::string split_json(const SplitCounts& split, bool sft) {
  return detail::concat("{\"documents\": ", split.documents, ", \"tokens\": ", split.tokens,
                        sft ? detail::concat(", \"trained_tokens\": ", split.trained_tokens) : "",
                        ", \"path\": ", json_string(fs::path(split.path).filename().string()), "}");
}

// Writes one split: the token shard of the chosen items and, for SFT samples, its loss-mask
// shard (packing.hpp); a text split removes a loss-mask shard left by an earlier SFT prepare.
template <class Item>
SplitCounts write_split(const std::vector<Item>& items, const std::vector<size_t>& which,
                        const std::string& path) {
  const ByteTokenizer tokenizer;
  constexpr bool sft = std::is_same_v<Item, SftSample>;
  ShardWriter writer(path, token_dtype_for_vocab(tokenizer.vocab_size()), tokenizer.vocab_size());
  std::optional<ShardWriter> mask;
  if constexpr (sft) mask.emplace(loss_mask_path(path), TokenDtype::u8, 2);
  SplitCounts counts;
  for (size_t i : which) {
    if constexpr (sft) {
      writer.add_document(tokenizer.encode(items[i].text));
      const std::vector<int32_t> marks(items[i].trained.begin(), items[i].trained.end());
      mask->add_document(marks);
      counts.trained_tokens += std::count(marks.begin(), marks.end(), 1);
    } else {
      writer.add_document(tokenizer.encode(items[i]));
    }
  }
  // The mask first, or an old one removed first: a new token shard never stands beside a
  // missing or older mask.
  if (mask) {
    mask->finish();
  } else {
    std::error_code ec;
    fs::remove(loss_mask_path(path), ec);
  }
  writer.finish();
  counts.documents = writer.num_documents();
  counts.tokens = writer.num_tokens();
  counts.path = path;
  return counts;
}

// Fisher-Yates over item indices; the first n_val go to validation, both sets keep the
// corpus order. Items are documents, or samples of an SFT corpus.
template <class Item>
PrepareResult prepare_items(const std::vector<Item>& items, const PrepareOptions& options) {
  if (!(options.val_fraction >= 0.0 && options.val_fraction < 1.0))
    input_error("prepare: val_fraction must be in [0, 1), got ", options.val_fraction);
  constexpr bool sft = std::is_same_v<Item, SftSample>;
  const char* kind = sft ? "samples" : "documents";
  const size_t n = items.size();
  if (n < 2)
    input_error("corpus \"", options.corpus, "\" has ", n, " ", kind,
                "; a training and a validation split need at least 2");
  for (size_t d = 0; d < n; ++d) {
    if constexpr (sft)
      TESSEL_CHECK(!items[d].text.empty() && items[d].text.size() == items[d].trained.size(),
                   "corpus \"", options.corpus, "\" sample ", d, " is empty or mis-sized");
    else
      TESSEL_CHECK(!items[d].empty(), "corpus \"", options.corpus, "\" document ", d, " is empty");
  }

  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t(0));
  Rng rng(options.seed);
  for (size_t i = n - 1; i > 0; --i) std::swap(order[i], order[rng.below(i + 1)]);
  const size_t n_val =
      std::clamp<size_t>(size_t(std::llround(options.val_fraction * double(n))), 1, n - 1);
  std::vector<size_t> val(order.begin(), order.begin() + n_val);
  std::vector<size_t> train(order.begin() + n_val, order.end());
  std::sort(val.begin(), val.end());
  std::sort(train.begin(), train.end());

  const fs::path dir(options.output_dir);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) input_error(options.output_dir, ": cannot create output directory: ", ec.message());

  PrepareResult result;
  result.sft = sft;
  result.train = write_split(items, train, (dir / "train.tok").string());
  result.val = write_split(items, val, (dir / "val.tok").string());
  result.metadata_path = (dir / "dataset.json").string();
  const std::string json = detail::concat(
      "{\n  \"corpus\": ", json_string(options.corpus), ",\n  \"format\": \"", sft ? "sft" : "text",
      "\",\n  \"tokenizer\": \"byte\",\n", "  \"vocab_size\": ", ByteTokenizer::kVocabSize,
      ",\n  \"seed\": ", options.seed, ",\n  \"val_fraction\": ", options.val_fraction,
      ",\n  \"train\": ", split_json(result.train, sft),
      ",\n  \"val\": ", split_json(result.val, sft), "\n}\n");
  write_file_atomically(result.metadata_path, json);
  return result;
}

}  // namespace

PrepareResult prepare_documents(const std::vector<std::string>& documents,
                                const PrepareOptions& options) {
  return prepare_items(documents, options);
}

PrepareResult prepare_samples(const std::vector<SftSample>& samples,
                              const PrepareOptions& options) {
  return prepare_items(samples, options);
}

PrepareResult prepare_dataset(const PrepareOptions& options) {
  if (is_sft_corpus(options.corpus))
    return prepare_samples(load_sft_corpus(options.corpus), options);
  return prepare_documents(load_corpus(options.corpus), options);
}

}  // namespace tessel::data
