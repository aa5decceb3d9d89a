#include "tessel/moe/config.hpp"

#include <cmath>
#include <limits>

#include "tessel/core/error.hpp"

namespace tessel::moe {

void validate(const MoeConfig& c) {
  if (c.experts < 1 || c.experts > 256)  // the router's selection keeps a 256-bit set
    input_error("model.moe_experts = ", c.experts, " must lie in [1, 256]");
  if (c.top_k < 1 || c.top_k > c.experts)
    input_error("model.moe_top_k = ", c.top_k, " must lie in [1, model.moe_experts = ", c.experts,
                "]");
  constexpr int64_t kMaxHidden = int64_t(1) << 24;  // as model.mlp_hidden
  if (c.hidden < 0 || c.hidden > kMaxHidden)
    input_error("model.moe_hidden = ", c.hidden, " must lie in [1, ", kMaxHidden,
                "] (or 0 = model.mlp_hidden)");
  if (c.shared < 0 || c.shared > kMaxHidden)
    input_error("model.moe_shared = ", c.shared, " must lie in [1, ", kMaxHidden,
                "] (or 0 = no shared expert)");
  auto non_negative = [](const char* field, double v) {
    if (!(v >= 0) || !std::isfinite(v))
      input_error("model.moe_", field, " = ", v, " must be a finite number >= 0");
  };
  // The coefficients reach the router's gradients and the bias in f32, where more is inf.
  auto float_coefficient = [&](const char* field, double v) {
    non_negative(field, v);
    if (v > std::numeric_limits<float>::max())
      input_error("model.moe_", field, " = ", v,
                  " is outside the float range the router computes in (at most ",
                  std::numeric_limits<float>::max(), ")");
  };
  non_negative("capacity", c.capacity);
  float_coefficient("aux_coeff", c.aux_coeff);
  float_coefficient("z_coeff", c.z_coeff);
  float_coefficient("bias_rate", c.bias_rate);
  float_coefficient("lei_coeff", c.lei_coeff);
  if (!(c.eqb_step > 0 && c.eqb_step <= 1))
    input_error("model.moe_eqb_step = ", c.eqb_step, " must lie in (0, 1]");
  // Each update holds E x B int32 counters: the cap keeps that a bounded buffer.
  constexpr int64_t kMaxHistBins = int64_t(1) << 20;
  if (c.hist_bins < 2 || c.hist_bins > kMaxHistBins)
    input_error("model.moe_hist_bins = ", c.hist_bins, " must lie in [2, ", kMaxHistBins, "]");
  // LEI marks margins outside every kernel with +-1e30 (layer.cpp): a width near that would
  // give those tokens a nonzero kernel derivative; at 1e6 they stay 1e24 widths away.
  constexpr double kMaxLeiWidth = 1e6;
  if (!(c.lei_width > 0 && c.lei_width <= kMaxLeiWidth))
    input_error("model.moe_lei_width = ", c.lei_width, " must lie in (0, 1e6]");
  if (c.capacity > 0 && c.capacity * double(c.top_k) < 1e-9)
    input_error("model.moe_capacity = ", c.capacity, " is too small");
  // DeepSeek-V3 normalizes sigmoid scores over the experts before its sequence-wise loss; this
  // implementation averages the probabilities as they come, which is that only for softmax.
  if (c.balance == Balance::seq_aux && c.score != ScoreFn::softmax)
    input_error(
        "model.moe_balance = \"seq_aux\" needs model.moe_score = \"softmax\" (DeepSeek-V3 "
        "normalizes sigmoid scores over the experts first, which is not implemented)");
  if (uses_global_quantile(c.balance) && c.top_k == c.experts)
    input_error("model.moe_balance = \"", to_string(c.balance),
                "\" needs model.moe_top_k < model.moe_experts (every token takes every expert)");
  if (c.balance == Balance::expert_choice && c.drop == DropPolicy::position)
    input_error(
        "model.moe_balance = \"expert_choice\" needs model.moe_drop = \"probability\" (each "
        "expert takes the tokens with the highest scores; there is no later token to drop)");
}

bool uses_global_quantile(Balance b) {
  return b == Balance::eqb || b == Balance::eqb_lei || b == Balance::qb_hist;
}
bool uses_lei(Balance b) {
  return b == Balance::lei || b == Balance::eqb_lei;
}

const char* to_string(Balance v) {
  switch (v) {
    case Balance::none:
      return "none";
    case Balance::aux:
      return "aux";
    case Balance::aux_global:
      return "aux_global";
    case Balance::seq_aux:
      return "seq_aux";
    case Balance::bias:
      return "bias";
    case Balance::qb_avg:
      return "qb_avg";
    case Balance::eqb:
      return "eqb";
    case Balance::qb_hist:
      return "qb_hist";
    case Balance::lei:
      return "lei";
    case Balance::eqb_lei:
      return "eqb_lei";
    case Balance::sinkhorn:
      return "sinkhorn";
    case Balance::expert_choice:
      return "expert_choice";
  }
  return "?";
}
}  // namespace tessel::moe
