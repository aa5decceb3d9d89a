#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "support/bpe_files.hpp"
#include "tessel/core/rng.hpp"
#include "tessel/data/byte_tokenizer.hpp"
#include "tessel/data/packing.hpp"
#include "tessel/data/prepare.hpp"
#include "tessel/data/shard.hpp"
#include "tessel/data/token_file.hpp"
#include "tessel/data/tokenizer.hpp"
#include "unit/data/test_util.hpp"

using namespace tessel;
using namespace tessel::data;
using tessel::data::testing::bible_documents;
using tessel::data::testing::expect_input_error;
using tessel::data::testing::TempDir;

namespace {

// The documents of a shard as token ids.
std::vector<std::vector<int32_t>> shard_documents(const ShardReader& r) {
  std::vector<std::vector<int32_t>> docs;
  const auto starts = r.doc_starts();
  for (int64_t d = 0; d < r.num_documents(); ++d) {
    const int64_t begin = int64_t(starts[size_t(d)]);
    const int64_t end = d + 1 < r.num_documents() ? int64_t(starts[size_t(d + 1)]) : r.num_tokens();
    docs.emplace_back(size_t(end - begin));
    r.read(begin, end - begin, docs.back().data());
  }
  return docs;
}

// The documents of a byte-tokenized shard, decoded back to text.
std::vector<std::string> decode_shard(const std::string& path) {
  const ShardReader r(path);
  EXPECT_EQ(r.dtype(), TokenDtype::u8);
  EXPECT_EQ(r.vocab_size(), 256);
  std::vector<std::string> docs;
  for (const auto& ids : shard_documents(r)) docs.push_back(ByteTokenizer().decode(ids));
  return docs;
}

// Writes `ids` as a raw little-endian file of type T.
template <class T>
void write_ids(const std::string& path, const std::vector<int64_t>& ids) {
  std::vector<T> raw(ids.begin(), ids.end());
  std::ofstream(path, std::ios::binary)
      .write(reinterpret_cast<const char*>(raw.data()), std::streamsize(sizeof(T) * raw.size()));
}

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

// True when `part` is a subsequence of `whole`, in order.
template <class Doc>
bool in_order_subset(const std::vector<Doc>& part, const std::vector<Doc>& whole) {
  size_t j = 0;
  for (const auto& p : part) {
    while (j < whole.size() && whole[j] != p) ++j;
    if (j++ == whole.size()) return false;
  }
  return true;
}

// Two documents, one per split, prepared into `out` with the BPE vocabulary in `bpe`.
void prepare_two_documents(const std::string& bpe, const std::string& out) {
  PrepareOptions opt;
  opt.corpus = "file:docs.txt";
  opt.output_dir = out;
  opt.val_fraction = 0.5;
  opt.tokenizer = "bpe:" + bpe;
  prepare_documents({"In the beginning", "the LORD said"}, opt);
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
  // What train-bpe learns from: exactly the training split, in order.
  EXPECT_EQ(training_documents(opt), train);
  opt.seed = 6;
  EXPECT_NE(training_documents(opt), train);
  opt.seed = 5;
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
  expect_input_error([&] { prepare_documents({"a\n", "b\n"}, opt); }, {"--val-fraction"});
  opt.val_fraction = 0.1;
  opt.corpus = "nope";
  expect_input_error([&] { prepare_dataset(opt); },
                     {"unknown corpus", "file:PATH, jsonl:PATH or tokens:PATH", "chat:PATH"});
  // A prefix without its path is said to name no file, whatever other options are given.
  for (const char* prefix : {"file:", "jsonl:", "chat:", "tokens:"}) {
    opt.corpus = prefix;
    expect_input_error([&] { prepare_dataset(opt); },
                       {std::string("corpus \"") + prefix + "\" names no file", "PATH)"});
    expect_input_error([&] { training_documents(opt); }, {"names no file"});
  }
  opt.vocab = 1000, opt.eot = 999;
  expect_input_error([&] { prepare_dataset(opt); }, {"\"tokens:\" names no file"});
  // Not into a run's, a checkpoint's or an export's directory, whose files the shards would join.
  opt = PrepareOptions{};
  opt.corpus = "test";
  for (const char* file : {"config.toml", "checkpoints", "manifest.json", "model.safetensors"}) {
    opt.output_dir = dir.file(std::string("not-data-") + file);
    std::filesystem::create_directories(opt.output_dir);
    std::ofstream(opt.output_dir + "/" + file) << "x";
    expect_input_error(
        [&] {
          prepare_documents({"a\n", "b\n"}, opt);
        },
        {"holds " + std::string(file), "not a data set's"});
    EXPECT_FALSE(std::filesystem::exists(opt.output_dir + "/train.tok"));
  }
}

// Without --out, each corpus gets its own directory: only `tessel prepare` of the Bible
// writes data/bible.
TEST(Prepare, EachCorpusNamesItsOwnDefaultDirectory) {
  EXPECT_EQ(corpus_directory_name("bible"), "bible");
  EXPECT_EQ(corpus_directory_name("fortunes"), "fortunes");
  EXPECT_EQ(corpus_directory_name("bible-quotes"), "bible-quotes");
  EXPECT_EQ(corpus_directory_name("file:/tmp/two.txt"), "two");
  EXPECT_EQ(corpus_directory_name("jsonl:web.jsonl"), "web");
  EXPECT_EQ(corpus_directory_name("tokens:owt/train.bin"), "train");
  EXPECT_EQ(corpus_directory_name("chat:talks.jsonl"), "talks");
  for (const char* nameless : {"file:/tmp/", "file:..", "jsonl:."})
    expect_input_error([&] { corpus_directory_name(nameless); }, {nameless, "--out"});
  expect_input_error([] { corpus_directory_name("file:"); }, {"names no file", "file:PATH"});
  expect_input_error([] { corpus_directory_name("nope:"); }, {"nope:", "--out"});  // no prefix
}

// A tokens:PATH corpus: every document (ending at the eot id, the tail after the last eot one
// more) lands in exactly one split, in file order, with its ids unchanged; the split is the
// one a text corpus of as many documents gets; the shards take the narrowest dtype for the
// vocabulary. u16 (nanoGPT's GPT-2 files), and u32 / i32 with ids past 2^16.
TEST(Prepare, TokenFileCorpusKeepsEveryDocumentOnce) {
  struct Case {
    const char* dtype;
    int64_t vocab, eot;
    TokenDtype shard;
  };
  for (const Case& c :
       {Case{"u16", 50304, 50256, TokenDtype::u16}, Case{"u32", 70000, 3, TokenDtype::i32},
        Case{"i32", 70000, 69999, TokenDtype::i32}}) {
    SCOPED_TRACE(c.dtype);
    TempDir dir;
    Rng rng(9);
    std::vector<std::vector<int32_t>> docs;
    std::vector<int64_t> ids;
    for (int d = 0; d < 61; ++d) {
      docs.emplace_back();
      const int length = 1 + int(rng.below(20));
      for (int t = 0; t < length; ++t) {
        int32_t id = int32_t(rng.below(uint64_t(c.vocab)));
        if (id == c.eot) id = 0;
        docs.back().push_back(id);
      }
      if (d < 60) docs.back().push_back(int32_t(c.eot));  // the last has no eot
      ids.insert(ids.end(), docs.back().begin(), docs.back().end());
    }
    const std::string file = dir.file("ids.bin");
    if (std::string(c.dtype) == "u16")
      write_ids<uint16_t>(file, ids);
    else if (std::string(c.dtype) == "u32")
      write_ids<uint32_t>(file, ids);
    else
      write_ids<int32_t>(file, ids);
    PrepareOptions opt;
    opt.corpus = "tokens:" + file;
    opt.output_dir = dir.file("out");
    opt.val_fraction = 0.2;
    opt.seed = 3;
    opt.token_dtype = c.dtype;
    opt.vocab = c.vocab;
    opt.eot = c.eot;
    const PrepareResult res = prepare_dataset(opt);
    const ShardReader train(res.train.path), val(res.val.path);
    EXPECT_EQ(train.dtype(), c.shard);
    EXPECT_EQ(train.vocab_size(), c.vocab);
    const auto train_docs = shard_documents(train), val_docs = shard_documents(val);
    EXPECT_EQ(val_docs.size(), 12u);  // round(0.2 * 61)
    EXPECT_TRUE(in_order_subset(train_docs, docs));
    EXPECT_TRUE(in_order_subset(val_docs, docs));
    auto all = train_docs;
    all.insert(all.end(), val_docs.begin(), val_docs.end());
    std::sort(all.begin(), all.end());
    auto expected = docs;
    std::sort(expected.begin(), expected.end());
    EXPECT_EQ(all, expected);
    EXPECT_EQ(res.train.tokens + res.val.tokens, int64_t(ids.size()));
    // The split of a text corpus with as many documents and the same seed.
    std::vector<std::string> text(docs.size());
    for (size_t d = 0; d < docs.size(); ++d) text[d] = std::to_string(d) + "\n";
    opt.corpus = "test";
    opt.vocab.reset(), opt.eot.reset(), opt.token_dtype.reset();
    opt.output_dir = dir.file("text");
    const auto text_val = decode_shard(prepare_documents(text, opt).val.path);
    ASSERT_EQ(text_val.size(), val_docs.size());
    for (size_t i = 0; i < text_val.size(); ++i)
      EXPECT_EQ(val_docs[i], docs[size_t(std::stoi(text_val[i]))]);
    const std::string json = read_text(res.metadata_path);
    for (const std::string& part : {std::string("\"tokenizer\": \"pretokenized ") + c.dtype +
                                        ", eot " + std::to_string(c.eot) + "\"",
                                    "\"vocab_size\": " + std::to_string(c.vocab)})
      EXPECT_NE(json.find(part), std::string::npos) << part << " not in " << json;
  }
}

TEST(Prepare, TokenFileErrorsNameTheProblem) {
  TempDir dir;
  const std::string file = dir.file("ids.bin");
  PrepareOptions opt;
  opt.corpus = "tokens:" + file;
  opt.output_dir = dir.file("out");
  opt.vocab = 10;
  opt.eot = 9;
  write_ids<uint16_t>(file, {1, 2, 9, 4, 12, 9});
  expect_input_error([&] { prepare_dataset(opt); }, {file, "token 12 at index 4", "[0, 10)"});
  write_ids<uint16_t>(file, {1, 2, 3});
  expect_input_error([&] { prepare_dataset(opt); },
                     {"has 1 document ", "at least 2", "are --eot and --token-dtype (u16) right?"});
  std::ofstream(file, std::ios::binary) << "abc";
  expect_input_error([&] { prepare_dataset(opt); }, {"3 bytes", "whole number of u16"});
  opt.token_dtype = "u8";
  expect_input_error([&] { prepare_dataset(opt); }, {"--token-dtype = \"u8\""});
  opt.token_dtype = "u16";
  opt.eot = 10;
  expect_input_error([&] { prepare_dataset(opt); }, {"end-of-document id 10", "[0, 10)"});
  opt.eot.reset();
  expect_input_error([&] { prepare_dataset(opt); }, {"needs --vocab", "--eot"});
  opt.eot = 9;
  opt.corpus = "tokens:" + dir.file("missing.bin");
  expect_input_error([&] { prepare_dataset(opt); }, {"missing.bin", "no such token file"});
  opt.corpus = "bible";
  expect_input_error([&] { prepare_dataset(opt); }, {"--vocab, --eot and --token-dtype", "bible"});
  opt.vocab.reset(), opt.eot.reset();
  opt.token_dtype = "u16";  // even the default, when given, belongs to a tokens:PATH corpus
  expect_input_error([&] { prepare_dataset(opt); }, {"--vocab, --eot and --token-dtype", "bible"});
}

// With --tokenizer bpe:DIR a text corpus is encoded with that vocabulary, whose files travel
// with the shards (dataset.json names them); preparing without it removes them again.
TEST(Prepare, BpeTokenizerEncodesAndTravelsWithTheShards) {
  TempDir dir;
  const std::string bpe = dir.file("bpe"), out = dir.file("out");
  std::filesystem::create_directories(bpe);
  const int vocab = int(data::write_bpe_files(bpe, fixture::english_merges()));
  const std::vector<std::string> docs = {"In the beginning", "the LORD said", "And the earth\n\n",
                                         "he said, Let there be light"};
  PrepareOptions opt;
  opt.corpus = "file:docs.txt";
  opt.output_dir = out;
  opt.val_fraction = 0.25;
  opt.tokenizer = "bpe:" + bpe;
  const PrepareResult res = prepare_documents(docs, opt);
  EXPECT_EQ(read_text(out + "/vocab.json"), read_text(bpe + "/vocab.json"));
  EXPECT_EQ(read_text(out + "/merges.txt"), read_text(bpe + "/merges.txt"));
  const auto meta = nlohmann::json::parse(read_text(res.metadata_path));
  EXPECT_EQ(meta["tokenizer"], "bpe");
  EXPECT_EQ(meta["vocab_size"], vocab);
  const auto tokenizer = load_tokenizer(out, vocab);
  ASSERT_NE(tokenizer, nullptr);
  std::vector<std::string> decoded;
  int64_t tokens = 0;
  for (const std::string& split : {res.train.path, res.val.path}) {
    const ShardReader r(split);
    EXPECT_EQ(r.dtype(), TokenDtype::u16);
    EXPECT_EQ(r.vocab_size(), vocab);
    tokens += r.num_tokens();
    for (const auto& ids : shard_documents(r)) decoded.push_back(tokenizer->decode(ids));
  }
  std::sort(decoded.begin(), decoded.end());
  std::vector<std::string> sorted = docs;
  std::sort(sorted.begin(), sorted.end());
  EXPECT_EQ(decoded, sorted);
  int64_t bytes = 0;
  for (const auto& d : docs) bytes += int64_t(d.size());
  EXPECT_LT(tokens, bytes) << "merges shorten the text";

  opt.tokenizer.reset();  // byte again: the copies go
  prepare_documents(docs, opt);
  EXPECT_FALSE(std::filesystem::exists(out + "/vocab.json"));
  EXPECT_FALSE(std::filesystem::exists(out + "/merges.txt"));
  EXPECT_EQ(load_tokenizer(out, 256)->name(), "byte");

  // A mixture's directories must share the tokenizer: the same BPE files, or both bytes.
  const std::string same = dir.file("same"), other = dir.file("other");
  opt.output_dir = same;
  opt.tokenizer = "bpe:" + bpe;
  prepare_documents(docs, opt);
  opt.output_dir = out;
  check_same_tokenizer({same, same});
  expect_input_error([&] { check_same_tokenizer({same, out}); }, {same, out, "byte and bpe"});
  auto merges = fixture::english_merges();
  std::swap(merges[10], merges[11]);  // ("Ġ", "t") before ("e", "r"): the same size, other ids
  data::write_bpe_files(bpe, merges);
  opt.output_dir = other;
  prepare_documents(docs, opt);
  expect_input_error([&] { check_same_tokenizer({same, out, other}); }, {"byte and bpe"});
  expect_input_error(
      [&] {
        check_same_tokenizer({same, other});
      },
      {other, same, "bpe vocabularies that differ"});
  check_same_tokenizer({same, dir.file("no-dataset-json")});

  opt.output_dir = bpe;  // the vocabulary's own directory: a later prepare would drop it
  opt.tokenizer = "bpe:" + bpe;
  expect_input_error([&] { prepare_documents(docs, opt); }, {bpe, "is the output directory"});
  std::ofstream(out + "/dataset.json") << "{not json";  // an unreadable old description
  opt.output_dir = out;
  opt.tokenizer.reset();
  prepare_documents(docs, opt);
  EXPECT_EQ(load_tokenizer(out, 256)->name(), "byte");
  opt.tokenizer = "wordpiece";
  expect_input_error([&] { prepare_documents(docs, opt); }, {"byte or bpe:DIR", "wordpiece"});
}

// dataset.json and a run's copy record the BPE files' checksums: files replaced afterwards
// (train-bpe --out into the directory) are refused, not read as the vocabulary of the ids.
TEST(Prepare, ReplacedBpeFilesAreRefusedByTheirChecksums) {
  TempDir dir;
  const std::string bpe = dir.file("bpe"), out = dir.file("out"), copy = dir.file("run/tokenizer");
  const int vocab = int(data::write_bpe_files(bpe, fixture::english_merges()));
  prepare_two_documents(bpe, out);
  const auto meta = nlohmann::json::parse(read_text(out + "/dataset.json"));
  ASSERT_TRUE(meta.contains(kBpeChecksumsKey));
  EXPECT_EQ(meta[kBpeChecksumsKey], nlohmann::json::parse(bpe_checksums_json(bpe)));
  EXPECT_NE(load_tokenizer(out, vocab), nullptr);
  save_tokenizer(out, copy);
  EXPECT_EQ(nlohmann::json::parse(read_text(copy + "/tokenizer.json"))[kBpeChecksumsKey],
            meta[kBpeChecksumsKey]);
  EXPECT_NE(load_tokenizer(copy, vocab), nullptr);

  auto merges = fixture::english_merges();
  std::swap(merges[10], merges[11]);  // the same size, other ids
  data::write_bpe_files(copy, merges);
  expect_input_error([&] { load_tokenizer(copy, vocab); },
                     {copy, "tokenizer.json", std::string(kBpeChecksumsKey)});
  const std::string vocab_json = read_text(out + "/vocab.json");
  data::write_bpe_files(out, merges);
  expect_input_error([&] { load_tokenizer(out, vocab); },
                     {out, "dataset.json", "prepare the data again"});
  expect_input_error([&] { save_tokenizer(out, copy); }, {out, "dataset.json"});
  std::ofstream(out + "/vocab.json", std::ios::binary) << vocab_json;  // one file restored
  expect_input_error([&] { load_tokenizer(out, vocab); }, {out, "dataset.json"});
  data::write_bpe_files(out, fixture::english_merges());
  EXPECT_NE(load_tokenizer(out, vocab), nullptr) << "both restored";
}

// A prepare cut short (here: its val.tok cannot be written) has removed the earlier prepare's
// shards, loss masks and description before writing anything: its new train.tok never stands
// beside the old val.tok. The temporaries of prepare's files that a prepare killed earlier
// left go too; other files in the directory stay.
TEST(Prepare, APrepareCutShortLeavesNoFileOfTheEarlierOne) {
  TempDir dir;
  const std::string out = dir.file("out");
  PrepareOptions opt;
  opt.corpus = "chat:talks.jsonl";
  opt.output_dir = out;
  opt.val_fraction = 0.5;
  const SftSample sample{"User: hi\nAssistant: hello\n", std::vector<uint8_t>(26, 1)};
  prepare_samples({sample, sample}, opt);
  ASSERT_TRUE(std::filesystem::exists(out + "/val.loss_mask.tok"));
  const std::vector<std::string> stale = {"val.tok.tmp.999999", "train.loss_mask.tok.tmp.12",
                                          "dataset.json.tmp.7", "vocab.json.tmp.8"},
                                 kept = {"notes.txt.tmp.7", "val.tok.tmp.x", "val.tok.old"};
  for (const auto& name : stale) std::ofstream(out + "/" + name) << "partial";
  for (const auto& name : kept) std::ofstream(out + "/" + name) << "mine";
  // val.tok's temporary cannot be created: a directory stands under its name.
  const std::string blocked = out + "/val.tok.tmp." + std::to_string(::getpid());
  std::filesystem::create_directories(blocked + "/inside");
  opt.corpus = "file:docs.txt";
  expect_input_error(
      [&] {
        prepare_documents({"In the beginning", "the LORD said"}, opt);
      },
      {out + "/val.tok", "cannot create"});
  const ShardReader train(out + "/train.tok");  // the new one, bytes of one document
  EXPECT_EQ(train.num_documents(), 1);
  EXPECT_EQ(train.vocab_size(), 256);
  for (const char* gone : {"val.tok", "train.loss_mask.tok", "val.loss_mask.tok", "dataset.json"})
    EXPECT_FALSE(std::filesystem::exists(out + "/" + gone)) << gone;
  for (const auto& name : stale) EXPECT_FALSE(std::filesystem::exists(out + "/" + name)) << name;
  for (const auto& name : kept) EXPECT_EQ(read_text(out + "/" + name), "mine") << name;
  std::filesystem::remove_all(blocked);
  prepare_documents({"In the beginning", "the LORD said"}, opt);
  EXPECT_EQ(ShardReader(out + "/val.tok").num_documents(), 1);
}

// dataset.json describes the shards prepare wrote beside it; edited ("bpe" renamed "byte", as
// if the ids were bytes) it no longer does, and each shard says so.
TEST(Prepare, ADescriptionIsCheckedAgainstItsShards) {
  TempDir dir;
  const std::string bpe = dir.file("bpe"), out = dir.file("out");
  data::write_bpe_files(bpe, fixture::english_merges());
  prepare_two_documents(bpe, out);
  const ShardReader train(out + "/train.tok"), val(out + "/val.tok");
  ASSERT_GT(train.vocab_size(), 256);
  check_described_shard(train);
  check_described_shard(val);
  std::string json = read_text(out + "/dataset.json");
  json.replace(json.find("\"bpe\""), 5, "\"byte\"");
  std::ofstream(out + "/dataset.json") << json;
  for (const ShardReader* shard : {&train, &val})
    expect_input_error([&] { check_described_shard(*shard); },
                       {out + "/dataset.json does not describe " + shard->path(),
                        "\"tokenizer\": \"byte\"", "prepare the data set again"});
  std::ofstream(out + "/dataset.json") << "{\"tokenizer\": ";
  expect_input_error([&] { check_described_shard(train); }, {out + "/dataset.json", "JSON"});
  std::filesystem::remove(out + "/dataset.json");
  check_described_shard(train);  // shards written another way describe themselves
}

// prepare never writes over its own corpus file, nor over a vocabulary it did not copy.
TEST(Prepare, KeepsItsCorpusAndAVocabularyItDidNotWrite) {
  TempDir dir;
  const std::string out = dir.file("out");
  std::filesystem::create_directories(out);
  const std::string text = "In the beginning\n\nthe LORD said\n\nand it was so\n";
  PrepareOptions opt;
  opt.output_dir = out;
  for (const char* file : {"train.tok", "val.loss_mask.tok", "dataset.json", "merges.txt"}) {
    std::ofstream(out + "/" + file, std::ios::binary) << text;
    opt.corpus = std::string("file:") + out + "/" + file;
    expect_input_error([&] { prepare_dataset(opt); },
                       {file, "a file prepare writes or removes in --out"});
    EXPECT_EQ(read_text(out + "/" + file), text);
    std::filesystem::remove(out + "/" + file);
  }
  std::ofstream(dir.file("docs.txt"), std::ios::binary) << text;
  opt.corpus = "file:" + dir.file("docs.txt");
  EXPECT_NO_THROW(prepare_dataset(opt));

  // train-bpe's vocabulary in the output directory: byte prepares keep it (documented), a
  // BPE prepare would have replaced it by its copy and is refused.
  const std::string bpe = dir.file("bpe"), learned = dir.file("learned");
  data::write_bpe_files(bpe, fixture::english_merges());
  auto merges = fixture::english_merges();
  merges.pop_back();
  data::write_bpe_files(learned, merges);
  const std::string learned_vocab = read_text(learned + "/vocab.json");
  opt.output_dir = learned;
  prepare_dataset(opt);
  opt.tokenizer = "bpe:" + bpe;
  expect_input_error([&] { prepare_dataset(opt); },
                     {learned + "/vocab.json", "no dataset.json there names as prepare's copy"});
  opt.tokenizer.reset();
  prepare_dataset(opt);
  EXPECT_EQ(read_text(learned + "/vocab.json"), learned_vocab);
  // Even the same files are not taken over: the copy's description would let a later byte
  // prepare remove the learned vocabulary.
  data::write_bpe_files(learned, fixture::english_merges());
  opt.tokenizer = "bpe:" + bpe;
  expect_input_error([&] { prepare_dataset(opt); }, {"train-bpe's, or a prepare cut short"});
}

// A vocabulary whose merges.txt or vocab.json is a directory (which would read as an empty
// file: no merges) or that does not exist is refused by name, and nothing is prepared.
TEST(Prepare, ABpeDirectoryWithoutItsFilesIsRefused) {
  TempDir dir;
  const std::string bpe = dir.file("bpe"), out = dir.file("out");
  for (const char* file : {"vocab.json", "merges.txt"}) {
    data::write_bpe_files(bpe, fixture::english_merges());
    std::filesystem::remove(bpe + "/" + file);
    std::filesystem::create_directory(bpe + "/" + file);
    expect_input_error([&] { prepare_two_documents(bpe, out); },
                       {bpe + "/" + file + ": is a directory"});
    EXPECT_FALSE(std::filesystem::exists(out + "/dataset.json"));
    std::filesystem::remove(bpe + "/" + file);
  }
  expect_input_error([&] { prepare_two_documents(dir.file("nonexistent"), out); },
                     {dir.file("nonexistent/vocab.json") + ": no such file or directory"});
}

// A run's copy of a BPE vocabulary whose files no longer match the data set's record is
// refused before anything is staged: no `<copy>.tmp.<pid>` is left beside the copy.
TEST(Prepare, ARefusedTokenizerCopyLeavesNothingBehind) {
  TempDir dir;
  const std::string bpe = dir.file("bpe"), out = dir.file("out"), run = dir.file("run");
  data::write_bpe_files(bpe, fixture::english_merges());
  prepare_two_documents(bpe, out);
  std::ofstream(out + "/merges.txt", std::ios::app) << "x y\n";
  std::filesystem::create_directories(run);
  expect_input_error([&] { save_tokenizer(out, run + "/tokenizer"); }, {out, "dataset.json"});
  EXPECT_TRUE(std::filesystem::is_empty(run));
}

// SFT samples through BPE: each run of equally trained bytes is encoded apart, so the trained
// tokens decode to exactly the trained bytes and the others to the context.
TEST(Prepare, SftSamplesTakeBpeRunByRun) {
  TempDir dir;
  const std::string bpe = dir.file("bpe"), out = dir.file("out");
  const int vocab = int(data::write_bpe_files(bpe, fixture::english_merges()));
  std::vector<SftSample> samples;
  for (const std::string reply : {"the LORD said\n", "and the earth\n", "he said the\n"}) {
    SftSample s;
    s.text = "User: in the beginning\nAssistant: " + reply;
    s.trained.assign(s.text.size(), 0);
    std::fill(s.trained.end() - int64_t(reply.size()), s.trained.end(), uint8_t(1));
    samples.push_back(s);
  }
  PrepareOptions opt;
  opt.corpus = "chat:test.jsonl";
  opt.output_dir = out;
  opt.val_fraction = 0.34;
  opt.tokenizer = "bpe:" + bpe;
  const PrepareResult res = prepare_samples(samples, opt);
  const auto tokenizer = load_tokenizer(out, vocab);
  ASSERT_EQ(tokenizer->name(), "bpe");
  std::vector<std::string> contexts, replies;
  int64_t tokens = 0, trained = 0;
  for (const SplitCounts& split : {res.train, res.val}) {
    const auto docs = shard_documents(ShardReader(split.path));
    const auto marks = shard_documents(ShardReader(loss_mask_path(split.path)));
    ASSERT_EQ(docs.size(), marks.size());
    int64_t split_trained = 0;
    for (size_t d = 0; d < docs.size(); ++d) {
      ASSERT_EQ(docs[d].size(), marks[d].size());
      std::string context, reply;
      for (size_t t = 0; t < docs[d].size(); ++t)
        (marks[d][t] ? reply : context) += tokenizer->decode(std::span(&docs[d][t], 1));
      contexts.push_back(context);
      replies.push_back(reply);
      tokens += int64_t(docs[d].size());
      split_trained += std::count(marks[d].begin(), marks[d].end(), 1);
    }
    EXPECT_EQ(split.trained_tokens, split_trained);
    trained += split_trained;
  }
  std::sort(replies.begin(), replies.end());
  EXPECT_EQ(replies,
            (std::vector<std::string>{"and the earth\n", "he said the\n", "the LORD said\n"}));
  for (const auto& c : contexts) EXPECT_EQ(c, "User: in the beginning\nAssistant: ");
  int64_t bytes = 0, reply_bytes = 0;
  for (const auto& s : samples) {
    bytes += int64_t(s.text.size());
    reply_bytes += std::count(s.trained.begin(), s.trained.end(), 1);
  }
  EXPECT_LT(tokens, bytes);
  EXPECT_LT(trained, reply_bytes);
}

// A tokens:PATH corpus with --tokenizer bpe:DIR: the ids are that vocabulary's, which must fit
// in --vocab; byte is refused (its ids are not bytes).
TEST(Prepare, TokenFileTakesTheVocabularyOfItsIds) {
  TempDir dir;
  const std::string bpe = dir.file("bpe"), file = dir.file("ids.bin"), out = dir.file("out");
  std::filesystem::create_directories(bpe);
  const int vocab = int(data::write_bpe_files(bpe, fixture::english_merges()));
  write_ids<uint16_t>(file, {257, 32, 271, 280, 258, 261, 280});
  PrepareOptions opt;
  opt.corpus = "tokens:" + file;
  opt.output_dir = out;
  opt.val_fraction = 0.5;
  opt.vocab = 320;
  opt.eot = vocab - 1;
  opt.tokenizer = "bpe:" + bpe;
  const PrepareResult res = prepare_dataset(opt);
  EXPECT_EQ(nlohmann::json::parse(read_text(res.metadata_path))["tokenizer"], "bpe");
  const auto tokenizer = load_tokenizer(out, 320);
  ASSERT_NE(tokenizer, nullptr);
  EXPECT_EQ(tokenizer->decode(std::vector<int32_t>{257, 32, 271, 280}), "the LORD<|endoftext|>");
  opt.vocab = vocab - 1;
  opt.eot = 3;
  expect_input_error([&] { prepare_dataset(opt); }, {bpe, "281 ids", "--vocab 280"});
  opt.tokenizer = "byte";
  expect_input_error([&] { prepare_dataset(opt); }, {"tokens:PATH", "not byte"});
  opt.tokenizer.reset();
  opt.vocab = 320;
  opt.eot = vocab - 1;
  prepare_dataset(opt);
  EXPECT_FALSE(std::filesystem::exists(out + "/vocab.json"));
  EXPECT_EQ(load_tokenizer(out, 320), nullptr) << "ids without a vocabulary";
}

// Documents that cross the file's read chunks (3 ids per read here) arrive whole, in order;
// the count agrees and holds none of them; ids past 2^31 in a u32 file and negative i32 ids
// are outside any vocabulary.
TEST(TokenFile, DocumentsCrossReadChunksWhole) {
  TempDir dir;
  const std::string file = dir.file("ids.bin");
  const std::vector<std::vector<int32_t>> docs = {{1, 2, 3, 4, 9}, {9}, {5, 6, 9}, {7, 8}};
  std::vector<int64_t> ids;
  for (const auto& d : docs) ids.insert(ids.end(), d.begin(), d.end());
  write_ids<uint16_t>(file, ids);
  for (int64_t chunk : {1, 3, 4, 1 << 20}) {
    SCOPED_TRACE("chunk " + std::to_string(chunk));
    const TokenFile f(file, RawTokenDtype::u16, 10, 9, chunk);
    EXPECT_EQ(f.num_tokens(), int64_t(ids.size()));
    EXPECT_EQ(f.count_documents(), 4);
    std::vector<std::vector<int32_t>> got;
    f.for_each_document([&](std::span<const int32_t> d) { got.emplace_back(d.begin(), d.end()); });
    EXPECT_EQ(got, docs);
  }
  write_ids<uint32_t>(file, {1, 9, int64_t(1) << 31, 9});
  expect_input_error([&] { TokenFile(file, RawTokenDtype::u32, 10, 9).count_documents(); },
                     {"token 2147483648 at index 2"});
  write_ids<int32_t>(file, {1, 9, -5, 9});
  expect_input_error([&] { TokenFile(file, RawTokenDtype::i32, 10, 9).count_documents(); },
                     {"token -5 at index 2"});
}
