#include "tessel/train/moe_metrics.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "tessel/core/median.hpp"
#include "tessel/moe/layer.hpp"

namespace tessel::train {

namespace {
// After the E loads of a block: assignments, dropped, dropped at cf = 1 and 1.25, the MaxVio
// sum per (micro-batch, ep group), forwards, balancing-loss sum.
enum Slot {
  kAssigned,
  kDropped,
  kDroppedCf1,
  kDroppedCf125,
  kMaxvioMicro,
  kForwards,
  kBalanceLoss,
  kSlots
};
}  // namespace

double max_violation(std::span<const double> loads) {
  if (loads.empty()) return 0.0;
  const double mean = std::accumulate(loads.begin(), loads.end(), 0.0) / double(loads.size());
  return mean > 0 ? (*std::max_element(loads.begin(), loads.end()) - mean) / mean : 0.0;
}

double load_entropy(std::span<const double> loads) {
  const double total = std::accumulate(loads.begin(), loads.end(), 0.0);
  if (loads.size() < 2 || total <= 0) return 1.0;
  double h = 0;
  for (double l : loads)
    if (l > 0) h -= l / total * std::log(l / total);
  return h / std::log(double(loads.size()));
}

double max_over_median(std::span<const double> values) {
  if (values.empty()) return 1.0;
  const double typical = median({values.begin(), values.end()});
  const double max = *std::max_element(values.begin(), values.end());
  if (typical > 0) return max / typical;
  return max > 0 ? std::numeric_limits<double>::infinity() : 1.0;
}

double capacity_excess(std::span<const double> loads, int64_t tokens, int64_t k, double cf) {
  const double cap = double(moe::expert_capacity(tokens, k, int64_t(loads.size()), cf));
  double over = 0;
  for (double l : loads) over += std::max(0.0, l - cap);
  return over;
}

MoeMetrics::MoeMetrics(const model::Gpt& model)
    : E_(model.config().moe.experts),
      k_(model.config().moe.top_k),
      C_(model.config().width),
      expert_choice_(model.config().moe.balance == moe::Balance::expert_choice) {
  const auto& mask = model.moe_blocks();
  for (size_t l = 0; l < mask.size(); ++l)
    if (mask[l]) blocks_.push_back(int64_t(l));
  values_.assign(blocks_.size() * size_t(E_ + kSlots) + 1, 0.0);
}

void MoeMetrics::clear() {
  std::fill(values_.begin(), values_.end(), 0.0);
  ep_load_ = {0, 0};
}

void MoeMetrics::add(const model::Activations& acts) {
  for (size_t b = 0; b < blocks_.size(); ++b) {
    if (blocks_[b] < acts.first_layer || blocks_[b] >= acts.last_layer) continue;
    const moe::LayerCache& c = acts.moe[size_t(acts.slot(blocks_[b]))];
    double* v = values_.data() + b * size_t(E_ + kSlots);
    // Drops at capacity factors 1.0 and 1.25 and MaxVio are the whole micro-batch's (under
    // context parallelism summed over its cp ranks); this rank counts its share of the drops.
    for (int64_t e = 0; e < E_; ++e) v[e] += double(c.loads[size_t(e)]);
    const double share = c.N < c.batch_tokens ? double(c.N) / double(c.batch_tokens) : 1.0;
    double* s = v + E_;
    s[kDropped] += double(c.dropped);
    if (expert_choice_) {  // tokens no expert takes, over the tokens
      s[kAssigned] += double(c.N);
      s[kDroppedCf1] += double(c.unserved_cf1);
      s[kDroppedCf125] += double(c.unserved_cf1_25);
    } else {
      s[kAssigned] += double(c.N * k_);
      s[kDroppedCf1] += share * capacity_excess(c.batch_loads, c.batch_tokens, k_, 1.0);
      s[kDroppedCf125] += share * capacity_excess(c.batch_loads, c.batch_tokens, k_, 1.25);
    }
    s[kMaxvioMicro] += max_violation(c.batch_group_loads);
    s[kForwards] += 1;
    s[kBalanceLoss] += c.balance_loss;
    ep_load_[0] += c.expert_seconds;
    ep_load_[1] += double(c.received_rows * C_) * sizeof(float);
  }
}

nlohmann::json ep_skew(comm::Communicator& ep_group, double expert_seconds, double recv_bytes) {
  const size_t P = size_t(ep_group.size());
  const std::array<double, 2> mine = {expert_seconds, recv_bytes};
  std::vector<double> all(2 * P), seconds(P), bytes(P);
  ep_group.all_gather(mine, all);
  for (size_t r = 0; r < P; ++r) seconds[r] = all[2 * r], bytes[r] = all[2 * r + 1];
  return {{"expert_time", max_over_median(seconds)}, {"recv_bytes", max_over_median(bytes)}};
}

void MoeMetrics::add_all_to_all_bytes(double bytes) {
  values_.back() += bytes;
}

nlohmann::json MoeMetrics::step_json() const {
  nlohmann::json out = nlohmann::json::array();
  for (size_t b = 0; b < blocks_.size(); ++b) {
    const double* v = values_.data() + b * size_t(E_ + kSlots);
    const double* s = v + E_;
    const std::span<const double> loads(v, size_t(E_));
    const double forwards = std::max(1.0, s[kForwards]), assigned = std::max(1.0, s[kAssigned]);
    out.push_back({{"layer", blocks_[b]},
                   {"loads", std::vector<double>(loads.begin(), loads.end())},
                   {"maxvio_batch", max_violation(loads)},
                   {"maxvio_micro", s[kMaxvioMicro] / forwards},
                   {"entropy_batch", load_entropy(loads)},
                   {"dropped", s[kDropped] / assigned},
                   {"dropped_cf1", s[kDroppedCf1] / assigned},
                   {"dropped_cf1_25", s[kDroppedCf125] / assigned},
                   {"balance_loss", s[kBalanceLoss] / forwards}});
  }
  return out;
}

nlohmann::json MoeMetrics::validation_json() const {
  nlohmann::json out = nlohmann::json::array();
  for (size_t b = 0; b < blocks_.size(); ++b) {
    const std::span<const double> loads(values_.data() + b * size_t(E_ + kSlots), size_t(E_));
    out.push_back({{"layer", blocks_[b]},
                   {"loads", std::vector<double>(loads.begin(), loads.end())},
                   {"maxvio_global", max_violation(loads)},
                   {"entropy_global", load_entropy(loads)}});
  }
  return out;
}

}  // namespace tessel::train
