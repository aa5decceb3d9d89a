#pragma once
// Learning-rate schedule: linear warm-up from 0 to `lr` over `warmup_steps` (W), then a shape
// (optim.schedule) that reaches `min_lr` at `total_steps` (T), constant `min_lr` after:
//   s <  W:        lr * s / W
//   cosine:        min_lr + (lr - min_lr) * (1 + cos(pi * (s - W) / (T - W))) / 2   (W <= s <= T)
//   wsd:           warmup-stable-decay: lr until D = max(W, T - max(1, round(decay_fraction * T))),
//                  then p = (s - D) / (T - D) falls to min_lr at T, along
//                  linear: min_lr + (lr - min_lr) * (1 - p), or
//                  sqrt:   min_lr + (lr - min_lr) * (1 - sqrt(p))
//   constant:      lr at every s >= W (no decay; min_lr is not used)
// `s` is the 1-based number of the update about to be applied (the optimizer's step count
// after it), so the first update gets lr / W and update W gets the peak; lr(0) = 0 is the
// value before training. A warm-up that reaches past T - round(decay_fraction * T) shortens the
// decay. Under wsd the learning rate before D does not depend on T, so a run
// resumed in its stable phase with more train.steps continues exactly where it was.
#include <cstdint>

namespace tessel::optim {

enum class LrScheduleKind { cosine, wsd, constant };
enum class LrDecayShape { linear, sqrt };

struct LrShape {
  LrScheduleKind kind = LrScheduleKind::cosine;
  double decay_fraction = 0.2;                // wsd: share of total_steps in the final decay
  LrDecayShape decay = LrDecayShape::linear;  // wsd: the decay's shape
};

class LrSchedule {
 public:
  // Throws InputError naming the config field (`optim.lr`, `optim.min_lr`,
  // `optim.warmup_steps`, `train.steps`, `optim.decay_fraction`) when an argument
  // is out of range.
  LrSchedule(double lr, double min_lr, int64_t warmup_steps, int64_t total_steps,
             LrShape shape = {});

  // Learning rate of update `step` (>= 0).
  double lr(int64_t step) const;
  // lr(step) / peak lr: the factor Optimizer::step takes.
  double scale(int64_t step) const { return lr(step) / lr_; }

 private:
  double lr_;
  double min_lr_;
  int64_t warmup_;
  int64_t total_;
  LrShape shape_;
  int64_t decay_start_;  // wsd: D
};

}  // namespace tessel::optim
