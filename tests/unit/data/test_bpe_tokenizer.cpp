#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>

#include "support/bpe_files.hpp"
#include "tessel/core/rng.hpp"
#include "tessel/data/bpe_tokenizer.hpp"
#include "tessel/data/bpe_trainer.hpp"
#include "tessel/data/byte_tokenizer.hpp"
#include "unit/data/test_util.hpp"

using namespace tessel;
using namespace tessel::data;
using tessel::data::testing::expect_input_error;
using tessel::data::testing::TempDir;
using tessel::fixture::english_merges;

namespace {

std::vector<std::string> pieces(std::string_view text) {
  std::vector<std::string> out;
  for (std::string_view p : gpt2_pretokenize(text)) out.emplace_back(p);
  return out;
}

using Pieces = std::vector<std::string>;

// Random UTF-8 text from characters that exercise every pre-tokenizer rule.
std::string random_text(Rng& rng, size_t chars) {
  static const std::vector<std::string> pool = {
      "a",    "Z",       "é",  "ß", "中", "1",   "٣", "Ⅻ", " ", " ", "  ",
      "\n",   "\t",      "\r", "'", "'s", "'ll", "!", ".", "—", "😀", std::string(1, '\0'),
      "\x7f", "\xc2\xa0" /* no-break space */};
  std::string text;
  for (size_t i = 0; i < chars; ++i) text += pool[rng.below(pool.size())];
  return text;
}

class BpeFiles : public ::testing::Test {
 protected:
  void SetUp() override {
    vocab_size_ = int(write_bpe_files(dir_.path().string(), english_merges()));
  }
  BpeTokenizer load() const {
    return BpeTokenizer(dir_.file("vocab.json"), dir_.file("merges.txt"));
  }
  void write(const std::string& name, const std::string& text) const {
    std::ofstream(dir_.file(name)) << text;
  }
  TempDir dir_;
  int vocab_size_ = 0;
};

}  // namespace

TEST(Gpt2Pretokenize, SplitsAsTheReferencePattern) {
  // Each expectation follows the pattern's first matching alternative, by hand.
  EXPECT_EQ(pieces("Hello world"), (Pieces{"Hello", " world"}));
  EXPECT_EQ(pieces("I'm here, they're 'quoted'"),
            (Pieces{"I", "'m", " here", ",", " they", "'re", " '", "quoted", "'"}));
  EXPECT_EQ(pieces("'ll'd'S"), (Pieces{"'ll", "'d", "'", "S"}));  // contractions: lower case
  EXPECT_EQ(pieces("a  b"), (Pieces{"a", " ", " b"}));  // a space run leaves one to the word
  EXPECT_EQ(pieces("x\n\ny"), (Pieces{"x", "\n", "\n", "y"}));
  EXPECT_EQ(pieces("x\n\n"), (Pieces{"x", "\n\n"}));  // a run at the end stays whole
  EXPECT_EQ(pieces("ends   "), (Pieces{"ends", "   "}));
  EXPECT_EQ(pieces("a\tb"), (Pieces{"a", "\t", "b"}));
  EXPECT_EQ(pieces("abc123 4.5"), (Pieces{"abc", "123", " 4", ".", "5"}));
  // Unicode letters (é, ñ), numbers (Arabic-Indic digits Nd, Roman numeral Nl), symbols.
  EXPECT_EQ(pieces("café ñ ٣٤Ⅻ 😀!"), (Pieces{"café", " ñ", " ٣٤Ⅻ", " 😀!"}));
  EXPECT_EQ(pieces("a\xc2\xa0\xc2\xa0"
                   "b"),
            (Pieces{"a", "\xc2\xa0", "\xc2\xa0", "b"}))
      << "no-break space is White_Space but not ' ': it never joins a word";
  // Cases checked against Python's `regex` module (the one GPT-2's encoder uses) in review:
  // regex.findall(pattern, text) gives these pieces.
  EXPECT_EQ(pieces(" 's"), (Pieces{" '", "s"}));
  EXPECT_EQ(pieces(" \tfoo"), (Pieces{" ", "\t", "foo"}));
  EXPECT_EQ(pieces("cafe\xcc\x81"), (Pieces{"cafe", "\xcc\x81"}));  // a combining mark: other
  EXPECT_EQ(pieces("a \x1c"
                   "b"),
            (Pieces{"a", " \x1c", "b"}));  // U+001C: not White_Space
  EXPECT_EQ(pieces("''s?'s"), (Pieces{"''", "s", "?'", "s"}));
  EXPECT_EQ(pieces("a\xe3\x80\x80"
                   "b\xe2\x80\xa8"),
            (Pieces{"a", "\xe3\x80\x80", "b", "\xe2\x80\xa8"}));
  EXPECT_TRUE(pieces("").empty());
}

TEST(Gpt2Pretokenize, PiecesCoverTheTextAndRejectBadUtf8) {
  Rng rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const std::string text = random_text(rng, rng.below(40));
    std::string joined;
    for (const auto& p : pieces(text)) {
      EXPECT_FALSE(p.empty());
      joined += p;
    }
    EXPECT_EQ(joined, text);
  }
  expect_input_error([] { gpt2_pretokenize("ok \xff"); }, {"not valid UTF-8", "byte 3"});
  expect_input_error([] { gpt2_pretokenize("\xe4\xb8"); }, {"byte 0"});  // cut short
}

TEST(BpeMerge, FollowsRanksNotPositions) {
  // Symbols 0..4; merges: (1,2)->5 rank 0, (0,1)->6 rank 1, (5,3)->7 rank 2, (0,0)->8 rank 3.
  const BpeMergeTable table = {{bpe_pair_key(1, 2), {0, 5}},
                               {bpe_pair_key(0, 1), {1, 6}},
                               {bpe_pair_key(5, 3), {2, 7}},
                               {bpe_pair_key(0, 0), {3, 8}}};
  // (0,1) comes first by position but (1,2) by rank.
  EXPECT_EQ(bpe_merge({0, 1, 2, 3}, table), (std::vector<int32_t>{0, 7}));
  EXPECT_EQ(bpe_merge({0, 0, 0}, table), (std::vector<int32_t>{8, 0}));  // leftmost first
  EXPECT_EQ(bpe_merge({0, 0, 0, 0}, table), (std::vector<int32_t>{8, 8}));
  EXPECT_EQ(bpe_merge({4}, table), (std::vector<int32_t>{4}));
  EXPECT_TRUE(bpe_merge({}, table).empty());
  EXPECT_EQ(naive::bpe_merge({0, 1, 2, 3}, table), (std::vector<int32_t>{0, 7}));
}

TEST(BpeMerge, HeapEqualsTheReferenceLoopOnRandomTables) {
  // Tables as BPE training makes them: each merge joins two tokens that exist by then into a
  // new one. Few symbols and many merges give long chains and repeated pairs.
  Rng rng(11);
  for (int table_no = 0; table_no < 20; ++table_no) {
    const int32_t symbols = 2 + int32_t(rng.below(4));
    BpeMergeTable table;
    int32_t next_id = symbols;
    for (int32_t rank = 0; rank < 60; ++rank) {
      const auto left = int32_t(rng.below(uint64_t(next_id)));
      const auto right = int32_t(rng.below(uint64_t(next_id)));
      if (table.emplace(bpe_pair_key(left, right), BpeMerge{rank, next_id}).second) ++next_id;
    }
    for (int word = 0; word < 50; ++word) {
      std::vector<int32_t> ids(rng.below(80));
      for (auto& id : ids) id = int32_t(rng.below(uint64_t(symbols)));
      ASSERT_EQ(bpe_merge(ids, table), naive::bpe_merge(ids, table))
          << "table " << table_no << ", word " << word;
    }
  }
}

TEST_F(BpeFiles, EncodesByMergeRankAndRoundTrips) {
  const BpeTokenizer tok = load();
  EXPECT_EQ(tok.vocab_size(), vocab_size_);
  EXPECT_EQ(tok.name(), "bpe");
  EXPECT_EQ(tok.end_of_text(), vocab_size_ - 1);
  // Ids: "th" 256, "the" 257, "Ġthe" 258, ... (english_merges order); bytes are their value.
  EXPECT_EQ(tok.encode("the LORD said"), (std::vector<int32_t>{257, ' ', 271, 275}));
  // " the": (t, h) outranks (Ġ, t), so "Ġthe" forms, not "Ġth" + "e".
  EXPECT_EQ(tok.encode("And the"), (std::vector<int32_t>{'A', 'n', 'd', 258}));
  EXPECT_EQ(tok.encode("x\n\n"), (std::vector<int32_t>{'x', 276}));
  EXPECT_EQ(tok.encode("x\n\ny"), (std::vector<int32_t>{'x', '\n', '\n', 'y'}));
  EXPECT_EQ(tok.decode(std::vector<int32_t>{258, 261}), " the and");
  Rng rng(3);
  for (int trial = 0; trial < 300; ++trial) {
    const std::string text = random_text(rng, rng.below(60));
    EXPECT_EQ(tok.decode(tok.encode(text)), text);
  }
  EXPECT_LT(tok.encode("the LORD said and the LORD").size(),
            ByteTokenizer().encode("the LORD said and the LORD").size());
}

TEST_F(BpeFiles, DecodesGapsAsReplacementAndRefusesIdsOutsideTheVocabulary) {
  // "<|endoftext|>" moved 5 ids up: the ids it skips name no token.
  auto vocab = nlohmann::json::parse(std::ifstream(dir_.file("vocab.json")));
  vocab["<|endoftext|>"] = vocab_size_ + 4;
  write("vocab.json", vocab.dump());
  const BpeTokenizer tok = load();
  EXPECT_EQ(tok.vocab_size(), vocab_size_ + 5);
  EXPECT_EQ(tok.decode(std::vector<int32_t>{'a', vocab_size_ - 1, vocab_size_ + 3}),
            "a\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(tok.decode(std::vector<int32_t>{tok.end_of_text()}), "<|endoftext|>");
  for (int32_t bad : {-1, vocab_size_ + 5})
    expect_input_error(
        [&] {
          tok.decode(std::vector<int32_t>{'a', bad});
        },
        {"position 1", "outside [0, " + std::to_string(vocab_size_ + 5) + ")"});
}

TEST_F(BpeFiles, SingleTokenNamesTheSetting) {
  const BpeTokenizer tok = load();
  EXPECT_EQ(tok.single_token("\n", "--stop"), '\n');
  EXPECT_EQ(tok.single_token(" the", "--stop"), 258);
  EXPECT_EQ(tok.single_token("", "--stop"), -1);
  expect_input_error([&] { tok.single_token("the LORD", "--stop"); },
                     {"--stop", "bpe", "3 tokens"});
  // The text in the message is escaped: one line, whatever it holds.
  expect_input_error([&] { tok.single_token("\n\nthe", "--stop"); }, {"\"\\n\\nthe\" is 3 tokens"});
  expect_input_error([&] { tok.single_token("\xff", "--stop"); }, {"--stop: ", "UTF-8"});
  expect_input_error([] { ByteTokenizer().single_token("ab", "train.sample_stop"); },
                     {"train.sample_stop", "byte", "2 tokens"});
  // A backslash and an n, as an unquoted --set gives it: how a newline is written.
  expect_input_error([] { ByteTokenizer().single_token("\\n", "train.sample_stop"); },
                     {"2 tokens (a backslash and an n", "'train.sample_stop=\"\\n\"'"});
}

TEST_F(BpeFiles, RefusesTablesThatCouldFailToEncode) {
  const std::string vocab = dir_.file("vocab.json"), merges = dir_.file("merges.txt");
  auto rewrite_merges = [&](const std::string& body) {
    write("merges.txt", "#version: 0.2\n" + body);
  };
  rewrite_merges("t\n");
  expect_input_error([&] { load(); }, {merges, ":2:", "two tokens"});
  rewrite_merges("t h x\n");
  expect_input_error([&] { load(); }, {":2:", "two tokens"});
  rewrite_merges("th e\n");  // "th" is in vocab.json but no merge has made it yet
  expect_input_error([&] { load(); }, {":2:", "\"th\"", "earlier merge"});
  rewrite_merges("t h\nt h\n");
  expect_input_error([&] { load(); }, {":3:", "earlier merge"});
  rewrite_merges("q q\n");
  expect_input_error([&] { load(); }, {"\"qq\"", "not in"});
  rewrite_merges("zz z\n");
  expect_input_error([&] { load(); }, {"\"zz\" is not in"});

  write_bpe_files(dir_.path().string(), english_merges());
  write("vocab.json", "[1, 2]");
  expect_input_error([&] { load(); }, {vocab, "JSON object"});
  write("vocab.json", "{\"a\": ");
  expect_input_error([&] { load(); }, {vocab, "not valid JSON"});
  write("vocab.json", "{\"a\": 0, \"a\": 1}");
  expect_input_error([&] { load(); }, {vocab, "\"a\" appears twice"});
  write("vocab.json", "{\"a\": 0, \"b\": 70000}");
  expect_input_error([&] { load(); }, {vocab, "ids up to 70000 for 2 tokens"});
  write("vocab.json", "{\"a\": 0, \"b\": 0}");
  expect_input_error([&] { load(); }, {"id 0 belongs to two tokens"});
  write("vocab.json", "{\"a\": -3}");
  expect_input_error([&] { load(); }, {"\"a\"", "-3"});
  write("vocab.json", "{\"a\": 0}");
  expect_input_error([&] { load(); }, {"no token for byte 0"});
}

// A file that is missing or a directory is named as such (an ifstream reads a directory as an
// empty file: "no merges"), as is a vocabulary directory that does not exist.
TEST_F(BpeFiles, AMissingFileOrADirectoryIsNamed) {
  for (const char* file : {"vocab.json", "merges.txt"}) {
    std::filesystem::remove(dir_.file(file));
    std::filesystem::create_directory(dir_.file(file));
    expect_input_error([&] { load(); }, {dir_.file(file) + ": is a directory"});
    std::filesystem::remove(dir_.file(file));
    expect_input_error([&] { load(); }, {dir_.file(file) + ": no such file or directory"});
    write_bpe_files(dir_.path().string(), english_merges());
  }
  expect_input_error([&] { BpeTokenizer::from_directory(dir_.file("nonexistent")); },
                     {dir_.file("nonexistent/vocab.json"), "no such file or directory"});
}

// A token is quoted escaped (a NUL or newline would cut or split the message) and cut short.
TEST_F(BpeFiles, ErrorsQuoteTokensEscapedAndCut) {
  write("merges.txt", "#version: 0.2\nt h\n" + std::string("a\0b", 3) + " c\n");
  expect_input_error([&] { load(); }, {dir_.file("merges.txt") + ":3: \"a\\u0000b\" is not in " +
                                       dir_.file("vocab.json")});
  write("merges.txt", "t h\nq\x01 x\n");
  expect_input_error([&] { load(); }, {":2: \"q\\u0001\" is not in"});
  const std::string long_token(2'000'000, 'q');
  write("merges.txt", long_token + " q\n");
  try {
    load();
    ADD_FAILURE() << "no InputError thrown";
  } catch (const InputError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find(":1: \"" + std::string(80, 'q') + "\"... (2000000 bytes) is not in"),
              std::string::npos)
        << what.substr(0, 300);
    EXPECT_LT(what.size(), 300u);
  }
  // Cut at a character, never inside one: 79 q's and a two-byte "Ġ" that would cross byte 80.
  write("merges.txt", std::string(79, 'q') + "Ġ" + long_token + " q\n");
  expect_input_error([&] { load(); }, {":1: \"" + std::string(79, 'q') + "\"... (2000081 bytes)"});
}

// merges.txt is UTF-8 text: a leading byte-order mark is dropped (as vocab.json's and a
// corpus's), and bytes that are not UTF-8 are named as such at their line.
TEST_F(BpeFiles, MergesDropAByteOrderMarkAndRefuseInvalidUtf8) {
  std::ifstream in(dir_.file("merges.txt"), std::ios::binary);
  const std::string merges((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  write("merges.txt", "\xEF\xBB\xBF" + merges);
  EXPECT_EQ(load().encode("the LORD said"), (std::vector<int32_t>{257, ' ', 271, 275}));
  write("merges.txt", "#version: 0.2\nt h\nth\xff e\n");
  expect_input_error([&] { load(); },
                     {dir_.file("merges.txt") + ":3: not valid UTF-8", "(at byte 20 of the file)"});
  // The offset counts the file's bytes, a byte-order mark's too.
  write("merges.txt", "\xEF\xBB\xBF#version: 0.2\nt h\nth\xff e\n");
  expect_input_error([&] { load(); }, {":3: not valid UTF-8", "(at byte 23 of the file)"});
}

// Every token is byte symbols (GPT-2's map), so that it decodes to bytes of its own: a token
// with another character, or an empty one, is refused by name and id; specials such as
// "<|endoftext|>" are printable ASCII, which is byte symbols.
// A token decodes to its byte symbols' bytes; a character that is no byte symbol (the specials
// of newer vocabularies, as "<\u2581bos\u2581>" or "<|a b|>") stands for its own UTF-8; an
// empty token, which would decode to nothing, is refused.
TEST_F(BpeFiles, TokensDecodeToTheirBytesAndAnEmptyOneIsRefused) {
  const auto vocab = nlohmann::json::parse(std::ifstream(dir_.file("vocab.json")));
  ASSERT_TRUE(vocab.contains("<|endoftext|>"));
  for (const auto& [token, bytes] : std::vector<std::pair<std::string, std::string>>{
           {"caf\u00E9", "caf\xE9"},  // "é" is byte 0xE9's own symbol, as in GPT-2's tokens
           {"\u0120x", " x"},         // "Ġ" is the space's
           {"<\u2581bos\u2581>", "<\u2581bos\u2581>"},
           {"<|a b|>", "<|a b|>"}}) {
    auto more = vocab;
    more[token] = vocab_size_;
    write("vocab.json", more.dump());
    EXPECT_EQ(load().decode(std::vector<int32_t>{vocab_size_}), bytes) << token;
  }
  auto empty = vocab;
  empty[""] = vocab_size_;
  write("vocab.json", empty.dump());
  expect_input_error([&] { load(); }, {dir_.file("vocab.json") + ": token \"\" (id " +
                                       std::to_string(vocab_size_) + ") is empty"});
}

TEST_F(BpeFiles, LoadTokenizerReadsWhatTheDirectoryHolds) {
  TempDir empty;
  const std::string none = empty.path().string();
  EXPECT_EQ(tokenizer_name(none), std::nullopt);
  EXPECT_EQ(load_tokenizer(none, 256)->name(), "byte") << "nothing, 256 ids: bytes";
  EXPECT_EQ(load_tokenizer(none, 50304), nullptr) << "nothing, other ids: none";
  // A vocabulary directory (train-bpe's output) is BPE as it is.
  const std::string d = dir_.path().string();
  EXPECT_EQ(tokenizer_name(d), "bpe");
  const auto bpe = load_tokenizer(d, 512);
  ASSERT_NE(bpe, nullptr);
  EXPECT_EQ(bpe->encode("the"), (std::vector<int32_t>{257}));
  expect_input_error([&] { load_tokenizer(d, 256); }, {"281 ids", "model.vocab = 256"});
  // dataset.json (a prepared data directory) decides before the files beside it.
  write("dataset.json", "{\"tokenizer\": \"pretokenized u16, eot 50256\"}");
  EXPECT_EQ(load_tokenizer(d, 50304), nullptr);
  write("dataset.json", "{\"tokenizer\": \"byte\"}");
  EXPECT_EQ(load_tokenizer(d, 300)->name(), "byte");
  write("dataset.json", "{\"tokenizer\": \"sentencepiece\"}");
  expect_input_error([&] { load_tokenizer(d, 300); }, {"unknown tokenizer", "sentencepiece"});
  write("dataset.json", "{}");
  expect_input_error([&] { load_tokenizer(d, 300); }, {"dataset.json", "\"tokenizer\""});
  write("dataset.json", "{\"tokenizer\": \"bpe\"}");

  // A run's copy (save_tokenizer): tokenizer.json and the vocabulary, equal to its source.
  const std::string copy = empty.file("run/tokenizer");
  save_tokenizer(d, copy);
  EXPECT_EQ(tokenizer_name(copy), "bpe");
  EXPECT_EQ(load_tokenizer(copy, 512)->encode("the LORD"), bpe->encode("the LORD"));
  check_same_tokenizer({copy, d});
  const std::string bytes = empty.file("bytes");
  std::filesystem::create_directories(bytes);
  std::ofstream(bytes + "/dataset.json") << "{\"tokenizer\": \"byte\"}";
  const std::string byte_copy = empty.file("run2/tokenizer");
  save_tokenizer(bytes, byte_copy);
  EXPECT_EQ(tokenizer_name(byte_copy), "byte");
  expect_input_error([&] { check_same_tokenizer({copy, byte_copy}); }, {"byte and bpe"});
  // Pretokenized ids name no tokenizer to compare; their copy replaces an older one whole, so
  // that no other vocabulary speaks for them.
  std::ofstream(bytes + "/dataset.json") << "{\"tokenizer\": \"pretokenized u32, eot 3\"}";
  check_same_tokenizer({copy, bytes});
  save_tokenizer(bytes, copy);
  EXPECT_EQ(tokenizer_name(copy), "pretokenized u32, eot 3");
  EXPECT_FALSE(std::filesystem::exists(copy + "/vocab.json"));
  EXPECT_EQ(load_tokenizer(copy, 512), nullptr);
  save_tokenizer(none, empty.file("run3/tokenizer"));  // nothing to copy: nothing written
  EXPECT_FALSE(std::filesystem::exists(empty.file("run3/tokenizer")));
}
