#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "tessel/core/error.hpp"
#include "tessel/optim/lr_schedule.hpp"

using namespace tessel;
using namespace tessel::optim;

// Closed-form points; tolerance 1e-15 relative to the peak (a few double roundings and
// cos(pi/2) ~ 6e-17).
TEST(LrSchedule, ClosedFormPoints) {
  const double lr = 3e-3, min_lr = 3e-4;
  const double tol = 1e-15 * lr;
  LrSchedule s(lr, min_lr, 100, 1100);
  EXPECT_EQ(s.lr(0), 0.0);
  EXPECT_NEAR(s.lr(1), lr / 100, tol);
  EXPECT_NEAR(s.lr(50), lr / 2, tol);
  EXPECT_NEAR(s.lr(100), lr, tol);                 // warmup end: the peak
  EXPECT_NEAR(s.lr(600), (lr + min_lr) / 2, tol);  // cosine midpoint
  EXPECT_NEAR(s.lr(350), min_lr + (lr - min_lr) * (1 + std::sqrt(0.5)) / 2, tol);  // quarter
  EXPECT_NEAR(s.lr(1100), min_lr, tol);                                            // end
  EXPECT_EQ(s.lr(1101), min_lr);                                                   // constant after
  EXPECT_EQ(s.lr(5000), min_lr);
  EXPECT_NEAR(s.scale(100), 1.0, 1e-15);
  EXPECT_NEAR(s.scale(1100), 0.1, 1e-15);
}

TEST(LrSchedule, MonotoneWarmupThenDecay) {
  LrSchedule s(1.0, 0.0, 10, 50);
  for (int64_t t = 1; t <= 10; ++t) EXPECT_GT(s.lr(t), s.lr(t - 1)) << t;
  for (int64_t t = 11; t <= 50; ++t) EXPECT_LT(s.lr(t), s.lr(t - 1)) << t;
}

TEST(LrSchedule, NoWarmupStartsAtPeak) {
  LrSchedule s(2.0, 1.0, 0, 10);
  EXPECT_EQ(s.lr(0), 2.0);
  EXPECT_NEAR(s.lr(5), 1.5, 1e-15);
  EXPECT_EQ(s.lr(10), 1.0);
}

namespace {
void expect_error(double lr, double min_lr, int64_t warmup, int64_t total,
                  const std::string& field) {
  try {
    LrSchedule s(lr, min_lr, warmup, total);
    ADD_FAILURE() << "no InputError for " << field;
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(field), std::string::npos) << e.what();
  }
}
}  // namespace

TEST(LrSchedule, BadArgumentsNameTheField) {
  expect_error(0.0, 0.0, 0, 10, "optim.lr");
  expect_error(1.0, 2.0, 0, 10, "optim.min_lr");
  expect_error(1.0, -1.0, 0, 10, "optim.min_lr");
  expect_error(1.0, 0.1, 0, 0, "train.steps");
  expect_error(1.0, 0.1, 10, 10, "optim.warmup_steps");
  expect_error(1.0, 0.1, -1, 10, "optim.warmup_steps");
  LrSchedule s(1.0, 0.1, 1, 10);
  EXPECT_THROW(s.lr(-1), Error);
}
