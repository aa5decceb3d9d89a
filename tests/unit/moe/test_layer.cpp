// MoeLayer against its naive twin (f32 fast vs f64 naive), the naive backward against
// central finite differences, determinism, capacity drops, and the (damped) EQB and
// qb_hist updates against a sorted pool of the margins.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <utility>

#include "support/expect_input_error.hpp"
#include "tessel/core/bf16.hpp"
#include "tessel/moe/layer.hpp"
#include "tessel/moe/quantile.hpp"
#include "unit/kernels/kernel_test_util.hpp"
#include "unit/moe/moe_test_util.hpp"

namespace tessel::moe {
namespace {

using kernels::test::added;
using kernels::test::bitwise_equal;
using kernels::test::kFastVsNaive;
using kernels::test::kFiniteDiff;
using kernels::test::numeric_grad;
using kernels::test::rel_error;
using kernels::test::to_f64;
using kernels::test::VecD;
using kernels::test::VecF;
using testing::bind;
using testing::Layout;

struct Case {
  const char* name;
  Layout layout;
  int64_t N;
  std::vector<int32_t> sequence = {};  // MoeLayer::forward's (seq_aux)
  // Experts given a zero router row and one common beta: their selection scores tie exactly
  // for every token (and so do their gates within a token), so selection and capacity
  // tie-breaks are compared.
  std::vector<int64_t> tied = {};
};

Layout layout(ExpertMlp mlp, ScoreFn score, bool normalize, int64_t Fs, bool bias, double cf,
              DropPolicy drop, Balance balance, double z = 0) {
  Layout l;
  l.config.experts = 6;
  l.config.top_k = 2;
  l.config.score = score;
  l.config.normalize_gates = normalize;
  l.config.capacity = cf;
  l.config.drop = drop;
  l.config.balance = balance;
  l.config.z_coeff = z;
  l.config.lei_coeff = 0.5;
  l.config.lei_kernel = LeiKernel::tanh;
  l.config.aux_coeff = 0.1;
  l.shape = {8, 5, Fs, mlp};
  l.bias = bias;
  return l;
}

Layout lei(Layout l, LeiKernel kernel, LeiMargin margin, LeiLoss loss) {
  l.config.lei_kernel = kernel;
  l.config.lei_margin = margin;
  l.config.lei_loss = loss;
  return l;
}

std::vector<Case> cases() {
  using B = Balance;
  using D = DropPolicy;
  const auto gelu = ExpertMlp::gelu, swiglu = ExpertMlp::swiglu;
  const auto sm = ScoreFn::softmax, sg = ScoreFn::sigmoid;
  return {
      {"gelu_softmax", layout(gelu, sm, true, 0, true, 0, D::probability, B::none), 7},
      {"swiglu_sigmoid_shared", layout(swiglu, sg, false, 4, false, 0, D::probability, B::none), 9},
      {"one_token", layout(swiglu, sm, true, 3, true, 0, D::probability, B::none), 1},
      {"capacity_probability", layout(gelu, sm, true, 0, true, 1.0, D::probability, B::none), 12},
      {"capacity_position", layout(swiglu, sg, true, 0, false, 0.5, D::position, B::none), 12},
      {"aux_z", layout(gelu, sm, true, 0, true, 0, D::probability, B::aux, 0.01), 10},
      {"lei_sigmoid", layout(gelu, sg, true, 0, true, 0, D::probability, B::lei), 10},
      {"lei_identity",
       [] {
         Layout l = layout(swiglu, sm, false, 0, true, 0, D::probability, B::lei);
         l.config.lei_kernel = LeiKernel::identity;
         return l;
       }(),
       8},
      // The LEI margins and losses (lei_sigmoid above: the defaults midpoint and centered_fsq).
      {"lei_defaults_rectangle",
       lei(layout(gelu, sm, true, 0, true, 0, D::probability, B::lei), LeiKernel::rectangle,
           LeiMargin::midpoint, LeiLoss::centered_fsq),
       9},
      {"lei_topk_fsq",
       lei(layout(gelu, sm, true, 0, true, 0, D::probability, B::lei), LeiKernel::tanh,
           LeiMargin::topk, LeiLoss::fsq),
       10},
      // N = 14: experts 1 and 2 tie at the largest load (maxvio's shared subgradient).
      {"lei_topk_plus_one_maxvio",
       lei(layout(swiglu, sg, true, 0, false, 0, D::probability, B::lei), LeiKernel::triangle,
           LeiMargin::topk_plus_one, LeiLoss::maxvio),
       14},
      // N k / E = 22 / 6 and 24 / 6: windows around a fractional and an integer C.
      {"lei_exact_margin_totalvio",
       lei(layout(gelu, sm, true, 0, true, 0, D::probability, B::lei), LeiKernel::tanh,
           LeiMargin::exact_margin, LeiLoss::totalvio),
       11},
      {"eqb_lei_exact_margin_centered",
       lei(layout(gelu, sg, true, 0, true, 0, D::probability, B::eqb_lei), LeiKernel::rectangle,
           LeiMargin::exact_margin, LeiLoss::centered_fsq),
       12},
      // Sequences of 3, 2 and 5 tokens, with the z-loss on top.
      {"seq_aux_z",
       layout(gelu, sm, true, 0, true, 0, D::probability, B::seq_aux, 0.01),
       10,
       {0, 0, 0, 1, 1, 2, 2, 2, 2, 2}},
      {"sinkhorn", layout(swiglu, sm, true, 0, true, 0, D::probability, B::sinkhorn), 11},
      // cf 0 = 1: ceil(2 * 11 / 6) = 4 tokens per expert; normalize_gates does not apply.
      {"expert_choice", layout(gelu, sm, true, 4, true, 0, D::probability, B::expert_choice, 0.01),
       11},
      // cf 0.5: 2 tokens per expert of 13, so some tokens go to no expert.
      {"expert_choice_sigmoid_cf",
       layout(swiglu, sg, false, 0, false, 0.5, D::probability, B::expert_choice), 13},
      // Top-1 with normalized gates: every gate is 1, so capacity keeps each expert's first
      // ceil(12 * 0.5 / 6) = 1 slot, and tokens whose best score is the tied one take expert 1.
      {"ties_top1_capacity_probability",
       [&] {
         Layout l = layout(gelu, sm, true, 0, true, 0.5, D::probability, B::none);
         l.config.top_k = 1;
         return l;
       }(),
       12,
       {},
       {1, 3, 4}},
      {"ties_capacity_position",
       layout(swiglu, sg, true, 0, false, 1.0, D::position, B::none),
       12,
       {},
       {0, 2, 5}},
  };
}

struct LayerRun {
  VecF y, dx, grads, beta;
  LayerCache cache;
};

LayerRun run_fast(const Layout& l, const VecF& params, const VecF& x, const VecF& dy,
                  const VecF& beta, const VecF& grad_base, float loss_scale,
                  std::span<const int32_t> sequence = {}) {
  MoeLayer layer(l.config, l.shape);
  LocalExpertComm comm;
  const int64_t N = int64_t(x.size()) / l.shape.C;
  LayerRun r;
  r.y.resize(x.size());
  r.dx.assign(x.size(), 0.5f);
  r.grads = grad_base;
  auto w = bind<const float>(params.data(), l);
  auto g = bind<float>(r.grads.data(), l);
  BalanceState state;
  layer.forward(r.cache, r.y.data(), x.data(), N, w, beta.data(), comm, std::nullopt, sequence);
  layer.backward(r.cache, r.dx.data(), g, dy.data(), x.data(), w, loss_scale, state, comm);
  return r;
}

TEST(MoeLayer, FastMatchesNaive) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const Layout& l = c.layout;
    Rng rng(11);
    VecF params = testing::random_params(l, 5);
    const VecF x = kernels::test::randn(rng, size_t(c.N * l.shape.C));
    const VecF dy = kernels::test::randn(rng, x.size());
    VecF beta = kernels::test::randn(rng, size_t(l.config.experts), 0.3f);
    for (int64_t e : c.tied) {
      std::fill_n(params.begin() + e * l.shape.C, l.shape.C, 0.0f);  // router row e
      beta[size_t(e)] = beta[size_t(c.tied[0])];
    }
    const VecF base = kernels::test::randn(rng, params.size());
    const float scale = 0.7f;
    LayerRun fast = run_fast(l, params, x, dy, beta, base, scale, c.sequence);

    const VecD pd = to_f64(params), xd = to_f64(x), dyd = to_f64(dy), bd = to_f64(beta);
    VecD y(x.size()), dx(x.size(), 0.0), g(params.size(), 0.0);
    auto w = bind<const double>(pd.data(), l);
    auto gw = bind<double>(g.data(), l);
    naive::moe_forward<double>(y.data(), xd.data(), c.N, w, bd.data(), l.config, l.shape);
    naive::moe_backward<double>(dx.data(), gw, dyd.data(), xd.data(), c.N, w, bd.data(), scale,
                                l.config, l.shape, c.sequence);
    // kFastVsNaive: f32 GEMMs and activations against f64 loops, relative to max |ref|.
    EXPECT_LT(rel_error(fast.y, y), kFastVsNaive);
    EXPECT_LT(rel_error(added(fast.dx, VecF(x.size(), 0.5f)), dx), kFastVsNaive);
    EXPECT_LT(rel_error(added(fast.grads, base), g), kFastVsNaive);
  }
}

TEST(MoeLayer, CapacityDropsTheExcess) {
  const Layout l = cases()[3].layout;  // cf = 1, by probability
  Rng rng(3);
  const int64_t N = 30;
  const VecF params = testing::random_params(l, 8, 3.0f);
  const VecF x = kernels::test::randn(rng, size_t(N * l.shape.C));
  const VecF zero(size_t(l.config.experts), 0.0f);
  LayerRun r = run_fast(l, params, x, VecF(x.size(), 0.0f), zero, VecF(params.size(), 0.0f), 1.0f);
  const int64_t cap = int64_t(std::ceil(double(l.config.top_k * N) / double(l.config.experts)));
  int64_t excess = 0, kept = 0;
  for (int64_t e = 0; e < l.config.experts; ++e) {
    excess += std::max<int64_t>(0, r.cache.loads[size_t(e)] - cap);
    EXPECT_EQ(r.cache.counts[size_t(e)], std::min(cap, r.cache.loads[size_t(e)]));
    kept += r.cache.counts[size_t(e)];
  }
  EXPECT_GT(excess, 0) << "the test needs an unbalanced router";
  EXPECT_EQ(r.cache.dropped, excess);
  EXPECT_EQ(int64_t(r.cache.order.size()), kept);
}

// Which slots capacity drops (token choice), by gate and by position, on hand-built logits
// through an identity router: E = 4, k = 2, N = 4, cf = 0.5, so each expert keeps
// ceil(2 * 4 * 0.5 / 4) = 1 slot. Tokens 0 and 2 are equal (experts 0, 1), as are tokens 1
// and 3 (experts 0, 3); slot s = 2 n + j. Expert 0's gate is 0.525 in tokens 0 and 2 and 0.881
// in tokens 1 and 3; experts 1 and 3 each see two equal gates.
TEST(MoeLayer, CapacityDropsTheLowestGatesOrTheLatestTokens) {
  Layout l;
  l.config.experts = 4;
  l.config.top_k = 2;
  l.config.capacity = 0.5;
  l.shape = {4, 3, 0, ExpertMlp::gelu};
  const VecF logits = {1, 0.9f, -5, -5, 2, -5, -5, 0, 1, 0.9f, -5, -5, 2, -5, -5, 0};
  const std::pair<DropPolicy, std::vector<int32_t>> cases[] = {
      // Expert 0 keeps token 1's slot 2 (the highest gate, tied with slot 6: the earlier
      // slot); experts 1 and 3 keep the earlier of their tied slots, 1 and 3.
      {DropPolicy::probability, {0, 1, 1, 1, 0, 0, 0, 0}},
      // Each expert keeps its earliest slot: 0 (expert 0), 1 (expert 1), 3 (expert 3).
      {DropPolicy::position, {1, 1, 0, 1, 0, 0, 0, 0}}};
  for (const auto& [drop, kept] : cases) {
    SCOPED_TRACE(drop == DropPolicy::probability ? "probability" : "position");
    l.config.drop = drop;
    const auto r = testing::balance_grad(l, logits);
    ASSERT_EQ(r.cache.choice, (std::vector<int32_t>{0, 1, 0, 3, 0, 1, 0, 3}));
    for (size_t s = 0; s < kept.size(); ++s)
      EXPECT_EQ(r.cache.position[s] >= 0, kept[s] == 1) << "slot " << s;
    EXPECT_EQ(r.cache.dropped, 5);
  }
}

// ceil(k N cf / E), capped at N: an expert ranks at most one slot per token.
TEST(MoeLayer, ExpertCapacityIsTheCeilingCappedAtTheTokens) {
  EXPECT_EQ(expert_capacity(30, 2, 8, 1.0), 8);    // 7.5 -> 8
  EXPECT_EQ(expert_capacity(30, 2, 8, 1.25), 10);  // 9.375 -> 10
  EXPECT_EQ(expert_capacity(30, 2, 8, 4.0), 30);
  EXPECT_EQ(expert_capacity(30, 2, 8, 100.0), 30);
  EXPECT_EQ(expert_capacity(30, 2, 8, 1e17), 30);
}

TEST(MoeLayer, BackwardIsDeterministic) {
  const Layout l = cases()[1].layout;
  Rng rng(4);
  const VecF params = testing::random_params(l, 9);
  const VecF x = kernels::test::randn(rng, size_t(20 * l.shape.C));
  const VecF dy = kernels::test::randn(rng, x.size());
  const VecF beta(size_t(l.config.experts), 0.0f), base(params.size(), 0.0f);
  LayerRun a = run_fast(l, params, x, dy, beta, base, 1.0f);
  LayerRun b = run_fast(l, params, x, dy, beta, base, 1.0f);
  EXPECT_TRUE(bitwise_equal(a.y, b.y));
  EXPECT_TRUE(bitwise_equal(a.dx, b.dx));
  EXPECT_TRUE(bitwise_equal(a.grads, b.grads));
}

// J = <R, y> + loss_scale * N * (aux + seq_aux + z), the objective whose gradient the naive
// backward adds (selection and hard loads are piecewise constant, so FD sees only the smooth
// part). seq_aux: the mean over the sequences of alpha E sum_e f_{s,e} P_{s,e}.
double objective(const Layout& l, const VecD& params, const VecD& x, const VecD& R,
                 const VecD& beta, double loss_scale, const std::vector<int32_t>& sequence) {
  const int64_t N = int64_t(x.size()) / l.shape.C, E = l.config.experts, C = l.shape.C;
  VecD y(x.size());
  naive::moe_forward<double>(y.data(), x.data(), N, bind<const double>(params.data(), l),
                             beta.data(), l.config, l.shape);
  double j = kernels::test::dot(R, y);
  std::vector<double> P(size_t(E), 0.0), logit(static_cast<size_t>(E));
  std::vector<int64_t> loads(size_t(E), 0);
  const int64_t S = sequence.empty() ? 0 : *std::max_element(sequence.begin(), sequence.end()) + 1;
  std::vector<double> seq_P(size_t(S * E), 0.0), seq_loads(size_t(S * E), 0.0),
      seq_T(size_t(S), 0.0);
  double z = 0;
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t e = 0; e < E; ++e) {
      logit[size_t(e)] = 0;
      for (int64_t i = 0; i < C; ++i)
        logit[size_t(e)] += x[size_t(n * C + i)] * params[size_t(e * C + i)];
    }
    double m = *std::max_element(logit.begin(), logit.end()), s = 0;
    for (double v : logit) s += std::exp(v - m);
    const double lse = m + std::log(s);
    z += lse * lse;
    std::vector<float> sel(static_cast<size_t>(E));
    for (int64_t e = 0; e < E; ++e) sel[size_t(e)] = float(logit[size_t(e)] - beta[size_t(e)]);
    std::vector<int32_t> ch(size_t(l.config.top_k));
    float kth, kp1;
    select_top_k(sel.data(), E, l.config.top_k, ch.data(), &kth, &kp1);
    for (int32_t e : ch) ++loads[size_t(e)];
    for (int64_t e = 0; e < E; ++e) P[size_t(e)] += std::exp(logit[size_t(e)] - lse) / double(N);
    if (S > 0) {
      const int64_t s = sequence[size_t(n)];
      seq_T[size_t(s)] += 1;
      for (int32_t e : ch) seq_loads[size_t(s * E + e)] += 1;
      for (int64_t e = 0; e < E; ++e) seq_P[size_t(s * E + e)] += std::exp(logit[size_t(e)] - lse);
    }
  }
  double aux = 0;
  for (int64_t e = 0; e < E && l.config.balance == Balance::aux; ++e)
    aux += l.config.aux_coeff * double(E) * double(loads[size_t(e)]) / double(N * l.config.top_k) *
           P[size_t(e)];
  for (int64_t s = 0; s < S && l.config.balance == Balance::seq_aux; ++s)
    for (int64_t e = 0; e < E; ++e)
      aux += l.config.aux_coeff * double(E) * seq_loads[size_t(s * E + e)] /
             (double(l.config.top_k) * seq_T[size_t(s)]) * seq_P[size_t(s * E + e)] /
             seq_T[size_t(s)] / double(S);
  return j + loss_scale * double(N) * (aux + l.config.z_coeff * z / double(N));
}

TEST(MoeLayer, NaiveBackwardMatchesFiniteDifferences) {
  // plain, shared + sigmoid, aux + z, seq_aux + z, sinkhorn, both expert_choice cases
  for (int i : {0, 1, 5, 13, 14, 15, 16}) {
    const Case c = cases()[size_t(i)];
    SCOPED_TRACE(c.name);
    const Layout& l = c.layout;
    Rng rng(21);
    VecD params = to_f64(testing::random_params(l, 6));
    VecD x = to_f64(kernels::test::randn(rng, size_t(c.N * l.shape.C)));
    const VecD R = to_f64(kernels::test::randn(rng, x.size()));
    const VecD beta = to_f64(kernels::test::randn(rng, size_t(l.config.experts), 0.3f));
    const double scale = 0.5;
    VecD dx(x.size(), 0.0), g(params.size(), 0.0);
    auto gw = bind<double>(g.data(), l);
    naive::moe_backward<double>(dx.data(), gw, R.data(), x.data(), c.N,
                                bind<const double>(params.data(), l), beta.data(), scale, l.config,
                                l.shape, c.sequence);
    auto J = [&] { return objective(l, params, x, R, beta, scale, c.sequence); };
    EXPECT_LT(rel_error(dx, numeric_grad(x, J)), kFiniteDiff);
    EXPECT_LT(rel_error(g, numeric_grad(params, J)), kFiniteDiff);
  }
}

// The step's margins, naively: per token alpha = the (k+1)-th largest of logits - beta,
// margins logits - alpha rounded to bf16; per expert, sorted.
std::vector<VecF> margin_columns(const std::vector<VecF>& logits, const VecF& beta, int64_t E,
                                 int64_t k) {
  std::vector<VecF> columns(static_cast<size_t>(E));
  for (const VecF& lg : logits)
    for (size_t n = 0; n < lg.size() / size_t(E); ++n) {
      VecF s(static_cast<size_t>(E));
      for (int64_t e = 0; e < E; ++e)
        s[size_t(e)] = lg[n * size_t(E) + size_t(e)] - beta[size_t(e)];
      std::sort(s.begin(), s.end(), std::greater<>());
      const float alpha = s[size_t(k)];
      for (int64_t e = 0; e < E; ++e)
        columns[size_t(e)].push_back(
            bf16_to_f32(f32_to_bf16(lg[n * size_t(E) + size_t(e)] - alpha)));
    }
  for (VecF& c : columns) std::sort(c.begin(), c.end());
  return columns;
}

// EQB's beta from the step's margins: per expert the qb_rank-th smallest.
VecD quantile_beta(const std::vector<VecF>& logits, const VecF& beta, int64_t E, int64_t k) {
  VecD q;
  for (const VecF& c : margin_columns(logits, beta, E, k))
    q.push_back(c[size_t(qb_rank(int64_t(c.size()), k, E) - 1)]);
  return q;
}

// One optimizer step of the layer on one process: forward and backward of each micro-batch
// of `xs` from beta0, then the update; returns beta, and each micro-batch's logits.
VecF step_beta(const Layout& l, const VecF& params, const VecF& beta0, const std::vector<VecF>& xs,
               std::vector<VecF>& logits) {
  MoeLayer layer(l.config, l.shape);
  LocalExpertComm comm;
  BalanceState state;
  VecF grads(params.size(), 0.0f);
  auto w = bind<const float>(params.data(), l);
  auto g = bind<float>(grads.data(), l);
  logits.clear();
  for (const VecF& x : xs) {
    const int64_t N = int64_t(x.size()) / l.shape.C;
    VecF y(x.size()), dx(x.size(), 0.0f);
    LayerCache cache;
    layer.forward(cache, y.data(), x.data(), N, w, beta0.data(), comm);
    layer.backward(cache, dx.data(), g, VecF(x.size(), 0.1f).data(), x.data(), w, 1.0f, state,
                   comm);
    logits.push_back(cache.logits);
  }
  VecF beta = beta0;
  layer.update(state, beta.data(), comm);
  return beta;
}

// A layer balanced by `balance`, its parameters, a starting beta and two micro-batches of one
// step: the inputs of step_beta that the balancing tests share.
struct OneStep {
  Layout l;
  VecF params, beta0;
  std::vector<VecF> xs;
};
OneStep one_step(Balance balance) {
  OneStep s{
      layout(ExpertMlp::gelu, ScoreFn::softmax, true, 0, true, 0, DropPolicy::probability, balance),
      {},
      {},
      {}};
  Rng rng(31);
  s.params = testing::random_params(s.l, 12);
  s.beta0 = kernels::test::randn(rng, size_t(s.l.config.experts), 0.3f);
  s.xs = {kernels::test::randn(rng, size_t(7 * s.l.shape.C)),
          kernels::test::randn(rng, size_t(9 * s.l.shape.C))};
  return s;
}

TEST(MoeLayer, EqbStepMovesBetaTowardTheExactQuantile) {
  auto [l, params, beta0, xs] = one_step(Balance::eqb);
  const int64_t E = l.config.experts, k = l.config.top_k;
  for (double eta : {1.0, 0.3, 0.01}) {
    SCOPED_TRACE("eta " + std::to_string(eta));
    l.config.eqb_step = eta;
    std::vector<VecF> logits;
    const VecF beta = step_beta(l, params, beta0, xs, logits);
    const VecD q = quantile_beta(logits, beta0, E, k);
    int64_t moved = 0;  // experts whose quantile is not already (the bf16 rounding of) beta0
    for (int64_t e = 0; e < E; ++e) {
      const size_t i = size_t(e);
      moved += std::abs(q[i] - beta0[i]) > 1e-2;
      if (eta == 1.0) {
        // The spec's rule, bitwise: beta = the quantile.
        EXPECT_EQ(std::bit_cast<uint32_t>(beta[i]), std::bit_cast<uint32_t>(float(q[i])))
            << "expert " << e;
      } else {
        // The convex combination in closed form, within one f32 rounding.
        const double want = (1.0 - eta) * double(beta0[i]) + eta * q[i];
        EXPECT_LE(std::abs(double(beta[i]) - want),
                  std::abs(want) * std::numeric_limits<float>::epsilon())
            << "expert " << e;
      }
    }
    EXPECT_GE(moved, E / 2) << "the test needs a beta0 away from the quantile";
  }
}

// qb_hist on the same step: the layer records the same bf16 margins as EQB, and its beta
// (eta = 1) is the histogram estimate, never below EQB's exact quantile and at most one bin
// width ((max - min) / B of that expert's margins) above it, beta's own f32 rounding aside.
// With the damped step the same bound scales by eta.
TEST(MoeLayer, QbHistStepIsWithinOneBinAboveTheExactQuantile) {
  auto [l, params, beta0, xs] = one_step(Balance::qb_hist);
  const int64_t E = l.config.experts, k = l.config.top_k;
  for (int64_t bins : {int64_t(1000), int64_t(10)}) {
    for (double eta : {1.0, 0.3}) {
      SCOPED_TRACE(std::to_string(bins) + " bins, eta " + std::to_string(eta));
      l.config.hist_bins = bins;
      l.config.eqb_step = eta;
      std::vector<VecF> logits;
      const VecF beta = step_beta(l, params, beta0, xs, logits);
      const auto columns = margin_columns(logits, beta0, E, k);
      const VecD q = quantile_beta(logits, beta0, E, k);
      int64_t above = 0;  // experts where the estimate is not the exact quantile
      for (int64_t e = 0; e < E; ++e) {
        const VecF& c = columns[size_t(e)];
        const double w = (double(c.back()) - double(c.front())) / double(bins);
        const double exact = std::lerp(double(beta0[size_t(e)]), q[size_t(e)], eta);
        const double b = beta[size_t(e)];
        const double rounding = std::abs(b) * std::numeric_limits<float>::epsilon();
        EXPECT_GE(b, exact - rounding) << "expert " << e;
        EXPECT_LE(b - exact, eta * w + rounding) << "expert " << e;
        above += b > exact + rounding;
      }
      if (bins == 10) {
        EXPECT_GT(above, 0) << "ten bins should be visibly coarse";
      }
    }
  }
}

TEST(MoeLayer, QbHistBinsBelowTwoOrAboveTwoToThe20AreAnInputError) {
  MoeConfig c;
  c.balance = Balance::qb_hist;
  for (int64_t bins : {int64_t(1), int64_t(0), int64_t(-5), (int64_t(1) << 20) + 1}) {
    c.hist_bins = bins;
    fixture::expect_input_error([&] { validate(c); }, {"model.moe_hist_bins", "[2, 1048576]"});
  }
  for (int64_t bins : {int64_t(2), int64_t(1000), int64_t(1) << 20}) {
    c.hist_bins = bins;
    EXPECT_NO_THROW(validate(c)) << bins;
  }
}

// Router logits that overflow make the quantile margins inf - inf = NaN, which have no order:
// the run stops as diverged (exit 4, DivergenceError), not on an internal check (exit 1).
// Sigmoid scores: the probabilities of inf logits are finite, so no NaN gradient would say it.
TEST(MoeLayer, NonFiniteRouterLogitsUnderQuantileBalancingAreADivergence) {
  for (Balance b : {Balance::qb_avg, Balance::eqb, Balance::qb_hist}) {
    SCOPED_TRACE(to_string(b));
    Layout l;
    l.config.experts = 4;
    l.config.top_k = 2;
    l.config.score = ScoreFn::sigmoid;
    l.config.balance = b;
    l.shape = {4, 3, 0, ExpertMlp::gelu};
    VecF logits(12, 0.5f);
    EXPECT_NO_THROW(testing::balance_grad(l, logits));
    std::fill(logits.begin() + 4, logits.begin() + 8, std::numeric_limits<float>::infinity());
    EXPECT_THROW(testing::balance_grad(l, logits), RouterOverflow);  // the trainer catches it
  }
}

TEST(MoeLayer, EqbStepOutsideZeroToOneIsAnInputError) {
  MoeConfig c;
  c.balance = Balance::eqb_lei;
  for (double eta : {0.0, -0.5, 1.5, std::nan("")}) {
    c.eqb_step = eta;
    fixture::expect_input_error([&] { validate(c); }, {"model.moe_eqb_step", "(0, 1]"});
  }
  for (double eta : {1.0, 0.2, 1e-6}) {
    c.eqb_step = eta;
    EXPECT_NO_THROW(validate(c)) << eta;
  }
}

// The loss coefficients and bias rate reach the router in f32: beyond FLT_MAX they would be
// inf there (a bias rate of 1e39 wrote NaN biases into the checkpoint), so they are refused by
// name; up to FLT_MAX they pass.
TEST(MoeLayer, CoefficientsBeyondTheFloatRangeAreInputErrors) {
  const double too_large = 1e39, largest = double(std::numeric_limits<float>::max());
  const std::pair<const char*, double MoeConfig::*> fields[] = {
      {"model.moe_aux_coeff", &MoeConfig::aux_coeff},
      {"model.moe_z_coeff", &MoeConfig::z_coeff},
      {"model.moe_bias_rate", &MoeConfig::bias_rate},
      {"model.moe_lei_coeff", &MoeConfig::lei_coeff}};
  for (const auto& [name, field] : fields) {
    MoeConfig c;
    c.*field = too_large;
    fixture::expect_input_error([&] { validate(c); }, {name, "float range"});
    c.*field = largest;
    EXPECT_NO_THROW(validate(c)) << name;
  }
}

// LEI's +-1e30 margins lie outside every kernel only for widths far below 1e30: the width is
// capped at 1e6, the bound named in the message; 1e6 itself passes.
TEST(MoeLayer, LeiWidthAboveTheBoundIsAnInputError) {
  MoeConfig c;
  c.balance = Balance::lei;
  for (double w :
       {2e6, 1e30, 1e39, 0.0, -1.0, std::nan(""), std::numeric_limits<double>::infinity()}) {
    c.lei_width = w;
    fixture::expect_input_error([&] { validate(c); }, {"model.moe_lei_width", "(0, 1e6]"});
  }
  for (double w : {1e6, 1.0, 1e-3}) {
    c.lei_width = w;
    EXPECT_NO_THROW(validate(c)) << w;
  }
}

}  // namespace
}  // namespace tessel::moe
