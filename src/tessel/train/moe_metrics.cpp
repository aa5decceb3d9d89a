#include "tessel/train/moe_metrics.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace tessel::train {

namespace {
// After the E loads of a block: assignments, dropped, dropped at cf = 1, the MaxVio sum
// per (micro-batch, ep group), forwards, balancing-loss sum.
enum Slot { kAssigned, kDropped, kDroppedCf1, kMaxvioMicro, kForwards, kBalanceLoss, kSlots };
}  // namespace

double max_violation(std::span<const double> loads) {
  if (loads.empty()) return 0.0;
  const double mean = std::accumulate(loads.begin(), loads.end(), 0.0) / double(loads.size());
  return mean > 0 ? (*std::max_element(loads.begin(), loads.end()) - mean) / mean : 0.0;
}

MoeMetrics::MoeMetrics(const model::Gpt& model)
    : E_(model.config().moe.experts), k_(model.config().moe.top_k) {
  const auto& mask = model.moe_blocks();
  for (size_t l = 0; l < mask.size(); ++l)
    if (mask[l]) blocks_.push_back(int64_t(l));
  values_.assign(blocks_.size() * size_t(E_ + kSlots) + 1, 0.0);
}

void MoeMetrics::clear() {
  std::fill(values_.begin(), values_.end(), 0.0);
}

void MoeMetrics::add(const model::Activations& acts) {
  for (size_t b = 0; b < blocks_.size(); ++b) {
    if (blocks_[b] < acts.first_layer || blocks_[b] >= acts.last_layer) continue;
    const moe::LayerCache& c = acts.moe[size_t(acts.slot(blocks_[b]))];
    double* v = values_.data() + b * size_t(E_ + kSlots);
    // Drops at capacity factor 1.0 and MaxVio are the whole micro-batch's (under context
    // parallelism summed over its cp ranks); this rank counts its share of the drops.
    const double cap = double((k_ * c.batch_tokens + E_ - 1) / E_);  // ceil(k N / E)
    double over = 0;
    for (int64_t e = 0; e < E_; ++e) {
      v[e] += double(c.loads[size_t(e)]);
      over += std::max(0.0, c.batch_loads[size_t(e)] - cap);
    }
    double* s = v + E_;
    s[kAssigned] += double(c.N * k_);
    s[kDropped] += double(c.dropped);
    if (c.N < c.batch_tokens) over *= double(c.N) / double(c.batch_tokens);
    s[kDroppedCf1] += over;
    s[kMaxvioMicro] += max_violation(c.batch_group_loads);
    s[kForwards] += 1;
    s[kBalanceLoss] += c.balance_loss;
  }
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
                   {"dropped", s[kDropped] / assigned},
                   {"dropped_cf1", s[kDroppedCf1] / assigned},
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
                   {"maxvio_global", max_violation(loads)}});
  }
  return out;
}

}  // namespace tessel::train
