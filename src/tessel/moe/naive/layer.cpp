// The naive twin of MoeLayer: one token at a time, every selected expert evaluated on its
// own row with the naive kernels, in T.
#include "tessel/moe/layer.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "tessel/core/error.hpp"
#include "tessel/kernels/cpu/activations.hpp"
#include "tessel/kernels/cpu/gemm.hpp"

namespace tessel::moe::naive {

namespace knn = tessel::kernels::naive;

namespace {

// Slots per token: k, or E under expert_choice (slot n E + e: token n offered to expert e).
template <class T>
struct Routing {
  int64_t slots = 0;
  std::vector<T> logits, probs;  // [N, E]
  std::vector<int32_t> choice;   // [N, slots]
  std::vector<T> gate;           // [N, slots]
  std::vector<uint8_t> kept;     // [N, slots]
  std::vector<T> margin;         // [N, E] LEI margins
  std::vector<int64_t> loads;    // [E]
};

// The k largest of sel [E], best first (ties: the lower expert, spec 2.1): expert e goes to
// place p = the number of experts ahead of it (a larger score, or an equal one and a lower
// number) when p < k.
void top_k(const float* sel, int64_t E, int64_t k, int32_t* choice) {
  for (int64_t e = 0; e < E; ++e) {
    int64_t ahead = 0;
    for (int64_t o = 0; o < E; ++o) ahead += sel[o] > sel[e] || (sel[o] == sel[e] && o < e);
    if (ahead < k) choice[ahead] = int32_t(e);
  }
}

// Token choice at capacity cf > 0: a slot stays when fewer than ceil(k N cf / E) slots of its
// expert come before it: by gate, a higher gate or an equal one in an earlier slot
// (probability); any earlier slot, i.e. an earlier token (position).
template <class T>
void drop_over_capacity(Routing<T>& r, int64_t N, const MoeConfig& cfg) {
  const int64_t slots = N * cfg.top_k;
  const int64_t cap = expert_capacity(N, cfg.top_k, cfg.experts, cfg.capacity);
  for (int64_t s = 0; s < slots; ++s) {
    int64_t ahead = 0;
    for (int64_t o = 0; o < slots; ++o) {
      if (r.choice[size_t(o)] != r.choice[size_t(s)]) continue;
      const T go = r.gate[size_t(o)], gs = r.gate[size_t(s)];
      ahead += cfg.drop == DropPolicy::position ? o < s : go > gs || (go == gs && o < s);
    }
    r.kept[size_t(s)] = ahead < cap;
  }
}

// Sinkhorn's log column scale (docs/model.md, balance sinkhorn; one micro-batch): from c = 1,
// alternately r_n = 1 / (N (sum_e K[n, e] c_e + eps)) and c_e = 1 / (E (sum_n r_n K[n, e] +
// eps)), K = exp(logits less each row's maximum), until no c_e moves by more than the
// tolerance relative, at most kSinkhornIterations times.
template <class T>
std::vector<T> sinkhorn_log_c(const std::vector<T>& logits, int64_t N, int64_t E) {
  const T eps = T(1e-8);
  std::vector<T> K(size_t(N * E)), r(static_cast<size_t>(N)), c(size_t(E), T(1));
  for (int64_t n = 0; n < N; ++n) {
    const T m = *std::max_element(logits.begin() + n * E, logits.begin() + (n + 1) * E);
    for (int64_t e = 0; e < E; ++e) K[size_t(n * E + e)] = std::exp(logits[size_t(n * E + e)] - m);
  }
  for (int it = 0; it < kSinkhornIterations; ++it) {
    for (int64_t n = 0; n < N; ++n) {
      T row = 0;
      for (int64_t e = 0; e < E; ++e) row += K[size_t(n * E + e)] * c[size_t(e)];
      r[size_t(n)] = T(1) / (T(N) * (row + eps));
    }
    bool settled = true;
    for (int64_t e = 0; e < E; ++e) {
      T col = 0;
      for (int64_t n = 0; n < N; ++n) col += r[size_t(n)] * K[size_t(n * E + e)];
      const T next = T(1) / (T(E) * (col + eps));
      if (std::abs(next / c[size_t(e)] - T(1)) > T(kSinkhornTolerance)) settled = false;
      c[size_t(e)] = next;
    }
    if (settled) break;
  }
  for (T& v : c) v = std::log(v);
  return c;
}

// phi'(m) of the LEI kernels of width w (docs/model.md, balance lei): rectangle phi = the ramp
// clamp(1/2 + m / w, 0, 1); triangle's phi' is a triangle of half-width w and area 1; tanh
// phi = (1 + tanh(m / w)) / 2, so phi' = 1 / (2 w cosh^2(m / w)).
template <class T>
T lei_phi_prime(LeiKernel kernel, T m, T w) {
  const T a = std::abs(m);
  switch (kernel) {
    case LeiKernel::rectangle:
      return a <= w / 2 ? T(1) / w : T(0);
    case LeiKernel::triangle:
      return a < w ? (w - a) / (w * w) : T(0);
    case LeiKernel::tanh:
      return T(1) / (T(2) * w * std::cosh(m / w) * std::cosh(m / w));
    case LeiKernel::identity:
      break;
  }
  TESSEL_CHECK(false, "the identity kernel acts on the probabilities, not on a margin");
}

// Expert choice: each expert in turn takes, C times, the highest-scoring token it has not
// taken yet (the first on ties): C = ceil(k N cf / E), cf = 1 when the capacity is 0.
template <class T>
void experts_choose(Routing<T>& r, int64_t N, const MoeConfig& cfg) {
  const int64_t E = cfg.experts;
  const int64_t cap = expert_capacity(N, cfg.top_k, E, capacity_factor(cfg));
  std::fill(r.kept.begin(), r.kept.end(), uint8_t(0));
  for (int64_t e = 0; e < E; ++e)
    for (int64_t taken = 0; taken < std::min(cap, N); ++taken) {
      int64_t best = -1;
      for (int64_t n = 0; n < N; ++n)
        if (!r.kept[size_t(n * E + e)] &&
            (best < 0 || r.probs[size_t(n * E + e)] > r.probs[size_t(best * E + e)]))
          best = n;
      r.kept[size_t(best * E + e)] = 1;
      ++r.loads[size_t(e)];
    }
}

// exact_margin's windows (layer.hpp), from the margins to flipping: each expert in turn takes,
// as many times as its load is beyond [floor(C), ceil(C)], the token closest to flipping (the
// first on ties) among those that chose it (over) or did not (under). Window margins become 0,
// the others +1e30 (chosen) or -1e30.
template <class T>
void exact_windows(Routing<T>& r, int64_t N, const MoeConfig& cfg) {
  const int64_t E = cfg.experts, k = cfg.top_k;
  const double C = double(N * k) / double(E);
  std::vector<T> out(size_t(N * E));
  auto chosen = [&](int64_t n, int64_t e) {
    const int32_t* ch = r.choice.data() + n * k;
    return std::find(ch, ch + k, int32_t(e)) != ch + k;
  };
  for (int64_t n = 0; n < N; ++n)
    for (int64_t e = 0; e < E; ++e) out[size_t(n * E + e)] = chosen(n, e) ? T(1e30) : T(-1e30);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t load = r.loads[size_t(e)];
    const bool over = double(load) > std::ceil(C);
    const int64_t size =
        over ? load - int64_t(std::ceil(C)) : std::max<int64_t>(0, int64_t(std::floor(C)) - load);
    std::vector<uint8_t> taken(static_cast<size_t>(N), 0);
    for (int64_t i = 0; i < size; ++i) {
      int64_t best = -1;
      for (int64_t n = 0; n < N; ++n)
        if (!taken[size_t(n)] && chosen(n, e) == over &&
            (best < 0 ||
             std::abs(r.margin[size_t(n * E + e)]) < std::abs(r.margin[size_t(best * E + e)])))
          best = n;
      taken[size_t(best)] = 1;
      out[size_t(best * E + e)] = 0;
    }
  }
  r.margin = out;
}

template <class T>
Routing<T> route(const T* x, int64_t N, const LayerWeightsT<const T>& w, const T* beta,
                 const MoeConfig& cfg, int64_t C) {
  const int64_t E = cfg.experts, k = cfg.top_k;
  const bool ec = cfg.balance == Balance::expert_choice;
  const int64_t S = ec ? E : k;
  Routing<T> r{S,
               std::vector<T>(size_t(N * E)),
               std::vector<T>(size_t(N * E)),
               std::vector<int32_t>(size_t(N * S)),
               std::vector<T>(size_t(N * S)),
               std::vector<uint8_t>(size_t(N * S), 1),
               std::vector<T>(size_t(N * E)),
               std::vector<int64_t>(size_t(E), 0)};
  for (int64_t n = 0; n < N; ++n) {
    T* lg = r.logits.data() + n * E;
    for (int64_t e = 0; e < E; ++e) {
      lg[e] = 0;
      for (int64_t i = 0; i < C; ++i) lg[e] += x[n * C + i] * w.router[e * C + i];
    }
  }
  // Selection bias: beta, less Sinkhorn's log column scale (sinkhorn; one micro-batch here).
  std::vector<T> sel_bias(beta, beta + E);
  if (cfg.balance == Balance::sinkhorn) {
    const std::vector<T> log_c = sinkhorn_log_c(r.logits, N, E);
    for (int64_t e = 0; e < E; ++e) sel_bias[size_t(e)] -= log_c[size_t(e)];
  }
  for (int64_t n = 0; n < N; ++n) {
    T* lg = r.logits.data() + n * E;
    T* p = r.probs.data() + n * E;
    if (cfg.score == ScoreFn::softmax) {
      T m = *std::max_element(lg, lg + E), sum = 0;
      for (int64_t e = 0; e < E; ++e) sum += std::exp(lg[e] - m);
      for (int64_t e = 0; e < E; ++e) p[e] = std::exp(lg[e] - m) / sum;
    } else {
      for (int64_t e = 0; e < E; ++e) p[e] = T(1) / (T(1) + std::exp(-lg[e]));
    }
    if (ec) {  // gate = score, for every expert; experts_choose decides which count
      for (int64_t e = 0; e < E; ++e) r.choice[size_t(n * E + e)] = int32_t(e);
      std::copy(p, p + E, r.gate.begin() + n * E);
      continue;
    }
    std::vector<float> sel(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) sel[size_t(e)] = float(lg[e] - sel_bias[size_t(e)]);
    int32_t* ch = r.choice.data() + n * k;
    top_k(sel.data(), E, k, ch);
    T sum = 0;
    for (int64_t j = 0; j < k; ++j) sum += p[ch[j]];
    for (int64_t j = 0; j < k; ++j)
      r.gate[size_t(n * k + j)] = cfg.normalize_gates ? p[ch[j]] / sum : p[ch[j]];
    for (int64_t j = 0; j < k; ++j) ++r.loads[size_t(ch[j])];
    // LEI boundary from the k-th and (k+1)-th largest lg - beta (model.moe_lei_margin).
    T kth = lg[ch[k - 1]] - beta[ch[k - 1]];
    T kp1 = -std::numeric_limits<T>::infinity();
    for (int64_t e = 0; e < E; ++e)
      if (std::find(ch, ch + k, int32_t(e)) == ch + k) kp1 = std::max(kp1, lg[e] - beta[e]);
    const LeiMargin at = cfg.lei_margin;
    const T boundary = k == E                           ? T(-1e30)
                       : at == LeiMargin::midpoint      ? (kth + kp1) / 2
                       : at == LeiMargin::topk_plus_one ? kp1
                                                        : kth;
    for (int64_t e = 0; e < E; ++e) {
      // exact_margin: chosen experts measure from the (k+1)-th instead (the score to drop below).
      const bool chosen = std::find(ch, ch + k, int32_t(e)) != ch + k;
      const bool from_kp1 = at == LeiMargin::exact_margin && chosen && k < E;
      r.margin[size_t(n * E + e)] = lg[e] - beta[e] - (from_kp1 ? kp1 : boundary);
    }
  }
  if (uses_lei(cfg.balance) && cfg.lei_margin == LeiMargin::exact_margin) exact_windows(r, N, cfg);
  if (ec) {
    experts_choose(r, N, cfg);
  } else if (cfg.capacity > 0) {
    drop_over_capacity(r, N, cfg);
  }
  return r;
}

// One row through fc_out(act(fc_in(x))); fills fc [Fi], act [F], out [C].
template <class T>
void mlp_row(const MlpWeightsT<const T>& m, const T* x, int64_t C, int64_t F, ExpertMlp mlp,
             std::vector<T>& fc, std::vector<T>& act, std::vector<T>& out) {
  const int64_t Fi = mlp == ExpertMlp::swiglu ? 2 * F : F;
  fc.assign(size_t(Fi), 0);
  act.assign(size_t(F), 0);
  out.assign(size_t(C), 0);
  knn::linear_forward(fc.data(), x, m.fc_in_w, m.fc_in_b, 1, C, Fi);
  if (mlp == ExpertMlp::gelu)
    knn::gelu_forward(act.data(), fc.data(), F);
  else
    knn::swiglu_forward(act.data(), fc.data(), 1, F);
  knn::linear_forward(out.data(), act.data(), m.fc_out_w, m.fc_out_b, 1, F, C);
}

// Adds the row's gradients for output gradient d_out [C].
template <class T>
void mlp_row_backward(T* dx, MlpWeightsT<T>& g, const MlpWeightsT<const T>& m, const T* x,
                      const T* d_out, int64_t C, int64_t F, ExpertMlp mlp) {
  const int64_t Fi = mlp == ExpertMlp::swiglu ? 2 * F : F;
  std::vector<T> fc, act, out, d_act(size_t(F), 0), d_fc(size_t(Fi), 0);
  mlp_row(m, x, C, F, mlp, fc, act, out);
  knn::linear_backward(d_act.data(), g.fc_out_w, g.fc_out_b, d_out, act.data(), m.fc_out_w, 1, F,
                       C);
  if (mlp == ExpertMlp::gelu)
    knn::gelu_backward(d_fc.data(), d_act.data(), fc.data(), F);
  else
    knn::swiglu_backward(d_fc.data(), d_act.data(), fc.data(), 1, F);
  knn::linear_backward(dx, g.fc_in_w, g.fc_in_b, d_fc.data(), x, m.fc_in_w, 1, C, Fi);
}

}  // namespace

template <class T>
void moe_forward(T* y, const T* x, int64_t N, const LayerWeightsT<const T>& w, const T* beta,
                 const MoeConfig& cfg, const LayerShape& shape) {
  const int64_t C = shape.C;
  const Routing<T> r = route(x, N, w, beta, cfg, C);
  const int64_t k = r.slots;
  std::vector<T> fc, act, out;
  for (int64_t n = 0; n < N; ++n) {
    T* yn = y + n * C;
    std::fill(yn, yn + C, T(0));
    if (shape.Fs > 0) {
      mlp_row(w.shared, x + n * C, C, shape.Fs, shape.mlp, fc, act, out);
      for (int64_t i = 0; i < C; ++i) yn[i] += out[size_t(i)];
    }
    for (int64_t j = 0; j < k; ++j) {
      if (!r.kept[size_t(n * k + j)]) continue;
      mlp_row(w.experts[size_t(r.choice[size_t(n * k + j)])], x + n * C, C, shape.F, shape.mlp, fc,
              act, out);
      for (int64_t i = 0; i < C; ++i) yn[i] += r.gate[size_t(n * k + j)] * out[size_t(i)];
    }
  }
}

template <class T>
void moe_backward(T* dx, LayerWeightsT<T>& g, const T* dy, const T* x, int64_t N,
                  const LayerWeightsT<const T>& w, const T* beta, T loss_scale,
                  const MoeConfig& cfg, const LayerShape& shape,
                  std::span<const int32_t> sequence) {
  const int64_t E = cfg.experts, C = shape.C;
  const Routing<T> r = route(x, N, w, beta, cfg, C);
  const int64_t k = r.slots;  // = top_k but under expert_choice
  const T Tk = T(N * cfg.top_k);
  // seq_aux: each sequence's tokens and loads, and how many sequences have tokens.
  auto seq_of = [&](int64_t n) { return sequence.empty() ? int64_t(0) : int64_t(sequence[n]); };
  std::vector<T> seq_tokens, seq_loads;
  T sequences = 0;
  if (cfg.balance == Balance::seq_aux) {
    for (int64_t n = 0; n < N; ++n) {
      const int64_t s = seq_of(n);
      if (int64_t(seq_tokens.size()) <= s) {
        seq_tokens.resize(size_t(s + 1), T(0));
        seq_loads.resize(size_t((s + 1) * E), T(0));
      }
      if (seq_tokens[size_t(s)]++ == 0) sequences += 1;
      for (int64_t j = 0; j < k; ++j) seq_loads[size_t(s * E + r.choice[size_t(n * k + j)])] += 1;
    }
  }
  // LEI: dL/df_e of model.moe_lei_loss (maxvio: tied maxima share; totalvio: sign(0) = 0).
  std::vector<T> lei_df(static_cast<size_t>(E), T(0));
  if (uses_lei(cfg.balance)) {
    const int64_t top = *std::max_element(r.loads.begin(), r.loads.end());
    const T ties = T(std::count(r.loads.begin(), r.loads.end(), top));
    for (int64_t e = 0; e < E; ++e) {
      const int64_t load = r.loads[size_t(e)];
      const T f = T(load) / Tk, err = f - T(1) / T(E);
      const int64_t excess = load * E - N * cfg.top_k;  // the sign of err, exactly
      switch (cfg.lei_loss) {
        case LeiLoss::centered_fsq:
          lei_df[size_t(e)] = T(2 * E) * err;
          break;
        case LeiLoss::fsq:
          lei_df[size_t(e)] = T(2 * E) * f;
          break;
        case LeiLoss::maxvio:
          lei_df[size_t(e)] = load == top ? T(E) / ties : T(0);
          break;
        case LeiLoss::totalvio:
          lei_df[size_t(e)] = T(E) / 2 * T((excess > 0) - (excess < 0));
          break;
      }
    }
  }
  std::vector<T> fc, act, out, d_out(static_cast<size_t>(C));
  for (int64_t n = 0; n < N; ++n) {
    const T* xn = x + n * C;
    const T* dyn = dy + n * C;
    if (shape.Fs > 0)
      mlp_row_backward(dx + n * C, g.shared, w.shared, xn, dyn, C, shape.Fs, shape.mlp);
    std::vector<T> d_gate(size_t(k), 0), dp(size_t(E), 0), dl(size_t(E), 0);
    for (int64_t j = 0; j < k; ++j) {
      if (!r.kept[size_t(n * k + j)]) continue;
      const int32_t e = r.choice[size_t(n * k + j)];
      mlp_row(w.experts[size_t(e)], xn, C, shape.F, shape.mlp, fc, act, out);
      for (int64_t i = 0; i < C; ++i) {
        d_gate[size_t(j)] += dyn[i] * out[size_t(i)];
        d_out[size_t(i)] = r.gate[size_t(n * k + j)] * dyn[i];
      }
      mlp_row_backward(dx + n * C, g.experts[size_t(e)], w.experts[size_t(e)], xn, d_out.data(), C,
                       shape.F, shape.mlp);
    }
    // gate_j = p[e_j] / S with S = sum_l p[e_l] (or p[e_j]).
    const T* p = r.probs.data() + n * E;
    const int32_t* ch = r.choice.data() + n * k;
    T S = 0;
    for (int64_t j = 0; j < k; ++j) S += p[ch[j]];
    for (int64_t j = 0; j < k; ++j)
      for (int64_t i = 0; i < k; ++i) {
        // d gate_j / d p[e_i]
        const bool normalized = cfg.normalize_gates && cfg.balance != Balance::expert_choice;
        T dgdp =
            normalized ? ((i == j ? T(1) / S : T(0)) - p[ch[j]] / (S * S)) : (i == j ? T(1) : T(0));
        dp[size_t(ch[i])] += d_gate[size_t(j)] * dgdp;
      }
    for (int64_t e = 0; e < E; ++e) {
      const T f = T(r.loads[size_t(e)]) / Tk;
      if (cfg.balance == Balance::aux || cfg.balance == Balance::aux_global)
        dp[size_t(e)] += loss_scale * T(cfg.aux_coeff) * T(E) * f;
      if (cfg.balance == Balance::seq_aux) {
        // (N / S) times d/dp of alpha E f_s P_s, P_s a mean over the sequence's T_s tokens.
        const int64_t s = seq_of(n);
        const T Ts = seq_tokens[size_t(s)], fs = seq_loads[size_t(s * E + e)] / (T(cfg.top_k) * Ts);
        dp[size_t(e)] += loss_scale * T(cfg.aux_coeff) * T(E) * fs * T(N) / (sequences * Ts);
      }
      if (uses_lei(cfg.balance)) {
        // dL/ds[n, e] = dL/df_e phi'(m[n, e]) / (N k); times N.
        const T a = loss_scale * T(cfg.lei_coeff) * lei_df[size_t(e)] / T(cfg.top_k);
        if (cfg.lei_kernel == LeiKernel::identity)
          dp[size_t(e)] += a;
        else
          dl[size_t(e)] +=
              a * lei_phi_prime(cfg.lei_kernel, r.margin[size_t(n * E + e)], T(cfg.lei_width));
      }
    }
    // d logits from d p: softmax Jacobian p_e (delta - p_i), or sigmoid p (1 - p).
    for (int64_t e = 0; e < E; ++e) {
      if (cfg.score == ScoreFn::softmax) {
        for (int64_t i = 0; i < E; ++i)
          dl[size_t(e)] += dp[size_t(i)] * p[i] * ((i == e ? T(1) : T(0)) - p[e]);
      } else {
        dl[size_t(e)] += dp[size_t(e)] * p[e] * (T(1) - p[e]);
      }
    }
    if (cfg.z_coeff > 0) {
      const T* lg = r.logits.data() + n * E;
      T m = *std::max_element(lg, lg + E), sum = 0;
      for (int64_t e = 0; e < E; ++e) sum += std::exp(lg[e] - m);
      const T lse = m + std::log(sum);
      for (int64_t e = 0; e < E; ++e)
        dl[size_t(e)] += loss_scale * T(cfg.z_coeff) * T(2) * lse * std::exp(lg[e] - lse);
    }
    for (int64_t e = 0; e < E; ++e)
      for (int64_t i = 0; i < C; ++i) {
        dx[n * C + i] += dl[size_t(e)] * w.router[e * C + i];
        g.router[e * C + i] += dl[size_t(e)] * xn[i];
      }
  }
}

#define TESSEL_INSTANTIATE(T)                                                                  \
  template void moe_forward<T>(T*, const T*, int64_t, const LayerWeightsT<const T>&, const T*, \
                               const MoeConfig&, const LayerShape&);                           \
  template void moe_backward<T>(T*, LayerWeightsT<T>&, const T*, const T*, int64_t,            \
                                const LayerWeightsT<const T>&, const T*, T, const MoeConfig&,  \
                                const LayerShape&, std::span<const int32_t>);
TESSEL_INSTANTIATE(float)
TESSEL_INSTANTIATE(double)
#undef TESSEL_INSTANTIATE

}  // namespace tessel::moe::naive
