#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <set>

#include "support/bpe_files.hpp"
#include "tessel/core/rng.hpp"
#include "tessel/data/bpe_tokenizer.hpp"
#include "tessel/data/bpe_trainer.hpp"
#include "unit/data/test_util.hpp"

using namespace tessel;
using namespace tessel::data;
using tessel::data::testing::bible_documents;
using tessel::data::testing::expect_input_error;
using tessel::data::testing::TempDir;

using Merges = std::vector<BpeMergeStrings>;

TEST(BpeTrainer, MergesTheMostFrequentPairUntilNoneRepeats) {
  // Pieces "ab" x1, " ab" x2, "abc" x1: (a, b) occurs 4 times, then (Ġ, ab) twice; (ab, c)
  // once, which ends learning before the 10 merges asked for.
  const std::vector<std::string> docs = {"ab ab ab", "abc"};
  EXPECT_EQ(learn_bpe_merges(docs, 10), (Merges{{"a", "b"}, {"Ġ", "ab"}}));
  EXPECT_EQ(learn_bpe_merges(docs, 1), (Merges{{"a", "b"}}));
  EXPECT_TRUE(learn_bpe_merges(docs, 0).empty());
  // Equal counts: the lower (left id, right id) first, i.e. (a, b) before (c, d).
  EXPECT_EQ(learn_bpe_merges({"cd", "ab", "cd", "ab"}, 10), (Merges{{"a", "b"}, {"c", "d"}}));
  // A run: "aaaa" x2 counts (a, a) three times per piece; left to right it becomes [aa, aa].
  EXPECT_EQ(learn_bpe_merges({"aaaa", "aaaa"}, 10), (Merges{{"a", "a"}, {"aa", "aa"}}));
  expect_input_error([&] { learn_bpe_merges(docs, -1); }, {"merges", "-1"});
}

TEST(BpeTrainer, IncrementalCountsEqualTheRecountingTwin) {
  Rng rng(5);
  for (int corpus = 0; corpus < 12; ++corpus) {
    // Few letters and many repeats: long merge chains, runs and ties.
    const std::string letters = corpus % 2 ? "ab" : "abcde";
    std::vector<std::string> docs(1 + rng.below(8));
    for (auto& doc : docs)
      for (size_t c = rng.below(200); c > 0; --c)
        doc += rng.below(6) == 0 ? ' ' : letters[rng.below(letters.size())];
    ASSERT_EQ(learn_bpe_merges(docs, 80), naive::learn_bpe_merges(docs, 80)) << "corpus " << corpus;
  }
  const std::vector<std::string> genesis(bible_documents().begin(), bible_documents().begin() + 6);
  EXPECT_EQ(learn_bpe_merges(genesis, 150), naive::learn_bpe_merges(genesis, 150));
}

// What train-bpe writes loads as a tokenizer (whose loader refuses a token made twice), in
// GPT-2's symbols, and compresses the text it was learned from.
TEST(BpeTrainer, WrittenFilesLoadAndCompressTheirCorpus) {
  const std::vector<std::string> docs(bible_documents().begin(), bible_documents().begin() + 50);
  const Merges merges = learn_bpe_merges(docs, 400);
  ASSERT_EQ(merges.size(), 400u);
  std::set<std::string> made;
  for (const auto& [left, right] : merges) EXPECT_TRUE(made.insert(left + right).second);
  TempDir dir;
  const std::string out = dir.file("bible-bpe");
  EXPECT_EQ(write_bpe_files(out, merges), 657);
  const auto vocab = nlohmann::json::parse(std::ifstream(out + "/vocab.json"));
  for (int b = 0; b < 256; ++b) EXPECT_EQ(vocab.at(fixture::gpt2_byte_symbol(b)), b) << b;
  EXPECT_EQ(vocab.at("<|endoftext|>"), 656);
  const BpeTokenizer tok(out + "/vocab.json", out + "/merges.txt");
  EXPECT_EQ(tok.vocab_size(), 657);
  int64_t bytes = 0, tokens = 0;
  for (const auto& doc : docs) {
    const auto ids = tok.encode(doc);
    ASSERT_EQ(tok.decode(ids), doc);
    bytes += int64_t(doc.size());
    tokens += int64_t(ids.size());
  }
  EXPECT_LT(double(tokens), 0.5 * double(bytes)) << "400 merges halve the text at least";
}
