#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <set>

#include "tessel/core/rng.hpp"
#include "tessel/data/loader.hpp"
#include "unit/data/test_util.hpp"

using namespace tessel;
using namespace tessel::data;
using tessel::data::testing::expect_input_error;
using tessel::data::testing::TempDir;

namespace {

// A shard of random documents of 1..60 tokens; returns its token stream and doc starts.
struct TestShard {
  std::string path;
  std::vector<int32_t> tokens;
  std::set<int64_t> starts;
};

TestShard make_shard(const TempDir& dir, const std::string& name, int64_t min_tokens,
                     uint64_t seed) {
  TestShard s{dir.file(name), {}, {}};
  ShardWriter w(s.path, TokenDtype::u8, 256);
  Rng rng(seed);
  while (int64_t(s.tokens.size()) < min_tokens) {
    std::vector<int32_t> doc(1 + rng.below(60));
    for (auto& t : doc) t = int32_t(rng.below(256));
    s.starts.insert(int64_t(s.tokens.size()));
    s.tokens.insert(s.tokens.end(), doc.begin(), doc.end());
    w.add_document(doc);
  }
  w.finish();
  return s;
}

bool same(const Batch& a, const Batch& b) {
  return a.B == b.B && a.T == b.T && a.tokens == b.tokens && a.targets == b.targets &&
         a.loss_mask == b.loss_mask && a.positions == b.positions && a.doc_starts == b.doc_starts;
}

// Checks row r of batch b against window w of the shard by brute force.
void expect_row_is_window(const Batch& b, int64_t r, int64_t w, const TestShard& s) {
  const int64_t T = b.T, first = w * T;
  std::vector<int32_t> expected_starts;
  for (int64_t t = 0; t < T; ++t) {
    const size_t i = size_t(r * T + t);
    ASSERT_EQ(b.tokens[i], s.tokens[size_t(first + t)]);
    ASSERT_EQ(b.targets[i], s.tokens[size_t(first + t + 1)]);
    ASSERT_EQ(b.positions[i], t);
    // Masked exactly where the target opens a new document.
    ASSERT_EQ(b.loss_mask[i], s.starts.count(first + t + 1) ? 0.0f : 1.0f) << "t=" << t;
    if (t == 0 || s.starts.count(first + t)) expected_starts.push_back(int32_t(t));
  }
  ASSERT_EQ(b.doc_starts[size_t(r)], expected_starts);
}

class Loader : public ::testing::Test {
 protected:
  void SetUp() override { shard_ = make_shard(dir_, "train.tok", 3000, 11); }
  LoaderOptions options(int64_t T = 32, int64_t mb = 2, int64_t accum = 1, int64_t rank = 0,
                        int64_t dp = 1) const {
    LoaderOptions o;
    o.seq_len = T;
    o.micro_batch = mb;
    o.accum = accum;
    o.dp_rank = rank;
    o.dp_size = dp;
    o.seed = 1234;
    return o;
  }
  TempDir dir_;
  TestShard shard_;
};

}  // namespace

TEST_F(Loader, RowsAreWindowsWithShiftedTargetsAndDocumentStarts) {
  DataLoader loader(shard_.path, options(32, 3));
  EXPECT_EQ(loader.windows(), int64_t(shard_.tokens.size() - 1) / 32);
  for (int64_t step = 0; step < 20; ++step) {
    const Batch b = loader.next();
    ASSERT_EQ(b.B, 3);
    ASSERT_EQ(b.T, 32);
    ASSERT_EQ(b.tokens.size(), 96u);
    for (int64_t r = 0; r < 3; ++r)
      expect_row_is_window(b, r, loader.row_of(step * 3 + r).row, shard_);
  }
}

TEST_F(Loader, SameSeedSameBatches) {
  DataLoader a(shard_.path, options()), b(shard_.path, options());
  auto other = options();
  other.seed = 99;
  DataLoader c(shard_.path, other);
  bool any_differs = false;
  for (int i = 0; i < 30; ++i) {
    const Batch x = a.next(), y = b.next(), z = c.next();
    ASSERT_TRUE(same(x, y));
    any_differs |= !same(x, z);
  }
  EXPECT_TRUE(any_differs);
}

TEST_F(Loader, EachEpochIsAPermutationAndEpochsDiffer) {
  DataLoader loader(shard_.path, options());
  const int64_t W = loader.windows();
  std::vector<int64_t> e0, e1;
  for (int64_t g = 0; g < W; ++g) e0.push_back(loader.row_of(g).row);
  for (int64_t g = W; g < 2 * W; ++g) e1.push_back(loader.row_of(g).row);
  EXPECT_NE(e0, e1);
  std::vector<int64_t> identity(static_cast<size_t>(W));
  std::iota(identity.begin(), identity.end(), int64_t(0));
  EXPECT_NE(e0, identity);
  std::sort(e0.begin(), e0.end());
  std::sort(e1.begin(), e1.end());
  EXPECT_EQ(e0, identity);
  EXPECT_EQ(e1, identity);
  // Going back to an earlier epoch recomputes the same permutation.
  EXPECT_EQ(loader.row_of(5).row, DataLoader(shard_.path, options()).row_of(5).row);

  auto plain = options();
  plain.shuffle = false;
  DataLoader unshuffled(shard_.path, plain);
  for (int64_t g = 0; g < 2 * W + 3; ++g) EXPECT_EQ(unshuffled.row_of(g).row, g % W);
}

TEST_F(Loader, DataParallelRanksSplitWhatAccumulationWouldSee) {
  // dp_size = 4 with accum = 1 and dp_size = 1 with accum = 4 consume the same global
  // sequences per step: rank r's micro-batch is micro-batch r of the single rank.
  DataLoader single(shard_.path, options(32, 2, 4, 0, 1));
  std::vector<DataLoader> ranks;
  for (int r = 0; r < 4; ++r) ranks.emplace_back(shard_.path, options(32, 2, 1, r, 4));
  EXPECT_EQ(single.sequences_per_step(), 8);
  EXPECT_EQ(ranks[0].sequences_per_step(), 8);
  for (int step = 0; step < 12; ++step) {
    for (int m = 0; m < 4; ++m) {
      ASSERT_EQ(single.state(), (LoaderState{step, m}));
      ASSERT_TRUE(same(single.next(), ranks[size_t(m)].next())) << "step " << step << " m " << m;
    }
  }
}

TEST_F(Loader, MicroBatchesFollowTheShardingFormula) {
  // Rank r's micro-batch m of step s holds s*G + (r*accum + m)*micro_batch + [0, micro_batch),
  // so dp_size = 2, accum = 2 matches dp_size = 1, accum = 4 at micro-batch r*2 + m.
  const int64_t mb = 3, accum = 2, dp = 2, G = dp * accum * mb;
  DataLoader single(shard_.path, options(32, mb, 4, 0, 1));
  std::vector<DataLoader> ranks;
  for (int r = 0; r < dp; ++r) ranks.emplace_back(shard_.path, options(32, mb, accum, r, dp));
  for (int64_t step = 0; step < 10; ++step) {
    std::vector<Batch> flat;
    for (int m = 0; m < 4; ++m) flat.push_back(single.next());
    for (int64_t r = 0; r < dp; ++r) {
      for (int64_t m = 0; m < accum; ++m) {
        const Batch b = ranks[size_t(r)].next();
        ASSERT_TRUE(same(b, flat[size_t(r * accum + m)])) << "step " << step;
        for (int64_t i = 0; i < mb; ++i)
          expect_row_is_window(b, i, single.row_of(step * G + (r * accum + m) * mb + i).row,
                               shard_);
      }
    }
  }
}

TEST_F(Loader, RestoreResumesBitwise) {
  DataLoader a(shard_.path, options(16, 2, 3));
  for (int i = 0; i < 7; ++i) a.next();
  const LoaderState saved = a.state();
  EXPECT_EQ(saved, (LoaderState{2, 1}));  // 7 micro-batches at accum 3
  std::vector<Batch> expected;
  for (int i = 0; i < 200; ++i) expected.push_back(a.next());  // crosses epochs

  DataLoader b(shard_.path, options(16, 2, 3));
  for (int i = 0; i < 62; ++i) b.next();  // another step, micro-batch and epoch before restoring
  ASSERT_NE(b.state().micro, saved.micro);
  b.restore(saved);
  for (const auto& e : expected) ASSERT_TRUE(same(b.next(), e));
  expect_input_error([&] { b.restore({0, 3}); }, {"accum = 3"});
  expect_input_error([&] { b.restore({-1, 0}); }, {"step -1"});
}

TEST_F(Loader, EpochWrapAround) {
  // 5 windows of T = 8 and micro-batches of 3: batches straddle epoch boundaries.
  const TestShard small = make_shard(dir_, "small.tok", 41, 3);
  auto opt = options(8, 3);
  DataLoader loader(small.path, opt);
  const int64_t W = loader.windows();
  ASSERT_EQ(W, int64_t(small.tokens.size() - 1) / 8);
  std::vector<int64_t> seen;
  for (int step = 0; step < 10; ++step) {
    const Batch b = loader.next();
    for (int64_t r = 0; r < 3; ++r) {
      const int64_t w = loader.row_of(step * 3 + r).row;
      expect_row_is_window(b, r, w, small);
      seen.push_back(w);
    }
  }
  for (int64_t e = 0; e * W + W <= int64_t(seen.size()); ++e) {
    std::vector<int64_t> epoch(seen.begin() + e * W, seen.begin() + e * W + W);
    std::sort(epoch.begin(), epoch.end());
    for (int64_t w = 0; w < W; ++w) ASSERT_EQ(epoch[size_t(w)], w) << "epoch " << e;
  }
}

TEST_F(Loader, Errors) {
  expect_input_error([&] { DataLoader(shard_.path, options(0)); }, {shard_.path, "seq_len"});
  const TestShard tiny = make_shard(dir_, "tiny.tok", 1, 1);
  const int64_t n = int64_t(tiny.tokens.size());
  expect_input_error([&] { DataLoader(tiny.path, options(n)); },
                     {tiny.path, "too few for one sequence", "a smaller train.seq_len"});
  EXPECT_EQ(DataLoader(tiny.path, options(n - 1)).windows(), 1);
  expect_input_error([&] { DataLoader(shard_.path, options(32, 2, 1, 4, 4)); }, {"dp_rank 4"});
  expect_input_error([&] { DataLoader(shard_.path, options(32, 0)); }, {"micro_batch"});
  expect_input_error([&] { DataLoader(dir_.file("none.tok"), options()); }, {"tessel prepare"});
}

// A mixture 3 : 1 of two shards: every row is the window of the data set MixtureOrder names,
// data set 0 is read in the order a loader of it alone reads it, data set 1 (smaller, so it
// wraps epochs sooner) takes each window once per epoch, and the rows split 3 : 1.
TEST_F(Loader, AMixtureReadsEachDataSetInItsOwnOrderAtItsShare) {
  const TestShard other = make_shard(dir_, "other.tok", 700, 5);
  const std::vector<const TestShard*> shards = {&shard_, &other};
  DataLoader mixture({shard_.path, other.path}, {3, 1}, options(16, 4));
  DataLoader alone(shard_.path, options(16, 4));
  EXPECT_EQ(mixture.sources(), 2);
  EXPECT_EQ(mixture.weights(), (std::vector<double>{0.75, 0.25}));
  EXPECT_EQ(mixture.windows(1), int64_t(other.tokens.size() - 1) / 16);
  MixtureOrder order({3, 1});
  std::vector<std::vector<int64_t>> rows(2);
  const int64_t steps = 100;
  for (int64_t step = 0; step < steps; ++step) {
    const Batch b = mixture.next();
    for (int64_t r = 0; r < 4; ++r) {
      const int64_t g = step * 4 + r;
      const auto row = mixture.row_of(g);
      const auto slot = order.locate(g);
      ASSERT_EQ(row.source, slot.source);
      ASSERT_EQ(int64_t(rows[size_t(row.source)].size()), slot.index);
      expect_row_is_window(b, r, row.row, *shards[size_t(row.source)]);
      rows[size_t(row.source)].push_back(row.row);
    }
  }
  EXPECT_EQ(rows[0].size(), size_t(steps * 4 * 3 / 4));
  for (size_t i = 0; i < rows[0].size(); ++i) ASSERT_EQ(rows[0][i], alone.row_of(int64_t(i)).row);
  const int64_t W1 = mixture.windows(1);
  ASSERT_GE(int64_t(rows[1].size()), 2 * W1);  // two whole epochs of data set 1
  for (int64_t e = 0; e < 2; ++e) {
    std::vector<int64_t> epoch(rows[1].begin() + e * W1, rows[1].begin() + (e + 1) * W1);
    std::sort(epoch.begin(), epoch.end());
    for (int64_t w = 0; w < W1; ++w) ASSERT_EQ(epoch[size_t(w)], w) << "epoch " << e;
  }
  // Its own seed: not data set 0's permutation of the same windows.
  EXPECT_NE(std::vector<int64_t>(rows[1].begin(), rows[1].begin() + W1), [&] {
    std::vector<int64_t> own;
    DataLoader other_alone(other.path, options(16, 4));
    for (int64_t i = 0; i < W1; ++i) own.push_back(other_alone.row_of(i).row);
    return own;
  }());
}

// A mixture's batches depend on the layout only through the global batch, and it resumes
// bitwise, as a single data set does.
TEST_F(Loader, AMixtureSplitsOverRanksAndResumesBitwise) {
  const TestShard other = make_shard(dir_, "other.tok", 700, 5);
  const std::vector<std::string> paths = {shard_.path, other.path};
  DataLoader single(paths, {1, 2}, options(16, 3, 4, 0, 1));
  std::vector<DataLoader> ranks;
  for (int r = 0; r < 2; ++r)
    ranks.emplace_back(paths, std::vector<double>{1, 2}, options(16, 3, 2, r, 2));
  std::vector<Batch> seen;
  for (int step = 0; step < 20; ++step)
    for (int m = 0; m < 4; ++m) {
      seen.push_back(single.next());
      ASSERT_TRUE(same(seen.back(), ranks[size_t(m / 2)].next())) << "step " << step;
    }
  DataLoader resumed(paths, {1, 2}, options(16, 3, 4, 0, 1));
  resumed.restore({11, 2});
  for (size_t i = 11 * 4 + 2; i < seen.size(); ++i) ASSERT_TRUE(same(resumed.next(), seen[i]));
}

TEST_F(Loader, AMixtureNeedsOneWeightPerDataSetAndOneVocabulary) {
  const TestShard other = make_shard(dir_, "other.tok", 700, 5);
  expect_input_error(
      [&] {
        DataLoader({shard_.path, other.path}, {1}, options());
      },
      {"2 data sets but 1 weights"});
  expect_input_error(
      [&] {
        DataLoader({shard_.path, other.path}, {1, 0}, options());
      },
      {"positive"});
  const std::string wide = dir_.file("wide.tok");
  ShardWriter w(wide, TokenDtype::u16, 300);
  w.add_document(std::vector<int32_t>(100, 299));
  w.finish();
  expect_input_error(
      [&] {
        DataLoader({shard_.path, wide}, {1, 1}, options());
      },
      {wide, "token vocabulary 300", "256", "one tokenizer"});
}

TEST_F(Loader, ValidationUnionIsTheFirstWindowsForAnyLayout) {
  const int64_t T = 32;
  const int64_t W = int64_t(shard_.tokens.size() - 1) / T;
  for (int64_t max_sequences : {int64_t(13), W + 100, int64_t(0)}) {
    const int64_t n = std::min(max_sequences > 0 ? max_sequences : W, W);
    for (int64_t dp : {1, 2, 3, 4, 5}) {
      std::vector<int64_t> rows;  // windows in rank order
      for (int64_t r = 0; r < dp; ++r) {
        for (const Batch& b : validation_batches(shard_.path, T, 4, max_sequences, r, dp)) {
          ASSERT_LE(b.B, 4);
          ASSERT_GE(b.B, 1);
          for (int64_t i = 0; i < b.B; ++i) {
            expect_row_is_window(b, i, int64_t(rows.size()), shard_);
            rows.push_back(int64_t(rows.size()));
          }
        }
      }
      ASSERT_EQ(int64_t(rows.size()), n) << "dp " << dp << " max " << max_sequences;
    }
  }
}
