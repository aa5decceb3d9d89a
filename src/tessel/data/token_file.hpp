#pragma once
// A raw file of token ids, as tokenizers outside tessel write them (nanoGPT's train.bin holds
// GPT-2 ids as u16): little-endian ids of one dtype back to back, no header. Documents end at
// each `eot` id, which stays their last token; tokens after the last eot form one more
// document. Read in fixed-size chunks, so a file larger than memory streams through.
#include <cstdint>
#include <functional>
#include <span>
#include <string>

namespace tessel::data {

enum class RawTokenDtype { u16, u32, i32 };

// "u16" | "u32" | "i32"; InputError naming `what` otherwise.
RawTokenDtype parse_raw_token_dtype(const std::string& name, const std::string& what);
const char* raw_token_dtype_name(RawTokenDtype dtype);

class TokenFile {
 public:
  // InputError for a missing or unreadable file, one that holds no token or whose size is not
  // a multiple of the dtype's, a vocab < 1, or an eot outside [0, vocab). The file is read
  // `chunk_tokens` ids at a time.
  TokenFile(std::string path, RawTokenDtype dtype, int64_t vocab, int64_t eot,
            int64_t chunk_tokens = int64_t(1) << 20);

  const std::string& path() const { return path_; }
  int64_t num_tokens() const { return num_tokens_; }

  // The documents of the file, counted without holding any (every id is checked as below).
  int64_t count_documents() const;
  // Calls f with every document, in file order (the span lives until f returns; a document is
  // held whole). InputError naming the file and index of the first id outside [0, vocab).
  void for_each_document(const std::function<void(std::span<const int32_t>)>& f) const;

 private:
  // Calls f(id) for every id in file order, after checking it against the vocabulary.
  void for_each_id(const std::function<void(int32_t)>& f) const;

  std::string path_;
  RawTokenDtype dtype_;
  int64_t vocab_, eot_, chunk_tokens_, num_tokens_ = 0;
};

}  // namespace tessel::data
