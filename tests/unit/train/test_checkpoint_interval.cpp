#include <gtest/gtest.h>

#include <cmath>

#include "tessel/train/checkpoint_interval.hpp"

using namespace tessel::train;

// The spec's vectors (delta = 5 min; M in minutes); Daly's paper reports 117, 57 and 9.1.
TEST(CheckpointInterval, DalyMatchesTheSpecVectors) {
  EXPECT_NEAR(daly_interval(5, 1440), 116.7, 0.5);
  EXPECT_NEAR(daly_interval(5, 360), 56.7, 0.05);
  EXPECT_NEAR(daly_interval(5, 15), 9.1, 0.05);
  // delta >= 2M: checkpoint once per MTBF.
  EXPECT_DOUBLE_EQ(daly_interval(30, 15), 15.0);
  EXPECT_DOUBLE_EQ(daly_interval(40, 15), 15.0);
}

TEST(CheckpointInterval, YoungIsTheSquareRootOfTwiceDeltaTimesMtbf) {
  EXPECT_DOUBLE_EQ(young_interval(5, 1440), 120.0);  // sqrt(14400)
  EXPECT_DOUBLE_EQ(young_interval(2, 8), std::sqrt(32.0));
}

TEST(CheckpointInterval, StepsFollowThePolicy) {
  EXPECT_EQ(checkpoint_interval_steps("fixed", 7, 1.0, 100.0, 0.5), 7);
  // Young: sqrt(2 * 0.5 * 200) = 14.14 s at 0.5 s per step = 28.28 -> 28 steps.
  EXPECT_EQ(checkpoint_interval_steps("young", 7, 0.5, 200.0, 0.5), 28);
  // Daly: 14.142 * (1 + sqrt(1/800)/3 + 1/7200) - 0.5 = 13.811 s -> 27.6 -> 28 steps.
  EXPECT_EQ(checkpoint_interval_steps("daly", 7, 0.5, 200.0, 0.5), 28);
  EXPECT_EQ(checkpoint_interval_steps("daly", 7, 0.5, 1.0, 10.0), 1);  // at least one step
}
