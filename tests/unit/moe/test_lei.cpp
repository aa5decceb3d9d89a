// Load-error injection (spec 3): the worked examples of every loss, the margin positions,
// exact_margin's windows, the sign of the gradient, its vanishing when balanced, the identity
// kernel against the Switch aux loss, and finite differences of the straight-through
// surrogate for every margin and loss. The router is the identity (C = E), so the logits are
// the inputs and, with dy = 0, dx is exactly the logit gradient of the balancing loss.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "tessel/moe/layer.hpp"
#include "unit/kernels/kernel_test_util.hpp"
#include "unit/moe/moe_test_util.hpp"

namespace tessel::moe {
namespace {

using kernels::test::VecD;
using kernels::test::VecF;
using testing::Layout;

Layout lei_layout(int64_t E, int64_t k, LeiKernel kernel, double width,
                  LeiMargin margin = LeiMargin::midpoint, LeiLoss loss = LeiLoss::centered_fsq) {
  Layout l;
  l.config.experts = E;
  l.config.top_k = k;
  l.config.balance = Balance::lei;
  l.config.lei_coeff = 1.0;
  l.config.lei_kernel = kernel;
  l.config.lei_width = width;
  l.config.lei_margin = margin;
  l.config.lei_loss = loss;
  l.shape = {E, 3, 0, ExpertMlp::gelu};
  return l;
}

constexpr LeiLoss kLosses[] = {LeiLoss::centered_fsq, LeiLoss::fsq, LeiLoss::maxvio,
                               LeiLoss::totalvio};
constexpr LeiMargin kMargins[] = {LeiMargin::midpoint, LeiMargin::topk, LeiMargin::topk_plus_one,
                                  LeiMargin::exact_margin};

using Result = testing::BalanceResult;
using testing::balance_grad;

TEST(Lei, WorkedExampleOneToken) {
  // Spec 3.3: logits [2.7, 2.5, 2.4, 0.1], k = 2: loads [1, 1, 0, 0], L = 1 + 4 * 4 / 16 = 2.
  // Boundary (2.5 + 2.4) / 2 = 2.45: margins 0.25, 0.05, -0.05, -2.35; rectangle w = 1 gives
  // phi' = 1 inside |m| <= 0.5. dL/ds_e = 2E/(T k) (f_e - 1/E) phi' = 4 (f_e - 1/4) phi'.
  const Result r =
      balance_grad(lei_layout(4, 2, LeiKernel::rectangle, 1.0), {2.7f, 2.5f, 2.4f, 0.1f});
  EXPECT_DOUBLE_EQ(r.loss, 2.0);
  EXPECT_FLOAT_EQ(r.d_logits[0], 1.0f);   // overloaded
  EXPECT_FLOAT_EQ(r.d_logits[1], 1.0f);   // overloaded
  EXPECT_FLOAT_EQ(r.d_logits[2], -1.0f);  // underloaded, near the boundary
  EXPECT_EQ(r.d_logits[3], 0.0f);         // underloaded, far from it
}

TEST(Lei, WorkedExampleLoads4312) {
  // Tokens pick (0,1), (0,1), (0,1), (0,3), (2,3): loads [4, 3, 1, 2], T = 5, k = 2:
  // L = 1 + 4 ((.4-.25)^2 + (.3-.25)^2 + (.1-.25)^2 + (.2-.25)^2) = 1.2.
  const VecF logits = {3, 2, 0, 0, 3, 2, 0, 0, 3, 2, 0, 0, 3, 0, 0, 2, 0, 0, 3, 2};
  const Result r = balance_grad(lei_layout(4, 2, LeiKernel::triangle, 4.0), logits);
  EXPECT_EQ((std::vector<int64_t>(r.cache.loads.begin(), r.cache.loads.end())),
            (std::vector<int64_t>{4, 3, 1, 2}));
  EXPECT_NEAR(r.loss, 1.2, 1e-12);
}

TEST(Lei, WorkedExamplesOfTheOtherLosses) {
  // Spec 3.3's one token (f = [.5, .5, 0, 0], margins 0.25, 0.05, -0.05, -2.35, phi' = 1 on
  // the first three): dL/ds_e = dL/df_e / (T k) phi'. fsq L = 4 (.25 + .25) = 2 with
  // dL/df = 2E f = [4, 4, 0, 0]: the overloaded experts go down, but the underloaded expert 2
  // gets 0, not a push up (f_2 = 0; spec 3.3's sign facts are centered_fsq's). maxvio
  // L = 1 + (.5 - .25) / .25 = 2, the tied maxima share dL/df = E: [2, 2, 0, 0]. totalvio
  // L = 1 + 2 (4 * .25) = 3, dL/df = (E/2) sign(f - 1/E) = [2, 2, -2, -2].
  const VecF one = {2.7f, 2.5f, 2.4f, 0.1f};
  struct Want {
    LeiLoss loss;
    double value;
    VecF grad;
  };
  for (const Want& want :
       {Want{LeiLoss::fsq, 2.0, {2, 2, 0, 0}}, Want{LeiLoss::maxvio, 2.0, {1, 1, 0, 0}},
        Want{LeiLoss::totalvio, 3.0, {1, 1, -1, 0}}}) {
    SCOPED_TRACE(int(want.loss));
    const Result r = balance_grad(
        lei_layout(4, 2, LeiKernel::rectangle, 1.0, LeiMargin::midpoint, want.loss), one);
    EXPECT_DOUBLE_EQ(r.loss, want.value);
    for (size_t e = 0; e < 4; ++e) EXPECT_FLOAT_EQ(r.d_logits[e], want.grad[e]) << e;
  }
  // Loads [4, 3, 1, 2], T = 5, k = 2, f = [.4, .3, .1, .2]: fsq 4 (.16 + .09 + .01 + .04) =
  // 1.2 (= centered_fsq whenever sum f = 1), maxvio 1 + .15 / .25 = 1.6, totalvio
  // 1 + 2 (.15 + .05 + .15 + .05) = 1.8. maxvio pushes only the single maximum, expert 0.
  const VecF logits = {3, 2, 0, 0, 3, 2, 0, 0, 3, 2, 0, 0, 3, 0, 0, 2, 0, 0, 3, 2};
  for (auto [loss, value] : {std::pair{LeiLoss::fsq, 1.2}, std::pair{LeiLoss::maxvio, 1.6},
                             std::pair{LeiLoss::totalvio, 1.8}}) {
    SCOPED_TRACE(int(loss));
    const Result r =
        balance_grad(lei_layout(4, 2, LeiKernel::triangle, 4.0, LeiMargin::midpoint, loss), logits);
    EXPECT_NEAR(r.loss, value, 1e-12);
    if (loss != LeiLoss::maxvio) continue;
    for (size_t i = 0; i < r.d_logits.size(); ++i) {
      if (i % 4 == 0)
        EXPECT_GT(r.d_logits[i], 0.0f) << i;
      else
        EXPECT_EQ(r.d_logits[i], 0.0f) << i;
    }
  }
}

TEST(Lei, TotalvioLeavesExactlyBalancedExpertsAlone) {
  // Tokens pick (0,1), (0,2), (0,3), (1,2): loads [3, 2, 2, 1], C = 2, f = [3, 2, 2, 1] / 8.
  // L = 1 + 2 (1/8 + 0 + 0 + 1/8) = 1.5; |f_e - 1/E| at 0 contributes 0 (not +-E/2) to the
  // balanced experts 1 and 2, though the wide triangle puts every token in their windows.
  const VecF logits = {3, 2, 0, 0, 3, 0, 2, 0, 3, 0, 0, 2, 0, 3, 2, 0};
  const Result r = balance_grad(
      lei_layout(4, 2, LeiKernel::triangle, 8.0, LeiMargin::midpoint, LeiLoss::totalvio), logits);
  EXPECT_NEAR(r.loss, 1.5, 1e-12);
  for (size_t n = 0; n < 4; ++n) {
    EXPECT_GT(r.d_logits[n * 4 + 0], 0.0f) << n;
    EXPECT_EQ(r.d_logits[n * 4 + 1], 0.0f) << n;
    EXPECT_EQ(r.d_logits[n * 4 + 2], 0.0f) << n;
    EXPECT_LT(r.d_logits[n * 4 + 3], 0.0f) << n;
  }
}

TEST(Lei, MarginPositions) {
  // Scores [2.7, 2.5, 2.4, 0.1], k = 2: the k-th is 2.5, the (k+1)-th 2.4.
  const VecF one = {2.7f, 2.5f, 2.4f, 0.1f};
  auto margins = [&](LeiMargin m) {
    return balance_grad(lei_layout(4, 2, LeiKernel::tanh, 1.0, m), one).cache.lei_margin;
  };
  const std::vector<float> mid = margins(LeiMargin::midpoint), top = margins(LeiMargin::topk),
                           next = margins(LeiMargin::topk_plus_one);
  const float s[] = {2.7f, 2.5f, 2.4f, 0.1f};
  for (size_t e = 0; e < 4; ++e) {
    EXPECT_EQ(mid[e], s[e] - 0.5f * (2.5f + 2.4f)) << e;
    EXPECT_EQ(top[e], s[e] - 2.5f) << e;
    EXPECT_EQ(next[e], s[e] - 2.4f) << e;
  }
}

// Nonzero gradient entries of expert e's column.
int64_t window_size(const Result& r, int64_t N, int64_t E, int64_t e) {
  int64_t n_in = 0;
  for (int64_t n = 0; n < N; ++n) n_in += r.d_logits[size_t(n * E + e)] != 0.0f;
  return n_in;
}

TEST(Lei, ExactMarginWindowHoldsTheLoadErrorInTokens) {
  // Every expert with load != C gets exactly |load - C| tokens: the chosen ones closest to
  // dropping it when over, the others closest to taking it when under (checked against every
  // token outside). N k / E not an integer: the window reaches [floor(C), ceil(C)] instead.
  const int64_t E = 6, k = 2;
  for (int64_t N : {30, 31}) {
    SCOPED_TRACE(N);
    Rng rng(uint64_t(40 + N));
    VecF logits = kernels::test::randn(rng, size_t(N * E));
    for (int64_t n = 0; n < N; ++n)
      logits[size_t(n * E)] += 1.0f, logits[size_t(n * E + 5)] -= 1.0f;
    const Result r =
        balance_grad(lei_layout(E, k, LeiKernel::triangle, 0.5, LeiMargin::exact_margin), logits);
    const int64_t lo = N * k / E, hi = (N * k + E - 1) / E;
    int64_t windows = 0;
    for (int64_t e = 0; e < E; ++e) {
      SCOPED_TRACE(e);
      const int64_t load = r.cache.loads[size_t(e)];
      const int64_t want = load > hi ? load - hi : std::max<int64_t>(0, lo - load);
      EXPECT_EQ(window_size(r, N, E, e), want);
      windows += want > 0;
      // Distance to flipping: chosen, to the token's (k+1)-th score; not, to its k-th.
      double in_max = 0, out_min = 1e30;
      for (int64_t n = 0; n < N; ++n) {
        VecF row(logits.begin() + n * E, logits.begin() + (n + 1) * E);
        std::sort(row.begin(), row.end(), std::greater<>());
        const float v = logits[size_t(n * E + e)];
        const bool chosen = v >= row[size_t(k - 1)];
        if (chosen != (load > hi)) continue;
        const double distance = chosen ? v - row[size_t(k)] : row[size_t(k - 1)] - v;
        if (r.d_logits[size_t(n * E + e)] != 0.0f) {
          in_max = std::max(in_max, distance);
          EXPECT_EQ(r.d_logits[size_t(n * E + e)] > 0, load > hi) << n;
        } else {
          out_min = std::min(out_min, distance);
        }
      }
      if (want > 0) {
        EXPECT_LT(in_max, out_min);
      }
    }
    EXPECT_GE(windows, 2) << "the test needs unbalanced experts";
  }
}

TEST(Lei, TopkPlusOneLeavesAnUnderloadedExpertUncorrected) {
  // E = 3, k = 1, every token picks expert 0: loads [3, 0, 0], C = 1. Expert 2 is third in
  // every token, more than w/2 = 0.5 below the (k+1)-th score, so topk_plus_one's window
  // (around the (k+1)-th) never reaches it: its column stays 0. exact_margin gives each expert
  // |load - C| tokens (expert 0 the two closest to dropping it, tokens 2 and 0; experts 1 and 2
  // token 2, the closest to taking them), with dL/ds = (E/k) 2 (f - 1/E) phi'(0) = [4, -2, -2].
  const VecF logits = {3, 1, 0, 3, 0.9f, -0.5f, 2.5f, 1.2f, 0.1f};
  const Result next =
      balance_grad(lei_layout(3, 1, LeiKernel::rectangle, 1.0, LeiMargin::topk_plus_one), logits);
  const Result exact =
      balance_grad(lei_layout(3, 1, LeiKernel::rectangle, 1.0, LeiMargin::exact_margin), logits);
  const VecF want_next = {0, -2, 0, 0, -2, 0, 0, -2, 0};
  const VecF want_exact = {4, 0, 0, 0, 0, 0, 4, -2, -2};
  for (size_t i = 0; i < logits.size(); ++i) {
    EXPECT_FLOAT_EQ(next.d_logits[i], want_next[i]) << i;
    EXPECT_FLOAT_EQ(exact.d_logits[i], want_exact[i]) << i;
  }
}

TEST(Lei, GradientHasTheSignOfTheLoadErrorAndVanishesWhenBalanced) {
  Rng rng(3);
  const int64_t E = 6, k = 2, N = 40;
  const Layout l = lei_layout(E, k, LeiKernel::tanh, 0.7);
  VecF logits = kernels::test::randn(rng, size_t(N * E));
  for (int64_t n = 0; n < N; ++n) logits[size_t(n * E)] += 1.0f;  // expert 0 overloaded
  const Result r = balance_grad(l, logits);
  int nonzero = 0;
  for (int64_t n = 0; n < N; ++n)
    for (int64_t e = 0; e < E; ++e) {
      const double err = double(r.cache.loads[size_t(e)]) / double(N * k) - 1.0 / double(E);
      const float d = r.d_logits[size_t(n * E + e)];
      if (d == 0.0f) continue;
      ++nonzero;
      EXPECT_EQ(d > 0, err > 0) << "token " << n << " expert " << e;
    }
  EXPECT_GT(nonzero, 0);
  // Balanced: 3 tokens, k = 2, E = 6, each expert picked once.
  const VecF balanced = {3, 2, 0, 0, 0, 0, 0, 0, 3, 2, 0, 0, 0, 0, 0, 0, 3, 2};
  const Result b = balance_grad(l, balanced);
  EXPECT_DOUBLE_EQ(b.loss, 1.0);
  for (float d : b.d_logits) EXPECT_EQ(d, 0.0f);
}

TEST(Lei, IdentityKernelEqualsTheAuxLossGradient) {
  // phi = p (the softmax probability): dL/dp = coeff 2E/(T k) (f_e - 1/E); the Switch loss
  // has alpha E f_e / T. The constant -1/E vanishes through the softmax Jacobian, so with
  // coeff = alpha k / 2 the logit gradients agree.
  Rng rng(8);
  const int64_t E = 8, k = 2, N = 33;
  const double alpha = 0.01;
  const VecF logits = kernels::test::randn(rng, size_t(N * E));
  Layout lei = lei_layout(E, k, LeiKernel::identity, 1.0);
  lei.config.lei_coeff = alpha * double(k) / 2;
  Layout aux = lei;
  aux.config.balance = Balance::aux;
  aux.config.aux_coeff = alpha;
  const Result a = balance_grad(lei, logits, 0.3f), b = balance_grad(aux, logits, 0.3f);
  double scale = 0;
  for (float v : b.d_logits) scale = std::max(scale, double(std::abs(v)));
  ASSERT_GT(scale, 0);
  for (size_t i = 0; i < a.d_logits.size(); ++i)
    EXPECT_NEAR(a.d_logits[i], b.d_logits[i], 1e-4 * scale) << i;  // rtol 1e-4 (spec)
}

// The loss of load fractions f [E], written out (model.moe_lei_loss).
double loss_of(LeiLoss loss, const VecD& f) {
  const double E = double(f.size());
  double sq = 0, sq_err = 0, abs_err = 0;
  for (double v : f) {
    sq += v * v;
    sq_err += (v - 1 / E) * (v - 1 / E);
    abs_err += std::abs(v - 1 / E);
  }
  switch (loss) {
    case LeiLoss::centered_fsq:
      return 1 + E * sq_err;
    case LeiLoss::fsq:
      return E * sq;
    case LeiLoss::maxvio:
      return 1 + (*std::max_element(f.begin(), f.end()) - 1 / E) * E;
    case LeiLoss::totalvio:
      return 1 + E / 2 * abs_err;
  }
  return 0;
}

TEST(Lei, SurrogateGradientMatchesFiniteDifferences) {
  // L~(S) = L(f + f~(S) - f~(S0)) with f~_e = sum_t phi(m_te)/(T k), phi(m) = (1 + tanh(m /
  // w)) / 2, m = s - boundary(S0): the straight-through surrogate, whose gradient at S0 is
  // what the layer injects (loss_scale = 1/T undoes the sum scale). exact_margin's margins are
  // 0 in the windows and +-1e30 outside, where phi is flat. T k / E = 4.8: no f_e is 1/E
  // (totalvio's kink) and the test checks maxvio's maximum is unique.
  Rng rng(12);
  const int64_t E = 5, k = 2, N = 12;
  const double w = 0.8;
  const VecF logits = kernels::test::randn(rng, size_t(N * E));
  for (LeiMargin margin : kMargins)
    for (LeiLoss loss : kLosses) {
      SCOPED_TRACE(::testing::Message() << "margin " << int(margin) << " loss " << int(loss));
      const Layout l = lei_layout(E, k, LeiKernel::tanh, w, margin, loss);
      const Result r = balance_grad(l, logits, 1.0f / float(N));
      const auto& loads = r.cache.loads;
      ASSERT_EQ(
          std::count(loads.begin(), loads.end(), *std::max_element(loads.begin(), loads.end())), 1);
      const VecD m0(r.cache.lei_margin.begin(), r.cache.lei_margin.end());
      const VecD s0(logits.begin(), logits.end());
      auto phi = [&](double m) { return 0.5 * (1.0 + std::tanh(m / w)); };
      VecD s = s0;
      auto surrogate = [&] {
        VecD f(static_cast<size_t>(E));
        for (int64_t e = 0; e < E; ++e) {
          double soft = 0;
          for (int64_t t = 0; t < N; ++t) {
            const size_t i = size_t(t * E + e);
            soft += phi(m0[i] + s[i] - s0[i]) - phi(m0[i]);
          }
          f[size_t(e)] = (double(loads[size_t(e)]) + soft) / double(N * k);
        }
        return loss_of(loss, f);
      };
      EXPECT_NEAR(r.loss, surrogate(), 1e-12);
      const VecD fd = kernels::test::numeric_grad(s, surrogate);
      double scale = 0;
      for (double v : fd) scale = std::max(scale, std::abs(v));
      ASSERT_GT(scale, 0) << "the test needs a nonzero gradient";
      // f32 gradient against the f64 central difference: relative 1e-5 of the largest entry.
      EXPECT_LT(kernels::test::rel_error(r.d_logits, fd), 1e-5);
    }
}

}  // namespace
}  // namespace tessel::moe
