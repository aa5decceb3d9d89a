#include "tessel/optim/spike_filter.hpp"

#include "tessel/core/error.hpp"
#include "tessel/core/median.hpp"

namespace tessel::optim {

SpikeFilter::SpikeFilter(double factor, int64_t window) : factor_(factor), window_(window) {
  if (!(factor == 0 || factor > 1))
    input_error("train.spike_factor = ", factor,
                factor > 0 ? " would skip ordinary steps" : " is negative",
                "; use a factor > 1 (or 0 = never skip)");
  if (window < 1) input_error("train.spike_window = ", window, " must be >= 1");
}

double SpikeFilter::median() const {
  if (int64_t(norms_.size()) < window_) return 0;
  return tessel::median({norms_.begin(), norms_.end()});
}

bool SpikeFilter::skip(double norm, double* compared) {
  const bool compare = factor_ > 0 && int64_t(norms_.size()) == window_;
  const double m = compare ? median() : 0;
  if (compared) *compared = m;
  const bool spike = compare && norm > factor_ * m;
  norms_.push_back(norm);
  if (int64_t(norms_.size()) > window_) norms_.pop_front();
  return spike;
}

void SpikeFilter::restore(const std::vector<double>& history) {
  // The newest `window` of them: a resumed run may have another window.
  const size_t keep = std::min(history.size(), size_t(window_));
  norms_.assign(history.end() - std::ptrdiff_t(keep), history.end());
}

}  // namespace tessel::optim
