#include "tessel/data/shard.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <utility>

#include "tessel/core/error.hpp"

static_assert(std::endian::native == std::endian::little,
              "the shard format is little-endian and is read in place");

namespace tessel::data {

namespace {

constexpr char kMagic[8] = {'T', 'E', 'S', 'S', 'E', 'L', 'T', 'K'};
constexpr size_t kChecksumOffset = 56;

// The fixed 64-byte header, laid out exactly as in the file.
struct Header {
  char magic[8];
  uint32_t version;
  uint32_t dtype;
  uint32_t vocab_size;
  uint32_t header_bytes;
  uint64_t num_tokens;
  uint64_t num_documents;
  uint64_t index_offset;
  uint64_t file_bytes;
  uint64_t checksum;
};
static_assert(sizeof(Header) == kShardHeaderBytes);
static_assert(offsetof(Header, checksum) == kChecksumOffset);

uint64_t fnv1a(const void* data, size_t n) {
  auto* p = static_cast<const unsigned char*>(data);
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 0x100000001b3ull;
  return h;
}

uint64_t index_offset_for(uint64_t num_tokens, size_t dtype_bytes) {
  uint64_t end = kShardHeaderBytes + num_tokens * dtype_bytes;
  return (end + 7) / 8 * 8;
}

bool valid_dtype_code(uint32_t code) {
  return code >= 1 && code <= 3;
}

int64_t dtype_capacity(TokenDtype dtype) {
  switch (dtype) {
    case TokenDtype::u8:
      return int64_t(1) << 8;
    case TokenDtype::u16:
      return int64_t(1) << 16;
    case TokenDtype::i32:
      return int64_t(1) << 31;
  }
  TESSEL_CHECK(false, "bad token dtype ", uint32_t(dtype));
}

}  // namespace

size_t token_dtype_size(TokenDtype dtype) {
  switch (dtype) {
    case TokenDtype::u8:
      return 1;
    case TokenDtype::u16:
      return 2;
    case TokenDtype::i32:
      return 4;
  }
  TESSEL_CHECK(false, "bad token dtype ", uint32_t(dtype));
}

const char* token_dtype_name(TokenDtype dtype) {
  switch (dtype) {
    case TokenDtype::u8:
      return "u8";
    case TokenDtype::u16:
      return "u16";
    case TokenDtype::i32:
      return "i32";
  }
  TESSEL_CHECK(false, "bad token dtype ", uint32_t(dtype));
}

TokenDtype token_dtype_for_vocab(int64_t vocab_size) {
  TESSEL_CHECK(vocab_size >= 1 && vocab_size <= dtype_capacity(TokenDtype::i32), "vocab size ",
               vocab_size);
  if (vocab_size <= dtype_capacity(TokenDtype::u8)) return TokenDtype::u8;
  if (vocab_size <= dtype_capacity(TokenDtype::u16)) return TokenDtype::u16;
  return TokenDtype::i32;
}

// ---------------------------------------------------------------------------------------------
// ShardWriter

ShardWriter::ShardWriter(std::string path, TokenDtype dtype, int64_t vocab_size)
    : path_(std::move(path)), dtype_(dtype), vocab_size_(vocab_size) {
  TESSEL_CHECK(vocab_size >= 1 && vocab_size <= dtype_capacity(dtype), "vocab size ", vocab_size,
               " does not fit token dtype ", token_dtype_name(dtype));
  tmp_path_ = detail::concat(path_, ".tmp.", ::getpid());
  file_ = std::fopen(tmp_path_.c_str(), "wb");
  if (!file_) input_error(path_, ": cannot create ", tmp_path_, ": ", std::strerror(errno));
  Header placeholder{};
  write_bytes(&placeholder, sizeof placeholder);
}

ShardWriter::~ShardWriter() {
  if (file_) {
    std::fclose(file_);
    std::remove(tmp_path_.c_str());
  }
}

void ShardWriter::write_bytes(const void* data, size_t n) {
  if (std::fwrite(data, 1, n, file_) != n)
    input_error(path_, ": write to ", tmp_path_, " failed: ", std::strerror(errno));
}

void ShardWriter::add_document(std::span<const int32_t> tokens) {
  TESSEL_CHECK(file_, "add_document after finish");
  TESSEL_CHECK(!tokens.empty(), "empty document");
  const size_t width = token_dtype_size(dtype_);
  buffer_.resize(tokens.size() * width);
  for (size_t i = 0; i < tokens.size(); ++i) {
    int32_t t = tokens[i];
    TESSEL_CHECK(t >= 0 && t < vocab_size_, "token ", t, " outside vocab size ", vocab_size_);
    // Little-endian narrowing: the low `width` bytes of the id.
    std::memcpy(&buffer_[i * width], &t, width);
  }
  write_bytes(buffer_.data(), buffer_.size());
  doc_starts_.push_back(uint64_t(num_tokens_));
  num_tokens_ += int64_t(tokens.size());
}

void ShardWriter::finish() {
  TESSEL_CHECK(file_, "finish called twice");
  const size_t width = token_dtype_size(dtype_);
  Header h{};
  std::memcpy(h.magic, kMagic, sizeof kMagic);
  h.version = kShardVersion;
  h.dtype = uint32_t(dtype_);
  h.vocab_size = uint32_t(vocab_size_);
  h.header_bytes = uint32_t(kShardHeaderBytes);
  h.num_tokens = uint64_t(num_tokens_);
  h.num_documents = doc_starts_.size();
  h.index_offset = index_offset_for(h.num_tokens, width);
  h.file_bytes = h.index_offset + 8 * h.num_documents;
  h.checksum = fnv1a(&h, kChecksumOffset);

  const uint64_t padding = h.index_offset - (kShardHeaderBytes + h.num_tokens * width);
  const unsigned char zeros[8] = {};
  write_bytes(zeros, padding);
  write_bytes(doc_starts_.data(), doc_starts_.size() * sizeof(uint64_t));
  if (std::fseek(file_, 0, SEEK_SET) != 0)
    input_error(path_, ": seek in ", tmp_path_, " failed: ", std::strerror(errno));
  write_bytes(&h, sizeof h);
  bool ok = std::fflush(file_) == 0 && ::fsync(::fileno(file_)) == 0;
  ok = (std::fclose(file_) == 0) && ok;
  file_ = nullptr;
  if (!ok || std::rename(tmp_path_.c_str(), path_.c_str()) != 0) {
    std::string reason = std::strerror(errno);
    std::remove(tmp_path_.c_str());
    input_error(path_, ": cannot finish writing the shard: ", reason);
  }
}

// ---------------------------------------------------------------------------------------------
// ShardReader

ShardReader::ShardReader(std::string path) : path_(std::move(path)) {
  int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT)
      input_error(path_, ": no such token shard (create it with `tessel prepare`)");
    input_error(path_, ": cannot open token shard: ", std::strerror(errno));
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    input_error(path_, ": not a regular file");
  }
  const size_t file_bytes = size_t(st.st_size);
  if (file_bytes < kShardHeaderBytes) {
    ::close(fd);
    input_error(path_, ": not a tessel token shard (file holds ", file_bytes,
                " bytes, less than the ", kShardHeaderBytes, "-byte header)");
  }
  map_ = ::mmap(nullptr, file_bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    input_error(path_, ": cannot map token shard: ", std::strerror(errno));
  }
  map_bytes_ = file_bytes;
  try {
    validate(file_bytes);
  } catch (...) {
    ::munmap(map_, map_bytes_);
    map_ = nullptr;
    throw;
  }
}

void ShardReader::validate(size_t file_bytes) {
  Header h;
  std::memcpy(&h, map_, sizeof h);
  const std::string& p = path_;
  if (std::memcmp(h.magic, kMagic, sizeof kMagic) != 0)
    input_error(p, ": not a tessel token shard (bad magic)");
  if (h.version != kShardVersion)
    input_error(p, ": unsupported token shard format version ", h.version,
                " (this build reads version ", kShardVersion, ")");
  if (h.checksum != fnv1a(&h, kChecksumOffset))
    input_error(p, ": corrupt token shard (header checksum mismatch)");
  if (!valid_dtype_code(h.dtype))
    input_error(p, ": unknown token dtype code ", h.dtype, " (expected 1 = u8, 2 = u16, 3 = i32)");
  dtype_ = TokenDtype(h.dtype);
  const size_t width = token_dtype_size(dtype_);
  if (h.vocab_size < 1 || int64_t(h.vocab_size) > dtype_capacity(dtype_))
    input_error(p, ": vocab size ", h.vocab_size, " does not fit token dtype ",
                token_dtype_name(dtype_));
  if (h.header_bytes != kShardHeaderBytes)
    input_error(p, ": header size ", h.header_bytes, ", expected ", kShardHeaderBytes);
  // Counts are checked against what the file can hold before any size is computed from them,
  // so a corrupt header cannot overflow the arithmetic.
  const uint64_t tokens_held = (file_bytes - kShardHeaderBytes) / width;
  if (h.num_tokens > tokens_held)
    input_error(p, ": truncated: header says ", h.num_tokens, " tokens but file holds ",
                tokens_held);
  const uint64_t index_offset = index_offset_for(h.num_tokens, width);
  const uint64_t documents_held = file_bytes > index_offset ? (file_bytes - index_offset) / 8 : 0;
  if (h.num_documents > documents_held)
    input_error(p, ": truncated: header says ", h.num_documents,
                " documents but the boundary index holds ", documents_held);
  const uint64_t expected_bytes = index_offset + 8 * h.num_documents;
  if (h.index_offset != index_offset || h.file_bytes != expected_bytes)
    input_error(p, ": inconsistent header (index offset ", h.index_offset, " and file size ",
                h.file_bytes, ", expected ", index_offset, " and ", expected_bytes, ")");
  if (file_bytes > expected_bytes)
    input_error(p, ": file holds ", file_bytes, " bytes but the header describes ", expected_bytes,
                " (trailing data)");

  vocab_size_ = h.vocab_size;
  num_tokens_ = int64_t(h.num_tokens);
  num_documents_ = int64_t(h.num_documents);
  tokens_ = static_cast<const unsigned char*>(map_) + kShardHeaderBytes;
  index_ =
      reinterpret_cast<const uint64_t*>(static_cast<const unsigned char*>(map_) + index_offset);

  if (num_tokens_ > 0 && num_documents_ == 0)
    input_error(p, ": boundary index is empty but the shard holds ", num_tokens_, " tokens");
  for (int64_t d = 0; d < num_documents_; ++d) {
    const uint64_t s = index_[d];
    if (d == 0 && s != 0)
      input_error(p, ": boundary index: document 0 starts at ", s, ", expected 0");
    if (d > 0 && s <= index_[d - 1])
      input_error(p, ": boundary index out of order: document ", d, " starts at ", s,
                  ", not after document ", d - 1, " at ", index_[d - 1]);
    if (s >= h.num_tokens)
      input_error(p, ": boundary index out of range: document ", d, " starts at ", s,
                  " but the shard holds ", num_tokens_, " tokens");
  }
  if (dtype_capacity(dtype_) > vocab_size_) {
    std::vector<int32_t> chunk(std::min<int64_t>(num_tokens_, 1 << 16));
    for (int64_t begin = 0; begin < num_tokens_; begin += int64_t(chunk.size())) {
      const int64_t count = std::min<int64_t>(int64_t(chunk.size()), num_tokens_ - begin);
      read(begin, count, chunk.data());
      for (int64_t i = 0; i < count; ++i)
        if (chunk[i] < 0 || chunk[i] >= vocab_size_)
          input_error(p, ": token ", begin + i, " is ", chunk[i], ", outside the vocabulary [0, ",
                      vocab_size_, ")");
    }
  }
}

ShardReader::~ShardReader() {
  if (map_) ::munmap(map_, map_bytes_);
}

ShardReader::ShardReader(ShardReader&& other) noexcept {
  *this = std::move(other);
}

ShardReader& ShardReader::operator=(ShardReader&& other) noexcept {
  if (this != &other) {
    if (map_) ::munmap(map_, map_bytes_);
    path_ = std::move(other.path_);
    map_ = std::exchange(other.map_, nullptr);
    map_bytes_ = std::exchange(other.map_bytes_, 0);
    dtype_ = other.dtype_;
    vocab_size_ = other.vocab_size_;
    num_tokens_ = other.num_tokens_;
    num_documents_ = other.num_documents_;
    tokens_ = std::exchange(other.tokens_, nullptr);
    index_ = std::exchange(other.index_, nullptr);
  }
  return *this;
}

int32_t ShardReader::token(int64_t i) const {
  TESSEL_CHECK(i >= 0 && i < num_tokens_, "token index ", i, " of ", num_tokens_);
  int32_t t = 0;
  read(i, 1, &t);
  return t;
}

void ShardReader::read(int64_t begin, int64_t count, int32_t* out) const {
  TESSEL_CHECK(begin >= 0 && count >= 0 && begin + count <= num_tokens_, "tokens [", begin, ", ",
               begin + count, ") of ", num_tokens_);
  switch (dtype_) {
    case TokenDtype::u8:
      for (int64_t i = 0; i < count; ++i) out[i] = tokens_[begin + i];
      return;
    case TokenDtype::u16: {
      // The token area starts at byte 64 of a page-aligned map, so u16 and i32 are aligned.
      auto* src = reinterpret_cast<const uint16_t*>(tokens_) + begin;
      for (int64_t i = 0; i < count; ++i) out[i] = src[i];
      return;
    }
    case TokenDtype::i32:
      std::memcpy(out, reinterpret_cast<const int32_t*>(tokens_) + begin,
                  size_t(count) * sizeof(int32_t));
      return;
  }
}

}  // namespace tessel::data
