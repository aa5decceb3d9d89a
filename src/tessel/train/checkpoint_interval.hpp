#pragma once
// The checkpoint interval (spec section 3). With delta the blocking cost of one
// checkpoint and M the mean time between failures (same unit):
//   Young (1974): tau = sqrt(2 delta M)
//   Daly (2006):  tau = sqrt(2 delta M) [1 + sqrt(delta / (2M)) / 3 + (delta / (2M)) / 9] - delta
//                 for delta < 2M, else tau = M.
// With asynchronous saves delta is only the part that blocks training.
#include <cstdint>
#include <string>

namespace tessel::train {

double young_interval(double delta, double mtbf);
double daly_interval(double delta, double mtbf);

// train.checkpoint_policy: "fixed" (every train.checkpoint_every steps), "young", "daly".
// The formula's interval in steps of `step_seconds` (at least 1); for "fixed", `fixed_steps`.
int64_t checkpoint_interval_steps(const std::string& policy, int64_t fixed_steps,
                                  double delta_seconds, double mtbf_seconds, double step_seconds);

}  // namespace tessel::train
