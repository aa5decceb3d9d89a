#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "support/expect_input_error.hpp"
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

// Warmup-stable-decay: T = 1000, decay_fraction 0.2, so D = 800; linear and 1 - sqrt decays.
TEST(LrSchedule, WsdHoldsThePeakThenDecays) {
  const double lr = 3e-3, min_lr = 3e-4, tol = 1e-15 * lr;
  const LrSchedule linear(lr, min_lr, 100, 1000, {LrScheduleKind::wsd, 0.2, LrDecayShape::linear});
  const LrSchedule sqrt(lr, min_lr, 100, 1000, {LrScheduleKind::wsd, 0.2, LrDecayShape::sqrt});
  for (const LrSchedule* s : {&linear, &sqrt}) {
    EXPECT_NEAR(s->lr(50), lr / 2, tol);  // the same warm-up
    EXPECT_EQ(s->lr(100), lr);
    EXPECT_EQ(s->lr(800), lr);  // stable up to D
    EXPECT_NEAR(s->lr(1000), min_lr, tol);
    EXPECT_EQ(s->lr(1500), min_lr);
  }
  EXPECT_NEAR(linear.lr(900), (lr + min_lr) / 2, tol);
  EXPECT_NEAR(linear.lr(850), min_lr + (lr - min_lr) * 0.75, tol);
  EXPECT_NEAR(sqrt.lr(850), min_lr + (lr - min_lr) * 0.5, tol);  // 1 - sqrt(1/4)
  EXPECT_NEAR(sqrt.lr(900), min_lr + (lr - min_lr) * (1 - std::sqrt(0.5)), tol);
  for (int64_t t = 801; t <= 1000; ++t) EXPECT_LT(linear.lr(t), linear.lr(t - 1)) << t;
  // A decay_fraction that rounds to no step still decays on the last one.
  const LrSchedule tiny(1.0, 0.25, 0, 2, {LrScheduleKind::wsd, 0.2, LrDecayShape::linear});
  EXPECT_EQ(tiny.lr(1), 1.0);
  EXPECT_EQ(tiny.lr(2), 0.25);
  // The decay never starts inside the warm-up: decay_fraction 1 decays from W on.
  const LrSchedule all(1.0, 0.0, 10, 50, {LrScheduleKind::wsd, 1.0, LrDecayShape::linear});
  EXPECT_EQ(all.lr(10), 1.0);
  EXPECT_NEAR(all.lr(30), 0.5, 1e-15);
}

// Before its decay a wsd schedule does not depend on the total: a longer run repeats it.
TEST(LrSchedule, WsdIsExtendableInItsStablePhase) {
  const LrShape wsd{LrScheduleKind::wsd, 0.1, LrDecayShape::linear};
  const LrSchedule short_run(1.0, 0.1, 20, 200, wsd), long_run(1.0, 0.1, 20, 400, wsd);
  for (int64_t t = 0; t <= 180; ++t) EXPECT_EQ(short_run.lr(t), long_run.lr(t)) << t;
  EXPECT_LT(short_run.lr(190), long_run.lr(190));
  // Cosine is not: the same steps of a longer run have larger rates.
  EXPECT_LT(LrSchedule(1.0, 0.1, 20, 200).lr(100), LrSchedule(1.0, 0.1, 20, 400).lr(100));
}

TEST(LrSchedule, ConstantHoldsThePeakAfterTheWarmup) {
  const LrSchedule s(2.0, 0.5, 4, 10, {LrScheduleKind::constant});
  EXPECT_NEAR(s.lr(2), 1.0, 1e-15);
  for (int64_t t : {4, 7, 10, 100}) EXPECT_EQ(s.lr(t), 2.0) << t;
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
  for (LrScheduleKind kind : {LrScheduleKind::wsd, LrScheduleKind::cosine})
    for (double f : {0.0, 1.5, -5.0})
      fixture::expect_input_error(
          [f, kind] {
            LrSchedule(1.0, 0.1, 1, 10, {kind, f, LrDecayShape::linear});
          },
          {"optim.decay_fraction"});
  LrSchedule s(1.0, 0.1, 1, 10);
  EXPECT_THROW(s.lr(-1), Error);
}
