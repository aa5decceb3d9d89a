#include "tessel/model/gpt_config.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "tessel/core/error.hpp"
#include "tessel/core/number_list.hpp"

namespace tessel::model {

int64_t default_mlp_hidden(MlpType mlp, int64_t width) {
  if (mlp == MlpType::gelu) return 4 * width;
  const int64_t hidden = (8 * width + 2) / 3;  // ceil(8 * width / 3)
  return (hidden + 63) / 64 * 64;
}

int64_t GptConfig::mlp_hidden_size() const {
  return mlp_hidden == 0 ? default_mlp_hidden(mlp, width) : mlp_hidden;
}

int64_t GptConfig::moe_hidden_size() const {
  return moe.hidden == 0 ? mlp_hidden_size() : moe.hidden;
}

std::vector<bool> GptConfig::moe_mask() const {
  std::vector<bool> mask(size_t(std::max<int64_t>(layers, 0)), moe_layers == "all");
  if (moe_layers == "all") return mask;
  for (int64_t i : parse_int_list("model.moe_layers", moe_layers, 0)) {
    if (i >= layers)
      input_error(
          "model.moe_layers = \"", moe_layers,
          "\" must be \"\", \"all\" or comma-separated block indices in [0, model.layers = ",
          layers, ")");
    if (mask[size_t(i)])
      input_error("model.moe_layers = \"", moe_layers, "\" lists block ", i, " twice");
    mask[size_t(i)] = true;
  }
  return mask;
}

namespace {
void require_positive(const char* field, int64_t value) {
  if (value <= 0) input_error("model.", field, " = ", value, " must be positive");
}
// Positive and at most `limit`: far beyond any trainable model, and small enough that the
// parameter-count bound below can be computed without overflow.
void require_size(const char* field, int64_t value, int64_t limit) {
  require_positive(field, value);
  if (value > limit)
    input_error("model.", field, " = ", value, " is larger than tessel supports (", limit, ")");
}
// Positive, and a positive finite float: the kernels compute in f32, where 1e-300 is 0.
void require_positive(const char* field, double value) {
  if (!(value > 0.0) || !std::isfinite(value))
    input_error("model.", field, " = ", value, " must be positive");
  check_positive_float_range(std::string("model.") + field, value, "the model");
}
}  // namespace

void validate(const GptConfig& c) {
  constexpr int64_t kMaxSize = int64_t(1) << 24;  // of a sequence or a hidden layer
  require_positive("vocab", c.vocab);
  if (c.vocab > std::numeric_limits<int32_t>::max())
    input_error("model.vocab = ", c.vocab, " must fit token ids in int32 (at most ",
                std::numeric_limits<int32_t>::max(), ")");
  require_size("layers", c.layers, int64_t(1) << 16);
  require_size("width", c.width, int64_t(1) << 20);
  require_positive("heads", c.heads);
  if (c.width % c.heads != 0)
    input_error("model.heads = ", c.heads, " must divide model.width = ", c.width);
  if (c.kv_heads < 0)
    input_error("model.kv_heads = ", c.kv_heads, " must be positive (or 0 = model.heads)");
  if (c.heads % c.num_kv_heads() != 0)
    input_error("model.kv_heads = ", c.kv_heads, " must divide model.heads = ", c.heads);
  if (c.mlp_hidden < 0)
    input_error("model.mlp_hidden = ", c.mlp_hidden, " must be positive (or 0 = default)");
  if (c.mlp_hidden > 0) require_size("mlp_hidden", c.mlp_hidden, kMaxSize);
  require_positive("norm_eps", c.norm_eps);
  if (c.positions == PositionType::rotary) {
    if (c.head_dim() % 2 != 0)
      input_error("model.width / model.heads = ", c.head_dim(),
                  " (the head dimension) must be even for model.positions = \"rotary\"");
    require_positive("rope_theta", c.rope_theta);
  }
  require_size("max_seq", c.max_seq, kMaxSize);
  if (c.attention_window < 0)
    input_error("model.attention_window = ", c.attention_window,
                " must be positive (or 0 = no window)");
  if (c.attention_window > kMaxSize)
    input_error("model.attention_window = ", c.attention_window,
                " is larger than tessel supports (", kMaxSize, ")");
  require_positive("init_std", c.init_std);
  const std::vector<bool> mask = c.moe_mask();
  const bool moe = std::find(mask.begin(), mask.end(), true) != mask.end();
  if (moe) moe::validate(c.moe);
  // An upper bound of the parameter count (every block with the widest MLP, gated, each
  // expert and the shared one), in floating point: sizes whose products would overflow the
  // int64 element counts of the model's tensors are refused here, not in an allocation.
  const double C = double(c.width), mlp = 2.0 * double(c.mlp_hidden_size()),
               experts = moe ? 2.0 * double(c.moe_hidden_size()) * double(c.moe.experts) +
                                   2.0 * double(c.moe.shared) + double(c.moe.experts)
                             : 0.0;
  const double bound = double(c.layers) * C * (4.0 * C + 2.0 * mlp + 2.0 * experts + 4.0) +
                       C * (2.0 * double(c.vocab) + double(c.max_seq) + 2.0);
  constexpr double kMaxParameters = double(int64_t(1) << 40);
  if (bound > kMaxParameters)
    input_error("model: about ", bound, " parameters (model.layers, width, mlp_hidden, vocab, ",
                "moe_*), more than tessel supports (2^40)");
}

const char* to_string(MlpType mlp) {
  return mlp == MlpType::gelu ? "gelu" : "swiglu";
}
const char* to_string(NormType norm) {
  return norm == NormType::layernorm ? "layernorm" : "rmsnorm";
}
const char* to_string(PositionType positions) {
  return positions == PositionType::learned ? "learned" : "rotary";
}
const char* to_string(Recompute recompute) {
  return recompute == Recompute::none ? "none" : "blocks";
}

void check_trainable(const GptConfig& c) {
  const std::vector<bool> mask = c.moe_mask();
  if (std::find(mask.begin(), mask.end(), true) == mask.end()) return;
  const moe::MoeConfig& m = c.moe;
  // The loss gives a gate of p / p no gradient: the router would never learn to route.
  if (m.top_k == 1 && m.normalize_gates && m.balance != moe::Balance::expert_choice)
    input_error(
        "model.moe_top_k = 1 with model.moe_normalize_gates = true makes every gate p / p = 1, so "
        "the loss gives the router no gradient and it never learns to route; set "
        "model.moe_normalize_gates = false (each token's output scaled by its expert's "
        "probability, as Switch Transformer's top-1 router)");
  // Every token takes every expert: each margin is S - (-inf) = inf, and so would beta be.
  if (m.balance == moe::Balance::qb_avg && m.top_k == m.experts)
    input_error(
        "model.moe_balance = \"qb_avg\" needs model.moe_top_k < model.moe_experts (every token "
        "takes every expert, and its quantile bias would be infinite)");
}

}  // namespace tessel::model
