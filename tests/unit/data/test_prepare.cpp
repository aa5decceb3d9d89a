#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>

#include "tessel/data/byte_tokenizer.hpp"
#include "tessel/data/prepare.hpp"
#include "tessel/data/shard.hpp"
#include "unit/data/test_util.hpp"

using namespace tessel;
using namespace tessel::data;
using tessel::data::testing::bible_documents;
using tessel::data::testing::expect_input_error;
using tessel::data::testing::TempDir;

namespace {

// The documents of a shard, decoded back to text.
std::vector<std::string> decode_shard(const std::string& path) {
  const ShardReader r(path);
  EXPECT_EQ(r.dtype(), TokenDtype::u8);
  EXPECT_EQ(r.vocab_size(), 256);
  std::vector<std::string> docs;
  const auto starts = r.doc_starts();
  for (int64_t d = 0; d < r.num_documents(); ++d) {
    const int64_t begin = int64_t(starts[size_t(d)]);
    const int64_t end = d + 1 < r.num_documents() ? int64_t(starts[size_t(d + 1)]) : r.num_tokens();
    std::vector<int32_t> ids(size_t(end - begin));
    r.read(begin, end - begin, ids.data());
    docs.push_back(ByteTokenizer().decode(ids));
  }
  return docs;
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

// True when `part` is a subsequence of `whole`, in order.
bool in_order_subset(const std::vector<std::string>& part, const std::vector<std::string>& whole) {
  size_t j = 0;
  for (const auto& p : part) {
    while (j < whole.size() && whole[j] != p) ++j;
    if (j++ == whole.size()) return false;
  }
  return true;
}

}  // namespace

TEST(Prepare, FileCorpusRoundTrip) {
  TempDir dir;
  const std::string corpus = dir.file("corpus.txt");
  std::vector<std::string> paragraphs;
  {
    std::ofstream out(corpus);
    for (int i = 0; i < 200; ++i) {
      paragraphs.push_back("paragraph " + std::to_string(i) + "\nline two of " + std::to_string(i) +
                           "\n");
      out << paragraphs.back() << "\n";
    }
  }
  PrepareOptions opt;
  opt.corpus = "file:" + corpus;
  opt.output_dir = dir.file("out");
  opt.val_fraction = 0.1;
  opt.seed = 5;
  const PrepareResult res = prepare_dataset(opt);
  EXPECT_EQ(res.val.documents, 20);  // round(0.1 * 200)
  EXPECT_EQ(res.train.documents, 180);
  EXPECT_EQ(res.train.path, dir.file("out/train.tok"));
  EXPECT_EQ(res.val.path, dir.file("out/val.tok"));

  const auto train = decode_shard(res.train.path);
  const auto val = decode_shard(res.val.path);
  EXPECT_EQ(int64_t(train.size()), res.train.documents);
  EXPECT_EQ(int64_t(val.size()), res.val.documents);
  // Each split keeps corpus order, and together they are the corpus exactly once.
  EXPECT_TRUE(in_order_subset(train, paragraphs));
  EXPECT_TRUE(in_order_subset(val, paragraphs));
  std::vector<std::string> all = train;
  all.insert(all.end(), val.begin(), val.end());
  std::sort(all.begin(), all.end());
  std::vector<std::string> expected = paragraphs;
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(all, expected);
  int64_t tokens = 0;
  for (const auto& d : train) tokens += int64_t(d.size());
  EXPECT_EQ(res.train.tokens, tokens);

  const std::string json = read_text(res.metadata_path);
  for (const std::string& part :
       {"\"corpus\": \"file:" + corpus + "\"", std::string("\"tokenizer\": \"byte\""),
        std::string("\"vocab_size\": 256"), std::string("\"seed\": 5"),
        "\"train\": {\"documents\": 180, \"tokens\": " + std::to_string(tokens),
        std::string("\"val\": {\"documents\": 20")})
    EXPECT_NE(json.find(part), std::string::npos) << part << " not in " << json;

  // Same seed, same files; another seed picks other validation documents.
  const std::string train_bytes = read_text(res.train.path);
  prepare_dataset(opt);
  EXPECT_EQ(read_text(res.train.path), train_bytes);
  opt.seed = 6;
  prepare_dataset(opt);
  EXPECT_NE(decode_shard(res.val.path), val);
}

TEST(Prepare, BibleSplit) {
  TempDir dir;
  PrepareOptions opt;
  opt.corpus = "bible";
  opt.output_dir = dir.file("bible");
  const auto res = prepare_documents(bible_documents(), opt);
  EXPECT_EQ(res.val.documents, 12);  // round(0.01 * 1189)
  EXPECT_EQ(res.train.documents + res.val.documents, 1189);
  int64_t tokens = 0;
  for (const auto& d : bible_documents()) tokens += int64_t(d.size());
  EXPECT_EQ(res.train.tokens + res.val.tokens, tokens);
}

TEST(Prepare, SplitBoundsAndErrors) {
  TempDir dir;
  PrepareOptions opt;
  opt.corpus = "test";
  opt.output_dir = dir.file("out");
  opt.val_fraction = 0.0;  // still one validation document
  auto res = prepare_documents({"a\n", "b\n"}, opt);
  EXPECT_EQ(res.val.documents, 1);
  EXPECT_EQ(res.train.documents, 1);
  opt.val_fraction = 0.9;  // still one training document
  res = prepare_documents({"a\n", "b\n"}, opt);
  EXPECT_EQ(res.train.documents, 1);

  expect_input_error([&] { prepare_documents({"a\n"}, opt); }, {"at least 2"});
  opt.val_fraction = 1.0;
  expect_input_error([&] { prepare_documents({"a\n", "b\n"}, opt); }, {"val_fraction"});
  opt.val_fraction = 0.1;
  opt.corpus = "nope";
  expect_input_error([&] { prepare_dataset(opt); }, {"unknown corpus"});
}
