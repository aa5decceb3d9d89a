#pragma once
// What turns text into a model's token ids and back: the byte tokenizer (byte_tokenizer.hpp)
// or a byte-level BPE vocabulary (bpe_tokenizer.hpp). A prepared data directory names its own
// in dataset.json (prepare.hpp); load_tokenizer reads it from there, so sampling, `tessel
// generate` and prompts use the tokenizer the training data was made with.
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace tessel::data {

// The start of dataset.json's tokenizer for a tokens:PATH corpus's ids without one:
// "pretokenized <dtype>, eot <id>" (prepare.hpp).
inline constexpr std::string_view kPretokenized = "pretokenized";

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual int32_t vocab_size() const = 0;  // one past the largest id
  // Not thread-safe (BPE caches pieces); every user encodes on one thread.
  virtual std::vector<int32_t> encode(std::string_view text) const = 0;
  // InputError for an id outside [0, vocab_size()), naming its position; an id inside it
  // that names no token (a gap in a BPE vocabulary) decodes to U+FFFD.
  virtual std::string decode(std::span<const int32_t> ids) const = 0;
  virtual std::string name() const = 0;  // as dataset.json records it: "byte", "bpe"
  // encode() of a setting's text, its errors (text that is not UTF-8) naming `what`.
  std::vector<int32_t> encode_text(std::string_view text, const std::string& what) const;
  // The id of a text that is exactly one token (a stop token), -1 for an empty one;
  // InputError naming `what` otherwise. Generation stops on that id only: a BPE token that
  // merely contains the text (e.g. "\n\n" for "\n") does not stop it.
  int32_t single_token(std::string_view text, const std::string& what) const;
};

// The files that describe a directory's tokenizer, the first that exists deciding:
// dataset.json (a prepared data directory) and tokenizer.json (a run's or an export's copy).
inline constexpr const char* kTokenizerMetadataFiles[2] = {"dataset.json", "tokenizer.json"};

// The key of dataset.json and of a run's tokenizer.json under which prepare and save_tokenizer
// record the CRC-32 of each BPE file they placed there ({"vocab.json": crc, "merges.txt": crc}),
// so that a vocabulary replaced afterwards (e.g. by train-bpe) is refused instead of decoding
// the ids as another vocabulary's tokens.
inline constexpr std::string_view kBpeChecksumsKey = "bpe_crc32";

// The CRC-32 of each BPE file in `dir`, as the JSON object kBpeChecksumsKey records.
std::string bpe_checksums_json(const std::string& dir);

// The tokenizer a directory holds, by the first of: dataset.json's "tokenizer" (a prepared
// data directory: "byte", "bpe", or "pretokenized <dtype>, eot <id>" for ids without one),
// tokenizer.json's (a run's copy, save_tokenizer), or "bpe" for vocab.json beside merges.txt
// (a vocabulary directory: train-bpe's output, GPT-2's files). nullopt when there is none.
// InputError for a metadata file without a "tokenizer" string.
std::optional<std::string> tokenizer_name(const std::string& dir);

// The tokenizer in `dir` (tokenizer_name): bytes, or the BPE vocabulary beside it. Without
// one, bytes when `model_vocab` is 256 (shards written another way), else nullptr; nullptr
// too for pretokenized ids. InputError for a bad vocabulary, one larger than model_vocab, or
// BPE files whose checksums differ from those the metadata recorded (kBpeChecksumsKey).
std::unique_ptr<Tokenizer> load_tokenizer(const std::string& dir, int64_t model_vocab);

// Replaces `to_dir` by a copy of the tokenizer of data directory `data_dir` (tokenizer.json
// and, for BPE, the vocabulary files, checked against and recorded with their checksums;
// built beside it and renamed into place), so that a run
// keeps what its ids mean when the data changes or moves. Pretokenized ids are recorded by
// name (no older copy then speaks for them); nothing is done for a directory without one.
void save_tokenizer(const std::string& data_dir, const std::string& to_dir);
// Whether `name` is the name of a file save_tokenizer writes into its copy.
bool is_saved_tokenizer_file(std::string_view name);

// InputError naming two of `dirs` (data, run or vocabulary directories, e.g. a mixture's)
// whose token ids come from different tokenizers: other names, or BPE vocabularies whose
// files differ. Directories without a tokenizer, or with pretokenized ids (of an unknown
// one), are not compared. The message ends with `advice`, what the caller's user can do.
void check_same_tokenizer(const std::vector<std::string>& dirs,
                          const std::string& advice = "prepare them with the same one");

}  // namespace tessel::data
