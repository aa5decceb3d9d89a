#pragma once
// The median of a list of numbers, of an even count the mean of the middle two: the typical
// value that gradient-spike skipping and the EP step-time skew compare with.
#include <algorithm>
#include <vector>

#include "tessel/core/error.hpp"

namespace tessel {

inline double median(std::vector<double> values) {
  TESSEL_CHECK(!values.empty(), "the median of no values");
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

}  // namespace tessel
