#pragma once
// The shape of a GPT, as data. Field names match the config keys `model.<field>`;
// docs/model.md describes every field, the parameter names and the init rule.
#include <cstdint>
#include <string>
#include <vector>

#include "tessel/moe/config.hpp"

namespace tessel::model {

enum class MlpType { gelu, swiglu };
enum class NormType { layernorm, rmsnorm };
enum class PositionType { learned, rotary };

// Activation recomputation (train.recompute). `none`: forward keeps every block's cache for
// backward. `blocks`: forward keeps only the residual stream at the block boundaries and one
// block's cache, and backward runs each block's forward again, just before that block's
// backward, to rebuild it. Same losses and gradients bitwise. Per token and block, the
// activations fall from about 4 C + 2 (H + Hkv) D + Fi + F floats (stream and cache; C width,
// H, Hkv heads of dim D, Fi, F the MLP's input and hidden widths) to C, for one more forward
// of the blocks less a dense MLP's output projection. An MoE block reruns its whole layer
// (token exchange included); its routing and expert buffers are freed after each forward and
// backward, its statistics stay.
enum class Recompute { none, blocks };

struct GptConfig {
  int64_t vocab = 50304;
  int64_t layers = 12;
  int64_t width = 768;   // C, the residual width
  int64_t heads = 12;    // query heads H; head dim D = width / heads
  int64_t kv_heads = 0;  // key/value heads Hkv (grouped-query attention); 0 = heads
  MlpType mlp = MlpType::gelu;
  int64_t mlp_hidden = 0;  // 0 = default_mlp_hidden(mlp, width)
  NormType norm = NormType::layernorm;
  double norm_eps = 1e-5;
  PositionType positions = PositionType::learned;
  double rope_theta = 10000.0;
  bool tied_head = true;  // the head reuses embed.weight
  bool bias = true;       // biases in the linear layers of the blocks (never in the head)
  int64_t max_seq = 1024;
  // Causal sliding-window attention: each token attends to itself and the W - 1 tokens before
  // it (within the data's own mask, e.g. its document); 0 = no window.
  int64_t attention_window = 0;
  double init_std = 0.02;
  // Mixture of experts: the blocks whose MLP is an MoE layer ("" = none, "all", or layer
  // indices "0,2"), with the layer's shape and balancing (experts use the `mlp` type).
  std::string moe_layers;
  moe::MoeConfig moe;

  int64_t head_dim() const { return width / heads; }
  int64_t num_kv_heads() const { return kv_heads == 0 ? heads : kv_heads; }
  int64_t mlp_hidden_size() const;  // mlp_hidden, or the default when it is 0
  int64_t moe_hidden_size() const;  // moe.hidden, or mlp_hidden_size() when it is 0
  // Whether each block's MLP is an MoE layer (InputError on a bad moe_layers).
  std::vector<bool> moe_mask() const;
};

// The MLP hidden width used when mlp_hidden = 0: 4 * width for gelu; for swiglu
// ceil(8 * width / 3) rounded up to a multiple of 64 (about the same parameter
// count as the gelu MLP, with GEMM-friendly sizes).
int64_t default_mlp_hidden(MlpType mlp, int64_t width);

// Throws tessel::InputError naming the first bad field ("model.<field> = value ...").
void validate(const GptConfig& config);

// InputError for settings the model computes but would not learn with, refused for a run
// that starts training (not for a checkpoint an earlier tessel let train with them, which
// still resumes, generates and exports): top-1 MoE routing with normalized gates (every
// gate p / p = 1, so the router gets no gradient), and qb_avg with every expert per token
// (an infinite bias).
void check_trainable(const GptConfig& config);

// Names as config files spell them; the parsers throw InputError naming model.<field>.
const char* to_string(MlpType mlp);             // "gelu" | "swiglu"
const char* to_string(NormType norm);           // "layernorm" | "rmsnorm"
const char* to_string(PositionType positions);  // "learned" | "rotary"
const char* to_string(Recompute recompute);     // "none" | "blocks" (train.recompute)

}  // namespace tessel::model
