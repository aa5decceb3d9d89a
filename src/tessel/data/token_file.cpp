#include "tessel/data/token_file.hpp"

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <vector>

#include "tessel/core/error.hpp"

namespace tessel::data {

namespace {

size_t dtype_bytes(RawTokenDtype dtype) {
  return dtype == RawTokenDtype::u16 ? 2 : 4;
}

// Token i of `bytes` (little-endian, as the machine: tessel runs on little-endian hosts only).
int64_t token_at(const unsigned char* bytes, size_t i, RawTokenDtype dtype) {
  switch (dtype) {
    case RawTokenDtype::u16: {
      uint16_t v;
      std::memcpy(&v, bytes + 2 * i, 2);
      return v;
    }
    case RawTokenDtype::u32: {
      uint32_t v;
      std::memcpy(&v, bytes + 4 * i, 4);
      return v;
    }
    case RawTokenDtype::i32: {
      int32_t v;
      std::memcpy(&v, bytes + 4 * i, 4);
      return v;
    }
  }
  return -1;
}

}  // namespace

RawTokenDtype parse_raw_token_dtype(const std::string& name, const std::string& what) {
  if (name == "u16") return RawTokenDtype::u16;
  if (name == "u32") return RawTokenDtype::u32;
  if (name == "i32") return RawTokenDtype::i32;
  input_error(what, " = \"", name, "\" (expected u16, u32 or i32)");
}

const char* raw_token_dtype_name(RawTokenDtype dtype) {
  switch (dtype) {
    case RawTokenDtype::u16:
      return "u16";
    case RawTokenDtype::u32:
      return "u32";
    case RawTokenDtype::i32:
      return "i32";
  }
  return "?";
}

TokenFile::TokenFile(std::string path, RawTokenDtype dtype, int64_t vocab, int64_t eot,
                     int64_t chunk_tokens)
    : path_(std::move(path)), dtype_(dtype), vocab_(vocab), eot_(eot), chunk_tokens_(chunk_tokens) {
  TESSEL_CHECK(chunk_tokens >= 1, "token file chunks of ", chunk_tokens, " ids");
  if (vocab < 1 || vocab > INT32_MAX)
    input_error(path_, ": token file needs a vocabulary size in [1, 2^31), got ", vocab);
  if (eot < 0 || eot >= vocab)
    input_error(path_, ": the end-of-document id ", eot, " is outside the vocabulary [0, ", vocab,
                ")");
  std::error_code ec;
  const auto status = std::filesystem::status(path_, ec);
  if (!std::filesystem::exists(status)) input_error(path_, ": no such token file");
  if (!std::filesystem::is_regular_file(status)) input_error(path_, ": not a regular file");
  const uintmax_t bytes = std::filesystem::file_size(path_, ec);
  if (ec) input_error(path_, ": cannot read its size: ", ec.message());
  if (bytes == 0) input_error(path_, ": token file is empty");
  if (bytes % dtype_bytes(dtype) != 0)
    input_error(path_, ": ", bytes, " bytes is not a whole number of ", raw_token_dtype_name(dtype),
                " tokens (", dtype_bytes(dtype), " bytes each); is the dtype right?");
  num_tokens_ = int64_t(bytes / dtype_bytes(dtype));
}

void TokenFile::for_each_id(const std::function<void(int32_t)>& f) const {
  const std::unique_ptr<std::FILE, int (*)(std::FILE*)> file(std::fopen(path_.c_str(), "rb"),
                                                             &std::fclose);
  if (!file) input_error(path_, ": cannot open: ", std::strerror(errno));
  const size_t width = dtype_bytes(dtype_);
  std::vector<unsigned char> chunk(size_t(chunk_tokens_) * width);
  int64_t index = 0;  // of the chunk's first id in the file
  for (size_t n; (n = std::fread(chunk.data(), width, size_t(chunk_tokens_), file.get())) > 0;
       index += int64_t(n))
    for (size_t i = 0; i < n; ++i) {
      const int64_t id = token_at(chunk.data(), i, dtype_);
      if (id < 0 || id >= vocab_)
        input_error(path_, ": token ", id, " at index ", index + int64_t(i),
                    " is outside the vocabulary [0, ", vocab_, ")");
      f(int32_t(id));
    }
  if (std::ferror(file.get())) input_error(path_, ": read failed: ", std::strerror(errno));
  if (index != num_tokens_)
    input_error(path_, ": read ", index, " tokens of ", num_tokens_, " (the file changed?)");
}

int64_t TokenFile::count_documents() const {
  int64_t documents = 0;
  bool open = false;  // a document has begun and not ended
  for_each_id([&](int32_t id) {
    open = id != eot_;
    if (!open) ++documents;
  });
  return documents + (open ? 1 : 0);
}

void TokenFile::for_each_document(const std::function<void(std::span<const int32_t>)>& f) const {
  std::vector<int32_t> document;
  for_each_id([&](int32_t id) {
    document.push_back(id);
    if (id == eot_) {
      f(document);
      document.clear();
    }
  });
  if (!document.empty()) f(document);
}

}  // namespace tessel::data
