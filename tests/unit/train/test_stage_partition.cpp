#include <gtest/gtest.h>

#include <algorithm>
#include <functional>

#include "support/expect_input_error.hpp"
#include "tessel/core/rng.hpp"
#include "tessel/train/config.hpp"
#include "tessel/train/stage_partition.hpp"

using namespace tessel;
using fixture::expect_input_error;
using train::LayerCosts;

namespace {

double slowest(const LayerCosts& c, const std::vector<int64_t>& counts) {
  auto costs = train::stage_costs(c, counts);
  return *std::max_element(costs.begin(), costs.end());
}

// Naive twin of balanced_layout: every composition of the blocks into the stages (middle
// stages at least one block), the smallest slowest-stage cost.
double brute_force_best(const LayerCosts& c, int64_t stages) {
  const int64_t L = int64_t(c.blocks.size());
  double best = 1e300;
  std::vector<int64_t> counts(static_cast<size_t>(stages));
  std::function<void(int64_t, int64_t)> place = [&](int64_t s, int64_t left) {
    if (s == stages - 1) {
      counts[size_t(s)] = left;
      if (stages == 1 && left == 0) return;
      best = std::min(best, slowest(c, counts));
      return;
    }
    const int64_t min = (s == 0 && stages > 1) ? 0 : 1;
    for (int64_t n = min; n <= left; ++n) counts[size_t(s)] = n, place(s + 1, left - n);
  };
  place(0, L);
  return best;
}

}  // namespace

TEST(StagePartition, UniformBlocksSplitEvenlyWithoutEnds) {
  LayerCosts c{std::vector<double>(8, 1.0), 0.0, 0.0};
  EXPECT_EQ(train::balanced_layout(c, 1), (std::vector<int64_t>{8}));
  EXPECT_EQ(train::balanced_layout(c, 2), (std::vector<int64_t>{4, 4}));
  EXPECT_EQ(train::balanced_layout(c, 4), (std::vector<int64_t>{2, 2, 2, 2}));
}

TEST(StagePartition, HeavyHeadGivesTheLastStageFewerBlocks) {
  // 6 blocks of 1, head = 2 blocks: the best split is 4 | 2 + head (both cost 4).
  LayerCosts c{std::vector<double>(6, 1.0), 0.0, 2.0};
  EXPECT_EQ(train::balanced_layout(c, 2), (std::vector<int64_t>{4, 2}));
  EXPECT_DOUBLE_EQ(slowest(c, train::balanced_layout(c, 2)), 4.0);
  // The head alone outweighs all blocks: the last stage takes none.
  LayerCosts heavy{std::vector<double>(3, 1.0), 0.0, 10.0};
  EXPECT_EQ(train::balanced_layout(heavy, 2), (std::vector<int64_t>{3, 0}));
}

TEST(StagePartition, MatchesBruteForceOnRandomCosts) {
  Rng rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t L = 1 + int64_t(rng.below(7)), P = 1 + int64_t(rng.below(4));
    if (P > 2 && L < P - 2) continue;
    LayerCosts c;
    for (int64_t i = 0; i < L; ++i) c.blocks.push_back(1.0 + double(rng.below(100)));
    c.embedding = double(rng.below(50));
    c.head = double(rng.below(300));
    auto counts = train::balanced_layout(c, P);
    ASSERT_EQ(int64_t(counts.size()), P);
    int64_t sum = 0;
    for (int64_t n : counts) sum += n;
    EXPECT_EQ(sum, L);
    for (int64_t s = 1; s + 1 < P; ++s) EXPECT_GE(counts[size_t(s)], 1);
    EXPECT_EQ(slowest(c, counts), brute_force_best(c, P)) << "L = " << L << ", P = " << P;
  }
}

TEST(StagePartition, CostsCountMatmulsAttentionAndTheHead) {
  model::GptConfig m = train::default_model();
  m.layers = 2, m.width = 64, m.heads = 4, m.kv_heads = 2, m.vocab = 100;
  m.mlp = model::MlpType::gelu, m.mlp_hidden = 0;
  auto c = train::layer_costs(m, 32);
  // qkv (64 + 2*32) x 64, out 64 x 64, fc_in 256 x 64, fc_out 64 x 256; attention 12 H D T.
  const double matmul = 128.0 * 64 + 64.0 * 64 + 2 * 256.0 * 64;
  EXPECT_DOUBLE_EQ(c.blocks[0], 6 * matmul + 12.0 * 64 * 32);
  EXPECT_DOUBLE_EQ(c.blocks[1], c.blocks[0]);
  EXPECT_DOUBLE_EQ(c.embedding, 6.0 * 64);
  EXPECT_DOUBLE_EQ(c.head, 6.0 * 64 * 100 + 6.0 * 100);
  EXPECT_EQ(train::stage_costs(c, {1, 1}),
            (std::vector<double>{c.blocks[0] + c.embedding, c.blocks[1] + c.head}));
}

TEST(StagePartition, ExplicitLayoutAndItsErrors) {
  LayerCosts c{std::vector<double>(4, 1.0), 0.0, 0.0};
  EXPECT_EQ(train::stage_layout("3,1", c, 2), (std::vector<int64_t>{3, 1}));
  EXPECT_EQ(train::stage_layout("4,0", c, 2), (std::vector<int64_t>{4, 0}));
  EXPECT_EQ(train::stage_layout("", c, 2), train::balanced_layout(c, 2));
  EXPECT_EQ(train::stage_boundaries({3, 0, 1}), (std::vector<int64_t>{0, 3, 3, 4}));
  expect_input_error([&] { train::stage_layout("2,1", c, 2); },
                     {"pipeline.layout", "3 blocks", "model.layers = 4"});
  expect_input_error([&] { train::stage_layout("2,2", c, 3); },
                     {"pipeline.layout", "parallel.pp = 3"});
  expect_input_error([&] { train::stage_layout("2,x", c, 2); }, {"pipeline.layout", "'x'"});
  expect_input_error([&] { train::stage_layout("2,-1,3", c, 3); }, {"pipeline.layout", "'-1'"});
  expect_input_error([&] { train::stage_layout("2,0,2", c, 3); },
                     {"pipeline.layout", "\": stage 1 has no blocks"});
  expect_input_error([&] { train::stage_layout("2,0,1,1", c, 4, "parallel.pp x pipeline.chunks"); },
                     {"pipeline.layout", "virtual stage 1 has no blocks"});
  // Counts that would overflow the sum to exactly 4 are refused one by one.
  expect_input_error(
      [&] { train::stage_layout("9223372036854775807,9223372036854775807,6", c, 3); },
      {"pipeline.layout", "stage 0 holds 9223372036854775807 blocks", "model.layers = 4"});
  LayerCosts two{std::vector<double>(2, 1.0), 0.0, 0.0};
  expect_input_error([&] { train::balanced_layout(two, 5); },
                     {"model.layers = 2", "parallel.pp = 5"});
}
