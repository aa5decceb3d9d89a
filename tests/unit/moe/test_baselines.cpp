// The spec's baselines beside aux loss: the sequence-wise aux loss (DeepSeek-V3) and the
// router z-loss (ST-MoE) against values and gradients computed by hand, through the identity
// router (C = E: the inputs are the logits and, with dy = 0, dx is exactly the logit gradient
// of the balancing terms; finite differences of both run in test_layer.cpp, case seq_aux_z);
// Sinkhorn selection against the closed form of a 2 x 2 scaling and its marginals.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "tessel/moe/layer.hpp"
#include "unit/kernels/kernel_test_util.hpp"
#include "unit/moe/moe_test_util.hpp"

namespace tessel::moe {
namespace {

using kernels::test::VecF;
using testing::balance_grad;
using testing::Layout;

Layout identity_layout(Balance balance, double aux, double z) {
  Layout l;
  l.config.experts = 4;
  l.config.top_k = 2;
  l.config.balance = balance;
  l.config.aux_coeff = aux;
  l.config.z_coeff = z;
  l.shape = {4, 3, 0, ExpertMlp::gelu};
  return l;
}

const float ln2 = std::log(2.0f), ln4 = std::log(4.0f);
// Softmax rows p: [1/2, 1/4, 1/8, 1/8] (picks 0, 1), [1/6, 1/6, 1/3, 1/3] (picks 2, 3),
// [1/4, 1/2, 1/8, 1/8] (picks 1, 0).
const VecF kLogits = {ln4, ln2, 0, 0, 0, 0, ln2, ln2, ln2, ln4, 0, 0};
const double kP[3][4] = {
    {0.5, 0.25, 0.125, 0.125}, {1.0 / 6, 1.0 / 6, 1.0 / 3, 1.0 / 3}, {0.25, 0.5, 0.125, 0.125}};

// The logit gradient of a softmax router for dp [4] = N dL/dp: p_e (dp_e - sum_i p_i dp_i).
std::vector<double> through_softmax(const double* p, const double* dp) {
  double dot = 0;
  for (int i = 0; i < 4; ++i) dot += p[i] * dp[i];
  std::vector<double> d(4);
  for (int e = 0; e < 4; ++e) d[size_t(e)] = p[e] * (dp[e] - dot);
  return d;
}

TEST(SeqAux, ValueAndGradientOfTwoSequences) {
  // Sequences {token 0, token 2} and {token 1}, alpha = 0.3, E = 4, k = 2.
  // Sequence 0: loads [2, 2, 0, 0], f = loads / (k T_s) = [1/2, 1/2, 0, 0], P = [3/8, 3/8, ..]:
  // E sum f P = 4 * 3/8 = 3/2. Sequence 1: f = [0, 0, 1/2, 1/2], P = [.., 1/3, 1/3]: 4/3.
  // L = alpha (3/2 + 4/3) / 2 = alpha 17/12. The micro-batch aux of the same tokens differs:
  // f = [2, 2, 1, 1] / 6, P = [11, 11, 7, 7] / 36, alpha E sum f P = alpha 29/27.
  const double alpha = 0.3;
  const std::vector<int32_t> sequence = {0, 1, 0};
  const auto r = balance_grad(identity_layout(Balance::seq_aux, alpha, 0), kLogits, 1.0f, sequence);
  EXPECT_NEAR(r.loss, alpha * 17.0 / 12.0, 1e-6);
  const auto aux = balance_grad(identity_layout(Balance::aux, alpha, 0), kLogits);
  EXPECT_NEAR(aux.loss, alpha * 29.0 / 27.0, 1e-6);
  // N dL/dp[n, e] = alpha E f_{s,e} N / (S T_s), N = 3, S = 2: sequence 0 (T_s = 2)
  // 3/4 * 4 alpha f = [1.5, 1.5, 0, 0] alpha, sequence 1 (T_s = 1) [0, 0, 3, 3] alpha.
  const double a = 1.5 * alpha, b = 3 * alpha;
  const double dp[3][4] = {{a, a, 0, 0}, {0, 0, b, b}, {a, a, 0, 0}};
  for (int n = 0; n < 3; ++n) {
    const std::vector<double> want = through_softmax(kP[n], dp[n]);
    for (int e = 0; e < 4; ++e)
      EXPECT_NEAR(r.d_logits[size_t(n * 4 + e)], want[size_t(e)], 1e-6) << n << " " << e;
  }
}

TEST(SeqAux, OneSequenceIsTheMicroBatchAuxLoss) {
  Rng rng(5);
  const VecF logits = kernels::test::randn(rng, 4 * 9);
  const auto seq = balance_grad(identity_layout(Balance::seq_aux, 0.1, 0), logits, 0.5f);
  const auto aux = balance_grad(identity_layout(Balance::aux, 0.1, 0), logits, 0.5f);
  EXPECT_NEAR(seq.loss, aux.loss, 1e-12);
  EXPECT_GT(aux.loss, 0.0);
  for (size_t i = 0; i < logits.size(); ++i)
    EXPECT_NEAR(seq.d_logits[i], aux.d_logits[i], 1e-7) << i;
}

TEST(ZLoss, ValueAndGradientByHand) {
  // lse of the rows: ln 8, ln 6, ln 8. L = z (ln^2 8 + ln^2 6 + ln^2 8) / 3;
  // N dL/dlogit[n, e] = 2 z lse_n p[n, e].
  const double z = 0.2, lse[3] = {std::log(8.0), std::log(6.0), std::log(8.0)};
  const auto r = balance_grad(identity_layout(Balance::none, 0, z), kLogits);
  EXPECT_NEAR(r.loss, z * (lse[0] * lse[0] + lse[1] * lse[1] + lse[2] * lse[2]) / 3, 1e-6);
  for (int n = 0; n < 3; ++n)
    for (int e = 0; e < 4; ++e)
      EXPECT_NEAR(r.d_logits[size_t(n * 4 + e)], 2 * z * lse[n] * kP[n][e], 1e-6) << n << " " << e;
  // Combined with a balance method, the terms add.
  const std::vector<int32_t> sequence = {0, 1, 0};
  const auto both =
      balance_grad(identity_layout(Balance::seq_aux, 0.3, z), kLogits, 1.0f, sequence);
  EXPECT_NEAR(both.loss, r.loss + 0.3 * 17.0 / 12.0, 1e-6);
}

std::vector<double> no_sum_log_scale(const VecF& logits, int64_t E) {
  return sinkhorn_log_scale(logits.data(), int64_t(logits.size()) / E, E, [](double*, size_t) {});
}

TEST(Sinkhorn, TwoByTwoClosedForm) {
  // Diagonal scaling keeps the cross ratio Q00 Q11 / (Q01 Q10) = K00 K11 / (K01 K10); with all
  // marginals 1/2 that fixes Q00 / Q01 = sqrt(K00 K11 / (K01 K10)) = K00 c0 / (K01 c1), so
  // log c0 - log c1 = (l01 + l11 - l00 - l10) / 2 = (0.2 - 0.3 - 1.0 - 0.5) / 2 = -0.8.
  const std::vector<double> log_c = no_sum_log_scale({1.0f, 0.2f, 0.5f, -0.3f}, 2);
  EXPECT_NEAR(log_c[0] - log_c[1], -0.8, 1e-4);
}

TEST(Sinkhorn, ScaledScoresHaveUniformMarginals) {
  // 30 tokens, 5 experts, expert 0 favoured by every token: Q = diag(r) exp(l) diag(c) with r
  // making rows sum to 1/30 must have columns summing to 1/5 (to the stopping tolerance).
  Rng rng(7);
  const int64_t N = 30, E = 5;
  VecF logits = kernels::test::randn(rng, size_t(N * E));
  for (int64_t n = 0; n < N; ++n) logits[size_t(n * E)] += 2.0f;
  const std::vector<double> log_c = no_sum_log_scale(logits, E);
  std::vector<double> col(size_t(E), 0.0);
  for (int64_t n = 0; n < N; ++n) {
    double row = 0;
    for (int64_t e = 0; e < E; ++e) row += std::exp(logits[size_t(n * E + e)] + log_c[size_t(e)]);
    for (int64_t e = 0; e < E; ++e)
      col[size_t(e)] += std::exp(logits[size_t(n * E + e)] + log_c[size_t(e)]) / (row * double(N));
  }
  for (int64_t e = 0; e < E; ++e) EXPECT_NEAR(col[size_t(e)] * double(E), 1.0, 1e-3) << e;
}

TEST(Sinkhorn, SelectsByScaledScoresAndGatesByTheOriginalOnes) {
  // Top-1, unnormalized gates: each token takes argmax_e logits + log c and its gate is its
  // softmax probability of that expert; the skewed router's loads even out.
  Rng rng(9);
  const int64_t N = 40, E = 4;
  VecF logits = kernels::test::randn(rng, size_t(N * E));
  for (int64_t n = 0; n < N; ++n) logits[size_t(n * E)] += 2.0f;
  Layout l = identity_layout(Balance::sinkhorn, 0, 0);
  l.config.top_k = 1;
  l.config.normalize_gates = false;
  const auto r = balance_grad(l, logits);
  Layout plain = l;
  plain.config.balance = Balance::none;
  const auto p = balance_grad(plain, logits);
  const std::vector<double> log_c = no_sum_log_scale(logits, E);
  for (int64_t n = 0; n < N; ++n) {
    const float* lg = logits.data() + n * E;
    int64_t best = 0;
    for (int64_t e = 1; e < E; ++e)
      if (lg[e] + log_c[size_t(e)] > lg[best] + log_c[size_t(best)]) best = e;
    EXPECT_EQ(r.cache.choice[size_t(n)], best) << n;
    EXPECT_EQ(r.cache.gate[size_t(n)], r.cache.probs[size_t(n * E + best)]) << n;
  }
  EXPECT_EQ(r.loss, 0.0);  // selection only: no loss term
  const auto max_load = [](const LayerCache& c) {
    return *std::max_element(c.loads.begin(), c.loads.end());
  };
  // Sinkhorn evens the column masses, not the hard loads; on these tokens the plain router
  // gives one expert over twice its share, Sinkhorn at most 2 over its share.
  EXPECT_GT(max_load(p.cache), 2 * N / E);
  EXPECT_LE(max_load(r.cache), N / E + 2);
}

}  // namespace
}  // namespace tessel::moe
