#pragma once
// `tessel prepare`: turns a corpus into the token shards the trainer reads.
//
// The corpus (see corpus.hpp) is tokenized with the byte tokenizer and split by whole
// documents into a training and a validation set. The validation documents are chosen by a
// Fisher-Yates shuffle of the document indices with tessel::Rng(seed), taking the first
// n_val = round(val_fraction * documents), clamped to [1, documents - 1]; both sets keep the
// corpus order. Written into the output directory (created if missing):
//   train.tok, val.tok   token shards (shard.hpp), dtype u8, vocab 256
//   dataset.json         {"corpus", "tokenizer": "byte", "vocab_size": 256, "seed",
//                         "val_fraction", "train": {"documents", "tokens", "path"},
//                         "val": {...}}
// Every file is written to a temporary name and renamed into place.
#include <cstdint>
#include <string>
#include <vector>

namespace tessel::data {

struct PrepareOptions {
  std::string corpus;      // "bible", "fortunes" or "file:PATH"
  std::string output_dir;  // e.g. "data/bible"
  double val_fraction = 0.01;
  uint64_t seed = 0;
};

struct SplitCounts {
  int64_t documents = 0;
  int64_t tokens = 0;
  std::string path;  // the shard written
};

struct PrepareResult {
  SplitCounts train, val;
  std::string metadata_path;  // <output_dir>/dataset.json
};

// Loads, splits, tokenizes and writes the corpus. InputError on a bad corpus name, a
// val_fraction outside [0, 1), a corpus of fewer than 2 documents, or an unwritable directory.
PrepareResult prepare_dataset(const PrepareOptions& options);

// The split above for already loaded documents: the same files, with `corpus` recorded.
PrepareResult prepare_documents(const std::vector<std::string>& documents,
                                const PrepareOptions& options);

}  // namespace tessel::data
