#include "tessel/data/prepare.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <numeric>

#include "tessel/core/error.hpp"
#include "tessel/core/file_io.hpp"
#include "tessel/core/rng.hpp"
#include "tessel/data/byte_tokenizer.hpp"
#include "tessel/data/corpus.hpp"
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

std::string split_json(const SplitCounts& split) {
  return detail::concat("{\"documents\": ", split.documents, ", \"tokens\": ", split.tokens,
                        ", \"path\": ", json_string(fs::path(split.path).filename().string()), "}");
}

SplitCounts write_split(const std::vector<std::string>& documents, const std::vector<size_t>& which,
                        const std::string& path) {
  const ByteTokenizer tokenizer;
  ShardWriter writer(path, token_dtype_for_vocab(tokenizer.vocab_size()), tokenizer.vocab_size());
  for (size_t d : which) writer.add_document(tokenizer.encode(documents[d]));
  writer.finish();
  return {writer.num_documents(), writer.num_tokens(), path};
}

}  // namespace

PrepareResult prepare_documents(const std::vector<std::string>& documents,
                                const PrepareOptions& options) {
  if (!(options.val_fraction >= 0.0 && options.val_fraction < 1.0))
    input_error("prepare: val_fraction must be in [0, 1), got ", options.val_fraction);
  const size_t n = documents.size();
  if (n < 2)
    input_error("corpus \"", options.corpus, "\" has ", n,
                " documents; a training and a validation split need at least 2");
  for (size_t d = 0; d < n; ++d)
    TESSEL_CHECK(!documents[d].empty(), "corpus \"", options.corpus, "\" document ", d,
                 " is empty");

  // Fisher-Yates over document indices; the first n_val go to validation.
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
  result.train = write_split(documents, train, (dir / "train.tok").string());
  result.val = write_split(documents, val, (dir / "val.tok").string());
  result.metadata_path = (dir / "dataset.json").string();
  const std::string json = detail::concat(
      "{\n  \"corpus\": ", json_string(options.corpus), ",\n  \"tokenizer\": \"byte\",\n",
      "  \"vocab_size\": ", ByteTokenizer::kVocabSize, ",\n  \"seed\": ", options.seed,
      ",\n  \"val_fraction\": ", options.val_fraction, ",\n  \"train\": ", split_json(result.train),
      ",\n  \"val\": ", split_json(result.val), "\n}\n");
  write_file_atomically(result.metadata_path, json);
  return result;
}

PrepareResult prepare_dataset(const PrepareOptions& options) {
  return prepare_documents(load_corpus(options.corpus), options);
}

}  // namespace tessel::data
