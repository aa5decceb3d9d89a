#include "tessel/moe/layer.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "tessel/core/error.hpp"
#include "tessel/core/timer.hpp"
#include "tessel/kernels/cpu/activations.hpp"
#include "tessel/kernels/cpu/gemm.hpp"
#include "tessel/kernels/cpu/softmax.hpp"
#include "tessel/moe/quantile.hpp"

namespace tessel::moe {

namespace kn = tessel::kernels;

void select_top_k(const float* sel, int64_t E, int64_t k, int32_t* out, float* kth, float* kplus1) {
  uint64_t taken[4] = {0, 0, 0, 0};  // E <= 256
  auto is_taken = [&](int64_t e) { return (taken[e >> 6] >> (e & 63)) & 1; };
  for (int64_t j = 0; j <= k && j < E; ++j) {
    int64_t best = -1;
    for (int64_t e = 0; e < E; ++e)
      if (!is_taken(e) && (best < 0 || sel[e] > sel[best])) best = e;
    if (j == k) {
      *kplus1 = sel[best];
      return;
    }
    taken[best >> 6] |= uint64_t(1) << (best & 63);
    out[j] = int32_t(best);
    *kth = sel[best];
  }
  *kplus1 = -std::numeric_limits<float>::infinity();
}

int64_t expert_capacity(int64_t N, int64_t k, int64_t E, double cf) {
  // An expert ranks at most N slots (one per token), so N keeps every one; capping in double
  // also keeps a huge cf from overflowing the conversion (1e17 turned dropless into drop-all).
  return int64_t(std::min(double(N), std::ceil(double(k) * double(N) * cf / double(E))));
}

double capacity_factor(const MoeConfig& config) {
  return config.balance == Balance::expert_choice && config.capacity == 0 ? 1.0 : config.capacity;
}

std::vector<double> sinkhorn_log_scale(const float* logits, int64_t N, int64_t E,
                                       const SumValues& sum) {
  constexpr double eps = 1e-8;
  double Nb = double(N);
  sum(&Nb, 1);
  if (Nb == 0) return std::vector<double>(size_t(E), 0.0);
  // A row's maximum is taken out (r_n absorbs it), so exp stays finite.
  std::vector<double> K(size_t(N * E)), col(static_cast<size_t>(E)), c(size_t(E), 1.0);
  for (int64_t n = 0; n < N; ++n) {
    const float* lg = logits + n * E;
    const double m = double(*std::max_element(lg, lg + E));
    for (int64_t e = 0; e < E; ++e) K[size_t(n * E + e)] = std::exp(double(lg[e]) - m);
  }
  for (int it = 0; it < kSinkhornIterations; ++it) {
    std::fill(col.begin(), col.end(), 0.0);
    for (int64_t n = 0; n < N; ++n) {
      const double* k = K.data() + n * E;
      double row = 0;
      for (int64_t e = 0; e < E; ++e) row += c[size_t(e)] * k[e];
      const double r = 1.0 / (Nb * (row + eps));
      for (int64_t e = 0; e < E; ++e) col[size_t(e)] += r * k[e];
    }
    sum(col.data(), col.size());
    double change = 0;
    for (int64_t e = 0; e < E; ++e) {
      const double next = 1.0 / (double(E) * (col[size_t(e)] + eps));
      change = std::max(change, std::abs(next / c[size_t(e)] - 1.0));
      c[size_t(e)] = next;
    }
    if (change <= kSinkhornTolerance) break;
  }
  for (double& v : c) v = std::log(v);
  return c;
}

namespace {

// rank[s] = the place of slot s of `choice` [N, slots] in its expert's priority order (by
// gate, highest first, ties by slot; or by slot): an expert of capacity cap keeps the slots
// of rank < cap.
void capacity_ranks(const int32_t* choice, const float* gate, int64_t N, int64_t slots, int64_t E,
                    DropPolicy drop, int32_t* rank) {
  std::vector<std::vector<int64_t>> by_expert(static_cast<size_t>(E));
  for (int64_t s = 0; s < N * slots; ++s) by_expert[size_t(choice[s])].push_back(s);
#pragma omp parallel for schedule(dynamic)
  for (int64_t e = 0; e < E; ++e) {
    std::vector<int64_t>& list = by_expert[size_t(e)];
    if (drop == DropPolicy::probability)
      std::stable_sort(list.begin(), list.end(),
                       [&](int64_t a, int64_t b) { return gate[a] > gate[b]; });
    for (size_t i = 0; i < list.size(); ++i) rank[list[i]] = int32_t(i);
  }
}

// phi'(m) of the LEI kernels (rectangle, triangle, tanh) of width w.
double lei_kernel_grad(LeiKernel kernel, double m, double w) {
  switch (kernel) {
    case LeiKernel::rectangle:
      return std::abs(m) <= 0.5 * w ? 1.0 / w : 0.0;
    case LeiKernel::triangle:
      return std::max(0.0, 1.0 - std::abs(m) / w) / w;
    case LeiKernel::tanh: {
      const double t = std::tanh(m / w);
      return 0.5 * (1.0 - t * t) / w;
    }
    case LeiKernel::identity:
      break;
  }
  TESSEL_CHECK(false, "the identity kernel acts on the probabilities, not on a margin");
}

// Blocks (s, l) of counts[s * El + l] rows of width C: source-major (s outer) <-> expert-major
// (l outer).
void reorder_blocks(float* dst, const float* src, const std::vector<int64_t>& counts, int64_t ep,
                    int64_t El, int64_t C, bool to_expert_major) {
  std::vector<int64_t> src_major(size_t(ep * El)), exp_major(size_t(ep * El));
  int64_t off = 0;
  for (int64_t s = 0; s < ep; ++s)
    for (int64_t l = 0; l < El; ++l)
      src_major[size_t(s * El + l)] = off, off += counts[size_t(s * El + l)];
  off = 0;
  for (int64_t l = 0; l < El; ++l)
    for (int64_t s = 0; s < ep; ++s)
      exp_major[size_t(s * El + l)] = off, off += counts[size_t(s * El + l)];
  for (int64_t b = 0; b < ep * El; ++b) {
    const int64_t from = to_expert_major ? src_major[size_t(b)] : exp_major[size_t(b)];
    const int64_t to = to_expert_major ? exp_major[size_t(b)] : src_major[size_t(b)];
    std::copy(src + from * C, src + (from + counts[size_t(b)]) * C, dst + to * C);
  }
}

// Floats per ep rank: to each destination (my kept rows of its experts) and from each source.
struct Sizes {
  std::vector<size_t> send, recv;
  int64_t rows_in = 0;  // R
};
Sizes exchange_sizes(const LayerCache& c, int64_t ep, int64_t El, int64_t C) {
  Sizes z{std::vector<size_t>(size_t(ep), 0), std::vector<size_t>(size_t(ep), 0), 0};
  for (int64_t d = 0; d < ep; ++d)
    for (int64_t l = 0; l < El; ++l) {
      z.send[size_t(d)] += size_t(c.counts[size_t(d * El + l)] * C);
      z.recv[size_t(d)] += size_t(c.recv_counts[size_t(d * El + l)] * C);
      z.rows_in += c.recv_counts[size_t(d * El + l)];
    }
  return z;
}

// Rows of each local expert in the expert-major layout: offsets [El + 1].
std::vector<int64_t> expert_offsets(const LayerCache& c, int64_t ep, int64_t El) {
  std::vector<int64_t> off(size_t(El + 1), 0);
  for (int64_t l = 0; l < El; ++l) {
    int64_t n = 0;
    for (int64_t s = 0; s < ep; ++s) n += c.recv_counts[size_t(s * El + l)];
    off[size_t(l + 1)] = off[size_t(l)] + n;
  }
  return off;
}

void act_forward(ExpertMlp mlp, float* act, const float* fc, int64_t rows, int64_t F) {
  if (rows == 0) return;
  if (mlp == ExpertMlp::gelu)
    kn::gelu_forward(act, fc, rows * F);
  else
    kn::swiglu_forward(act, fc, rows, F);
}
void act_backward(ExpertMlp mlp, float* d_fc, const float* d_act, const float* fc, int64_t rows,
                  int64_t F) {
  if (rows == 0) return;
  if (mlp == ExpertMlp::gelu)
    kn::gelu_backward(d_fc, d_act, fc, rows * F);
  else
    kn::swiglu_backward(d_fc, d_act, fc, rows, F);
}

// f(n, j, row) for every kept slot (token n, its j-th expert, its row in the permuted
// order); tokens in parallel, each token's slots in order.
template <class Fn>
void for_each_kept(const LayerCache& c, int64_t k, Fn f) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < c.N; ++n)
    for (int64_t j = 0; j < k; ++j) {
      const int32_t pos = c.position[size_t(n * k + j)];
      if (pos >= 0) f(n, j, int64_t(pos));
    }
}

// f(e, o, n) for each local expert with rows: global expert e = first + l, its n > 0 rows
// starting at row o of the expert-major layout (off from expert_offsets).
template <class Fn>
void for_each_local_expert(const std::vector<int64_t>& off, int64_t first, Fn f) {
  for (size_t l = 0; l + 1 < off.size(); ++l)
    if (off[l + 1] > off[l]) f(size_t(first) + l, off[l], off[l + 1] - off[l]);
}

float sigmoid(float v) {
  return 1.0f / (1.0f + std::exp(-v));
}

double row_lse(const float* row, int64_t E) {
  double m = row[0];
  for (int64_t e = 1; e < E; ++e) m = std::max(m, double(row[e]));
  double s = 0;
  for (int64_t e = 0; e < E; ++e) s += std::exp(double(row[e]) - m);
  return m + std::log(s);
}

// DeepSeek-V3's sequence-wise aux loss over the tokens of c (c.sequence set): the mean over
// the S sequences with tokens of alpha E sum_e f_{s,e} P_{s,e}, f_{s,e} = load_{s,e} / (k T_s)
// and P_{s,e} the mean p[n, e] over the sequence's T_s tokens. Keeps in c.seq_aux_grad N times
// dL/dp[n, e] for the tokens of sequence s: alpha E f_{s,e} N / (S T_s) (f is piecewise
// constant, as aux's).
double sequence_aux_forward(LayerCache& c, int64_t E, int64_t k, double alpha) {
  const int64_t N = c.N;
  const int64_t S = N > 0 ? *std::max_element(c.sequence.begin(), c.sequence.end()) + 1 : 0;
  std::vector<double> loads(size_t(S * E), 0.0), P(size_t(S * E), 0.0), T(size_t(S), 0.0);
  for (int64_t n = 0; n < N; ++n) {
    const int64_t s = c.sequence[size_t(n)];
    T[size_t(s)] += 1;
    for (int64_t j = 0; j < k; ++j) loads[size_t(s * E + c.choice[size_t(n * k + j)])] += 1;
    for (int64_t e = 0; e < E; ++e) P[size_t(s * E + e)] += c.probs[size_t(n * E + e)];
  }
  const double with_tokens =
      double(std::count_if(T.begin(), T.end(), [](double t) { return t > 0; }));
  c.seq_aux_grad.assign(size_t(S * E), 0.0);
  double loss = 0;
  for (int64_t s = 0; s < S; ++s) {
    const double Ts = T[size_t(s)];
    if (Ts == 0) continue;
    for (int64_t e = 0; e < E; ++e) {
      const double f = loads[size_t(s * E + e)] / (double(k) * Ts);
      loss += alpha * double(E) * f * P[size_t(s * E + e)] / Ts / with_tokens;
      c.seq_aux_grad[size_t(s * E + e)] = alpha * double(E) * f * double(N) / (with_tokens * Ts);
    }
  }
  return loss;
}

// LEI: the margins of token row s [E] (selection scores; its k choices ch, its k-th and
// (k+1)-th largest scores) into m [E] (layer.hpp). exact_margin: each expert's signed
// distance to flipping the token's choice of it (chosen: s - (k+1)-th >= 0; not: s - k-th
// <= 0), which exact_margin_windows turns into the windows.
void lei_token_margins(float* m, const float* s, const int32_t* ch, int64_t E, int64_t k, float kth,
                       float kplus1, LeiMargin margin) {
  // Tokens with k = E have no boundary: a margin far outside every kernel.
  float boundary = -1e30f;
  if (k < E)
    boundary = margin == LeiMargin::midpoint        ? 0.5f * (kth + kplus1)
               : margin == LeiMargin::topk_plus_one ? kplus1
                                                    : kth;  // topk, exact_margin's not chosen
  for (int64_t e = 0; e < E; ++e) m[e] = s[e] - boundary;
  if (margin == LeiMargin::exact_margin && k < E)
    for (int64_t j = 0; j < k; ++j) m[ch[j]] = s[ch[j]] - kplus1;
}

// exact_margin (layer.hpp): margin [N, E] holds lei_token_margins' distances to flipping;
// each expert's window gets margin 0, the rest +1e30 (chosen) or -1e30 (not chosen).
void exact_margin_windows(float* margin, const int32_t* choice, int64_t N, int64_t E, int64_t k) {
  std::vector<uint8_t> chosen(size_t(N * E), 0);
  std::vector<int64_t> loads(static_cast<size_t>(E), 0);
  for (int64_t i = 0; i < N * k; ++i) {
    chosen[size_t(i / k * E + choice[i])] = 1;
    ++loads[size_t(choice[i])];
  }
  const int64_t floor_c = N * k / E, ceil_c = (N * k + E - 1) / E;
  std::vector<float> window(size_t(N * E));
  for (int64_t i = 0; i < N * E; ++i) window[size_t(i)] = chosen[size_t(i)] ? 1e30f : -1e30f;
#pragma omp parallel for schedule(dynamic)
  for (int64_t e = 0; e < E; ++e) {
    const int64_t load = loads[size_t(e)];
    const bool over = load > ceil_c;
    const int64_t size = over ? load - ceil_c : std::max<int64_t>(0, floor_c - load);
    if (size == 0) continue;
    // Overloaded: its chosen tokens, underloaded: the others; closest to flipping first.
    std::vector<int64_t> tokens;
    for (int64_t n = 0; n < N; ++n)
      if (chosen[size_t(n * E + e)] == over) tokens.push_back(n);
    auto distance = [&](int64_t n) { return std::abs(margin[n * E + e]); };
    std::partial_sort(tokens.begin(), tokens.begin() + size, tokens.end(),
                      [&](int64_t a, int64_t b) {
                        return distance(a) < distance(b) || (distance(a) == distance(b) && a < b);
                      });
    for (int64_t i = 0; i < size; ++i) window[size_t(tokens[size_t(i)] * E + e)] = 0.0f;
  }
  std::copy(window.begin(), window.end(), margin);
}

// The LEI loss (model.moe_lei_loss, without its coefficient) of the load fractions f [E];
// with d, also d_e = (dL/df_e) / E into d [E]. Subgradients: maxvio's tied maxima share it
// equally, totalvio's |0| contributes 0 (both the minimum-norm choice).
double lei_loss(LeiLoss loss, const std::vector<double>& f, double* d = nullptr) {
  const int64_t E = int64_t(f.size());
  const double target = 1.0 / double(E);
  double value = 0;
  switch (loss) {
    case LeiLoss::centered_fsq: {
      double sq = 0;
      for (int64_t e = 0; e < E; ++e) sq += std::pow(f[size_t(e)] - target, 2);
      value = 1.0 + double(E) * sq;
      if (d)
        for (int64_t e = 0; e < E; ++e) d[e] = 2.0 * (f[size_t(e)] - target);
      break;
    }
    case LeiLoss::fsq: {
      double sq = 0;
      for (int64_t e = 0; e < E; ++e) sq += f[size_t(e)] * f[size_t(e)];
      value = double(E) * sq;
      if (d)
        for (int64_t e = 0; e < E; ++e) d[e] = 2.0 * f[size_t(e)];
      break;
    }
    case LeiLoss::maxvio: {
      const double top = *std::max_element(f.begin(), f.end());
      value = 1.0 + (top - target) / target;
      if (d) {
        const double ties = double(std::count(f.begin(), f.end(), top));
        for (int64_t e = 0; e < E; ++e) d[e] = f[size_t(e)] == top ? 1.0 / ties : 0.0;
      }
      break;
    }
    case LeiLoss::totalvio: {
      double sum = 0;
      for (int64_t e = 0; e < E; ++e) sum += std::abs(f[size_t(e)] - target);
      value = 1.0 + 0.5 * double(E) * sum;
      if (d)
        for (int64_t e = 0; e < E; ++e) {
          const double err = f[size_t(e)] - target;
          d[e] = 0.5 * double((err > 0) - (err < 0));
        }
      break;
    }
  }
  return value;
}

}  // namespace

void LayerCache::release_buffers() {
  auto release = [](auto&... v) { ((v.clear(), v.shrink_to_fit()), ...); };
  release(logits, probs, choice, gate, position, lei_margin, qb_margin, sequence, order, expert_in,
          expert_fc, expert_act, combined, shared_fc, shared_act);
}

MoeLayer::MoeLayer(const MoeConfig& config, const LayerShape& shape)
    : config_(config), shape_(shape) {
  validate(config_);
  TESSEL_CHECK(config_.experts <= 256, "at most 256 experts");
}

void MoeLayer::run_experts(LayerCache& c, float* out, const LayerWeights& w,
                           const std::vector<int64_t>& off, int64_t first) const {
  const int64_t C = shape_.C, F = shape_.F, Fi = shape_.fc_in_rows(F);
  const int64_t R = off.back();
  c.expert_fc.resize(size_t(R * Fi));
  c.expert_act.resize(size_t(R * F));
  for_each_local_expert(off, first, [&](size_t e, int64_t o, int64_t n) {
    kn::linear_forward(c.expert_fc.data() + o * Fi, c.expert_in.data() + o * C,
                       w.experts[e].fc_in_w, w.experts[e].fc_in_b, n, C, Fi);
  });
  act_forward(shape_.mlp, c.expert_act.data(), c.expert_fc.data(), R, F);
  for_each_local_expert(off, first, [&](size_t e, int64_t o, int64_t n) {
    kn::linear_forward(out + o * C, c.expert_act.data() + o * F, w.experts[e].fc_out_w,
                       w.experts[e].fc_out_b, n, F, C);
  });
}

int64_t MoeLayer::slots() const {
  return config_.balance == Balance::expert_choice ? config_.experts : config_.top_k;
}

int64_t MoeLayer::micro_batch_ranks(const LayerCache& c, std::span<const int32_t> token_index,
                                    ExpertComm& comm, int32_t* rank) const {
  TESSEL_CHECK(int64_t(token_index.size()) == c.N, token_index.size(), " token indices for ", c.N,
               " tokens");
  // Per token: its index, then its k slots' experts and the bits of their gates.
  const int64_t N = c.N, k = slots(), row = 1 + 2 * k;
  std::vector<int32_t> mine(size_t(N * row));
  for (int64_t n = 0; n < N; ++n) {
    int32_t* r = mine.data() + n * row;
    r[0] = token_index[n];
    std::copy_n(c.choice.data() + n * k, k, r + 1);
    std::memcpy(r + 1 + k, c.gate.data() + n * k, size_t(k) * sizeof(float));
  }
  const std::vector<int32_t> all = comm.gather_micro_batch(mine);
  // The whole micro-batch's assignments in its token order, as one rank holding it sees them.
  const int64_t Nb = int64_t(all.size()) / row;
  std::vector<int64_t> order(static_cast<size_t>(Nb));
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(),
            [&](int64_t a, int64_t b) { return all[size_t(a * row)] < all[size_t(b * row)]; });
  std::vector<int32_t> choice(size_t(Nb * k));
  std::vector<float> gate(size_t(Nb * k));
  std::vector<int64_t> place;  // the sorted place of each token index
  for (int64_t i = 0; i < Nb; ++i) {
    const int32_t* r = all.data() + order[size_t(i)] * row;
    TESSEL_CHECK(r[0] >= 0 && (i == 0 || r[0] > all[size_t(order[size_t(i - 1)] * row)]),
                 "token indices of a micro-batch must be distinct and non-negative");
    std::copy_n(r + 1, k, choice.data() + i * k);
    std::memcpy(gate.data() + i * k, r + 1 + k, size_t(k) * sizeof(float));
    if (size_t(r[0]) >= place.size()) place.resize(size_t(r[0]) + 1, -1);
    place[size_t(r[0])] = i;
  }
  std::vector<int32_t> rank_all(static_cast<size_t>(Nb * k));
  capacity_ranks(choice.data(), gate.data(), Nb, k, config_.experts, config_.drop, rank_all.data());
  for (int64_t n = 0; n < N; ++n)
    std::copy_n(rank_all.data() + place[size_t(token_index[n])] * k, k, rank + n * k);
  return Nb;
}

void MoeLayer::forward(LayerCache& c, float* y, const float* x, int64_t N, const LayerWeights& w,
                       const float* beta, ExpertComm& comm,
                       std::optional<std::span<const int32_t>> token_index,
                       std::span<const int32_t> sequence) const {
  const int64_t E = config_.experts, k = config_.top_k, C = shape_.C;
  const int64_t ep = comm.ep_size();
  TESSEL_CHECK(E % ep == 0, "model.moe_experts = ", E, " must be divisible by parallel.ep = ", ep);
  const int64_t El = E / ep, S = slots();
  const bool ec = config_.balance == Balance::expert_choice;
  c.N = N;
  c.logits.resize(size_t(N * E));
  c.probs.resize(size_t(N * E));
  c.choice.resize(size_t(N * S));
  c.gate.resize(size_t(N * S));
  kn::linear_forward(c.logits.data(), x, w.router, nullptr, N, C, E);
  if (config_.score == ScoreFn::softmax)
    kn::softmax_forward(c.probs.data(), c.logits.data(), N, E);
  else
    for (int64_t i = 0; i < N * E; ++i) c.probs[size_t(i)] = sigmoid(c.logits[size_t(i)]);

  const bool lei = uses_lei(config_.balance);
  const bool qb = config_.balance == Balance::qb_avg || uses_global_quantile(config_.balance);
  c.lei_margin.resize(lei ? size_t(N * E) : 0);
  c.qb_margin.resize(qb ? size_t(N * E) : 0);
  // Selection by logits - sel_bias: beta, less Sinkhorn's log column scale (sinkhorn).
  std::vector<float> sel(size_t(N * E)), sel_bias(beta, beta + E);
  if (config_.balance == Balance::sinkhorn) {
    const std::vector<double> log_c = sinkhorn_log_scale(
        c.logits.data(), N, E, [&comm](double* d, size_t n) { comm.sum_micro_batch_values(d, n); });
    for (int64_t e = 0; e < E; ++e) sel_bias[size_t(e)] = float(double(beta[e]) - log_c[size_t(e)]);
  }
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* lg = c.logits.data() + n * E;
    if (ec) {  // every expert is offered the token at its score; the experts choose below
      std::iota(c.choice.begin() + n * E, c.choice.begin() + (n + 1) * E, 0);
      std::copy(c.probs.begin() + n * E, c.probs.begin() + (n + 1) * E, c.gate.begin() + n * E);
      continue;
    }
    float* s = sel.data() + n * E;
    for (int64_t e = 0; e < E; ++e) s[e] = lg[e] - sel_bias[size_t(e)];
    float kth = 0, kplus1 = 0;
    int32_t* ch = c.choice.data() + n * k;
    select_top_k(s, E, k, ch, &kth, &kplus1);
    const float* p = c.probs.data() + n * E;
    float sum = 0;
    for (int64_t j = 0; j < k; ++j) sum += p[ch[j]];
    for (int64_t j = 0; j < k; ++j)
      c.gate[size_t(n * k + j)] = config_.normalize_gates ? p[ch[j]] / sum : p[ch[j]];
    if (lei)
      lei_token_margins(c.lei_margin.data() + n * E, s, ch, E, k, kth, kplus1, config_.lei_margin);
    if (qb)
      for (int64_t e = 0; e < E; ++e) c.qb_margin[size_t(n * E + e)] = lg[e] - kplus1;
  }

  if (lei && config_.lei_margin == LeiMargin::exact_margin) {
    // The windows rank the micro-batch's tokens, which this rank holds whole only without
    // context parallelism (train config refuses exact_margin under cp).
    TESSEL_CHECK(!token_index, "model.moe_lei_margin = \"exact_margin\" needs whole micro-batches");
    exact_margin_windows(c.lei_margin.data(), c.choice.data(), N, E, k);
  }

  // Capacity: each expert keeps its slots of rank < cap in the micro-batch (all of it under
  // context parallelism, gathered).
  std::vector<uint8_t> kept(size_t(N * S), 1);
  c.dropped = c.unserved_cf1 = c.unserved_cf1_25 = 0;
  if (const double cf = capacity_factor(config_); cf > 0) {
    std::vector<int32_t> rank(static_cast<size_t>(N * S));
    int64_t Nb = N;
    if (token_index)
      Nb = micro_batch_ranks(c, *token_index, comm, rank.data());
    else
      capacity_ranks(c.choice.data(), c.gate.data(), N, S, E, config_.drop, rank.data());
    const int64_t cap = expert_capacity(Nb, k, E, cf);
    for (int64_t s = 0; s < N * S; ++s) kept[size_t(s)] = rank[size_t(s)] < cap;
    if (ec) {
      // A token is served at capacity c when one of its slots ranks below c.
      const int64_t cap1 = expert_capacity(Nb, k, E, 1.0), cap125 = expert_capacity(Nb, k, E, 1.25);
      for (int64_t n = 0; n < N; ++n) {
        const int32_t best = *std::min_element(rank.begin() + n * S, rank.begin() + (n + 1) * S);
        c.dropped += best >= cap;
        c.unserved_cf1 += best >= cap1;
        c.unserved_cf1_25 += best >= cap125;
      }
    } else {
      c.dropped = std::count(kept.begin(), kept.end(), uint8_t(0));
    }
  }
  // Permute: kept slots by expert, then by token (a counting sort).
  c.counts.assign(size_t(E), 0);
  for (int64_t s = 0; s < N * S; ++s)
    if (kept[size_t(s)]) ++c.counts[size_t(c.choice[size_t(s)])];
  // Loads: the assignments before drops, i.e. the tokens each expert took under expert choice.
  c.loads.assign(size_t(E), 0);
  if (ec)
    c.loads = c.counts;
  else
    for (int32_t e : c.choice) ++c.loads[size_t(e)];
  std::vector<int64_t> next(size_t(E), 0);
  for (int64_t e = 1; e < E; ++e) next[size_t(e)] = next[size_t(e - 1)] + c.counts[size_t(e - 1)];
  const int64_t A = std::accumulate(c.counts.begin(), c.counts.end(), int64_t(0));
  c.order.resize(static_cast<size_t>(A));
  c.position.assign(size_t(N * S), -1);
  for (int64_t s = 0; s < N * S; ++s) {
    if (!kept[size_t(s)]) continue;
    const int64_t pos = next[size_t(c.choice[size_t(s)])]++;
    c.order[size_t(pos)] = int32_t(s);
    c.position[size_t(s)] = int32_t(pos);
  }

  // Counts: to each ep rank its experts' row counts and this rank's loads (for the metrics).
  std::vector<int64_t> send_c(size_t(ep * (El + E))), recv_c(size_t(ep * (El + E)));
  for (int64_t d = 0; d < ep; ++d) {
    std::copy(c.counts.begin() + d * El, c.counts.begin() + (d + 1) * El,
              send_c.begin() + d * (El + E));
    std::copy(c.loads.begin(), c.loads.end(), send_c.begin() + d * (El + E) + El);
  }
  comm.exchange_counts(send_c.data(), recv_c.data(), size_t(El + E));
  c.recv_counts.resize(size_t(ep * El));
  std::vector<int64_t> group_loads(static_cast<size_t>(E), 0);  // the ep group's
  for (int64_t s = 0; s < ep; ++s) {
    for (int64_t l = 0; l < El; ++l)
      c.recv_counts[size_t(s * El + l)] = recv_c[size_t(s * (El + E) + l)];
    for (int64_t e = 0; e < E; ++e) group_loads[size_t(e)] += recv_c[size_t(s * (El + E) + El + e)];
  }

  // Rows out, experts, rows back.
  const Sizes z = exchange_sizes(c, ep, El, C);
  std::vector<float> send(size_t(A * C)), recv(size_t(z.rows_in * C));
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < A; ++i) {
    const float* row = x + int64_t(c.order[size_t(i)]) / S * C;
    std::copy(row, row + C, send.data() + i * C);
  }
  comm.exchange_rows(send.data(), z.send, recv.data(), z.recv);
  c.expert_in.resize(recv.size());
  reorder_blocks(c.expert_in.data(), recv.data(), c.recv_counts, ep, El, C, true);
  std::vector<float> out(recv.size());
  c.received_rows = z.rows_in;
  const Timer experts;
  run_experts(c, out.data(), w, expert_offsets(c, ep, El), comm.ep_rank() * El);
  c.expert_seconds = experts.seconds();
  reorder_blocks(recv.data(), out.data(), c.recv_counts, ep, El, C, false);
  c.combined.resize(size_t(A * C));
  comm.exchange_rows(recv.data(), z.recv, c.combined.data(), z.send);

  // Shared expert, then unpermute with the gates.
  if (shape_.Fs > 0) {
    const int64_t Fs = shape_.Fs, Fsi = shape_.fc_in_rows(Fs);
    c.shared_fc.resize(size_t(N * Fsi));
    c.shared_act.resize(size_t(N * Fs));
    kn::linear_forward(c.shared_fc.data(), x, w.shared.fc_in_w, w.shared.fc_in_b, N, C, Fsi);
    act_forward(shape_.mlp, c.shared_act.data(), c.shared_fc.data(), N, Fs);
    kn::linear_forward(y, c.shared_act.data(), w.shared.fc_out_w, w.shared.fc_out_b, N, Fs, C);
  } else {
    std::fill(y, y + N * C, 0.0f);
  }
  for_each_kept(c, S, [&](int64_t n, int64_t j, int64_t pos) {
    const float g = c.gate[size_t(n * S + j)];
    const float* row = c.combined.data() + pos * C;
#pragma omp simd
    for (int64_t i = 0; i < C; ++i) y[n * C + i] += g * row[i];
  });

  // The balancing terms and metrics defined per micro-batch (aux's and LEI's load fractions
  // f_e, the z-loss mean, qb_avg's quantile, the micro-batch MaxVio and drops at cf 1) count
  // the whole micro-batch: under context parallelism its tokens are spread over the cp ranks,
  // whose sums [loads | ep group's loads | P sums | z sum | N] join here. The balancing value
  // (per-token means) goes to the metrics; 0 without tokens (a micro-batch of padding alone).
  const bool aux = config_.balance == Balance::aux || config_.balance == Balance::aux_global;
  std::vector<double> sums(size_t(3 * E + 2), 0.0);
  for (int64_t e = 0; e < E; ++e) {
    sums[size_t(e)] = double(c.loads[size_t(e)]);
    sums[size_t(E + e)] = double(group_loads[size_t(e)]);
  }
  if (aux)
    for (int64_t e = 0; e < E; ++e)
      for (int64_t n = 0; n < N; ++n) sums[size_t(2 * E + e)] += c.probs[size_t(n * E + e)];
  if (config_.z_coeff > 0)
    for (int64_t n = 0; n < N; ++n)
      sums[size_t(3 * E)] += std::pow(row_lse(c.logits.data() + n * E, E), 2);
  sums[size_t(3 * E + 1)] = double(N);
  comm.sum_micro_batch_values(sums.data(), sums.size());
  const double Nb = sums[size_t(3 * E + 1)], Tk = Nb * double(k);
  c.batch_tokens = int64_t(Nb);
  c.batch_loads.assign(sums.begin(), sums.begin() + E);
  c.batch_group_loads.assign(sums.begin() + E, sums.begin() + 2 * E);
  c.batch_f.resize(size_t(E));
  for (int64_t e = 0; e < E; ++e) c.batch_f[size_t(e)] = Nb > 0 ? sums[size_t(e)] / Tk : 0.0;
  double loss = 0;
  if (Nb > 0 && aux)
    for (int64_t e = 0; e < E; ++e)
      loss += config_.aux_coeff * double(E) * c.batch_f[size_t(e)] * (sums[size_t(2 * E + e)] / Nb);
  if (Nb > 0 && config_.z_coeff > 0) loss += config_.z_coeff * sums[size_t(3 * E)] / Nb;
  if (Nb > 0 && lei) loss += config_.lei_coeff * lei_loss(config_.lei_loss, c.batch_f);
  if (config_.balance == Balance::seq_aux) {
    // Per sequence, so local: the model keeps a sequence on one rank (no context parallelism).
    TESSEL_CHECK(sequence.empty() || int64_t(sequence.size()) == N, sequence.size(),
                 " sequence numbers for ", N, " tokens");
    c.sequence.assign(sequence.begin(), sequence.end());
    c.sequence.resize(size_t(N), 0);
    loss += sequence_aux_forward(c, E, k, config_.aux_coeff);
  }
  c.balance_loss = loss;
}

void MoeLayer::backward(LayerCache& c, float* dx, LayerGrads& g, const float* dy, const float* x,
                        const LayerWeights& w, float loss_scale, BalanceState& state,
                        ExpertComm& comm) const {
  const int64_t N = c.N, E = config_.experts, k = config_.top_k, C = shape_.C;
  const int64_t F = shape_.F, Fi = shape_.fc_in_rows(F);
  const int64_t ep = comm.ep_size(), El = E / ep, A = int64_t(c.order.size()), S = slots();
  const Sizes z = exchange_sizes(c, ep, El, C);

  // Through the unpermute: row gradients and gate gradients.
  std::vector<float> d_rows(size_t(A * C)), d_gate(size_t(N * S), 0.0f);
  for_each_kept(c, S, [&](int64_t n, int64_t j, int64_t pos) {
    const float gj = c.gate[size_t(n * S + j)];
    const float* row = c.combined.data() + pos * C;
    float* d = d_rows.data() + pos * C;
    float dot = 0;
    for (int64_t i = 0; i < C; ++i) {
      d[i] = gj * dy[n * C + i];
      dot += dy[n * C + i] * row[i];
    }
    d_gate[size_t(n * S + j)] = dot;
  });

  // The experts' backward on the rows they saw, by the same exchanges as forward.
  std::vector<float> recv(size_t(z.rows_in * C)), d_out(recv.size()), d_in(recv.size(), 0.0f);
  comm.exchange_rows(d_rows.data(), z.send, recv.data(), z.recv);
  reorder_blocks(d_out.data(), recv.data(), c.recv_counts, ep, El, C, true);
  const std::vector<int64_t> off = expert_offsets(c, ep, El);
  const int64_t R = off.back();
  std::vector<float> d_act(size_t(R * F), 0.0f), d_fc(size_t(R * Fi), 0.0f);
  const int64_t first = comm.ep_rank() * El;
  const Timer experts;
  for_each_local_expert(off, first, [&](size_t e, int64_t o, int64_t n) {
    kn::linear_backward(d_act.data() + o * F, g.experts[e].fc_out_w, g.experts[e].fc_out_b,
                        d_out.data() + o * C, c.expert_act.data() + o * F, w.experts[e].fc_out_w, n,
                        F, C);
  });
  act_backward(shape_.mlp, d_fc.data(), d_act.data(), c.expert_fc.data(), R, F);
  for_each_local_expert(off, first, [&](size_t e, int64_t o, int64_t n) {
    kn::linear_backward(d_in.data() + o * C, g.experts[e].fc_in_w, g.experts[e].fc_in_b,
                        d_fc.data() + o * Fi, c.expert_in.data() + o * C, w.experts[e].fc_in_w, n,
                        C, Fi);
  });
  c.expert_seconds += experts.seconds();
  reorder_blocks(recv.data(), d_in.data(), c.recv_counts, ep, El, C, false);
  comm.exchange_rows(recv.data(), z.recv, d_rows.data(), z.send);
  for_each_kept(c, S, [&](int64_t n, int64_t, int64_t pos) {
    const float* d = d_rows.data() + pos * C;
#pragma omp simd
    for (int64_t i = 0; i < C; ++i) dx[n * C + i] += d[i];
  });

  if (shape_.Fs > 0) {
    const int64_t Fs = shape_.Fs, Fsi = shape_.fc_in_rows(Fs);
    std::vector<float> ds_act(size_t(N * Fs), 0.0f), ds_fc(size_t(N * Fsi), 0.0f);
    kn::linear_backward(ds_act.data(), g.shared.fc_out_w, g.shared.fc_out_b, dy,
                        c.shared_act.data(), w.shared.fc_out_w, N, Fs, C);
    act_backward(shape_.mlp, ds_fc.data(), ds_act.data(), c.shared_fc.data(), N, Fs);
    kn::linear_backward(dx, g.shared.fc_in_w, g.shared.fc_in_b, ds_fc.data(), x, w.shared.fc_in_w,
                        N, C, Fsi);
  }

  // Router: gates -> probabilities, plus the balancing gradients.
  std::vector<float> dp(size_t(N * E), 0.0f), dl(size_t(N * E), 0.0f);
  for (int64_t n = 0; n < N; ++n) {
    const int32_t* ch = c.choice.data() + n * S;
    const float* dg = d_gate.data() + n * S;
    float* d = dp.data() + n * E;
    if (!config_.normalize_gates || config_.balance == Balance::expert_choice) {
      for (int64_t j = 0; j < S; ++j) d[ch[j]] += dg[j];
      continue;
    }
    float sum = 0, dot = 0;
    for (int64_t j = 0; j < k; ++j) sum += c.probs[size_t(n * E + ch[j])];
    for (int64_t j = 0; j < k; ++j) dot += dg[j] * c.gate[size_t(n * k + j)];
    for (int64_t j = 0; j < k; ++j) d[ch[j]] += (dg[j] - dot) / sum;
  }
  const double s = loss_scale;
  if (config_.balance == Balance::aux || config_.balance == Balance::aux_global) {
    // L = alpha E sum_i f_i P_i: dL/dp[n, i] = alpha E f_i / N; times N (a per-token mean).
    std::vector<double> f = c.batch_f;  // the micro-batch's
    if (config_.balance == Balance::aux_global) {
      // f over the whole balancing group and every micro-batch of the step so far.
      std::vector<int32_t> counts(c.loads.begin(), c.loads.end());
      comm.sum_counters(counts.data(), counts.size());
      state.global_counts.resize(size_t(E), 0);
      double total = 0;
      for (int64_t e = 0; e < E; ++e) total += state.global_counts[size_t(e)] += counts[size_t(e)];
      for (int64_t e = 0; e < E; ++e) f[size_t(e)] = double(state.global_counts[size_t(e)]) / total;
    }
    for (int64_t n = 0; n < N; ++n)
      for (int64_t e = 0; e < E; ++e)
        dp[size_t(n * E + e)] += float(s * config_.aux_coeff * double(E) * f[size_t(e)]);
  }
  if (config_.balance == Balance::seq_aux)
    for (int64_t n = 0; n < N; ++n) {
      const double* gs = c.seq_aux_grad.data() + int64_t(c.sequence[size_t(n)]) * E;
      for (int64_t e = 0; e < E; ++e) dp[size_t(n * E + e)] += float(s * gs[e]);
    }
  if (uses_lei(config_.balance)) {
    // coeff L(f) with f_e by straight-through: dL/ds[n, e] = coeff E d_e phi'(m[n, e]) / (N k),
    // E d_e = dL/df_e; times N.
    std::vector<double> d(static_cast<size_t>(E));
    lei_loss(config_.lei_loss, c.batch_f, d.data());
    for (int64_t e = 0; e < E; ++e) {
      const double a = s * config_.lei_coeff * double(E) / double(k) * d[size_t(e)];
      for (int64_t n = 0; n < N; ++n) {
        if (config_.lei_kernel == LeiKernel::identity)
          dp[size_t(n * E + e)] += float(a);
        else
          dl[size_t(n * E + e)] +=
              float(a * lei_kernel_grad(config_.lei_kernel, c.lei_margin[size_t(n * E + e)],
                                        config_.lei_width));
      }
    }
  }
  if (config_.score == ScoreFn::softmax) {
    kn::softmax_backward(dl.data(), dp.data(), c.probs.data(), N, E);
  } else {
    for (int64_t i = 0; i < N * E; ++i) {
      const float p = c.probs[size_t(i)];
      dl[size_t(i)] += dp[size_t(i)] * p * (1.0f - p);
    }
  }
  if (config_.z_coeff > 0) {
    // L = z (1/N) sum_n lse_n^2: dL/dlogit[n, e] = z (2/N) lse_n softmax[n, e]; times N.
    for (int64_t n = 0; n < N; ++n) {
      const float* lg = c.logits.data() + n * E;
      const double lse = row_lse(lg, E);
      for (int64_t e = 0; e < E; ++e)
        dl[size_t(n * E + e)] +=
            float(s * config_.z_coeff * 2.0 * lse * std::exp(double(lg[e]) - lse));
    }
  }
  kn::linear_backward(dx, g.router, nullptr, dl.data(), x, w.router, N, C, E);

  // Record the micro-batch for the step-end update.
  if (config_.balance == Balance::bias) {
    state.loads.resize(size_t(E), 0.0);
    for (int64_t e = 0; e < E; ++e) state.loads[size_t(e)] += double(c.loads[size_t(e)]);
  }
  if (config_.balance == Balance::qb_avg || uses_global_quantile(config_.balance)) {
    std::vector<uint16_t> keys(size_t(N * E));
    for (int64_t n = 0; n < N; ++n)
      for (int64_t e = 0; e < E; ++e) {
        const float margin = c.qb_margin[size_t(n * E + e)];
        // Logits that overflowed (inf - inf): a NaN has no rank among the margins. The step's
        // gradient norm need not show it (sigmoid scores of inf are finite), so stop here.
        if (std::isnan(margin))
          throw RouterOverflow(
              "the MoE router's logits are not finite (a quantile-balancing margin is NaN): the "
              "run diverged");
        keys[size_t(e * N + n)] = bf16_order_key(margin);
      }
    if (config_.balance == Balance::qb_avg && c.batch_tokens > 0) {
      // The biased baseline: this micro-batch's own quantile, averaged at the step's end.
      // valid = {}: padding rows never reach the layer (the model routes only the others).
      const auto q = global_kth_smallest(
          keys, E, {}, [&](int64_t n) { return qb_rank(n, k, E); },
          [&comm](int32_t* d, size_t n) { comm.sum_micro_batch_counters(d, n); });
      state.beta_sum.resize(size_t(E), 0.0);
      for (int64_t e = 0; e < E; ++e) state.beta_sum[size_t(e)] += value_of_order_key(q[size_t(e)]);
      ++state.micro_batches;
    } else if (config_.balance != Balance::qb_avg) {
      state.keys.resize(static_cast<size_t>(E));
      for (int64_t e = 0; e < E; ++e)
        state.keys[size_t(e)].insert(state.keys[size_t(e)].end(), keys.begin() + e * N,
                                     keys.begin() + (e + 1) * N);
    }
  }
}

void MoeLayer::update(BalanceState& state, float* beta, ExpertComm& comm) const {
  const int64_t E = config_.experts, k = config_.top_k;
  if (config_.balance == Balance::bias) {
    // beta_e += gamma sign(load_e - mean load): selection is by logits - beta.
    std::vector<double> loads = state.loads;
    loads.resize(size_t(E), 0.0);
    comm.sum_values(loads.data(), loads.size());
    const double mean = std::accumulate(loads.begin(), loads.end(), 0.0) / double(E);
    for (int64_t e = 0; e < E; ++e) {
      const double d = loads[size_t(e)] - mean;
      beta[e] += float(config_.bias_rate * double((d > 0) - (d < 0)));
    }
  } else if (config_.balance == Balance::qb_avg) {
    std::vector<double> sums = state.beta_sum;
    sums.resize(size_t(E), 0.0);
    sums.push_back(double(state.micro_batches));
    comm.sum_values(sums.data(), sums.size());
    if (sums[size_t(E)] > 0)
      for (int64_t e = 0; e < E; ++e) beta[e] = float(sums[size_t(e)] / sums[size_t(E)]);
  } else if (uses_global_quantile(config_.balance)) {
    state.keys.resize(static_cast<size_t>(E));
    std::vector<uint16_t> keys;
    for (const auto& col : state.keys) keys.insert(keys.end(), col.begin(), col.end());
    const RankOf rank = [&](int64_t n) { return qb_rank(n, k, E); };
    std::vector<float> q(static_cast<size_t>(E));
    // valid = {} below: padding rows never reach the layer (the model routes only the others).
    if (config_.balance == Balance::qb_hist) {
      // The same bf16 margins as EQB's, so the two differ only in how they find the quantile.
      std::vector<float> margins(keys.size());
      std::transform(keys.begin(), keys.end(), margins.begin(), value_of_order_key);
      q = global_histogram_quantile(margins, E, {}, config_.hist_bins, rank, comm);
    } else {
      const auto exact = global_kth_smallest(keys, E, {}, rank, comm);
      std::transform(exact.begin(), exact.end(), q.begin(), value_of_order_key);
    }
    // A step of size eta toward the quantile, in double: lerp(b, q, 1) is q exactly, and beta
    // stays f32 so steps far below the quantile's bf16 spacing still count.
    for (int64_t e = 0; e < E; ++e)
      beta[e] = float(std::lerp(double(beta[e]), double(q[size_t(e)]), config_.eqb_step));
  }
  state = BalanceState{};
}

}  // namespace tessel::moe
