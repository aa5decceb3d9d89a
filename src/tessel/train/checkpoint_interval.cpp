#include "tessel/train/checkpoint_interval.hpp"

#include <algorithm>
#include <cmath>

#include "tessel/core/error.hpp"

namespace tessel::train {

double young_interval(double delta, double mtbf) {
  return std::sqrt(2.0 * delta * mtbf);
}

double daly_interval(double delta, double mtbf) {
  if (delta >= 2.0 * mtbf) return mtbf;
  double r = delta / (2.0 * mtbf);
  return young_interval(delta, mtbf) * (1.0 + std::sqrt(r) / 3.0 + r / 9.0) - delta;
}

int64_t checkpoint_interval_steps(const std::string& policy, int64_t fixed_steps,
                                  double delta_seconds, double mtbf_seconds, double step_seconds) {
  if (policy == "fixed") return fixed_steps;
  TESSEL_CHECK(policy == "young" || policy == "daly", "unknown checkpoint policy ", policy);
  double tau = policy == "young" ? young_interval(delta_seconds, mtbf_seconds)
                                 : daly_interval(delta_seconds, mtbf_seconds);
  double steps = tau / std::max(step_seconds, 1e-9);
  return std::max<int64_t>(1, std::llround(std::min(steps, 1e15)));
}

}  // namespace tessel::train
