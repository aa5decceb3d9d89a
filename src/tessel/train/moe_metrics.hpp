#pragma once
// The MoE blocks' balance statistics for metrics.jsonl, summed over forwards on this rank;
// the trainer sums values() over the dp x cp group (one all-reduce) before reading them. Every
// MoE block of the whole model has its slots; add() fills those of the blocks the
// activations hold, so a pipeline's stages fill disjoint slots and a sum over pp joins them.
//   per MoE block: expert loads (assignments before drops), MaxVio of those loads, the mean
//   MaxVio per (micro-batch, ep group) over the loads that group's experts receive, the
//   dropped fraction, the fractions capacity factors 1.0 and 1.25 would drop, the normalized
//   entropy of the loads, the balancing losses; and the all-to-all bytes this step sent.
// MaxVio = (max_e load_e - mean load) / mean load (arXiv 2408.15664).
// Under expert_choice the loads are the tokens each expert took (equal by construction) and
// the dropped fractions count tokens no expert takes (at the run's, 1.0 and 1.25 capacity
// factors) over the tokens, not assignments over N k.
// EP step-time skew (per step, over the ep group): max / median over the ep ranks of this
// rank's expert MLP seconds (forward + backward) and of the bytes its experts received in
// forward's dispatch; 1 at ep = 1.
#include <array>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <span>
#include <vector>

#include "tessel/comm/communicator.hpp"
#include "tessel/model/gpt.hpp"

namespace tessel::train {

double max_violation(std::span<const double> loads);
// H(f) / log E of the load fractions f_e = load_e / sum(load): 1 = uniform, 0 = one expert
// takes everything; 1 when E = 1 or no load (nothing to balance), as max_violation's 0.
double load_entropy(std::span<const double> loads);
// Assignments over a capacity of moe::expert_capacity(tokens, k, E, cf) per expert:
// sum_e max(0, load_e - capacity), E = loads.size().
double capacity_excess(std::span<const double> loads, int64_t tokens, int64_t k, double cf);
// max / median of values (the median of an even count: the mean of the middle two); 1 when
// all are 0 (nothing measured), infinity (null in JSON) when only the median is.
double max_over_median(std::span<const double> values);
// Collective over the ep group: {"expert_time", "recv_bytes"}, max_over_median of the ep
// ranks' expert_seconds and recv_bytes.
nlohmann::json ep_skew(comm::Communicator& ep_group, double expert_seconds, double recv_bytes);

class MoeMetrics {
 public:
  explicit MoeMetrics(const model::Gpt& model);
  bool empty() const { return blocks_.empty(); }
  void clear();
  void add(const model::Activations& acts);  // after a forward of acts: its blocks' slots
  void add_all_to_all_bytes(double bytes);
  std::span<double> values() { return values_; }
  // ep_skew of the expert seconds and dispatch bytes added since clear().
  nlohmann::json ep_skew_json(comm::Communicator& ep_group) const {
    return ep_skew(ep_group, ep_load_[0], ep_load_[1]);
  }
  // {"layer", "loads", "maxvio_batch", "maxvio_micro", "entropy_batch", "dropped",
  // "dropped_cf1", "dropped_cf1_25", "balance_loss"} per MoE block.
  nlohmann::json step_json() const;
  // {"layer", "loads", "maxvio_global", "entropy_global"} per MoE block: the loads over
  // every forward added.
  nlohmann::json validation_json() const;
  double all_to_all_bytes() const { return values_.back(); }

 private:
  std::vector<int64_t> blocks_;
  int64_t E_ = 0, k_ = 0, C_ = 0;
  bool expert_choice_ = false;
  std::vector<double> values_;  // per block [E loads | 7 sums], then the all-to-all bytes
  // This rank's alone (never summed over ranks): expert seconds, dispatch bytes received.
  std::array<double, 2> ep_load_ = {0, 0};
};

}  // namespace tessel::train
