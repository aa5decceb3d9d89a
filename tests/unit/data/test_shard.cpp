#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "tessel/core/rng.hpp"
#include "tessel/data/shard.hpp"
#include "unit/data/test_util.hpp"

using namespace tessel;
using namespace tessel::data;
using tessel::data::testing::expect_input_error;
using tessel::data::testing::TempDir;

namespace {

std::vector<std::vector<int32_t>> random_documents(int n, int64_t vocab, uint64_t seed) {
  Rng rng(seed);
  std::vector<std::vector<int32_t>> docs(static_cast<size_t>(n));
  for (auto& d : docs) {
    d.resize(1 + rng.below(40));
    for (auto& t : d) t = int32_t(rng.below(uint64_t(vocab)));
  }
  return docs;
}

void write_shard(const std::string& path, TokenDtype dtype, int64_t vocab,
                 const std::vector<std::vector<int32_t>>& docs) {
  ShardWriter w(path, dtype, vocab);
  for (const auto& d : docs) w.add_document(d);
  w.finish();
}

std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
}

template <class T>
T field(const std::string& bytes, size_t offset) {
  T v;
  std::memcpy(&v, bytes.data() + offset, sizeof v);
  return v;
}

template <class T>
void set_field(std::string& bytes, size_t offset, T v) {
  std::memcpy(bytes.data() + offset, &v, sizeof v);
}

// The documented header checksum, computed independently: FNV-1a 64 of bytes [0, 56).
void reseal(std::string& bytes) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < 56; ++i) h = (h ^ static_cast<unsigned char>(bytes[i])) * 0x100000001b3ull;
  set_field<uint64_t>(bytes, 56, h);
}

}  // namespace

TEST(Shard, RoundTripEachDtype) {
  TempDir dir;
  const std::pair<TokenDtype, int64_t> cases[] = {
      {TokenDtype::u8, 256}, {TokenDtype::u16, 50257}, {TokenDtype::i32, 200000}};
  for (auto [dtype, vocab] : cases) {
    SCOPED_TRACE(token_dtype_name(dtype));
    const auto docs = random_documents(37, vocab, uint64_t(vocab));
    const std::string path = dir.file(std::string(token_dtype_name(dtype)) + ".tok");
    write_shard(path, dtype, vocab, docs);
    EXPECT_FALSE(std::filesystem::exists(path + ".tmp." + std::to_string(::getpid())));

    const ShardReader r(path);
    EXPECT_EQ(r.dtype(), dtype);
    EXPECT_EQ(r.vocab_size(), vocab);
    EXPECT_EQ(r.num_documents(), int64_t(docs.size()));
    int64_t offset = 0;
    for (size_t d = 0; d < docs.size(); ++d) {
      EXPECT_EQ(r.doc_starts()[d], uint64_t(offset));
      std::vector<int32_t> got(docs[d].size());
      r.read(offset, int64_t(got.size()), got.data());
      EXPECT_EQ(got, docs[d]);
      EXPECT_EQ(r.token(offset), docs[d][0]);
      offset += int64_t(docs[d].size());
    }
    EXPECT_EQ(r.num_tokens(), offset);

    // The layout is the documented one: sizes in closed form, fields at their offsets.
    const std::string bytes = read_bytes(path);
    const uint64_t width = token_dtype_size(dtype);
    const uint64_t index_offset = (64 + offset * width + 7) / 8 * 8;
    EXPECT_EQ(bytes.size(), index_offset + 8 * docs.size());
    EXPECT_EQ(bytes.substr(0, 8), "TESSELTK");
    EXPECT_EQ(field<uint32_t>(bytes, 8), 1u);
    EXPECT_EQ(field<uint32_t>(bytes, 12), uint32_t(dtype));
    EXPECT_EQ(field<uint32_t>(bytes, 16), uint32_t(vocab));
    EXPECT_EQ(field<uint32_t>(bytes, 20), 64u);
    EXPECT_EQ(field<uint64_t>(bytes, 24), uint64_t(offset));
    EXPECT_EQ(field<uint64_t>(bytes, 32), docs.size());
    EXPECT_EQ(field<uint64_t>(bytes, 40), index_offset);
    EXPECT_EQ(field<uint64_t>(bytes, 48), bytes.size());
    std::string resealed = bytes;
    reseal(resealed);
    EXPECT_EQ(resealed, bytes);
  }
}

TEST(Shard, EmptyShardAndMove) {
  TempDir dir;
  const std::string path = dir.file("empty.tok");
  write_shard(path, TokenDtype::u8, 256, {});
  ShardReader r(path);
  EXPECT_EQ(r.num_tokens(), 0);
  EXPECT_EQ(r.num_documents(), 0);
  ShardReader moved(std::move(r));
  EXPECT_EQ(moved.path(), path);
  EXPECT_EQ(moved.num_tokens(), 0);
}

TEST(Shard, DtypeForVocab) {
  EXPECT_EQ(token_dtype_for_vocab(256), TokenDtype::u8);
  EXPECT_EQ(token_dtype_for_vocab(257), TokenDtype::u16);
  EXPECT_EQ(token_dtype_for_vocab(65536), TokenDtype::u16);
  EXPECT_EQ(token_dtype_for_vocab(65537), TokenDtype::i32);
}

TEST(Shard, UnfinishedWriterLeavesNothing) {
  TempDir dir;
  const std::string path = dir.file("partial.tok");
  {
    ShardWriter w(path, TokenDtype::u8, 256);
    w.add_document(std::vector<int32_t>{1, 2, 3});
  }
  EXPECT_TRUE(std::filesystem::is_empty(dir.path()));
}

// Every way a shard can be wrong gives an InputError naming the file and the problem.
class CorruptShard : public ::testing::Test {
 protected:
  void SetUp() override {
    path_ = dir_.file("data.tok");
    // Three documents of 400 + 300 + 300 tokens in a u16 shard of vocab 1000.
    std::vector<std::vector<int32_t>> docs = {
        std::vector<int32_t>(400, 7), std::vector<int32_t>(300, 8), std::vector<int32_t>(300, 999)};
    write_shard(path_, TokenDtype::u16, 1000, docs);
    good_ = read_bytes(path_);
    index_ = field<uint64_t>(good_, 40);
  }
  void expect_error(const std::string& bytes, std::initializer_list<std::string> parts) {
    write_bytes(path_, bytes);
    expect_input_error([&] { ShardReader r(path_); }, parts);
    expect_input_error([&] { ShardReader r(path_); }, {path_});
  }

  TempDir dir_;
  std::string path_, good_;
  uint64_t index_ = 0;
};

TEST_F(CorruptShard, GoodFileOpens) {
  EXPECT_EQ(ShardReader(path_).num_tokens(), 1000);
}

TEST_F(CorruptShard, MissingFile) {
  expect_input_error([&] { ShardReader r(dir_.file("nope.tok")); },
                     {dir_.file("nope.tok"), "tessel prepare"});
}

TEST_F(CorruptShard, ShorterThanHeader) {
  expect_error(good_.substr(0, 10), {"not a tessel token shard"});
}

TEST_F(CorruptShard, BadMagic) {
  std::string b = good_;
  b[0] = 'X';
  expect_error(b, {"not a tessel token shard (bad magic)"});
}

TEST_F(CorruptShard, WrongVersion) {
  std::string b = good_;
  set_field<uint32_t>(b, 8, 2);
  expect_error(b, {"version 2"});
}

TEST_F(CorruptShard, HeaderChecksum) {
  std::string b = good_;
  set_field<uint64_t>(b, 24, 999);
  expect_error(b, {"checksum"});
}

TEST_F(CorruptShard, UnknownDtype) {
  std::string b = good_;
  set_field<uint32_t>(b, 12, 9);
  reseal(b);
  expect_error(b, {"dtype code 9"});
}

TEST_F(CorruptShard, InconsistentHeader) {
  std::string b = good_;
  set_field<uint64_t>(b, 40, index_ + 8);
  reseal(b);
  expect_error(b, {"inconsistent header"});
}

TEST_F(CorruptShard, TruncatedTokens) {
  // u16 tokens start at byte 64: 64 + 2 * 512 bytes hold 512 of the 1000 tokens.
  expect_error(good_.substr(0, 64 + 2 * 512),
               {"truncated: header says 1000 tokens but file holds 512"});
}

TEST(Shard, TruncatedU8Shard) {
  TempDir dir;
  const std::string path = dir.file("train.tok");
  write_shard(path, TokenDtype::u8, 256, {std::vector<int32_t>(1000, 65)});
  std::filesystem::resize_file(path, 64 + 512);
  expect_input_error([&] { ShardReader r(path); },
                     {path + ": truncated: header says 1000 tokens but file holds 512"});
}

TEST_F(CorruptShard, TruncatedIndex) {
  expect_error(good_.substr(0, good_.size() - 8), {"truncated", "3 documents", "holds 2"});
}

TEST_F(CorruptShard, TrailingData) {
  expect_error(good_ + "xyz", {"trailing data"});
}

TEST_F(CorruptShard, IndexDoesNotStartAtZero) {
  std::string b = good_;
  set_field<uint64_t>(b, index_, 1);
  expect_error(b, {"document 0 starts at 1"});
}

TEST_F(CorruptShard, IndexOutOfOrder) {
  std::string b = good_;
  set_field<uint64_t>(b, index_ + 16, 400);  // document 2 starts where document 1 does
  expect_error(b, {"boundary index out of order", "document 2"});
}

TEST_F(CorruptShard, IndexOutOfRange) {
  std::string b = good_;
  set_field<uint64_t>(b, index_ + 16, 1000);
  expect_error(b, {"boundary index out of range", "document 2 starts at 1000"});
}

TEST_F(CorruptShard, TokenOutsideVocab) {
  std::string b = good_;
  set_field<uint16_t>(b, 64 + 2 * 5, 1000);
  expect_error(b, {"token 5 is 1000", "vocabulary [0, 1000)"});
}
