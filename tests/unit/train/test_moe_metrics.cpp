// The MoE balance metrics' closed forms: MaxVio, the normalized load entropy, the
// assignments a capacity factor would drop and the EP skew's max / median, on hand values.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "tessel/train/moe_metrics.hpp"

namespace tessel::train {
namespace {

TEST(MoeMetrics, MaxViolationOfHandLoads) {
  // mean 2.5, max 4: (4 - 2.5) / 2.5.
  EXPECT_DOUBLE_EQ(max_violation(std::vector<double>{4, 3, 1, 2}), 0.6);
  EXPECT_DOUBLE_EQ(max_violation(std::vector<double>{5, 5, 5}), 0.0);
}

TEST(MoeMetrics, LoadEntropyIsNormalizedByLogE) {
  // f = (0.4, 0.3, 0.1, 0.2): H = -sum f ln f, over ln 4.
  const double h =
      -(0.4 * std::log(0.4) + 0.3 * std::log(0.3) + 0.1 * std::log(0.1) + 0.2 * std::log(0.2)) /
      std::log(4.0);
  EXPECT_NEAR(load_entropy(std::vector<double>{4, 3, 1, 2}), h, 1e-15);
  // Two of four experts equally loaded: ln 2 / ln 4 = 1/2; an idle expert adds nothing.
  EXPECT_NEAR(load_entropy(std::vector<double>{7, 0, 7, 0}), 0.5, 1e-15);
  EXPECT_NEAR(load_entropy(std::vector<double>{3, 3, 3}), 1.0, 1e-15);
  EXPECT_EQ(load_entropy(std::vector<double>{9, 0, 0}), 0.0);
  EXPECT_EQ(load_entropy(std::vector<double>{0, 0}), 1.0);  // no load
  EXPECT_EQ(load_entropy(std::vector<double>{5}), 1.0);     // one expert
}

TEST(MoeMetrics, CapacityExcessAtCf1AndCf125) {
  // N = 5 tokens, k = 2, E = 4 experts: cf 1 keeps ceil(10 / 4) = 3 per expert (drops 1 of
  // expert 0's 4), cf 1.25 keeps ceil(12.5 / 4) = 4 (drops none).
  const std::vector<double> loads{4, 3, 1, 2};
  EXPECT_EQ(capacity_excess(loads, 5, 2, 1.0), 1.0);
  EXPECT_EQ(capacity_excess(loads, 5, 2, 1.25), 0.0);
  // N = 16, k = 2, E = 4: capacities 8 and 10; loads 14 + 10 + 6 + 2 = 32 = N k.
  const std::vector<double> skewed{14, 10, 6, 2};
  EXPECT_EQ(capacity_excess(skewed, 16, 2, 1.0), 6.0 + 2.0);
  EXPECT_EQ(capacity_excess(skewed, 16, 2, 1.25), 4.0);
}

TEST(MoeMetrics, MaxOverMedianOfHandValues) {
  // Odd count: the middle value; even: the mean of the middle two.
  EXPECT_DOUBLE_EQ(max_over_median(std::vector<double>{3, 9, 6}), 9.0 / 6.0);
  EXPECT_DOUBLE_EQ(max_over_median(std::vector<double>{11, 5}), 11.0 / 8.0);
  EXPECT_DOUBLE_EQ(max_over_median(std::vector<double>{4, 1, 2, 8}), 8.0 / 3.0);
  EXPECT_EQ(max_over_median(std::vector<double>{7}), 1.0);     // one ep rank
  EXPECT_EQ(max_over_median(std::vector<double>{0, 0}), 1.0);  // nothing measured
  EXPECT_EQ(max_over_median(std::vector<double>{0, 0, 5}), std::numeric_limits<double>::infinity());
}

}  // namespace
}  // namespace tessel::train
