// SFT data: conversation rendering and its loss mask, the JSON Lines and Bible-quote corpora,
// best-fit packing against a naive twin, and packed loader rows against the samples they hold.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <tuple>

#include "tessel/core/rng.hpp"
#include "tessel/data/loader.hpp"
#include "tessel/data/packing.hpp"
#include "tessel/data/prepare.hpp"
#include "tessel/data/sft_corpus.hpp"
#include "unit/data/test_util.hpp"

using namespace tessel;
using namespace tessel::data;
using tessel::data::testing::expect_input_error;
using tessel::data::testing::TempDir;

namespace {

// The trained bytes of a sample, as text.
std::string trained_text(const SftSample& s) {
  std::string out;
  for (size_t i = 0; i < s.text.size(); ++i)
    if (s.trained[i]) out.push_back(s.text[i]);
  return out;
}

// Random conversations: a user line of 1..12 words and a reply of 1..30 words.
std::vector<SftSample> random_samples(int count, uint64_t seed) {
  const char* words[] = {"the", "light", "was", "good", "and", "god", "said", "let"};
  Rng rng(seed);
  auto sentence = [&](int max_words) {
    std::string s;
    for (int w = 1 + int(rng.below(uint64_t(max_words))); w > 0; --w)
      s += std::string(words[rng.below(8)]) + (w > 1 ? " " : ".");
    return s;
  };
  std::vector<SftSample> samples;
  for (int i = 0; i < count; ++i) {
    const ChatMessage m[2] = {{"user", sentence(12)}, {"assistant", sentence(30)}};
    samples.push_back(render_conversation(m, "test"));
  }
  return samples;
}

// The naive twin of pack_best_fit: scan every row for the one with the least room that fits
// (the first such row on ties), items taken longest first (lower index on ties).
std::vector<std::vector<int64_t>> naive_best_fit(const std::vector<int64_t>& lengths,
                                                 int64_t capacity) {
  std::vector<int64_t> order(lengths.size());
  std::iota(order.begin(), order.end(), int64_t(0));
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return lengths[size_t(a)] > lengths[size_t(b)]; });
  std::vector<std::vector<int64_t>> rows;
  std::vector<int64_t> room;
  for (int64_t i : order) {
    int64_t best = -1;
    for (size_t r = 0; r < rows.size(); ++r)
      if (room[r] >= lengths[size_t(i)] && (best < 0 || room[r] < room[size_t(best)]))
        best = int64_t(r);
    if (best < 0) {
      best = int64_t(rows.size());
      rows.emplace_back();
      room.push_back(capacity);
    }
    rows[size_t(best)].push_back(i);
    room[size_t(best)] -= lengths[size_t(i)];
  }
  return rows;
}

}  // namespace

TEST(SftRender, OnlyTheAssistantRepliesAreTrained) {
  const ChatMessage m[] = {{"system", "Be brief."},
                           {"user", "Hi?"},
                           {"assistant", "Hello."},
                           {"user", "More?"},
                           {"assistant", "No."}};
  const SftSample s = render_conversation(m, "here");
  EXPECT_EQ(s.text,
            "System: Be brief.\nUser: Hi?\nAssistant: Hello.\nUser: More?\nAssistant: No.\n");
  ASSERT_EQ(s.trained.size(), s.text.size());
  // The replies with their closing newlines, and nothing of the generation prompt.
  EXPECT_EQ(trained_text(s), "Hello.\nNo.\n");
  const size_t reply = s.text.find("Hello.");
  EXPECT_EQ(s.trained[reply - 1], 0) << "the space of \"Assistant: \"";
  EXPECT_EQ(s.trained[reply], 1);
}

TEST(SftRender, BadConversationsAreClearErrors) {
  const ChatMessage bot[] = {{"user", "a"}, {"bot", "b"}};
  expect_input_error([&] { render_conversation(bot, "f.jsonl:3"); },
                     {"f.jsonl:3", "role \"bot\"", "system, user or assistant"});
  // A role holding a newline and a NUL is shown escaped: the error stays one whole line.
  const ChatMessage odd[] = {{std::string("user\nAssistant: x\0y", 19), "a"}};
  try {
    render_conversation(odd, "f.jsonl:5");
    ADD_FAILURE() << "an unknown role was accepted";
  } catch (const InputError& e) {
    EXPECT_EQ(std::string(e.what()),
              "f.jsonl:5: messages[0]: role \"user\\nAssistant: x\\u0000y\" is not system, "
              "user or assistant");
  }
  const ChatMessage no_reply[] = {{"user", "a"}, {"assistant", ""}};
  expect_input_error([&] { render_conversation(no_reply, "f.jsonl:4"); },
                     {"f.jsonl:4", "no assistant message"});
}

TEST(SftCorpus, JsonLinesInBothFormsAndErrorsNameTheLine) {
  const auto samples = parse_chat_jsonl(
      "{\"messages\": [{\"role\": \"user\", \"content\": \"Q\"}, {\"role\": \"assistant\", "
      "\"content\": \"A\\nB\"}]}\n\n  \n{\"prompt\": \"p\", \"response\": \"r\"}\n",
      "chat.jsonl");
  ASSERT_EQ(samples.size(), 2u);
  EXPECT_EQ(samples[0].text, "User: Q\nAssistant: A\nB\n");
  EXPECT_EQ(trained_text(samples[0]), "A\nB\n");
  EXPECT_EQ(samples[1].text, "User: p\nAssistant: r\n");
  EXPECT_EQ(trained_text(samples[1]), "r\n");

  expect_input_error([] { parse_chat_jsonl("{\"prompt\": \"p\"}\n{oops\n", "c.jsonl"); },
                     {"c.jsonl:1", "\"response\""});
  expect_input_error(
      [] { parse_chat_jsonl("{\"prompt\": \"p\", \"response\": \"r\"}\n{oops\n", "c.jsonl"); },
      {"c.jsonl:2", "not valid JSON"});
  expect_input_error([] { parse_chat_jsonl("{\"messages\": [{\"role\": 1}]}", "c.jsonl"); },
                     {"c.jsonl:1", "messages[0]", "\"role\" is not a string"});
  expect_input_error([] { parse_chat_jsonl("[1, 2]", "c.jsonl"); }, {"c.jsonl:1", "JSON object"});
  expect_input_error([] { parse_chat_jsonl("{\"text\": \"x\"}", "c.jsonl"); },
                     {"c.jsonl:1", "neither \"messages\""});
  expect_input_error([] { parse_chat_jsonl("\n \n", "c.jsonl"); }, {"c.jsonl", "no conversations"});
  // nlohmann keeps the last of two equal keys; the line is refused instead, at any depth. The
  // same key in two objects is fine.
  expect_input_error(
      [] {
        parse_chat_jsonl("{\"prompt\": \"a\", \"response\": \"r\", \"prompt\": \"b\"}", "c.jsonl");
      },
      {"c.jsonl:1", "\"prompt\" appears twice"});
  expect_input_error(
      [] {
        parse_chat_jsonl(
            "{\"messages\": [{\"role\": \"user\", \"content\": \"a\", \"content\": \"b\"}]}",
            "c.jsonl");
      },
      {"c.jsonl:1", "\"content\" appears twice"});
  EXPECT_EQ(parse_chat_jsonl("{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": "
                             "\"assistant\", \"content\": \"b\"}]}",
                             "c.jsonl")
                .size(),
            1u);
  // nlohmann's parser alone would stop at the NUL and drop the rest of the line.
  expect_input_error(
      [] {
        parse_chat_jsonl(std::string("{\"prompt\": \"p\", \"response\": \"r\"}\0{}", 35),
                         "c.jsonl");
      },
      {"c.jsonl:1", "NUL byte"});
  expect_input_error(
      [] {
        parse_chat_jsonl("{\"prompt\": \"p\", \"response\": \"r\", \"messages\": []}", "c.jsonl");
      },
      {"c.jsonl:1", "both"});
  // A number nlohmann cannot hold is an input error too, not an internal one.
  expect_input_error(
      [] { parse_chat_jsonl("{\"prompt\": \"p\", \"response\": \"r\", \"n\": 1e999}", "c.jsonl"); },
      {"c.jsonl:1", "not valid JSON"});
}

TEST(SftCorpus, BibleQuotesAskForEachVerse) {
  const auto samples = bible_quote_samples(
      {"Song of Solomon 3\n1 By night on my bed.\n2 I will rise now.\n", "Jude 1\n1 Jude.\n"});
  ASSERT_EQ(samples.size(), 3u);
  EXPECT_EQ(samples[0].text, "User: Quote Song of Solomon 3:1.\nAssistant: By night on my bed.\n");
  EXPECT_EQ(trained_text(samples[1]), "I will rise now.\n");
  EXPECT_EQ(samples[2].text, "User: Quote Jude 1:1.\nAssistant: Jude.\n");
  // Without a final newline the last verse still ends the chapter.
  EXPECT_EQ(bible_quote_samples({"Jude 1\n1 Jude."}).size(), 1u);
}

TEST(SftCorpus, PrepareWritesLossMasksAndATextPrepareRemovesThem) {
  TempDir dir;
  PrepareOptions o;
  o.corpus = "chat:test";
  o.output_dir = dir.path().string();
  o.val_fraction = 0.25;
  const auto samples = random_samples(40, 3);
  const PrepareResult r = prepare_samples(samples, o);
  EXPECT_TRUE(r.sft);
  EXPECT_EQ(r.train.documents + r.val.documents, 40);
  const ShardReader tokens(dir.file("train.tok")), mask(dir.file("train.loss_mask.tok"));
  EXPECT_EQ(mask.vocab_size(), 2);
  ASSERT_EQ(mask.num_tokens(), tokens.num_tokens());
  int64_t trained = 0;
  for (int64_t i = 0; i < mask.num_tokens(); ++i) trained += mask.token(i);
  EXPECT_EQ(trained, r.train.trained_tokens);
  EXPECT_GT(trained, 0);
  EXPECT_LT(trained, tokens.num_tokens());

  prepare_documents({"one\n", "two\n", "three\n"}, o);
  EXPECT_FALSE(std::filesystem::exists(dir.file("train.loss_mask.tok")));
  EXPECT_FALSE(std::filesystem::exists(dir.file("val.loss_mask.tok")));
}

TEST(Packing, BestFitDecreasingEqualsItsNaiveTwin) {
  Rng rng(5);
  for (int trial = 0; trial < 40; ++trial) {
    const int64_t capacity = 8 + int64_t(rng.below(120));
    std::vector<int64_t> lengths(1 + rng.below(300));
    for (auto& n : lengths) n = 1 + int64_t(rng.below(uint64_t(capacity)));
    const auto rows = pack_best_fit(lengths, capacity);
    ASSERT_EQ(rows, naive_best_fit(lengths, capacity)) << "trial " << trial;
    std::vector<int> seen(lengths.size(), 0);
    for (const auto& row : rows) {
      int64_t used = 0;
      for (int64_t i : row) used += lengths[size_t(i)], ++seen[size_t(i)];
      ASSERT_LE(used, capacity);
    }
    ASSERT_TRUE(std::all_of(seen.begin(), seen.end(), [](int c) { return c == 1; }));
  }
}

class SftLoader : public ::testing::Test {
 protected:
  void SetUp() override {
    samples_ = random_samples(120, 9);
    samples_.push_back(samples_[0]);  // duplicate text, still its own sample
    PrepareOptions o;
    o.corpus = "chat:test";
    o.output_dir = dir_.path().string();
    o.val_fraction = 0.1;
    prepare_samples(samples_, o);
    // The training split's samples in shard order, read back.
    const ShardReader tokens(dir_.file("train.tok")), mask(dir_.file("train.loss_mask.tok"));
    const auto starts = tokens.doc_starts();
    for (int64_t d = 0; d < tokens.num_documents(); ++d) {
      const int64_t end =
          d + 1 < tokens.num_documents() ? int64_t(starts[size_t(d + 1)]) : tokens.num_tokens();
      std::vector<int32_t> ids, marks;
      for (int64_t i = int64_t(starts[size_t(d)]); i < end; ++i)
        ids.push_back(tokens.token(i)), marks.push_back(mask.token(i));
      train_ids_.push_back(ids);
      train_marks_.push_back(marks);
    }
  }
  LoaderOptions options(int64_t T, int64_t mb = 2, int64_t accum = 1, int64_t rank = 0,
                        int64_t dp = 1) const {
    return {T, mb, accum, rank, dp, /*seed=*/77};
  }
  TempDir dir_;
  std::vector<SftSample> samples_;
  std::vector<std::vector<int32_t>> train_ids_, train_marks_;
};

// One sample's piece of a row as packing.hpp defines it, derived from the raw sample: its first
// min(n, T) tokens, each position's target (the next token of the sample, also past the cut;
// none after a whole sample's last token) and loss weight (the target's mark).
struct Piece {
  std::vector<int32_t> tokens, targets;
  std::vector<float> loss;
  bool operator<(const Piece& o) const {
    return std::tie(tokens, targets, loss) < std::tie(o.tokens, o.targets, o.loss);
  }
};

// Every row of one epoch against the samples, for both overlong policies: each kept sample
// exactly once with its targets and loss weights, padding without loss, a document start per
// sample, the counts of overlong and untrained samples, and row_tokens.
TEST_F(SftLoader, AnEpochOfRowsHoldsEveryKeptSampleOnce) {
  const int64_t T = 48;  // shorter than many samples
  for (Overlong policy : {Overlong::drop, Overlong::cut}) {
    SCOPED_TRACE(overlong_name(policy));
    LoaderOptions o = options(T, 1);
    o.overlong = policy;
    DataLoader loader(dir_.file("train.tok"), o);
    const PackedSamples* packed = loader.packed();
    ASSERT_NE(packed, nullptr);
    std::map<Piece, int> expected;
    int64_t overlong = 0, untrained = 0;
    for (size_t d = 0; d < train_ids_.size(); ++d) {
      const auto& ids = train_ids_[d];
      const auto& marks = train_marks_[d];
      const int64_t n = int64_t(ids.size()), m = std::min(n, T);
      if (n > T + 1 && policy == Overlong::drop) {  // T + 1 tokens fit: the last is a target
        ++overlong;
        continue;
      }
      Piece p;
      for (int64_t j = 0; j < m; ++j) {
        p.tokens.push_back(ids[size_t(j)]);
        p.targets.push_back(j + 1 < n ? ids[size_t(j + 1)] : 0);
        p.loss.push_back(j + 1 < n ? float(marks[size_t(j + 1)]) : 0.0f);
      }
      if (std::find(p.loss.begin(), p.loss.end(), 1.0f) == p.loss.end()) {
        ++untrained;
        continue;
      }
      overlong += n > T + 1;
      ++expected[p];
    }
    EXPECT_GT(overlong, 0);
    EXPECT_EQ(packed->overlong(), overlong);
    EXPECT_EQ(packed->untrained(), untrained);
    EXPECT_EQ(packed->samples() + overlong * (policy == Overlong::drop) + untrained,
              int64_t(train_ids_.size()));

    const int64_t W = loader.windows();
    EXPECT_EQ(W, packed->rows());
    for (int64_t g = 0; g < W; ++g) {
      const Batch b = loader.next();
      ASSERT_EQ(b.B, 1);
      const auto& starts = b.doc_starts[0];
      ASSERT_FALSE(starts.empty());
      ASSERT_EQ(starts[0], 0);
      int64_t used = 0;
      for (size_t k = 0; k < starts.size(); ++k) {
        const int64_t begin = starts[k], end = k + 1 < starts.size() ? starts[k + 1] : T;
        Piece p{{b.tokens.begin() + begin, b.tokens.begin() + end},
                {b.targets.begin() + begin, b.targets.begin() + end},
                {b.loss_mask.begin() + begin, b.loss_mask.begin() + end}};
        // Padding: the last piece, all zeros (sample text is never all zero bytes).
        const auto zero = [](auto v) { return v == 0; };
        if (k + 1 == starts.size() && std::all_of(p.tokens.begin(), p.tokens.end(), zero)) {
          ASSERT_TRUE(std::all_of(p.loss.begin(), p.loss.end(), zero));
          continue;
        }
        auto it = expected.find(p);
        ASSERT_NE(it, expected.end()) << "row " << g << " piece " << k << " is no kept sample";
        ASSERT_GT(it->second, 0) << "a sample placed twice";
        --it->second;
        used += end - begin;
      }
      EXPECT_EQ(used, packed->row_tokens(loader.row_of(g).row));
    }
    for (const auto& [piece, left] : expected) EXPECT_EQ(left, 0);
  }
}

// The rows come in the order of their first samples: unshuffled, row r's smallest sample index
// grows with r, so validation's first rows hold the corpus's first samples.
TEST_F(SftLoader, RowsFollowTheirFirstSamples) {
  const ShardReader tokens(dir_.file("train.tok"));
  const int64_t T = 200;  // every test sample fits
  const PackedSamples packed(tokens, T);
  ASSERT_EQ(packed.samples(), int64_t(train_ids_.size()));
  ASSERT_GT(packed.rows(), 2);
  // Row r starts with sample s_r, s_0 = 0 and s_r increasing; best-fit decreasing alone would
  // start with the longest sample.
  size_t next = 0;  // the smallest sample index not yet seen at a row start
  std::vector<bool> seen(train_ids_.size());
  for (int64_t r = 0; r < packed.rows(); ++r) {
    const int64_t ids[1] = {r};
    const Batch b = packed.batch(tokens, ids);
    while (seen[next]) ++next;
    const auto& first = train_ids_[next];
    ASSERT_TRUE(std::equal(first.begin(), first.end(), b.tokens.begin())) << "row " << r;
    // Mark every sample of the row seen, found by its tokens among the unseen ones.
    const auto& starts = b.doc_starts[0];
    for (size_t k = 0; k < starts.size(); ++k) {
      const int64_t begin = starts[k], end = k + 1 < starts.size() ? starts[k + 1] : T;
      for (size_t d = next; d < train_ids_.size(); ++d)
        if (!seen[d] && int64_t(train_ids_[d].size()) == end - begin &&
            std::equal(train_ids_[d].begin(), train_ids_[d].end(), b.tokens.begin() + begin)) {
          seen[d] = true;
          break;
        }
    }
  }
}

TEST_F(SftLoader, StepTokensCountTheRowsOfEveryRankWithoutPadding) {
  const int64_t T = 64;
  std::vector<DataLoader> ranks;
  for (int r = 0; r < 2; ++r) ranks.emplace_back(dir_.file("train.tok"), options(T, 2, 2, r, 2));
  for (int64_t step = 0; step < 12; ++step) {  // past the end of the first epoch
    int64_t nonpad = 0;
    for (auto& loader : ranks)
      for (int m = 0; m < 2; ++m) {
        const Batch b = loader.next();
        for (const auto& starts : b.doc_starts) {
          const size_t row = size_t(&starts - b.doc_starts.data());
          int64_t pad_from = T;
          const int32_t last = starts.back();
          if (std::all_of(b.tokens.begin() + int64_t(row) * T + last,
                          b.tokens.begin() + int64_t(row + 1) * T,
                          [](int32_t t) { return t == 0; }))
            pad_from = last;
          nonpad += pad_from;
        }
      }
    EXPECT_EQ(ranks[0].step_tokens(step), nonpad) << "step " << step;
    EXPECT_EQ(ranks[1].step_tokens(step), nonpad);
  }
}

// A mixture of two SFT data sets: each row is its data set's packed row with its padding,
// step_tokens counts the positions without padding over all ranks, and a mixture with a text
// data set is refused.
TEST_F(SftLoader, AMixtureOfSftDataSetsKeepsEachRowsPaddingAndRefusesText) {
  const int64_t T = 64;
  TempDir other_dir;
  PrepareOptions o;
  o.corpus = "chat:other";
  o.output_dir = other_dir.path().string();
  o.val_fraction = 0.1;
  prepare_samples(random_samples(60, 4), o);
  const std::vector<std::string> paths = {dir_.file("train.tok"), other_dir.file("train.tok")};
  std::vector<DataLoader> ranks;
  for (int r = 0; r < 2; ++r)
    ranks.emplace_back(paths, std::vector<double>{1, 1}, options(T, 2, 2, r, 2));
  const std::vector<ShardReader> shards = [&] {
    std::vector<ShardReader> v;
    for (const auto& p : paths) v.emplace_back(p);
    return v;
  }();
  for (int64_t step = 0; step < 10; ++step) {
    int64_t nonpad = 0;
    for (int64_t r = 0; r < 2; ++r)
      for (int64_t m = 0; m < 2; ++m) {
        const Batch b = ranks[size_t(r)].next();
        ASSERT_EQ(b.padding.size(), size_t(2 * T));
        nonpad += std::count(b.padding.begin(), b.padding.end(), uint8_t(0));
        for (int64_t i = 0; i < 2; ++i) {
          const auto row = ranks[0].row_of(step * 8 + (r * 2 + m) * 2 + i);
          const int64_t one[] = {row.row};
          const Batch alone = ranks[0].packed(row.source)->batch(shards[size_t(row.source)], one);
          ASSERT_TRUE(
              std::equal(alone.tokens.begin(), alone.tokens.end(), b.tokens.begin() + i * T));
          ASSERT_TRUE(std::equal(alone.loss_mask.begin(), alone.loss_mask.end(),
                                 b.loss_mask.begin() + i * T));
          ASSERT_TRUE(
              std::equal(alone.padding.begin(), alone.padding.end(), b.padding.begin() + i * T));
          ASSERT_EQ(alone.doc_starts[0], b.doc_starts[size_t(i)]);
        }
      }
    EXPECT_EQ(ranks[1].step_tokens(step), nonpad) << "step " << step;
  }
  TempDir text_dir;
  const std::string text = text_dir.file("train.tok");
  ShardWriter w(text, TokenDtype::u8, 256);
  w.add_document(std::vector<int32_t>(200, 7));
  w.finish();
  expect_input_error(
      [&] {
        DataLoader({paths[0], text}, {1, 1}, options(T));
      },
      {text, "all be SFT data sets or all text ones", "this one text"});
}

TEST_F(SftLoader, ValidationRowsAreThePackedRowsOfValTok) {
  const int64_t T = 64;
  const auto all = validation_batches(dir_.file("val.tok"), T, 3, 0, 0, 1);
  const ShardReader val(dir_.file("val.tok"));
  const PackedSamples packed(val, T);
  int64_t rows = 0;
  for (const Batch& b : all) {
    std::vector<int64_t> ids(size_t(b.B));
    std::iota(ids.begin(), ids.end(), rows);
    const Batch want = packed.batch(val, ids);
    EXPECT_EQ(b.tokens, want.tokens);
    EXPECT_EQ(b.loss_mask, want.loss_mask);
    rows += b.B;
  }
  EXPECT_EQ(rows, packed.rows());
}

TEST_F(SftLoader, DamagedOrMismatchedLossMasksAreClearErrors) {
  // A loss-mask shard whose documents differ from the token shard's.
  {
    ShardWriter w(dir_.file("train.loss_mask.tok"), TokenDtype::u8, 2);
    w.add_document(std::vector<int32_t>{0, 1, 1});
    w.finish();
  }
  expect_input_error([&] { DataLoader(dir_.file("train.tok"), options(64)); },
                     {"train.loss_mask.tok", "documents differ", "prepare the data set again"});
  // No sample keeps a trained token within seq_len = 2 ("User: ..." is never trained).
  PrepareOptions o;
  o.corpus = "chat:test";
  o.output_dir = dir_.path().string();
  prepare_samples(samples_, o);
  // Every sample is longer than 3 tokens: cut, each is left out for want of a trained token;
  // dropped, none is left to look at.
  const std::string n = std::to_string(ShardReader(dir_.file("train.tok")).num_documents());
  auto cut = options(2);
  cut.overlong = Overlong::cut;
  expect_input_error([&] { DataLoader(dir_.file("train.tok"), cut); },
                     {"train.tok", "no sample left to use at seq_len = 2",
                      n + " of its " + n +
                          " samples are longer (data.overlong = \"cut\": cut "
                          "to seq_len), " +
                          n + " have no trained token"});
  expect_input_error([&] { DataLoader(dir_.file("train.tok"), options(2)); },
                     {n + " of its " + n +
                      " samples are longer (data.overlong = \"drop\": left "
                      "out), 0 of the others have no trained token"});
}
