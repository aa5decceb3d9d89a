#pragma once
// Learning-rate schedule: linear warmup from 0 to `lr` over `warmup_steps`, then cosine
// decay to `min_lr` at `total_steps`, constant `min_lr` after:
//   s <  W:       lr * s / W
//   W <= s <= T:  min_lr + (lr - min_lr) * (1 + cos(pi * (s - W) / (T - W))) / 2
//   s >  T:       min_lr
// `s` is the 1-based number of the update about to be applied (the optimizer's step count
// after it), so the first update gets lr / W and update W gets the peak; lr(0) = 0 is the
// value before training.
#include <cstdint>

namespace tessel::optim {

class LrSchedule {
 public:
  // Throws InputError naming the config field (`optim.lr`, `optim.min_lr`,
  // `optim.warmup_steps`, `train.steps`) when an argument is out of range.
  LrSchedule(double lr, double min_lr, int64_t warmup_steps, int64_t total_steps);

  // Learning rate of update `step` (>= 0).
  double lr(int64_t step) const;
  // lr(step) / peak lr: the factor Optimizer::step takes.
  double scale(int64_t step) const { return lr(step) / lr_; }

 private:
  double lr_;
  double min_lr_;
  int64_t warmup_;
  int64_t total_;
};

}  // namespace tessel::optim
