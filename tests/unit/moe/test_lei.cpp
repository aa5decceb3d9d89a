// Load-error injection (spec 3): the worked examples, the sign of the gradient, its
// vanishing when balanced, the identity kernel against the Switch aux loss, and finite
// differences of the straight-through surrogate. The router is the identity (C = E), so the
// logits are the inputs and, with dy = 0, dx is exactly the logit gradient of the
// balancing loss.
#include <gtest/gtest.h>

#include <cmath>

#include "tessel/moe/layer.hpp"
#include "unit/kernels/kernel_test_util.hpp"
#include "unit/moe/moe_test_util.hpp"

namespace tessel::moe {
namespace {

using kernels::test::VecD;
using kernels::test::VecF;
using testing::Layout;

Layout lei_layout(int64_t E, int64_t k, LeiKernel kernel, double width) {
  Layout l;
  l.config.experts = E;
  l.config.top_k = k;
  l.config.balance = Balance::lei;
  l.config.lei_coeff = 1.0;
  l.config.lei_kernel = kernel;
  l.config.lei_width = width;
  l.shape = {E, 3, 0, ExpertMlp::gelu};
  return l;
}

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

TEST(Lei, SurrogateGradientMatchesFiniteDifferences) {
  // L~(S) = 1 + E sum_e (f_e + f~_e(S) - f~_e(S0) - 1/E)^2 with f~_e = sum_t phi(m_te)/(T k),
  // phi(m) = (1 + tanh(m / w)) / 2, m = s - boundary(S0): the straight-through surrogate,
  // whose gradient at S0 is what the layer injects (loss_scale = 1/T undoes the sum scale).
  Rng rng(12);
  const int64_t E = 5, k = 2, N = 12;
  const double w = 0.8;
  const Layout l = lei_layout(E, k, LeiKernel::tanh, w);
  const VecF logits = kernels::test::randn(rng, size_t(N * E));
  const Result r = balance_grad(l, logits, 1.0f / float(N));
  const VecD m0(r.cache.lei_margin.begin(), r.cache.lei_margin.end());
  const VecD s0(logits.begin(), logits.end());
  auto phi = [&](double m) { return 0.5 * (1.0 + std::tanh(m / w)); };
  VecD s = s0;
  auto surrogate = [&] {
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) {
      double soft = 0;
      for (int64_t t = 0; t < N; ++t) {
        const size_t i = size_t(t * E + e);
        soft += phi(m0[i] + s[i] - s0[i]) - phi(m0[i]);
      }
      const double f = double(r.cache.loads[size_t(e)]) / double(N * k) + soft / double(N * k);
      sum += (f - 1.0 / double(E)) * (f - 1.0 / double(E));
    }
    return 1.0 + double(E) * sum;
  };
  const VecD fd = kernels::test::numeric_grad(s, surrogate);
  // f32 gradient against the f64 central difference: relative 1e-5 of the largest entry.
  EXPECT_LT(kernels::test::rel_error(r.d_logits, fd), 1e-5);
}

}  // namespace
}  // namespace tessel::moe
