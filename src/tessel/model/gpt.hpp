#pragma once
// A decoder-only transformer (GPT) built from a GptConfig, with explicit
// forward/backward over caller-owned Activations. The model knows nothing about
// parallelism: a pipeline stage calls the pieces it owns (embedding, a range of
// blocks, the head) and moves the residual stream at block boundaries itself.
//
//   x_0 = embed[tokens] (+ pos_embed[positions] when positions = learned)
//   block i: m = x_i + attn(attn_norm(x_i));  x_{i+1} = m + mlp(mlp_norm(m))
//   logits = final_norm(x_L) head^T;  loss = sum_n weight[n] * CE(logits[n], targets[n])
//
// Gradient convention: backward functions ADD into parameter gradients (zero them
// once per step with zero_grads(), so micro-batches accumulate) and OVERWRITE the
// residual-stream gradients in Activations.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tessel/attention/flash_attention.hpp"
#include "tessel/core/parameter.hpp"
#include "tessel/core/tensor.hpp"
#include "tessel/model/gpt_config.hpp"

namespace tessel::model {

// One micro-batch of token data, row-major [B, T]; the pointers need only live
// through load_inputs (which copies them into the Activations).
struct ModelInputs {
  int64_t B = 0, T = 0;
  const int32_t* tokens = nullptr;     // ids in [0, vocab); null only for stages without embedding
  const int32_t* positions = nullptr;  // in [0, max_seq); null = 0..T-1 in every row
  const int32_t* targets = nullptr;    // next-token ids; null = inference (no loss, no backward)
  const float* loss_weight = nullptr;  // per-token loss weight; null = 1 for every token
  // Attention mask [B, Hm, T, T] (Hm = 1, heads or kv_heads); null = causal.
  const attention::ColumnMask* mask = nullptr;
};

// Everything one micro-batch's forward keeps for its backward, plus backward
// scratch, allocated once by Gpt::make_activations. Shapes, with N = B*T tokens,
// L layers, C width, H query heads, Hkv key/value heads, D head dim, F MLP hidden
// width, Fi = F (gelu) or 2F (swiglu), QKV = (H + 2 Hkv) D, V vocab:
struct Activations {
  int64_t B = 0, T = 0;
  bool has_tokens = false, has_targets = false;

  // Inputs, copied by load_inputs.
  Tensor tokens;              // i32 [N]
  Tensor positions;           // i32 [N]
  Tensor targets;             // i32 [N]
  Tensor loss_weight;         // f32 [N]
  attention::TiledMask mask;  // the attention mask with its tile summaries, shared by all layers

  // Forward cache. Per-layer buffers stack the layers along dimension 0. The
  // norm means exist only for layernorm.
  Tensor stream;           // [L+1, N, C] residual stream x_i at block boundary i
  Tensor attn_norm;        // [L, N, C] attn_norm(x_i)
  Tensor attn_norm_mean;   // [L, N]
  Tensor attn_norm_rstd;   // [L, N]
  Tensor q;                // [L, N, H, D] queries (rotated when rotary)
  Tensor k;                // [L, N, Hkv, D] keys (rotated when rotary)
  Tensor v;                // [L, N, Hkv, D] values
  Tensor attn;             // [L, N, H, D] attention output
  Tensor attn_lse;         // [L, B, H, T] log-sum-exp of each attention row
  Tensor mid;              // [L, N, C] residual after attention, m_i
  Tensor mlp_norm;         // [L, N, C] mlp_norm(m_i)
  Tensor mlp_norm_mean;    // [L, N]
  Tensor mlp_norm_rstd;    // [L, N]
  Tensor fc;               // [L, N, Fi] fc_in output (swiglu: [gate | up] per row)
  Tensor act;              // [L, N, F] gelu(fc) or silu(gate) * up
  Tensor final_norm;       // [N, C] final_norm(x_L)
  Tensor final_norm_mean;  // [N]
  Tensor final_norm_rstd;  // [N]
  Tensor logits;           // [N, V]
  Tensor lse;              // [N] log-sum-exp of each logits row (cross-entropy)

  // Gradients of the residual stream and the logits.
  Tensor d_stream;  // [L+1, N, C] d loss / d x_i
  Tensor d_logits;  // [N, V]

  // Scratch shared by all layers.
  Tensor qkv;      // [N, QKV] fused projection output; in backward its gradient
  Tensor d_split;  // [N*QKV] planar [dq (N*H*D) | dk (N*Hkv*D) | dv (N*Hkv*D)]
  Tensor d_unrot;  // rotary only: [N*(H+Hkv)*D] planar [dq | dk] before the rotation
  Tensor d_attn;   // [N, H*D]
  Tensor d_norm;   // [N, C] gradient of a norm output
  Tensor d_act;    // [N, F]
  Tensor d_fc;     // [N, Fi]

  // Residual stream x_i at block boundary i in [0, L] and its gradient, [B, T, C]
  // views: boundary 0 is the embedding output, boundary L the last block's output.
  Tensor residual(int64_t boundary) const;
  Tensor residual_grad(int64_t boundary) const;
};

class Gpt {
 public:
  // Validates the config (InputError) and initializes the parameters from `seed`.
  Gpt(const GptConfig& config, uint64_t seed);
  Gpt(const Gpt&) = delete;
  Gpt& operator=(const Gpt&) = delete;
  Gpt(Gpt&&) = default;
  Gpt& operator=(Gpt&&) = default;

  const GptConfig& config() const { return config_; }
  // Registry order, names, shapes and tags: docs/model.md.
  const ParameterList& parameters() const { return parameters_; }
  // The parameter called `name`; throws tessel::Error when there is none.
  const Parameter& parameter(const std::string& name) const;
  // All values / gradients, flat [num_parameters()] in registry order, no padding.
  Tensor flat_params() const { return flat_params_; }
  Tensor flat_grads() const { return flat_grads_; }
  void zero_grads();
  int64_t num_parameters() const { return flat_params_.numel(); }
  // Weights that multiply each token's activations: every block matrix plus the
  // head matrix (counted also when tied); no biases, norms or embedding lookups.
  // MFU counts 6 * matmul_parameters() + 12 * L * H * D * T flops per token.
  int64_t matmul_parameters() const;

  // Buffers for one micro-batch of B sequences of T tokens (InputError when
  // T > max_seq).
  std::unique_ptr<Activations> make_activations(int64_t B, int64_t T) const;

  // Whole model: load_inputs, then every forward piece; returns the SUM of the
  // weighted token losses (0 without targets); the caller divides by its count.
  double forward(Activations& acts, const ModelInputs& inputs) const;
  // Adds d(loss_sum * loss_scale) / d(parameters) into the gradients.
  void backward(Activations& acts, float loss_scale);

  // The pieces, for pipeline stages. Each forward reads the previous boundary of
  // acts and writes the next; each backward reads residual_grad(last) (after
  // backward_head or from the next stage) and writes residual_grad(first).
  // Validates and copies the inputs (InputError on ids or positions out of range).
  void load_inputs(Activations& acts, const ModelInputs& inputs) const;
  void forward_embedding(Activations& acts) const;                            // -> residual(0)
  void forward_blocks(Activations& acts, int64_t first, int64_t last) const;  // [first, last)
  double forward_head(Activations& acts) const;             // residual(L) -> logits, loss sum
  void backward_head(Activations& acts, float loss_scale);  // -> residual_grad(L)
  void backward_blocks(Activations& acts, int64_t first, int64_t last);
  void backward_embedding(Activations& acts);  // residual_grad(0) -> embedding grads

 private:
  // Indices into parameters_; -1 where the config has no such parameter.
  struct BlockParams {
    int attn_norm_w = -1, attn_norm_b = -1, qkv_w = -1, qkv_b = -1, out_w = -1, out_b = -1;
    int mlp_norm_w = -1, mlp_norm_b = -1, fc_in_w = -1, fc_in_b = -1, fc_out_w = -1, fc_out_b = -1;
  };
  const float* value(int index) const;
  float* grad(int index);
  void norm_forward(float* y, float* mean, float* rstd, const float* x, int w, int b,
                    int64_t N) const;
  void norm_backward(float* dx, int w, int b, const float* dy, const float* x, const float* mean,
                     const float* rstd, int64_t N);
  attention::AttentionShape attention_shape(const Activations& acts) const {
    return {acts.B, acts.T, acts.T, H_, Hkv_, D_};
  }
  void block_forward(Activations& acts, int64_t layer) const;
  void block_backward(Activations& acts, int64_t layer);

  GptConfig config_;
  int64_t C_, H_, Hkv_, D_, F_, Fi_, QKV_;
  Tensor flat_params_, flat_grads_;
  ParameterList parameters_;
  int embed_ = -1, pos_embed_ = -1, final_norm_w_ = -1, final_norm_b_ = -1, head_ = -1;
  std::vector<BlockParams> blocks_;
};

}  // namespace tessel::model
