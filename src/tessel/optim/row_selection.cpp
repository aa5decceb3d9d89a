#include "tessel/optim/row_selection.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "tessel/core/error.hpp"

namespace tessel::optim {

int64_t selected_count(double fraction, int64_t n) {
  if (n == 0) return 0;
  const int64_t k = int64_t(std::ceil(fraction * double(n) - 1e-9));
  return std::clamp<int64_t>(k, 1, n);
}

std::vector<int64_t> select_rows(const float* X, int64_t n, int64_t cols, int64_t stride,
                                 double fraction) {
  std::vector<double> score(size_t(n), 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < cols; ++j) score[size_t(i)] += std::abs(double(X[i * stride + j]));
  // A NaN score ranks lowest: NaN compares unordered with everything, which would break the
  // sort's strict weak order. Scores are sums of |x|, so -1 is below every number.
  for (double& s : score)
    if (std::isnan(s)) s = -1;
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), int64_t(0));
  const int64_t k = selected_count(fraction, n);
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t a, int64_t b) {
    return score[size_t(a)] != score[size_t(b)] ? score[size_t(a)] > score[size_t(b)] : a < b;
  });
  order.resize(size_t(k));
  std::sort(order.begin(), order.end());
  return order;
}

void normuon_normalize(float* O, int64_t k, int64_t cols, const int64_t* ids, float* v,
                       double beta2, double eps) {
  TESSEL_CHECK(cols > 0, "normuon of ", k, "x", cols);
  double before = 0, after = 0;
  for (int64_t i = 0; i < k; ++i) {
    float* row = O + i * cols;
    double ss = 0;
    for (int64_t j = 0; j < cols; ++j) ss += double(row[j]) * double(row[j]);
    before += ss;
    float& vi = v[ids[i]];
    vi = float(beta2 * double(vi) + (1.0 - beta2) * (ss / double(cols)));
    const float inv = float(1.0 / (std::sqrt(double(vi)) + eps));
    for (int64_t j = 0; j < cols; ++j) {
      row[j] *= inv;
      after += double(row[j]) * double(row[j]);
    }
  }
  const float scale = after > 0 ? float(std::sqrt(before / after)) : 1.0f;
  for (int64_t i = 0; i < k * cols; ++i) O[i] *= scale;
}

}  // namespace tessel::optim
