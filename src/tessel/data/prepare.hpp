#pragma once
// `tessel prepare`: turns a corpus into the token shards the trainer reads.
//
// The corpus (see corpus.hpp) is tokenized with the byte tokenizer (or a byte-level BPE
// vocabulary, `tokenizer = "bpe:DIR"`: below) and split by whole documents into a training and a
// validation set. The validation documents are chosen by a Fisher-Yates shuffle of the document
// indices with tessel::Rng(seed), taking the first n_val = round(val_fraction * documents), clamped
// to [1, documents - 1]; both sets keep the corpus order. Written into the output directory
// (created if missing):
//   train.tok, val.tok   token shards (shard.hpp), dtype u8, vocab 256
//   dataset.json         {"corpus", "tokenizer": "byte", "vocab_size": 256, "seed",
//                         "val_fraction", "train": {"documents", "tokens", "path"},
//                         "val": {...}}; written last (the old one removed first), so that it
//                         never describes half-written shards
// An SFT corpus (sft_corpus.hpp) is split the same way by samples, and each split also gets
// its loss-mask shard (train.loss_mask.tok, val.loss_mask.tok: packing.hpp); dataset.json then
// says "format": "sft" (else "text") and counts each split's "trained_tokens". Preparing a
// text corpus removes loss-mask shards an earlier SFT prepare left in the directory.
// A "tokens:PATH" corpus is a file of token ids from another tokenizer (token_file.hpp): its
// documents (ending at the eot id) are split the same way, streamed into shards of the
// narrowest dtype for the given vocabulary; dataset.json's tokenizer then reads
// "pretokenized <dtype>, eot <id>" and vocab_size is the given one.
// With tokenizer "bpe:DIR" (DIR holding GPT-2-style vocab.json and merges.txt,
// bpe_tokenizer.hpp) a text corpus is encoded with that vocabulary into shards of the
// narrowest dtype for it, a tokens:PATH corpus is taken as that vocabulary's ids (its size
// must not exceed --vocab), and both files are copied beside the shards with dataset.json's
// tokenizer "bpe", so that sampling and generation read them (tokenizer.hpp). Any other
// prepare removes such copies. An SFT sample is encoded run by run of equally trained bytes,
// so that each token is wholly context or wholly reply.
// Every file is written to a temporary name and renamed into place, after the earlier prepare's
// shards, loss masks, description and leftover temporaries are removed from the directory: a
// prepare cut short never leaves a new shard beside an old one.
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "tessel/data/sft_corpus.hpp"
#include "tessel/data/shard.hpp"

namespace tessel::data {

struct PrepareOptions {
  // "bible", "fortunes", "file:PATH", "tokens:PATH", "bible-quotes" or "chat:PATH"
  std::string corpus;
  std::string output_dir;  // e.g. "data/bible"
  double val_fraction = 0.01;
  uint64_t seed = 0;
  // A tokens:PATH corpus (token_file.hpp): the file's id dtype, the vocabulary size (required)
  // and the end-of-document id (required). InputError when set for another corpus.
  std::optional<std::string> token_dtype;  // unset: u16
  std::optional<int64_t> vocab;
  std::optional<int64_t> eot;
  // "byte" or "bpe:DIR"; unset: byte, or none for a tokens:PATH corpus.
  std::optional<std::string> tokenizer;
};

struct SplitCounts {
  int64_t documents = 0;  // documents, or samples of an SFT corpus
  int64_t tokens = 0;
  int64_t trained_tokens = 0;  // SFT: tokens the loss counts
  std::string path;            // the shard written
};

struct PrepareResult {
  bool sft = false;  // an SFT corpus: the splits have loss-mask shards
  SplitCounts train, val;
  std::string metadata_path;  // <output_dir>/dataset.json
};

// Loads, splits, tokenizes and writes the corpus. InputError on a bad corpus name, a
// val_fraction outside [0, 1), a corpus of fewer than 2 documents (samples), or an unwritable
// directory.
PrepareResult prepare_dataset(const PrepareOptions& options);

// InputError when `shard`, a prepared data directory's train.tok or val.tok, is not the shard
// the dataset.json beside it describes: its "vocab_size" is not the shard's vocabulary (nor
// 256 under the "byte" tokenizer), or the split's recorded "tokens" or "documents" are not
// the shard's (a description edited, or left by another prepare). The message says to prepare
// the data set again. A directory without dataset.json, or a record it lacks, is not checked.
void check_described_shard(const ShardReader& shard);

// The name prepare and train-bpe give a corpus's output directory when --out is not given
// (data/<name>, data/bpe-<name>), so that another corpus never replaces data/bible: a built-in
// corpus's own name, or the stem of a PREFIX:PATH corpus's file ("file:notes.txt" -> "notes").
// InputError when the path has no usable stem.
std::string corpus_directory_name(const std::string& corpus);

// InputError when the file a PREFIX:PATH corpus names is one of `outputs`, the files `command`
// (prepare, train-bpe) writes or removes in its output directory: the corpus would be lost.
void check_corpus_outside(const std::string& corpus,
                          const std::vector<std::filesystem::path>& outputs,
                          const std::string& command);

// The documents of text corpus `options.corpus` that prepare would put in the training split
// (the same val_fraction and seed leave out the same documents): what train-bpe learns from,
// so that a vocabulary never sees the validation text. InputError as prepare_dataset.
std::vector<std::string> training_documents(const PrepareOptions& options);

// The split above for already loaded documents or SFT samples: the same files, with `corpus`
// recorded.
PrepareResult prepare_documents(const std::vector<std::string>& documents,
                                const PrepareOptions& options);
PrepareResult prepare_samples(const std::vector<SftSample>& samples, const PrepareOptions& options);

}  // namespace tessel::data
