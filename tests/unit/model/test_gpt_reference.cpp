// The model's forward and backward against an independent f64 reference written
// from the math in gpt.hpp with the naive kernels, reading the weights by parameter
// name.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <string>

#include "tessel/kernels/cpu/activations.hpp"
#include "tessel/kernels/cpu/attention.hpp"
#include "tessel/kernels/cpu/cross_entropy.hpp"
#include "tessel/kernels/cpu/gemm.hpp"
#include "tessel/kernels/cpu/norms.hpp"
#include "tessel/kernels/cpu/rope.hpp"
#include "tessel/model/gpt.hpp"
#include "unit/kernels/kernel_test_util.hpp"
#include "unit/model/model_test_util.hpp"

using namespace tessel;
using namespace tessel::model;
using namespace tessel::model::testing;
namespace naive = tessel::kernels::naive;

namespace {

using Vec = std::vector<double>;

struct Reference {
  Vec logits;  // [N, V]
  double loss;
};

// f64 copies of a model's parameter values, by registry name.
using Params = std::map<std::string, Vec>;

Params f64_params(const Gpt& gpt) {
  Params params;
  for (const Parameter& p : gpt.parameters())
    params[p.name] = Vec(p.value.f32(), p.value.f32() + p.value.numel());
  return params;
}

// The model `c` at parameters `params` (names and shapes as in the registry) on `batch`.
Reference reference_forward(const GptConfig& c, const Params& params, const Batch& batch) {
  const int64_t N = batch.B * batch.T, C = c.width, H = c.heads, Hkv = c.num_kv_heads();
  const int64_t D = c.head_dim(), F = c.mlp_hidden_size(), V = c.vocab;
  const int64_t Fi = c.mlp == MlpType::swiglu ? 2 * F : F;
  const bool layernorm = c.norm == NormType::layernorm;
  auto param = [&](const std::string& name) -> const Vec& { return params.at(name); };
  auto has = [&](const std::string& name) { return params.count(name) > 0; };
  auto linear = [&](const Vec& x, const std::string& name, int64_t in, int64_t out) {
    Vec y(static_cast<size_t>(N * out));
    const double* b = has(name + ".bias") ? param(name + ".bias").data() : nullptr;
    naive::linear_forward<double>(y.data(), x.data(), param(name + ".weight").data(), b, N, in,
                                  out);
    return y;
  };
  auto norm = [&](const Vec& x, const std::string& name) {
    Vec y(x.size()), mean(static_cast<size_t>(N)), rstd(static_cast<size_t>(N));
    const Vec& w = param(name + ".weight");
    if (layernorm)
      naive::layernorm_forward<double>(y.data(), mean.data(), rstd.data(), x.data(), w.data(),
                                       param(name + ".bias").data(), N, C, c.norm_eps);
    else
      naive::rmsnorm_forward<double>(y.data(), rstd.data(), x.data(), w.data(), N, C, c.norm_eps);
    return y;
  };
  std::vector<int32_t> pos(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n)
    pos[n] = batch.positions.empty() ? int32_t(n % batch.T) : batch.positions[n];

  const Vec& embed = param("embed.weight");
  Vec x(static_cast<size_t>(N * C));
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < C; ++j) x[n * C + j] = embed[batch.tokens[n] * C + j];
  if (c.positions == PositionType::learned) {
    const Vec& pe = param("pos_embed.weight");
    for (int64_t n = 0; n < N; ++n)
      for (int64_t j = 0; j < C; ++j) x[n * C + j] += pe[pos[n] * C + j];
  }
  for (int64_t l = 0; l < c.layers; ++l) {
    const std::string p = "blocks." + std::to_string(l) + ".";
    const Vec qkv = linear(norm(x, p + "attn_norm"), p + "attn.qkv", C, (H + 2 * Hkv) * D);
    Vec q(static_cast<size_t>(N * H * D)), k(static_cast<size_t>(N * Hkv * D)),
        v(static_cast<size_t>(N * Hkv * D));
    for (int64_t n = 0; n < N; ++n) {
      const double* row = qkv.data() + n * (H + 2 * Hkv) * D;
      std::copy(row, row + H * D, q.data() + n * H * D);
      std::copy(row + H * D, row + (H + Hkv) * D, k.data() + n * Hkv * D);
      std::copy(row + (H + Hkv) * D, row + (H + 2 * Hkv) * D, v.data() + n * Hkv * D);
    }
    if (c.positions == PositionType::rotary) {
      Vec qr(q.size()), kr(k.size());
      naive::rope_forward<double>(qr.data(), q.data(), pos.data(), N, H, D, c.rope_theta);
      naive::rope_forward<double>(kr.data(), k.data(), pos.data(), N, Hkv, D, c.rope_theta);
      q.swap(qr);
      k.swap(kr);
    }
    Vec o(q.size()), lse(static_cast<size_t>(N * H));
    naive::causal_attention_forward<double>(o.data(), lse.data(), q.data(), k.data(), v.data(),
                                            {batch.B, batch.T, H, Hkv, D});
    const Vec attn = linear(o, p + "attn.out", H * D, C);
    for (size_t i = 0; i < x.size(); ++i) x[i] += attn[i];
    const Vec fc = linear(norm(x, p + "mlp_norm"), p + "mlp.fc_in", C, Fi);
    Vec act(static_cast<size_t>(N * F));
    if (c.mlp == MlpType::gelu)
      naive::gelu_forward<double>(act.data(), fc.data(), N * F);
    else
      naive::swiglu_forward<double>(act.data(), fc.data(), N, F);
    const Vec mlp = linear(act, p + "mlp.fc_out", F, C);
    for (size_t i = 0; i < x.size(); ++i) x[i] += mlp[i];
  }
  const Vec& head = param(c.tied_head ? "embed.weight" : "head.weight");
  const Vec h = norm(x, "final_norm");
  Reference r{Vec(static_cast<size_t>(N * V)), 0.0};
  naive::linear_forward<double>(r.logits.data(), h.data(), head.data(), nullptr, N, C, V);
  Vec lse(static_cast<size_t>(N)), weight(batch.weight.begin(), batch.weight.end());
  r.loss = naive::cross_entropy_forward<double>(lse.data(), r.logits.data(), batch.targets.data(),
                                                weight.data(), N, V);
  return r;
}

}  // namespace

// f32 model vs f64 reference: logits within 1e-4 * max |logit| (f32 rounding over
// sums of <= 64 terms through 2 blocks is ~1e-6 relative), loss within 1e-5
// relative. A wrong split of qkv, a missing residual or a swapped [gate | up]
// moves them by O(1).
TEST(GptReference, ForwardMatchesNaiveF64) {
  for (GptConfig c : {gelu_config(), swiglu_config()}) {
    for (bool bias : {false, true}) {
      c.bias = bias;
      Gpt gpt(c, 61);
      randomize_parameters(gpt, 62, 0.4f);
      const Batch batch = random_batch(c, 2, 6, 63, c.positions == PositionType::rotary);
      auto acts = gpt.make_activations(2, 6);
      const double loss = gpt.forward(*acts, batch.inputs());
      const Reference ref = reference_forward(c, f64_params(gpt), batch);
      double scale = 0.0, err = 0.0;
      for (size_t i = 0; i < ref.logits.size(); ++i) {
        scale = std::max(scale, std::fabs(ref.logits[i]));
        err = std::max(err, std::fabs(ref.logits[i] - acts->logits.f32()[i]));
      }
      EXPECT_GT(scale, 0.5);
      EXPECT_LE(err, 1e-4 * scale) << to_string(c.mlp) << " bias " << bias;
      EXPECT_NEAR(loss, ref.loss, 1e-5 * std::fabs(ref.loss));
    }
  }
}

namespace {

// Central differences (eps = 1e-6, kernel_test_util.hpp) of the f64 reference loss
// sum in EVERY coordinate of every parameter, with the model's f32 parameters copied
// into the reference exactly, against the f32 analytic gradient of Gpt::backward.
// The batch has random positions in [0, max_seq) (repeated and out of order: the
// position-embedding scatter accumulates) and three tokens out of the loss.
//
// Tolerance, per tensor: max |analytic - fd| <= 1e-4 * max |fd|. The f64 differences
// are exact to ~1e-9 relative; what is left is the f32 rounding of the model's forward
// and backward, measured at <= 7.3e-7 (gelu) and <= 4.3e-6 (swiglu; rotary's f32
// angles). Dropping one term of the backward (a residual path, the tied head's share of
// embed.weight, the position-embedding scatter, dq, dk or dv, the rotary backward of
// dk, a bias gradient) moves some tensor by >= 30%, and a rotary backward of dk with
// theta off by 10% by 1.7e-3.
void check_every_coordinate(const GptConfig& c, int64_t T) {
  Gpt gpt(c, 71);
  randomize_parameters(gpt, 72, 0.4f);
  Batch batch = random_batch(c, 2, T, 73, false);
  Rng rng(74);
  for (int64_t n = 0; n < 2 * T; ++n)
    batch.positions.push_back(int32_t(rng.below(uint64_t(c.max_seq))));
  for (int64_t n : {int64_t(1), T + 2}) {  // with token T - 1 of random_batch: three zeros
    batch.weight[size_t(n)] = 0.0f;
    batch.targets[size_t(n)] = -1;
  }
  auto acts = gpt.make_activations(batch.B, batch.T);
  gpt.zero_grads();
  gpt.forward(*acts, batch.inputs());
  gpt.backward(*acts, 1.0f);

  Params params = f64_params(gpt);
  const auto loss = [&] { return reference_forward(c, params, batch).loss; };
  for (const Parameter& p : gpt.parameters()) {
    const Vec fd = kernels::test::numeric_grad(params.at(p.name), loss);
    const std::vector<float> analytic(p.grad.f32(), p.grad.f32() + p.grad.numel());
    double scale = 0.0;
    for (double g : fd) scale = std::max(scale, std::fabs(g));
    EXPECT_GT(scale, 1e-2) << p.name << " shows no gradient to check";
    EXPECT_LE(kernels::test::rel_error(analytic, fd), 1e-4) << p.name;
  }
}

}  // namespace

// Vocab 11, width 8, 2 heads (D 4), MLP 12, sequence 7.
TEST(GptReference, EveryGradientMatchesF64FiniteDifferencesGelu) {
  GptConfig c = gelu_config();
  c.vocab = 11;
  c.width = 8;
  c.heads = 2;
  c.kv_heads = 2;
  c.mlp_hidden = 12;
  check_every_coordinate(c, 7);
}

// Vocab 17, width 16, 4 query heads over 2 kv heads (D 4), MLP 20, sequence 5.
TEST(GptReference, EveryGradientMatchesF64FiniteDifferencesSwiglu) {
  GptConfig c = swiglu_config();
  c.vocab = 17;
  c.mlp_hidden = 20;
  check_every_coordinate(c, 5);
}
