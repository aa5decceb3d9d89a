#include <gtest/gtest.h>

#include <cmath>

#include "kernel_test_util.hpp"
#include "tessel/kernels/cpu/attention.hpp"

using namespace tessel;
using namespace tessel::kernels;
using namespace tessel::kernels::test;

namespace {

struct Inputs {
  VecF q, k, v;
  explicit Inputs(const AttentionShape& s, uint64_t seed) {
    Rng rng(seed);
    q = randn(rng, s.B * s.T * s.Hq * s.D);
    k = randn(rng, s.B * s.T * s.Hkv * s.D);
    v = randn(rng, s.B * s.T * s.Hkv * s.D);
  }
};

std::string str(const AttentionShape& s) {
  return ::testing::PrintToString(std::vector<int64_t>{s.B, s.T, s.Hq, s.Hkv, s.D});
}

// B in [1, max_b], T in [1, max_t], Hkv in {1, 2, 3}, Hq = Hkv * {1, 2, 3}, D even in
// [2, max_d].
AttentionShape random_shape(Rng& rng, int64_t max_b, int64_t max_t, int64_t max_d) {
  const int64_t B = uniform_int(rng, 1, max_b), T = uniform_int(rng, 1, max_t);
  const int64_t Hkv = uniform_int(rng, 1, 3), Hq = Hkv * uniform_int(rng, 1, 3);
  return {B, T, Hq, Hkv, 2 * uniform_int(rng, 1, max_d / 2)};
}

}  // namespace

// B, T, Hq, Hkv, D: odd lengths, T = 1, grouped (Hq = 4, Hkv = 2; Hq = 6, Hkv = 1) and plain
// heads, and T = 150: several query blocks of the fast kernel, the last one partial; then
// random ones with B, T <= 40 and D <= 16.
TEST(CausalAttention, FastMatchesNaive) {
  for (const AttentionShape& s :
       with_random({{1, 1, 2, 2, 4},
                    {2, 13, 4, 2, 8},
                    {1, 7, 3, 3, 5},
                    {2, 33, 6, 1, 16},
                    {3, 64, 4, 4, 64},
                    {1, 150, 2, 1, 8}},
                   [](Rng& rng) { return random_shape(rng, 40, 40, 16); })) {
    SCOPED_TRACE(str(s));
    Inputs in(s, 1);
    Rng rng(2);
    const size_t nq = in.q.size(), nkv = in.k.size();
    VecF dout = randn(rng, nq), dq0 = randn(rng, nq), dk0 = randn(rng, nkv), dv0 = randn(rng, nkv);
    VecD qd = to_f64(in.q), kd = to_f64(in.k), vd = to_f64(in.v), doutd = to_f64(dout);
    VecF o(nq), lse(s.B * s.Hq * s.T);
    VecD od(nq), lsed(lse.size());
    causal_attention_forward(o.data(), lse.data(), in.q.data(), in.k.data(), in.v.data(), s);
    naive::causal_attention_forward(od.data(), lsed.data(), qd.data(), kd.data(), vd.data(), s);
    EXPECT_LT(rel_error(o, od), kFastVsNaive);
    EXPECT_LT(rel_error(lse, lsed), kFastVsNaive);

    VecF dq = dq0, dk = dk0, dv = dv0;
    VecD dqd = to_f64(dq0), dkd = to_f64(dk0), dvd = to_f64(dv0);
    causal_attention_backward(dq.data(), dk.data(), dv.data(), dout.data(), in.q.data(),
                              in.k.data(), in.v.data(), o.data(), lse.data(), s);
    naive::causal_attention_backward(dqd.data(), dkd.data(), dvd.data(), doutd.data(), qd.data(),
                                     kd.data(), vd.data(), od.data(), lsed.data(), s);
    // With T = 1 (one key) dq and dk are exactly 0 while f32 leaves rounding noise of the
    // O(1) terms dp - delta: relative to max(|ref|, 1), i.e. absolute there.
    EXPECT_LT(rel_error(added(dq, dq0), added(dqd, to_f64(dq0)), 1.0), kFastVsNaive);
    EXPECT_LT(rel_error(added(dk, dk0), added(dkd, to_f64(dk0)), 1.0), kFastVsNaive);
    EXPECT_LT(rel_error(added(dv, dv0), added(dvd, to_f64(dv0))), kFastVsNaive);
  }
}

// Then random shapes with B <= 3, T <= 8, D <= 8: differences in every coordinate stay cheap.
TEST(CausalAttention, NaiveBackwardMatchesFiniteDifferences) {
  for (const AttentionShape& s : with_random({{2, 5, 4, 2, 3}, {1, 4, 2, 2, 4}},
                                             [](Rng& rng) { return random_shape(rng, 3, 8, 8); })) {
    SCOPED_TRACE(str(s));
    Inputs in(s, 3);
    VecD q = to_f64(in.q), k = to_f64(in.k), v = to_f64(in.v);
    Rng rng(4);
    const VecD r = to_f64(randn(rng, q.size()));
    VecD o(q.size()), lse(s.B * s.Hq * s.T);
    const auto loss = [&] {
      naive::causal_attention_forward(o.data(), lse.data(), q.data(), k.data(), v.data(), s);
      return dot(r, o);
    };
    loss();
    VecD dq(q.size(), 0.0), dk(k.size(), 0.0), dv(v.size(), 0.0);
    naive::causal_attention_backward(dq.data(), dk.data(), dv.data(), r.data(), q.data(), k.data(),
                                     v.data(), o.data(), lse.data(), s);
    EXPECT_LT(rel_error(dq, numeric_grad(q, loss)), kFiniteDiff);
    EXPECT_LT(rel_error(dk, numeric_grad(k, loss)), kFiniteDiff);
    EXPECT_LT(rel_error(dv, numeric_grad(v, loss)), kFiniteDiff);
  }
}

// The last query row sees every key, so it is plain (non-causal) softmax attention,
// computed here directly in f64.
TEST(CausalAttention, LastRowIsFullSoftmaxAttention) {
  const AttentionShape s{2, 9, 4, 2, 8};
  Inputs in(s, 5);
  VecF o(in.q.size()), lse(s.B * s.Hq * s.T);
  causal_attention_forward(o.data(), lse.data(), in.q.data(), in.k.data(), in.v.data(), s);
  const int64_t i = s.T - 1;
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.Hq; ++h) {
      const int64_t g = h / (s.Hq / s.Hkv);
      VecD w(s.T);
      double sum = 0;
      for (int64_t j = 0; j < s.T; ++j) {
        double sc = 0;
        for (int64_t d = 0; d < s.D; ++d)
          sc += double(in.q[((b * s.T + i) * s.Hq + h) * s.D + d]) *
                in.k[((b * s.T + j) * s.Hkv + g) * s.D + d];
        sum += w[j] = std::exp(sc / std::sqrt(double(s.D)));
      }
      VecF got(s.D);
      VecD want(s.D, 0.0);
      for (int64_t d = 0; d < s.D; ++d) {
        got[d] = o[((b * s.T + i) * s.Hq + h) * s.D + d];
        for (int64_t j = 0; j < s.T; ++j)
          want[d] += w[j] / sum * in.v[((b * s.T + j) * s.Hkv + g) * s.D + d];
      }
      EXPECT_LT(rel_error(got, want), kFastVsNaive);
      EXPECT_NEAR(lse[(b * s.Hq + h) * s.T + i], std::log(sum),
                  1e-5 * std::abs(std::log(sum)) + 1e-6);
    }
}

TEST(CausalAttention, SingleTokenReturnsItsValue) {
  const AttentionShape s{3, 1, 4, 2, 5};
  Inputs in(s, 6);
  VecF o(in.q.size()), lse(s.B * s.Hq);
  causal_attention_forward(o.data(), lse.data(), in.q.data(), in.k.data(), in.v.data(), s);
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.Hq; ++h)
      for (int64_t d = 0; d < s.D; ++d)  // one key: probability exactly 1
        EXPECT_EQ(o[(b * s.Hq + h) * s.D + d], in.v[(b * s.Hkv + h / 2) * s.D + d]);
}

TEST(CausalAttention, BackwardIsDeterministic) {
  const AttentionShape s{2, 100, 4, 2, 32};
  Inputs in(s, 7);
  Rng rng(8);
  VecF dout = randn(rng, in.q.size());
  VecF o(in.q.size()), lse(s.B * s.Hq * s.T);
  causal_attention_forward(o.data(), lse.data(), in.q.data(), in.k.data(), in.v.data(), s);
  VecF dq[2], dk[2], dv[2];
  for (int run = 0; run < 2; ++run) {
    dq[run].assign(in.q.size(), 0.0f);
    dk[run].assign(in.k.size(), 0.0f);
    dv[run].assign(in.v.size(), 0.0f);
    causal_attention_backward(dq[run].data(), dk[run].data(), dv[run].data(), dout.data(),
                              in.q.data(), in.k.data(), in.v.data(), o.data(), lse.data(), s);
  }
  EXPECT_TRUE(bitwise_equal(dq[0], dq[1]));
  EXPECT_TRUE(bitwise_equal(dk[0], dk[1]));
  EXPECT_TRUE(bitwise_equal(dv[0], dv[1]));
}
