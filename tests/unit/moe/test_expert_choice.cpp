// Expert-choice routing (Zhou et al. 2022) on hand-built scores: which tokens each expert
// takes (its top-C of the micro-batch, ties to the lowest token), the gates, the tokens no
// expert takes at the run's, 1.0 and 1.25 capacity factors, and the refused drop policy.
// Sigmoid scores through the identity router (C = E): a column's order is its logits' order,
// and equal logits give bitwise equal scores; the naive twin on these ties. The naive twin on
// random scores and finite differences run in test_layer.cpp (cases expert_choice*).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <set>

#include "support/expect_input_error.hpp"
#include "tessel/moe/layer.hpp"
#include "unit/kernels/kernel_test_util.hpp"
#include "unit/moe/moe_test_util.hpp"

namespace tessel::moe {
namespace {

using kernels::test::VecF;
using testing::balance_grad;
using testing::Layout;

// N = 6 tokens, E = 4, k = 2: capacity ceil(2 * 6 * cf / 4) = 3 at cf 1, 4 at cf 1.25.
const VecF kLogits = {
    // expert 0   1   2   3
    5,  4,  0,  -5,  // token 0
    1,  4,  0,  -5,  // token 1
    1,  4,  2,  -5,  // token 2
    0,  4,  0,  -5,  // token 3
    -1, -2, -3, -5,  // token 4
    3,  -2, 1,  -5,  // token 5
};
constexpr int64_t kN = 6, kE = 4;

Layout ec_layout(double cf) {
  Layout l;
  l.config.experts = kE;
  l.config.top_k = 2;
  l.config.score = ScoreFn::sigmoid;
  l.config.capacity = cf;
  l.config.balance = Balance::expert_choice;
  l.shape = {kE, 3, 0, ExpertMlp::gelu};
  return l;
}

// The tokens expert e took: its slots with a row in the permuted order.
std::set<int64_t> taken(const LayerCache& c, int64_t e) {
  std::set<int64_t> tokens;
  for (int64_t n = 0; n < c.N; ++n)
    if (c.position[size_t(n * kE + e)] >= 0) tokens.insert(n);
  return tokens;
}

TEST(ExpertChoice, EachExpertTakesItsTopCTokensLowestTokenOnTies) {
  // Capacity 0 means cf = 1: C = 3. Column 0: 5 (token 0), 3 (token 5), then 1 twice (tokens
  // 1, 2: token 1). Column 1: four tokens at 4: tokens 0, 1, 2. Column 2: 2 (token 2), 1 (token
  // 5), then 0 three times (tokens 0, 1, 3: token 0). Column 3: all equal: tokens 0, 1, 2.
  for (double cf : {0.0, 1.0}) {
    SCOPED_TRACE("capacity " + std::to_string(cf));
    const auto r = balance_grad(ec_layout(cf), kLogits);
    const LayerCache& c = r.cache;
    EXPECT_EQ(taken(c, 0), (std::set<int64_t>{0, 5, 1}));
    EXPECT_EQ(taken(c, 1), (std::set<int64_t>{0, 1, 2}));
    EXPECT_EQ(taken(c, 2), (std::set<int64_t>{2, 5, 0}));
    EXPECT_EQ(taken(c, 3), (std::set<int64_t>{0, 1, 2}));
    // Every expert takes C tokens: the loads are equal (MaxVio 0); tokens 3 and 4 go nowhere.
    EXPECT_EQ(c.loads, (std::vector<int64_t>{3, 3, 3, 3}));
    EXPECT_EQ(c.counts, c.loads);
    EXPECT_EQ(c.dropped, 2);
    // cf 1.25 (C = 4) adds token 2 to column 0, token 3 to columns 1 and 3, token 1 to column 2:
    // only token 4 stays unserved.
    EXPECT_EQ(c.unserved_cf1, 2);
    EXPECT_EQ(c.unserved_cf1_25, 1);
    // Gates are the scores themselves, for every slot.
    for (int64_t i = 0; i < kN * kE; ++i) {
      EXPECT_EQ(c.choice[size_t(i)], i % kE);
      EXPECT_EQ(c.gate[size_t(i)], 1.0f / (1.0f + std::exp(-kLogits[size_t(i)]))) << i;
    }
    EXPECT_EQ(r.loss, 0.0);  // selection only: no loss term
  }
}

TEST(ExpertChoice, LargerCapacityServesMoreTokensAndAllTakeEveryToken) {
  // cf 1.25: C = 4, as the cf-1.25 count above; cf 2: C = 6 = N, every expert takes all.
  const auto r125 = balance_grad(ec_layout(1.25), kLogits);
  EXPECT_EQ(taken(r125.cache, 0), (std::set<int64_t>{0, 5, 1, 2}));
  EXPECT_EQ(taken(r125.cache, 2), (std::set<int64_t>{2, 5, 0, 1}));
  EXPECT_EQ(r125.cache.dropped, 1);
  const auto r2 = balance_grad(ec_layout(2.0), kLogits);
  EXPECT_EQ(r2.cache.dropped, 0);
  EXPECT_EQ(r2.cache.loads, (std::vector<int64_t>{6, 6, 6, 6}));
  // Any larger factor takes every token too, however large (1e17 once overflowed the capacity
  // to a negative count: every expert took none).
  for (double cf : {2.5, 1e17, 1e300}) {
    const auto big = balance_grad(ec_layout(cf), kLogits);
    EXPECT_EQ(big.cache.dropped, 0) << cf;
    EXPECT_EQ(big.cache.loads, r2.cache.loads) << cf;
  }
}

TEST(ExpertChoice, AnUnservedTokenGetsNoExpertOutput) {
  // Tokens 3 and 4 (cf 1) have no expert: their output is 0 (no shared expert), the others'
  // is not.
  Layout l = ec_layout(1.0);
  std::vector<float> params = testing::random_params(l, 3);
  std::fill(params.begin(), params.begin() + kE * kE, 0.0f);  // the identity router
  for (int64_t e = 0; e < kE; ++e) params[size_t(e * kE + e)] = 1.0f;
  MoeLayer layer(l.config, l.shape);
  LocalExpertComm comm;
  LayerCache c;
  VecF y(kLogits.size());
  const VecF beta(size_t(kE), 0.0f);
  layer.forward(c, y.data(), kLogits.data(), kN, testing::bind<const float>(params.data(), l),
                beta.data(), comm);
  for (int64_t n = 0; n < kN; ++n) {
    bool zero = true;
    for (int64_t i = 0; i < kE; ++i) zero = zero && y[size_t(n * kE + i)] == 0.0f;
    EXPECT_EQ(zero, n == 3 || n == 4) << "token " << n;
  }
}

TEST(ExpertChoice, NaiveTwinBreaksTiesAsTheLayer) {
  // The hand-built scores are full of ties; the twin (f64) must pick the same tokens: equal
  // outputs and gradients, at cf 1 and 1.25 (kFastVsNaive, relative to max |ref|).
  for (double cf : {1.0, 1.25}) {
    SCOPED_TRACE("capacity " + std::to_string(cf));
    const Layout l = ec_layout(cf);
    std::vector<float> params = testing::random_params(l, 3);
    std::fill(params.begin(), params.begin() + kE * kE, 0.0f);  // the identity router
    for (int64_t e = 0; e < kE; ++e) params[size_t(e * kE + e)] = 1.0f;
    Rng rng(5);
    const VecF dy = kernels::test::randn(rng, kLogits.size());
    const VecF beta(size_t(kE), 0.0f);
    MoeLayer layer(l.config, l.shape);
    LocalExpertComm comm;
    LayerCache c;
    BalanceState state;
    VecF y(kLogits.size()), dx(kLogits.size(), 0.0f), grads(params.size(), 0.0f);
    auto g = testing::bind<float>(grads.data(), l);
    const auto w = testing::bind<const float>(params.data(), l);
    layer.forward(c, y.data(), kLogits.data(), kN, w, beta.data(), comm);
    layer.backward(c, dx.data(), g, dy.data(), kLogits.data(), w, 1.0f, state, comm);

    using kernels::test::to_f64;
    const auto pd = to_f64(params), xd = to_f64(kLogits), dyd = to_f64(dy), bd = to_f64(beta);
    kernels::test::VecD yd(xd.size()), dxd(xd.size(), 0.0), gd(pd.size(), 0.0);
    auto gw = testing::bind<double>(gd.data(), l);
    const auto wd = testing::bind<const double>(pd.data(), l);
    naive::moe_forward<double>(yd.data(), xd.data(), kN, wd, bd.data(), l.config, l.shape);
    naive::moe_backward<double>(dxd.data(), gw, dyd.data(), xd.data(), kN, wd, bd.data(), 1.0,
                                l.config, l.shape);
    EXPECT_LT(kernels::test::rel_error(y, yd), kernels::test::kFastVsNaive);
    EXPECT_LT(kernels::test::rel_error(dx, dxd), kernels::test::kFastVsNaive);
    EXPECT_LT(kernels::test::rel_error(grads, gd), kernels::test::kFastVsNaive);
  }
}

TEST(ExpertChoice, DropByPositionIsAnInputError) {
  MoeConfig c = ec_layout(1.0).config;
  c.drop = DropPolicy::position;
  fixture::expect_input_error([&] { validate(c); }, {"expert_choice", "model.moe_drop"});
}

}  // namespace
}  // namespace tessel::moe
