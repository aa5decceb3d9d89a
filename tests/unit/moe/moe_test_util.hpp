#pragma once
// MoE layer parameters owned by a test: one flat buffer laid out as router [E, C], then per
// expert fc_in.w, fc_in.b, fc_out.w, fc_out.b (biases only with `bias`), then the shared
// expert. bind() makes the layer's pointer views over a buffer of that layout.
// balance_grad() runs a layer whose router is the identity (C = E).
#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "tessel/core/rng.hpp"
#include "tessel/moe/layer.hpp"

namespace tessel::moe::testing {

struct Layout {
  MoeConfig config;
  LayerShape shape;
  bool bias = true;

  int64_t mlp_size(int64_t hidden) const {
    const int64_t C = shape.C, Fi = shape.fc_in_rows(hidden);
    return Fi * C + C * hidden + (bias ? Fi + C : 0);
  }
  int64_t size() const {
    return config.experts * shape.C + config.experts * mlp_size(shape.F) +
           (shape.Fs > 0 ? mlp_size(shape.Fs) : 0);
  }
};

template <class P>
MlpWeightsT<P> bind_mlp(P*& at, const Layout& l, int64_t hidden) {
  const int64_t C = l.shape.C, Fi = l.shape.fc_in_rows(hidden);
  MlpWeightsT<P> m;
  m.fc_in_w = at, at += Fi * C;
  if (l.bias) m.fc_in_b = at, at += Fi;
  m.fc_out_w = at, at += C * hidden;
  if (l.bias) m.fc_out_b = at, at += C;
  return m;
}

template <class P>
LayerWeightsT<P> bind(P* base, const Layout& l) {
  LayerWeightsT<P> w;
  w.router = base;
  P* at = base + l.config.experts * l.shape.C;
  for (int64_t e = 0; e < l.config.experts; ++e) w.experts.push_back(bind_mlp(at, l, l.shape.F));
  if (l.shape.Fs > 0) w.shared = bind_mlp(at, l, l.shape.Fs);
  return w;
}

// Random parameters: router rows of scale `router_std` (large enough for clear top-k gaps),
// the rest normal(0, 0.3).
inline std::vector<float> random_params(const Layout& l, uint64_t seed, float router_std = 1.0f) {
  Rng rng(seed);
  std::vector<float> p(size_t(l.size()));
  const int64_t r = l.config.experts * l.shape.C;
  rng.fill_normal(p.data(), r, 0.0f, router_std);
  rng.fill_normal(p.data() + r, int64_t(p.size()) - r, 0.0f, 0.3f);
  return p;
}

struct BalanceResult {
  double loss;                  // the cache's balance_loss
  std::vector<float> d_logits;  // [N, E]
  LayerCache cache;
};

// logits [N, E] straight through the identity router (l.shape.C = E) with dy = 0, so the
// input gradient is exactly the logit gradient of the balancing terms, with loss_scale;
// sequence as MoeLayer::forward's.
inline BalanceResult balance_grad(const Layout& l, const std::vector<float>& logits,
                                  float loss_scale = 1.0f, std::span<const int32_t> sequence = {}) {
  const int64_t E = l.config.experts, N = int64_t(logits.size()) / E;
  std::vector<float> params = random_params(l, 1);
  std::fill(params.begin(), params.begin() + E * E, 0.0f);
  for (int64_t e = 0; e < E; ++e) params[size_t(e * E + e)] = 1.0f;
  std::vector<float> grads(params.size(), 0.0f), y(logits.size()), dx(logits.size(), 0.0f);
  const std::vector<float> beta(static_cast<size_t>(E), 0.0f), dy(logits.size(), 0.0f);
  MoeLayer layer(l.config, l.shape);
  LocalExpertComm comm;
  BalanceState state;
  BalanceResult r;
  auto w = bind<const float>(params.data(), l);
  auto g = bind<float>(grads.data(), l);
  layer.forward(r.cache, y.data(), logits.data(), N, w, beta.data(), comm, std::nullopt, sequence);
  layer.backward(r.cache, dx.data(), g, dy.data(), logits.data(), w, loss_scale, state, comm);
  r.loss = r.cache.balance_loss;
  r.d_logits = dx;
  return r;
}

}  // namespace tessel::moe::testing
