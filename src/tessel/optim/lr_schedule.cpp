#include "tessel/optim/lr_schedule.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>

#include "tessel/core/error.hpp"

namespace tessel::optim {

LrSchedule::LrSchedule(double lr, double min_lr, int64_t warmup_steps, int64_t total_steps,
                       LrShape shape)
    : lr_(lr), min_lr_(min_lr), warmup_(warmup_steps), total_(total_steps), shape_(shape) {
  if (!(std::isfinite(lr) && lr > 0)) input_error("optim.lr = ", lr, " must be > 0");
  if (!(min_lr >= 0 && min_lr <= lr)) {
    input_error("optim.min_lr = ", min_lr, " must be in [0, optim.lr = ", lr, "]");
  }
  if (total_steps < 1) input_error("train.steps = ", total_steps, " must be >= 1");
  if (warmup_steps < 0 || warmup_steps >= total_steps) {
    input_error("optim.warmup_steps = ", warmup_steps,
                " must be >= 0 and < train.steps = ", total_steps);
  }
  // Under any schedule, so that config.toml holds no value that fails once wsd is chosen.
  if (!(shape.decay_fraction > 0 && shape.decay_fraction <= 1))
    input_error("optim.decay_fraction = ", shape.decay_fraction, " must be in (0, 1]");
  // At least one decay step, so the last step always reaches min_lr.
  const int64_t decay = std::max<int64_t>(1, std::llround(shape.decay_fraction * double(total_)));
  decay_start_ = std::max(warmup_, total_ - decay);
}

double LrSchedule::lr(int64_t step) const {
  TESSEL_CHECK(step >= 0, "negative schedule step ", step);
  if (step < warmup_) return lr_ * double(step) / double(warmup_);
  switch (shape_.kind) {
    case LrScheduleKind::constant:
      return lr_;
    case LrScheduleKind::cosine: {
      if (step >= total_) return min_lr_;
      const double progress = double(step - warmup_) / double(total_ - warmup_);
      return min_lr_ + (lr_ - min_lr_) * 0.5 * (1.0 + std::cos(std::numbers::pi * progress));
    }
    case LrScheduleKind::wsd: {
      if (step <= decay_start_) return lr_;
      if (step >= total_) return min_lr_;
      const double p = double(step - decay_start_) / double(total_ - decay_start_);
      return min_lr_ + (lr_ - min_lr_) *
                           (shape_.decay == LrDecayShape::linear ? 1.0 - p : 1.0 - std::sqrt(p));
    }
  }
  return lr_;
}

}  // namespace tessel::optim
