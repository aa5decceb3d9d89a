#pragma once
// Skipping the update of a gradient spike (train.spike_factor): a step whose global gradient
// norm exceeds factor x the median of the last `window` steps' norms takes no update (the
// optimizer, and MoE balancing, do not step; its data stays consumed and the learning-rate
// schedule moves on). Only once `window` norms are known; every norm, a skipped one too,
// enters the window, so a lasting rise in the norm stops counting as a spike after about
// window / 2 steps instead of freezing the run. The decision depends only on the norms, which
// every rank computes alike, so all ranks skip the same steps.
#include <cstdint>
#include <deque>
#include <vector>

namespace tessel::optim {

class SpikeFilter {
 public:
  // factor 0: never skips. InputError naming train.spike_factor / train.spike_window for a
  // factor below 0 or in (0, 1], or a window < 1.
  SpikeFilter(double factor, int64_t window);

  // Whether the step with gradient norm `norm` is skipped; records the norm. `compared`, when
  // given, receives the median the norm was compared with (0 when it was not compared: factor
  // 0 or the window not yet full).
  bool skip(double norm, double* compared = nullptr);
  // The median that `norm` was compared with (0 before the window is full).
  double median() const;

  // The recorded norms, oldest first (checkpointed, so a resumed run skips the same steps).
  std::vector<double> history() const { return {norms_.begin(), norms_.end()}; }
  void restore(const std::vector<double>& history);  // keeps the newest `window`

 private:
  double factor_;
  int64_t window_;
  std::deque<double> norms_;
};

}  // namespace tessel::optim
