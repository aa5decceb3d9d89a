#pragma once
// Tiny models and micro-batches shared by the model tests.
#include <cstdint>
#include <cstring>
#include <vector>

#include "tessel/core/rng.hpp"
#include "tessel/model/gpt.hpp"

namespace tessel::model::testing {

// gelu + layernorm + learned positions + untied head + biases.
inline GptConfig gelu_config() {
  GptConfig c;
  c.vocab = 13;
  c.layers = 2;
  c.width = 16;
  c.heads = 4;
  c.kv_heads = 4;
  c.mlp = MlpType::gelu;
  c.mlp_hidden = 24;
  c.norm = NormType::layernorm;
  c.positions = PositionType::learned;
  c.tied_head = false;
  c.bias = true;
  c.max_seq = 8;
  return c;
}

// swiglu + rmsnorm + rotary + tied head + grouped-query attention (4 query, 2 kv heads).
inline GptConfig swiglu_config() {
  GptConfig c;
  c.vocab = 13;
  c.layers = 2;
  c.width = 16;
  c.heads = 4;
  c.kv_heads = 2;
  c.mlp = MlpType::swiglu;
  c.mlp_hidden = 0;  // default: 64
  c.norm = NormType::rmsnorm;
  c.positions = PositionType::rotary;
  c.tied_head = true;
  c.bias = false;
  c.max_seq = 8;
  return c;
}

// `base` with MoE blocks `layers` (3 experts, top-2, so each expert sees many tokens, a shared
// expert; swiglu configs also sigmoid scores and capacity factor 1). Balancing by EQB, which adds
// no loss term, so the gradient is that of the returned loss.
inline GptConfig moe_config(GptConfig base, const char* layers) {
  base.moe_layers = layers;
  base.moe.experts = 3;
  base.moe.top_k = 2;
  base.moe.hidden = 12;
  base.moe.shared = 8;
  base.moe.balance = moe::Balance::eqb;
  if (base.mlp == MlpType::swiglu) {
    base.moe.score = moe::ScoreFn::sigmoid;
    base.moe.capacity = 1.0;
  }
  return base;
}

// Token data of one micro-batch [B, T], owned.
struct Batch {
  int64_t B, T;
  std::vector<int32_t> tokens, positions, targets;
  std::vector<float> weight;
  ModelInputs inputs() const {
    return {B,
            T,
            tokens.data(),
            positions.empty() ? nullptr : positions.data(),
            targets.data(),
            weight.data()};
  }
  // Rows [b0, b1) as a batch of their own.
  Batch rows(int64_t b0, int64_t b1) const {
    auto cut = [&](const auto& v) {
      using V = std::decay_t<decltype(v)>;
      return v.empty() ? V() : V(v.begin() + b0 * T, v.begin() + b1 * T);
    };
    return {b1 - b0, T, cut(tokens), cut(positions), cut(targets), cut(weight)};
  }
};

// Random tokens and targets; the last token of row 0 is out of the loss (weight 0,
// target -1) and the others carry weights in [0.5, 1.5). With packed positions,
// each row holds two documents (positions restart at T/2).
inline Batch random_batch(const GptConfig& c, int64_t B, int64_t T, uint64_t seed,
                          bool packed_positions) {
  Rng rng(seed);
  Batch b{B, T, {}, {}, {}, {}};
  for (int64_t n = 0; n < B * T; ++n) {
    b.tokens.push_back(int32_t(rng.below(uint64_t(c.vocab))));
    b.targets.push_back(int32_t(rng.below(uint64_t(c.vocab))));
    b.weight.push_back(0.5f + rng.uniform());
    if (packed_positions) b.positions.push_back(int32_t(n % T < T / 2 ? n % T : n % T - T / 2));
  }
  b.targets[size_t(T - 1)] = -1;
  b.weight[size_t(T - 1)] = 0.0f;
  return b;
}

// Moves every parameter off its structured init (norm gains 1, biases 0) to a
// generic point with weights of size `stddev`, so every path carries gradient.
inline bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.numel() == b.numel() && std::memcmp(a.raw(), b.raw(), a.bytes()) == 0;
}

inline void randomize_parameters(Gpt& gpt, uint64_t seed, float stddev) {
  Rng rng(seed);
  for (const Parameter& p : gpt.parameters()) {
    Tensor v = p.value;
    const float mean = p.tag == ParamTag::norm && p.name.ends_with(".weight") ? 1.0f : 0.0f;
    rng.fill_normal(v.f32(), v.numel(), mean, stddev);
  }
}

// Runs `batch` as two pipeline stages would: blocks [0, k) with the embedding on `stage0`,
// [k, L) with the head on `stage1`, the residual stream and its gradient copied between them.
// Returns the loss sum; the gradients (loss_scale 1) are left in gpt's, zeroed first.
inline double run_as_two_stages(Gpt& gpt, Activations& stage0, Activations& stage1,
                                const Batch& batch, int64_t k) {
  const int64_t L = gpt.config().layers;
  gpt.load_inputs(stage0, batch.inputs());
  gpt.load_inputs(stage1, batch.inputs());
  gpt.forward_embedding(stage0);
  gpt.forward_blocks(stage0, 0, k);
  Tensor boundary = stage1.residual(k);
  std::memcpy(boundary.raw(), stage0.residual(k).raw(), boundary.bytes());
  gpt.forward_blocks(stage1, k, L);
  const double loss = gpt.forward_head(stage1);
  gpt.zero_grads();
  gpt.backward_head(stage1, 1.0f);
  gpt.backward_blocks(stage1, k, L);
  Tensor boundary_grad = stage0.residual_grad(k);
  std::memcpy(boundary_grad.raw(), stage1.residual_grad(k).raw(), boundary_grad.bytes());
  gpt.backward_blocks(stage0, 0, k);
  gpt.backward_embedding(stage0);
  return loss;
}

}  // namespace tessel::model::testing
