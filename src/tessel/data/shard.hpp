#pragma once
// Token shards: a tokenized corpus as one binary file that the loader maps into memory.
//
// ## Token shard format (version 1)
//
// A shard holds a stream of token ids and the offsets where each document begins. All
// integers are little-endian. The file has three parts:
//
// | offset | size | field                                                             |
// |-------:|-----:|-------------------------------------------------------------------|
// |      0 |    8 | magic, the ASCII bytes `TESSELTK`                                 |
// |      8 |    4 | u32 format version, 1                                             |
// |     12 |    4 | u32 token dtype code: 1 = u8, 2 = u16, 3 = i32                    |
// |     16 |    4 | u32 vocabulary size; every token id lies in [0, vocab size)       |
// |     20 |    4 | u32 header size in bytes, 64 (the offset of the first token)      |
// |     24 |    8 | u64 token count N                                                 |
// |     32 |    8 | u64 document count D                                              |
// |     40 |    8 | u64 index offset: 64 + N * dtype size, rounded up to a multiple of 8 |
// |     48 |    8 | u64 file size: index offset + 8 * D                               |
// |     56 |    8 | u64 header checksum: FNV-1a (64-bit) of bytes [0, 56)             |
//
// Then N tokens of the given dtype, zero padding up to the index offset, and the document
// boundary index: D u64 values, the token offset at which each document starts. The first is
// 0, they strictly increase (no empty documents) and each is below N. A shard with N = 0 has
// D = 0. Document d spans tokens [start[d], start[d + 1]), the last one ends at N.
//
// numpy reads a shard with `h = np.fromfile(p, "<u8", 8)`: tokens are
// `np.fromfile(p, dtype, count=h[3], offset=64)` and the index is
// `np.fromfile(p, "<u8", count=h[4], offset=h[5])`.
//
// ShardReader checks all of this when it opens a file (magic, version, checksum, dtype,
// sizes against the file length, the index, every token id against the vocabulary) and
// reports a failure as an InputError naming the file and what is wrong. ShardWriter writes to
// a temporary file beside the target and renames it into place only when finish() succeeds,
// so an interrupted write never leaves a partial shard under the final name.
#include <cstdint>
#include <cstdio>
#include <span>
#include <string>
#include <vector>

namespace tessel::data {

enum class TokenDtype : uint32_t { u8 = 1, u16 = 2, i32 = 3 };

size_t token_dtype_size(TokenDtype dtype);
const char* token_dtype_name(TokenDtype dtype);  // "u8", "u16", "i32"
// The narrowest dtype that holds every id below vocab_size.
TokenDtype token_dtype_for_vocab(int64_t vocab_size);

inline constexpr uint32_t kShardVersion = 1;
inline constexpr size_t kShardHeaderBytes = 64;

class ShardWriter {
 public:
  // Opens `<path>.tmp` for writing; vocab_size must fit the dtype.
  ShardWriter(std::string path, TokenDtype dtype, int64_t vocab_size);
  ~ShardWriter();  // removes the temporary file if finish() was not reached
  ShardWriter(const ShardWriter&) = delete;
  ShardWriter& operator=(const ShardWriter&) = delete;

  // Appends one document, tokens [n] with n >= 1 and ids in [0, vocab_size).
  void add_document(std::span<const int32_t> tokens);
  // Writes the index and header, flushes, and renames the file to its final path.
  void finish();

  int64_t num_tokens() const { return num_tokens_; }
  int64_t num_documents() const { return int64_t(doc_starts_.size()); }

 private:
  void write_bytes(const void* data, size_t n);

  std::string path_, tmp_path_;
  TokenDtype dtype_;
  int64_t vocab_size_;
  std::FILE* file_ = nullptr;
  int64_t num_tokens_ = 0;
  std::vector<uint64_t> doc_starts_;
  std::vector<unsigned char> buffer_;  // one document converted to the dtype
};

// A validated, read-only, memory-mapped shard. Movable, not copyable.
class ShardReader {
 public:
  // Maps and validates `path`; a missing file is an InputError that suggests `tessel prepare`.
  explicit ShardReader(std::string path);
  ~ShardReader();
  ShardReader(ShardReader&& other) noexcept;
  ShardReader& operator=(ShardReader&& other) noexcept;
  ShardReader(const ShardReader&) = delete;
  ShardReader& operator=(const ShardReader&) = delete;

  const std::string& path() const { return path_; }
  TokenDtype dtype() const { return dtype_; }
  int64_t vocab_size() const { return vocab_size_; }
  int64_t num_tokens() const { return num_tokens_; }
  int64_t num_documents() const { return num_documents_; }
  // Start offset of each document [num_documents], ascending, first = 0.
  std::span<const uint64_t> doc_starts() const { return {index_, size_t(num_documents_)}; }

  // Token i as int32, 0 <= i < num_tokens().
  int32_t token(int64_t i) const;
  // out [count] = tokens [begin, begin + count).
  void read(int64_t begin, int64_t count, int32_t* out) const;

 private:
  void validate(size_t file_bytes);

  std::string path_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
  TokenDtype dtype_ = TokenDtype::u8;
  int64_t vocab_size_ = 0, num_tokens_ = 0, num_documents_ = 0;
  const unsigned char* tokens_ = nullptr;
  const uint64_t* index_ = nullptr;
};

}  // namespace tessel::data
