#include "tessel/data/mixture.hpp"

#include <algorithm>
#include <cmath>
#include <utility>

#include "tessel/core/error.hpp"

namespace tessel::data {

std::vector<double> normalized_weights(std::vector<double> weights) {
  if (weights.empty()) input_error("data mixture: no data set");
  double sum = 0;
  for (double w : weights) {
    if (!(w > 0) || !std::isfinite(w))
      input_error("data mixture: every weight must be positive and finite, got ", w);
    sum += w;
  }
  for (double& w : weights) w /= sum;
  return weights;
}

MixtureOrder::MixtureOrder(std::vector<double> weights)
    : weights_(normalized_weights(std::move(weights))) {
  counts_.assign(weights_.size(), 0);
  blocks_ = counts_;
}

int64_t MixtureOrder::advance() {
  int64_t best = 0;
  double best_deficit = 0;
  for (size_t d = 0; d < weights_.size(); ++d) {
    const double deficit = weights_[d] * double(next_ + 1) - double(counts_[d]);
    if (d == 0 || deficit > best_deficit) best = int64_t(d), best_deficit = deficit;
  }
  ++counts_[size_t(best)];
  if (++next_ % kBlock == 0 && next_ / kBlock * sources() == int64_t(blocks_.size()))
    blocks_.insert(blocks_.end(), counts_.begin(), counts_.end());
  return best;
}

MixtureOrder::Slot MixtureOrder::locate(int64_t g) {
  TESSEL_CHECK(g >= 0, "global sequence ", g);
  if (weights_.size() == 1) return {0, g};
  // Restart from the last remembered block start at or before g when g lies behind the
  // cursor, or when that block start lies ahead of it.
  const int64_t from = std::min(g / kBlock, int64_t(blocks_.size()) / sources() - 1);
  if (g < next_ || from * kBlock > next_) {
    const auto first = blocks_.begin() + from * sources();
    std::copy(first, first + sources(), counts_.begin());
    next_ = from * kBlock;
  }
  while (next_ < g) advance();
  const int64_t source = advance();
  return {source, counts_[size_t(source)] - 1};
}

double mixture_mean(std::span<const double> weights, std::span<const double> values) {
  TESSEL_CHECK(weights.size() == values.size(), "mixture_mean: ", weights.size(), " weights, ",
               values.size(), " values");
  double mean = 0;
  for (size_t d = 0; d < weights.size(); ++d) mean += weights[d] * values[d];
  return mean;
}

}  // namespace tessel::data
