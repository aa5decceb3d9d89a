#include "tessel/model/gpt_config.hpp"

#include <cmath>
#include <limits>

#include "tessel/core/error.hpp"

namespace tessel::model {

int64_t default_mlp_hidden(MlpType mlp, int64_t width) {
  if (mlp == MlpType::gelu) return 4 * width;
  const int64_t hidden = (8 * width + 2) / 3;  // ceil(8 * width / 3)
  return (hidden + 63) / 64 * 64;
}

int64_t GptConfig::mlp_hidden_size() const {
  return mlp_hidden == 0 ? default_mlp_hidden(mlp, width) : mlp_hidden;
}

namespace {
void require_positive(const char* field, int64_t value) {
  if (value <= 0) input_error("model.", field, " = ", value, " must be positive");
}
void require_positive(const char* field, double value) {
  if (!(value > 0.0) || !std::isfinite(value))
    input_error("model.", field, " = ", value, " must be positive");
}
}  // namespace

void validate(const GptConfig& c) {
  require_positive("vocab", c.vocab);
  if (c.vocab > std::numeric_limits<int32_t>::max())
    input_error("model.vocab = ", c.vocab, " must fit token ids in int32 (at most ",
                std::numeric_limits<int32_t>::max(), ")");
  require_positive("layers", c.layers);
  require_positive("width", c.width);
  require_positive("heads", c.heads);
  if (c.width % c.heads != 0)
    input_error("model.heads = ", c.heads, " must divide model.width = ", c.width);
  if (c.kv_heads < 0)
    input_error("model.kv_heads = ", c.kv_heads, " must be positive (or 0 = model.heads)");
  if (c.heads % c.num_kv_heads() != 0)
    input_error("model.kv_heads = ", c.kv_heads, " must divide model.heads = ", c.heads);
  if (c.mlp_hidden < 0)
    input_error("model.mlp_hidden = ", c.mlp_hidden, " must be positive (or 0 = default)");
  require_positive("norm_eps", c.norm_eps);
  if (c.positions == PositionType::rotary) {
    if (c.head_dim() % 2 != 0)
      input_error("model.width / model.heads = ", c.head_dim(),
                  " (the head dimension) must be even for model.positions = \"rotary\"");
    require_positive("rope_theta", c.rope_theta);
  }
  require_positive("max_seq", c.max_seq);
  require_positive("init_std", c.init_std);
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

MlpType parse_mlp_type(const std::string& name) {
  if (name == "gelu") return MlpType::gelu;
  if (name == "swiglu") return MlpType::swiglu;
  input_error("model.mlp = \"", name, "\" must be \"gelu\" or \"swiglu\"");
}
NormType parse_norm_type(const std::string& name) {
  if (name == "layernorm") return NormType::layernorm;
  if (name == "rmsnorm") return NormType::rmsnorm;
  input_error("model.norm = \"", name, "\" must be \"layernorm\" or \"rmsnorm\"");
}
PositionType parse_position_type(const std::string& name) {
  if (name == "learned") return PositionType::learned;
  if (name == "rotary") return PositionType::rotary;
  input_error("model.positions = \"", name, "\" must be \"learned\" or \"rotary\"");
}

}  // namespace tessel::model
