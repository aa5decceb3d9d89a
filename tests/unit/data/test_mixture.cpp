// MixtureOrder: the greedy interleaving of data sets (data/mixture.hpp) against its stated
// properties, computed here by brute force.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "tessel/data/mixture.hpp"
#include "unit/data/test_util.hpp"

using namespace tessel::data;
using tessel::data::testing::expect_input_error;

namespace {

// The first n slots, in order.
std::vector<MixtureOrder::Slot> first_slots(MixtureOrder order, int64_t n) {
  std::vector<MixtureOrder::Slot> slots;
  for (int64_t g = 0; g < n; ++g) slots.push_back(order.locate(g));
  return slots;
}

}  // namespace

// In every prefix no data set is a whole sequence ahead of its share, none is more than 1.25
// behind (what random weights for up to 8 data sets showed: 1.22), two data sets stay within
// half a sequence of theirs, and each data set's sequences are numbered 0, 1, 2, ... in the
// order they are taken.
TEST(MixtureOrder, EveryPrefixKeepsTheShares) {
  for (const std::vector<double>& weights : {std::vector<double>{0.5, 0.3, 0.2},
                                             {1, 1, 1},
                                             {999, 1},
                                             {3, 1},
                                             {0.1, 0.2, 0.3, 0.4},
                                             {0.31, 0.02, 0.17, 0.05, 0.11, 0.09, 0.2, 0.05}}) {
    MixtureOrder order(weights);
    double sum = 0;
    for (double w : weights) sum += w;
    std::vector<int64_t> counts(weights.size(), 0);
    for (int64_t g = 0; g < 20000; ++g) {
      const auto slot = order.locate(g);
      ASSERT_EQ(slot.index, counts[size_t(slot.source)]) << "g " << g;
      ++counts[size_t(slot.source)];
      for (size_t d = 0; d < weights.size(); ++d) {
        const double ahead = double(counts[d]) - weights[d] / sum * double(g + 1);
        ASSERT_LT(ahead, 1.0) << "data set " << d << " after " << g + 1 << " sequences";
        ASSERT_GT(ahead, -1.25) << "data set " << d << " after " << g + 1 << " sequences";
        if (weights.size() == 2) {
          ASSERT_LE(std::abs(ahead), 0.5 + 1e-9);
        }
      }
    }
  }
}

// The greedy rule by hand for shares 3 : 1: deficits 0.75 / 0.25 at g = 0 pick data set 0;
// at g = 1: 1.5 - 1 = 0.5 against 0.5 ties to data set 0; g = 2: 2.25 - 2 = 0.25 against
// 0.75 picks data set 1; g = 3: 3 - 2 = 1 against 1 - 1 = 0 picks data set 0.
TEST(MixtureOrder, TheGreedyRuleByHand) {
  const auto slots = first_slots(MixtureOrder({3, 1}), 8);
  const std::vector<MixtureOrder::Slot> expected = {{0, 0}, {0, 1}, {1, 0}, {0, 2},
                                                    {0, 3}, {0, 4}, {1, 1}, {0, 5}};
  EXPECT_EQ(slots, expected);
}

// Any order of lookups, back and far ahead across the remembered blocks, gives the slots of
// one sequential pass.
TEST(MixtureOrder, RandomAccessEqualsOneSequentialPass) {
  const std::vector<double> weights = {0.45, 0.35, 0.2};
  const auto sequential = first_slots(MixtureOrder(weights), 6000);
  MixtureOrder order(weights);
  for (int64_t g : {5000, 10, 4097, 4096, 4095, 0, 2047, 5999, 1024, 1023, 3000, 3001, 2999})
    EXPECT_EQ(order.locate(g), sequential[size_t(g)]) << "g " << g;
}

TEST(MixtureOrder, OneDataSetIsTheIdentity) {
  MixtureOrder order({2.5});
  EXPECT_EQ(order.weights(), std::vector<double>{1.0});
  for (int64_t g : {0, 7, 1 << 20, 3}) EXPECT_EQ(order.locate(g), (MixtureOrder::Slot{0, g}));
}

TEST(MixtureOrder, WeightsAreNormalizedAndBadOnesRefused) {
  EXPECT_EQ(MixtureOrder({3, 1}).weights(), (std::vector<double>{0.75, 0.25}));
  expect_input_error([] { MixtureOrder({}); }, {"no data set"});
  expect_input_error([] { MixtureOrder({1, 0}); }, {"positive and finite", "0"});
  expect_input_error([] { MixtureOrder({1, -2}); }, {"positive and finite"});
  expect_input_error([] { MixtureOrder({1, INFINITY}); }, {"positive and finite"});
  expect_input_error([] { MixtureOrder({1, NAN}); }, {"positive and finite"});
}
