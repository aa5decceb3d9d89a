#include <gtest/gtest.h>

#include <cmath>

#include "support/expect_input_error.hpp"
#include "tessel/attention/flash_attention.hpp"
#include "tessel/core/bf16.hpp"
#include "tessel/core/threading.hpp"
#include "tessel/kernels/cpu/attention.hpp"
#include "unit/attention/attention_test_util.hpp"

namespace tessel::attention {
namespace {

using kernels::test::kFastVsNaive;
using kernels::test::randn;
using kernels::test::rel_error;
using kernels::test::to_f64;
using kernels::test::VecD;
using kernels::test::VecF;
using test::lse_error;

// Spec tolerance: max error <= 1e-5 * max |reference| in f32.
constexpr double kTol = 1e-5;

struct Problem {
  AttentionShape s;
  VecF q, k, v, dout;
};

Problem random_problem(const AttentionShape& s, uint64_t seed) {
  Rng rng(seed);
  return {s, randn(rng, size_t(s.B * s.Sq * s.Hq * s.D)),
          randn(rng, size_t(s.B * s.Sk * s.Hk * s.D)), randn(rng, size_t(s.B * s.Sk * s.Hk * s.D)),
          randn(rng, size_t(s.B * s.Sq * s.Hq * s.D))};
}

// The dense f64 reference's O, LSE, dQ, dK, dV.
struct Reference {
  VecD o, lse, dq, dk, dv;
};

Reference reference(const Problem& p, const ColumnMask& mask, const BlockMask* block = nullptr) {
  const AttentionShape& s = p.s;
  const size_t nq = p.q.size(), nk = p.k.size(), nl = size_t(s.B * s.Hq * s.Sq);
  const VecD q = to_f64(p.q), k = to_f64(p.k), v = to_f64(p.v), g = to_f64(p.dout);
  Reference r{VecD(nq), VecD(nl), VecD(nq), VecD(nk), VecD(nk)};
  naive::masked_attention_forward(r.o.data(), r.lse.data(), q.data(), k.data(), v.data(), s, mask,
                                  block);
  naive::masked_attention_backward(r.dq.data(), r.dk.data(), r.dv.data(), g.data(), q.data(),
                                   k.data(), v.data(), r.o.data(), r.lse.data(), s, mask, block);
  return r;
}

// Runs the fast kernel (f32) and compares O, LSE, dQ, dK, dV with `ref` (of the same problem,
// mask and block mask).
void expect_matches(const Problem& p, const Reference& ref, const ColumnMask& mask,
                    const FlashOptions& opt = {}, int64_t tile_k = TiledMask::kDefaultTileK,
                    const BlockMask* block = nullptr) {
  const AttentionShape& s = p.s;
  const TiledMask tm(mask, tile_k);
  const size_t nq = p.q.size(), nk = p.k.size(), nl = size_t(s.B * s.Hq * s.Sq);
  VecF o(nq), lse(nl), dq(nq), dk(nk), dv(nk);
  flash_attention_forward(o.data(), lse.data(), p.q.data(), p.k.data(), p.v.data(), s, tm, opt,
                          block);
  flash_attention_backward(dq.data(), dk.data(), dv.data(), p.dout.data(), p.q.data(), p.k.data(),
                           p.v.data(), o.data(), lse.data(), s, tm, opt, block);
  // An all-zero reference (every row masked) compares absolutely.
  EXPECT_LT(rel_error(o, ref.o, 1.0), kTol);
  EXPECT_LT(lse_error(lse, ref.lse), kTol);
  EXPECT_LT(rel_error(dq, ref.dq, 1.0), kTol);
  EXPECT_LT(rel_error(dk, ref.dk, 1.0), kTol);
  EXPECT_LT(rel_error(dv, ref.dv, 1.0), kTol);
  for (float x : o) ASSERT_FALSE(std::isnan(x));
  for (float x : dq) ASSERT_FALSE(std::isnan(x));
}

void expect_matches_reference(const Problem& p, const ColumnMask& mask,
                              const FlashOptions& opt = {},
                              int64_t tile_k = TiledMask::kDefaultTileK,
                              const BlockMask* block = nullptr) {
  expect_matches(p, reference(p, mask, block), mask, opt, tile_k, block);
}

// All eleven masks at the spec's lengths; batch 2 with a different mask per row, GQA.
TEST(FlashAttention, MatchesReferenceForEveryMaskType) {
  Rng rng(3);
  for (int64_t N : {1, 127, 128, 1000}) {
    const auto row0 = test::standard_masks(N, rng), row1 = test::standard_masks(N, rng);
    for (size_t t = 0; t < row0.size(); ++t) {
      SCOPED_TRACE(row0[t].name + " N=" + std::to_string(N));
      const AttentionShape s{2, N, N, 4, 2, 16};
      expect_matches_reference(random_problem(s, 100 + t),
                               stack_masks(N, N, 2, 1, {row0[t].columns, row1[t].columns}));
    }
  }
}

TEST(FlashAttention, MatchesReferenceAtLength4096) {
  Rng rng(4);
  for (const auto& c : test::standard_masks(4096, rng)) {
    SCOPED_TRACE(c.name);
    expect_matches_reference(random_problem({1, 4096, 4096, 1, 1, 8}, 5),
                             stack_masks(4096, 4096, 1, 1, {c.columns}));
  }
}

// One mask per query head (Hm = Hq) and per kv head (Hm = Hk).
TEST(FlashAttention, PerHeadMasks) {
  Rng rng(5);
  const int64_t N = 200;
  std::vector<MaskColumns> per_q, per_kv;
  for (int h = 0; h < 4; ++h) per_q.push_back(test::standard_masks(N, rng)[2 + h].columns);
  expect_matches_reference(random_problem({1, N, N, 4, 2, 16}, 6),
                           stack_masks(N, N, 1, 4, {per_q[0], per_q[0], per_q[0], per_q[0]}));
  // Mixed forms need one form per mask: use random 4-vector masks per head.
  for (int h = 0; h < 4; ++h) per_q[size_t(h)] = test::random_mask(rng, N, N, false);
  expect_matches_reference(random_problem({1, N, N, 4, 2, 16}, 7), stack_masks(N, N, 1, 4, per_q));
  for (int h = 0; h < 2; ++h) per_kv.push_back(test::random_mask(rng, N, N, true));
  expect_matches_reference(random_problem({1, N, N, 4, 2, 16}, 8), stack_masks(N, N, 1, 2, per_kv));
}

// Sq != Sk (bottom-right causal), random masks, odd tile sizes and head dims.
TEST(FlashAttention, UnequalLengthsAndRandomMasks) {
  Rng rng(9);
  for (auto [Sq, Sk] : {std::pair<int64_t, int64_t>{100, 300}, {300, 100}, {1, 77}, {77, 1}}) {
    SCOPED_TRACE("Sq=" + std::to_string(Sq) + " Sk=" + std::to_string(Sk));
    expect_matches_reference(random_problem({1, Sq, Sk, 2, 1, 24}, 10),
                             stack_masks(Sq, Sk, 1, 1, {causal_mask(Sq, Sk)}));
    expect_matches_reference(random_problem({1, Sq, Sk, 2, 2, 8}, 11),
                             stack_masks(Sq, Sk, 1, 1, {sliding_window_mask(Sq, Sk, 17)}));
    expect_matches_reference(
        random_problem({2, Sq, Sk, 3, 1, 5}, 12),
        stack_masks(Sq, Sk, 2, 1,
                    {test::random_mask(rng, Sq, Sk, false), test::random_mask(rng, Sq, Sk, false)}),
        {.tile_q = 37}, 29);
    expect_matches_reference(random_problem({1, Sq, Sk, 2, 1, 8}, 13),
                             stack_masks(Sq, Sk, 1, 1, {test::random_mask(rng, Sq, Sk, true)}),
                             {.tile_q = 16}, 600);
  }
}

// Without skipping, fully masked tiles go through the element-wise mask: same results.
TEST(FlashAttention, SkippingDisabledGivesTheSameResult) {
  Rng rng(14);
  const int64_t N = 300;
  expect_matches_reference(random_problem({1, N, N, 2, 2, 16}, 15),
                           stack_masks(N, N, 1, 1, {test::standard_masks(N, rng)[2].columns}),
                           {.skip_tiles = false});
}

// Rows that see no key: O = 0, LSE = -inf, zero gradients, no NaN.
TEST(FlashAttention, FullyMaskedRowsGiveZeros) {
  const int64_t N = 100;
  // Non-causal, every column masks rows [10, 70): those rows see nothing.
  const ColumnMask mask =
      stack_masks(N, N, 1, 1, {MaskColumns{false, 4, [&] {
                                             std::vector<int32_t> v;
                                             for (int64_t j = 0; j < N; ++j)
                                               v.insert(v.end(), {10, 70, 0, 0});
                                             return v;
                                           }()}});
  const Problem p = random_problem({1, N, N, 1, 1, 8}, 16);
  expect_matches_reference(p, mask);
  FlashForward f = flash_attention_forward(Tensor({1, N, 1, 8}), Tensor({1, N, 1, 8}),
                                           Tensor({1, N, 1, 8}), TiledMask(mask));
  for (int64_t i = 10; i < 70; ++i) {
    EXPECT_EQ(f.lse.f32()[i], -INFINITY);
    for (int d = 0; d < 8; ++d) EXPECT_EQ(f.o.f32()[i * 8 + d], 0.0f);
  }
  Tensor dout({1, N, 1, 8});
  for (int64_t i = 0; i < dout.numel(); ++i) dout.f32()[i] = 1.0f;
  const FlashGradients g = flash_attention_backward(
      dout, Tensor({1, N, 1, 8}), Tensor({1, N, 1, 8}), Tensor({1, N, 1, 8}), f, TiledMask(mask));
  for (int64_t i = 10 * 8; i < 70 * 8; ++i) EXPECT_EQ(g.dq.f32()[i], 0.0f);
}

// NaN in, NaN out: a head whose queries are NaN has only NaN scores, which the running max
// passes over; the kernel once took such rows for fully masked ones and gave zeros (a finite
// loss from NaN weights). Like the naive twin, every output, LSE and query gradient of that head
// is NaN, and the other head matches the reference.
TEST(FlashAttention, NanScoresGiveNanNotZeros) {
  const AttentionShape s{1, 80, 80, 2, 2, 8};
  Problem p = random_problem(s, 21);
  auto head = [&](int64_t i, int64_t h) { return size_t((i * s.Hq + h) * s.D); };
  for (int64_t i = 0; i < s.Sq; ++i) std::fill_n(p.q.begin() + long(head(i, 0)), s.D, NAN);
  const ColumnMask mask = ColumnMask::causal_only(1, s.Sq, s.Sk);
  const Reference ref = reference(p, mask);
  const TiledMask tm(mask);
  VecF o(p.q.size()), lse(size_t(s.Hq * s.Sq)), dq(p.q.size()), dk(p.k.size()), dv(p.k.size());
  flash_attention_forward(o.data(), lse.data(), p.q.data(), p.k.data(), p.v.data(), s, tm);
  flash_attention_backward(dq.data(), dk.data(), dv.data(), p.dout.data(), p.q.data(), p.k.data(),
                           p.v.data(), o.data(), lse.data(), s, tm);
  double err = 0, scale = 0;
  for (int64_t i = 0; i < s.Sq; ++i) {
    EXPECT_TRUE(std::isnan(ref.lse[size_t(i)]) && std::isnan(lse[size_t(i)])) << i;
    EXPECT_FALSE(std::isnan(lse[size_t(s.Sq + i)])) << i;  // head 1
    for (int64_t d = 0; d < s.D; ++d) {
      const size_t nan_at = head(i, 0) + size_t(d), fine_at = head(i, 1) + size_t(d);
      EXPECT_TRUE(std::isnan(ref.o[nan_at]) && std::isnan(o[nan_at])) << i;
      EXPECT_TRUE(std::isnan(dq[nan_at])) << i;
      err = std::max(err, std::abs(double(o[fine_at]) - ref.o[fine_at]));
      scale = std::max(scale, std::abs(ref.o[fine_at]));
    }
  }
  EXPECT_LT(err, kTol * scale);
}

// The #2 causal kernel is the causal twin: same results under the causal mask.
TEST(FlashAttention, CausalEqualsPlainCausalKernel) {
  const AttentionShape s{2, 190, 190, 4, 2, 32};
  const Problem p = random_problem(s, 17);
  const TiledMask tm(ColumnMask::causal_only(2, 190, 190));
  VecF o(p.q.size()), lse(size_t(2 * 4 * 190)), o2 = o, lse2 = lse;
  flash_attention_forward(o.data(), lse.data(), p.q.data(), p.k.data(), p.v.data(), s, tm);
  kernels::causal_attention_forward(o2.data(), lse2.data(), p.q.data(), p.k.data(), p.v.data(),
                                    {2, 190, 4, 2, 32});
  EXPECT_LT(rel_error(o, to_f64(o2)), kFastVsNaive);
  EXPECT_LT(rel_error(lse, to_f64(lse2)), kFastVsNaive);
}

// The f64 reference backward agrees with central differences of its forward.
TEST(FlashAttention, ReferenceBackwardMatchesFiniteDifferences) {
  const AttentionShape s{1, 9, 11, 2, 1, 3};
  Rng rng(18);
  const ColumnMask mask = stack_masks(9, 11, 1, 1, {test::random_mask(rng, 9, 11, true)});
  const Problem p = random_problem(s, 19);
  VecD q = to_f64(p.q), k = to_f64(p.k), v = to_f64(p.v), g = to_f64(p.dout);
  const auto loss = [&] {
    VecD o(q.size()), l(size_t(2 * 9));
    naive::masked_attention_forward(o.data(), l.data(), q.data(), k.data(), v.data(), s, mask);
    return kernels::test::dot(o, g);
  };
  VecD o(q.size()), l(size_t(2 * 9)), dq(q.size()), dk(k.size()), dv(v.size());
  naive::masked_attention_forward(o.data(), l.data(), q.data(), k.data(), v.data(), s, mask);
  naive::masked_attention_backward(dq.data(), dk.data(), dv.data(), g.data(), q.data(), k.data(),
                                   v.data(), o.data(), l.data(), s, mask);
  EXPECT_LT(rel_error(dq, kernels::test::numeric_grad(q, loss)), kernels::test::kFiniteDiff);
  EXPECT_LT(rel_error(dk, kernels::test::numeric_grad(k, loss)), kernels::test::kFiniteDiff);
  EXPECT_LT(rel_error(dv, kernels::test::numeric_grad(v, loss)), kernels::test::kFiniteDiff);
}

// Bitwise the same results on repeated runs and with 1 or 2 threads.
TEST(FlashAttention, DeterministicAcrossRunsAndThreadCounts) {
  Rng rng(20);
  const int64_t N = 333;
  const AttentionShape s{2, N, N, 4, 2, 16};
  const Problem p = random_problem(s, 21);
  const auto masks = test::standard_masks(N, rng);
  // Causal document and share-question rows (both causal, V = 1).
  const TiledMask tm(stack_masks(N, N, 2, 1, {masks[2].columns, masks[4].columns}));
  const auto run = [&](int threads) {
    set_num_threads(threads);
    VecF o(p.q.size()), lse(size_t(2 * 4 * N)), dq(p.q.size()), dk(p.k.size()), dv(p.k.size());
    flash_attention_forward(o.data(), lse.data(), p.q.data(), p.k.data(), p.v.data(), s, tm);
    flash_attention_backward(dq.data(), dk.data(), dv.data(), p.dout.data(), p.q.data(), p.k.data(),
                             p.v.data(), o.data(), lse.data(), s, tm);
    o.insert(o.end(), dq.begin(), dq.end());
    o.insert(o.end(), dk.begin(), dk.end());
    o.insert(o.end(), dv.begin(), dv.end());
    return o;
  };
  const int saved = num_threads();
  const VecF a = run(2), b = run(2), c = run(1);
  set_num_threads(saved);
  EXPECT_TRUE(kernels::test::bitwise_equal(a, b));
  EXPECT_TRUE(kernels::test::bitwise_equal(a, c));
}

// Batch 1 with one kv head (the context-parallel shape) and GQA 4:1: the backward's key chunks
// (8 of 128 columns) give the same bits on 1, 2 and 3 threads under every standard mask.
TEST(FlashAttention, ChunkedBackwardBitwiseAcrossThreadCounts) {
  Rng rng(24);
  const int64_t N = 1000;
  const FlashOptions opt{.tile_q = 64, .run_cols = 128};
  const int saved = num_threads();
  for (const auto& c : test::standard_masks(N, rng))
    for (int64_t Hq : {1, 4}) {
      SCOPED_TRACE(c.name + " Hq=" + std::to_string(Hq));
      const AttentionShape s{1, N, N, Hq, 1, 16};
      const Problem p = random_problem(s, 25);
      const TiledMask tm(stack_masks(N, N, 1, 1, {c.columns}));
      VecF o(p.q.size()), lse(size_t(Hq * N));
      flash_attention_forward(o.data(), lse.data(), p.q.data(), p.k.data(), p.v.data(), s, tm, opt);
      const auto backward = [&](int threads) {
        set_num_threads(threads);
        VecF dq(p.q.size()), dk(p.k.size()), dv(p.k.size());
        flash_attention_backward(dq.data(), dk.data(), dv.data(), p.dout.data(), p.q.data(),
                                 p.k.data(), p.v.data(), o.data(), lse.data(), s, tm, opt);
        dq.insert(dq.end(), dk.begin(), dk.end());
        dq.insert(dq.end(), dv.begin(), dv.end());
        return dq;
      };
      const VecF one = backward(1);
      EXPECT_TRUE(kernels::test::bitwise_equal(one, backward(2)));
      EXPECT_TRUE(kernels::test::bitwise_equal(one, backward(3)));
    }
  set_num_threads(saved);
  // The masks above skip tiles: chunks meet query tiles they do not visit.
  EXPECT_GT(count_tiles(TiledMask(ColumnMask::causal_only(1, N, N)), 1, 1, 64).skipped, 0);
}

// The same shapes against the reference on 3 threads, with many key chunks: every standard
// mask, the default options (3 chunks) and Sq != Sk.
TEST(FlashAttention, ChunkedBackwardMatchesReference) {
  Rng rng(26);
  const int64_t N = 1500;
  const int saved = num_threads();
  set_num_threads(3);
  for (const auto& c : test::standard_masks(N, rng)) {
    SCOPED_TRACE(c.name);
    expect_matches_reference(random_problem({1, N, N, 4, 1, 16}, 27),
                             stack_masks(N, N, 1, 1, {c.columns}), {.tile_q = 64, .run_cols = 128});
  }
  expect_matches_reference(random_problem({1, N, N, 2, 1, 16}, 28),
                           stack_masks(N, N, 1, 1, {causal_mask(N, N)}));
  for (auto [Sq, Sk] : {std::pair<int64_t, int64_t>{300, 1000}, {1000, 300}}) {
    SCOPED_TRACE("Sq=" + std::to_string(Sq) + " Sk=" + std::to_string(Sk));
    expect_matches_reference(random_problem({1, Sq, Sk, 2, 1, 8}, 29),
                             stack_masks(Sq, Sk, 1, 1, {sliding_window_mask(Sq, Sk, 200)}),
                             {.tile_q = 48, .run_cols = 64}, 32);
  }
  set_num_threads(saved);
}

// bf16 inputs (spec "Accuracy": O, LSE, dQ, dK, dV within 2 x the error of a naive bf16
// implementation + 1e-3): the naive f32 kernel on the same bf16-rounded inputs, dO included,
// against the f64 reference on the exact inputs, for O and each gradient.
TEST(FlashAttention, AcceptsBf16Inputs) {
  Rng rng(22);
  const int64_t N = 150;
  const AttentionShape s{1, N, N, 2, 1, 16};
  const Problem p = random_problem(s, 23);
  const ColumnMask mask = stack_masks(N, N, 1, 1, {test::standard_masks(N, rng)[2].columns});
  const auto tensor = [](const VecF& x, Shape shape, DType dt) {
    Tensor t(shape);
    std::copy(x.begin(), x.end(), t.f32());
    return t.to(dt);
  };
  const Tensor q = tensor(p.q, {1, N, 2, 16}, DType::bf16);
  const Tensor k = tensor(p.k, {1, N, 1, 16}, DType::bf16);
  const Tensor v = tensor(p.v, {1, N, 1, 16}, DType::bf16);
  const Tensor dout = tensor(p.dout, {1, N, 2, 16}, DType::bf16);
  const TiledMask tm(mask);
  const FlashForward f = flash_attention_forward(q, k, v, tm);
  const FlashGradients fg = flash_attention_backward(dout, q, k, v, f, tm);
  const Tensor q32 = q.to(DType::f32), k32 = k.to(DType::f32), v32 = v.to(DType::f32),
               do32 = dout.to(DType::f32);
  const size_t nq = p.q.size(), nk = p.k.size();
  VecF no(nq), nl(size_t(2 * N)), ndq(nq, 0.0f), ndk(nk, 0.0f), ndv(nk, 0.0f);
  naive::masked_attention_forward(no.data(), nl.data(), q32.f32(), k32.f32(), v32.f32(), s, mask);
  naive::masked_attention_backward(ndq.data(), ndk.data(), ndv.data(), do32.f32(), q32.f32(),
                                   k32.f32(), v32.f32(), no.data(), nl.data(), s, mask);
  const Reference ref = reference(p, mask);
  const auto values = [](const Tensor& t) { return VecF(t.f32(), t.f32() + t.numel()); };
  const struct {
    const char* name;
    VecF fast, naive;
    const VecD& ref;
  } outputs[] = {{"O", values(f.o), no, ref.o},
                 {"dQ", values(fg.dq), ndq, ref.dq},
                 {"dK", values(fg.dk), ndk, ref.dk},
                 {"dV", values(fg.dv), ndv, ref.dv}};
  for (const auto& out : outputs) {
    SCOPED_TRACE(out.name);
    EXPECT_LE(rel_error(out.fast, out.ref), 2 * rel_error(out.naive, out.ref) + 1e-3);
    EXPECT_GT(rel_error(out.fast, out.ref), 1e-4);  // the inputs really were rounded
  }
}

// Random block masks (25-75 % of blocks on) ANDed with causal, sliding-window, causal-document
// and a non-causal V = 4 mask (global + sliding window); one block mask for all heads and one
// per query head; default tiles (128 x 64: a key tile is half a block), odd tiles that straddle
// block borders, and tiles spanning several blocks; the 1000-row case also with skipping off.
TEST(FlashAttention, BlockMaskMatchesReference) {
  Rng rng(30);
  const int64_t H = 4;
  for (int64_t N : {1, 127, 128, 300, 1000}) {
    const auto cases = test::standard_masks(N, rng);
    for (size_t t : {0, 1, 2, 5}) {
      for (int64_t Hm : {int64_t(1), H}) {
        SCOPED_TRACE(cases[t].name + " N=" + std::to_string(N) + " Hm=" + std::to_string(Hm));
        const AttentionShape s{2, N, N, H, 2, 8};
        const ColumnMask mask = stack_masks(N, N, 2, 1, {cases[t].columns, cases[t].columns});
        const BlockMask block = test::random_block_mask(rng, 2, Hm, N, N, 25 + 25 * (t % 3));
        const Problem p = random_problem(s, 31 + t);
        const Reference ref = reference(p, mask, &block);  // one per problem, for every tiling
        expect_matches(p, ref, mask, {}, TiledMask::kDefaultTileK, &block);
        expect_matches(p, ref, mask, {.tile_q = 37, .run_cols = 100}, 29, &block);
        expect_matches(p, ref, mask, {.tile_q = 300, .run_cols = 600}, 300, &block);
        if (N == 1000) expect_matches(p, ref, mask, {.skip_tiles = false}, 64, &block);
      }
    }
  }
}

// Every standard mask under a random block mask (50 % on, one per kv head: Hm = Hk), default
// tiles.
TEST(FlashAttention, BlockMaskWithEveryMaskType) {
  Rng rng(41);
  const int64_t N = 300;
  for (const auto& c : test::standard_masks(N, rng)) {
    SCOPED_TRACE(c.name);
    const BlockMask block = test::random_block_mask(rng, 1, 2, N, N, 50);
    expect_matches_reference(random_problem({1, N, N, 4, 2, 8}, 42),
                             stack_masks(N, N, 1, 1, {c.columns}), {}, TiledMask::kDefaultTileK,
                             &block);
  }
}

// Sq != Sk (bottom-right causal) with a block mask [B, Hm, ceil(Sq / 128), ceil(Sk / 128)].
TEST(FlashAttention, BlockMaskWithUnequalLengths) {
  Rng rng(32);
  for (auto [Sq, Sk] :
       {std::pair<int64_t, int64_t>{300, 1000}, {1000, 300}, {127, 129}, {1, 300}}) {
    SCOPED_TRACE("Sq=" + std::to_string(Sq) + " Sk=" + std::to_string(Sk));
    const BlockMask per_head = test::random_block_mask(rng, 1, 2, Sq, Sk, 50);
    expect_matches_reference(random_problem({1, Sq, Sk, 4, 2, 8}, 33),
                             stack_masks(Sq, Sk, 1, 1, {causal_mask(Sq, Sk)}), {}, 64, &per_head);
    const BlockMask shared = test::random_block_mask(rng, 1, 1, Sq, Sk, 50);
    expect_matches_reference(random_problem({1, Sq, Sk, 2, 1, 8}, 34),
                             stack_masks(Sq, Sk, 1, 1, {test::random_mask(rng, Sq, Sk, false)}),
                             {.tile_q = 48, .run_cols = 64}, 32, &shared);
  }
}

// Rows whose every visible key lies in off blocks: O = 0, LSE = -inf, zero gradients, no NaN;
// the column mask alone masks none of them. With 128-row query tiles the off block row is
// skipped; 100-row tiles straddle it, so its rows go through the element-wise block mask.
TEST(FlashAttention, RowsMaskedOnlyByBlocksGiveZeros) {
  const int64_t N = 300, D = 8;
  // Causal; block row 1 (rows 128-255) off everywhere, the rest on.
  std::vector<uint8_t> on(9, 1);
  for (int bc = 0; bc < 3; ++bc) on[size_t(3 + bc)] = 0;
  const BlockMask block(1, 1, N, N, on);
  const ColumnMask mask = ColumnMask::causal_only(1, N, N);
  const Problem p = random_problem({1, N, N, 1, 1, D}, 35);
  const AttentionShape s{1, N, N, 1, 1, D};
  const TiledMask tm(mask);
  const Reference ref = reference(p, mask, &block);
  for (const FlashOptions& opt : {FlashOptions{}, FlashOptions{.tile_q = 100}}) {
    SCOPED_TRACE("tile_q=" + std::to_string(opt.tile_q));
    expect_matches(p, ref, mask, opt, 64, &block);
    VecF o(p.q.size()), lse(static_cast<size_t>(N)), dq(p.q.size()), dk(p.k.size()), dv(p.k.size());
    flash_attention_forward(o.data(), lse.data(), p.q.data(), p.k.data(), p.v.data(), s, tm, opt,
                            &block);
    flash_attention_backward(dq.data(), dk.data(), dv.data(), p.dout.data(), p.q.data(), p.k.data(),
                             p.v.data(), o.data(), lse.data(), s, tm, opt, &block);
    for (int64_t i = 0; i < N; ++i) {
      const bool masked = i >= 128 && i < 256;
      EXPECT_EQ(lse[size_t(i)] == -INFINITY, masked) << "row " << i;
      for (int64_t d = 0; d < D; ++d) {
        const float od = o[size_t(i * D + d)], dqd = dq[size_t(i * D + d)];
        ASSERT_FALSE(std::isnan(od) || std::isnan(dqd));
        if (masked) {
          EXPECT_EQ(od, 0.0f);
          EXPECT_EQ(dqd, 0.0f);
        }
      }
    }
    for (float x : dk) ASSERT_FALSE(std::isnan(x));
    for (float x : dv) ASSERT_FALSE(std::isnan(x));
  }
}

// The block mask's layout written out by hand, not through BlockMask::on or allows (which the
// naive twin shares with the kernel): B = 2, Hq = 4, Hk = Hm = 2 (query heads 2h, 2h + 1 read
// mask head h), Sq = 200, Sk = 300 (2 x 3 blocks), bottom-right causal (every row sees a key).
// Block row 1 of one (batch, mask head) is off: exactly its query heads' rows 128-199 see
// nothing. (b, hm) = (1, 0) and (0, 1) tell a swapped batch / head order from the right one.
TEST(FlashAttention, BlockMaskLayoutByHand) {
  const int64_t B = 2, Hq = 4, Hm = 2, Sq = 200, Sk = 300, D = 8;
  const AttentionShape s{B, Sq, Sk, Hq, Hm, D};
  const Problem p = random_problem(s, 40);
  const ColumnMask mask = ColumnMask::causal_only(B, Sq, Sk);
  const TiledMask tm(mask);
  for (auto [b_off, hm_off] : {std::pair<int64_t, int64_t>{1, 1}, {1, 0}, {0, 1}}) {
    SCOPED_TRACE("off: b=" + std::to_string(b_off) + " hm=" + std::to_string(hm_off));
    std::vector<uint8_t> on(B * Hm * 2 * 3, 1);  // [B][Hm][2 block rows][3 block columns]
    for (int64_t bc = 0; bc < 3; ++bc) on[size_t(((b_off * Hm + hm_off) * 2 + 1) * 3 + bc)] = 0;
    const BlockMask block(B, Hm, Sq, Sk, on);
    VecF o(p.q.size()), lse(size_t(B * Hq * Sq));
    flash_attention_forward(o.data(), lse.data(), p.q.data(), p.k.data(), p.v.data(), s, tm, {},
                            &block);
    const VecD q = to_f64(p.q), k = to_f64(p.k), v = to_f64(p.v);
    VecD ro(p.q.size()), rl(lse.size());
    naive::masked_attention_forward(ro.data(), rl.data(), q.data(), k.data(), v.data(), s, mask,
                                    &block);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < Hq; ++h)
        for (int64_t i = 0; i < Sq; ++i) {
          const bool masked = b == b_off && h / 2 == hm_off && i >= 128;
          const size_t x = size_t((b * Hq + h) * Sq + i);
          SCOPED_TRACE("b=" + std::to_string(b) + " h=" + std::to_string(h) +
                       " i=" + std::to_string(i));
          ASSERT_EQ(lse[x] == -INFINITY, masked);
          ASSERT_EQ(std::isfinite(lse[x]), !masked);
          ASSERT_EQ(rl[x] == -INFINITY, masked);
          ASSERT_EQ(std::isfinite(rl[x]), !masked);
        }
  }
}

// A pattern that is not symmetric in (block row, block column), Sq != Sk, no column mask: with
// q = 0 every visible key scores 0, so row i's LSE is log(#visible keys) and, with V's channel d
// = 1 on block column d's keys, O[i][d] = (block column d's visible keys) / #visible. A
// transposed or otherwise wrong flat index reads other blocks and fails. Kernel (two tilings:
// tiles inside blocks, tiles straddling them) and naive twin.
TEST(FlashAttention, AsymmetricBlockPatternByHand) {
  const int64_t Sq = 300, Sk = 500, D = 4;  // 3 x 4 blocks; block column 3 holds 116 keys
  constexpr uint8_t kOn[3][4] = {{1, 1, 0, 0}, {0, 0, 0, 1}, {1, 0, 1, 0}};
  std::vector<uint8_t> on(12);
  for (int64_t br = 0; br < 3; ++br)
    for (int64_t bc = 0; bc < 4; ++bc) on[size_t(br * 4 + bc)] = kOn[br][bc];
  const BlockMask block(1, 1, Sq, Sk, on);
  const ColumnMask mask =
      stack_masks(Sq, Sk, 1, 1, {MaskColumns{false, 4, [&] {
                                               std::vector<int32_t> x;
                                               for (int64_t j = 0; j < Sk; ++j)
                                                 x.insert(x.end(), {0, 0, 0, 0});
                                               return x;
                                             }()}});
  const AttentionShape s{1, Sq, Sk, 1, 1, D};
  VecF q(size_t(Sq * D), 0.0f), k(size_t(Sk * D), 1.0f), v(size_t(Sk * D), 0.0f);
  for (int64_t j = 0; j < Sk; ++j) v[size_t(j * D + j / 128)] = 1.0f;
  const int64_t width[4] = {128, 128, 128, 116};
  const auto check = [&](const auto& o, const auto& lse) {
    for (int64_t i = 0; i < Sq; ++i) {
      const int64_t br = i / 128;
      int64_t n = 0;
      for (int64_t bc = 0; bc < 4; ++bc) n += kOn[br][bc] * width[bc];
      ASSERT_NEAR(lse[size_t(i)], std::log(double(n)), 1e-5) << "row " << i;
      for (int64_t d = 0; d < D; ++d)
        ASSERT_NEAR(o[size_t(i * D + d)], double(kOn[br][d] * width[d]) / double(n), 1e-5)
            << "row " << i << " channel " << d;
    }
  };
  for (const auto& [opt, tile_k] : {std::pair<FlashOptions, int64_t>{{}, 64},
                                    {FlashOptions{.tile_q = 100, .run_cols = 90}, 45}}) {
    SCOPED_TRACE("tile_q=" + std::to_string(opt.tile_q) + " tile_k=" + std::to_string(tile_k));
    VecF o(q.size()), lse(static_cast<size_t>(Sq));
    flash_attention_forward(o.data(), lse.data(), q.data(), k.data(), v.data(), s,
                            TiledMask(mask, tile_k), opt, &block);
    check(o, lse);
  }
  const VecD q64 = to_f64(q), k64 = to_f64(k), v64 = to_f64(v);
  VecD ro(q.size()), rl(static_cast<size_t>(Sq));
  naive::masked_attention_forward(ro.data(), rl.data(), q64.data(), k64.data(), v64.data(), s, mask,
                                  &block);
  check(ro, rl);
}

// Block masks skip irregular tiles, so key chunks visit query tiles their lower neighbours skip
// and the reverse: dQ, dK, dV still repeat bitwise on 1, 2 and 3 threads.
TEST(FlashAttention, BlockMaskBackwardBitwiseAcrossThreadCounts) {
  Rng rng(38);
  const int64_t N = 1000;
  const FlashOptions opt{.tile_q = 64, .run_cols = 128};
  const auto cases = test::standard_masks(N, rng);
  const int saved = num_threads();
  for (size_t t : {0, 2})
    for (int64_t Hq : {1, 4})
      for (uint64_t percent_on : {25, 50, 75}) {
        SCOPED_TRACE(cases[t].name + " Hq=" + std::to_string(Hq) + " on " +
                     std::to_string(percent_on) + "%");
        const AttentionShape s{1, N, N, Hq, 1, 16};
        const Problem p = random_problem(s, 39);
        const TiledMask tm(stack_masks(N, N, 1, 1, {cases[t].columns}));
        const BlockMask block = test::random_block_mask(rng, 1, Hq, N, N, percent_on);
        VecF o(p.q.size()), lse(static_cast<size_t>(Hq * N));
        flash_attention_forward(o.data(), lse.data(), p.q.data(), p.k.data(), p.v.data(), s, tm,
                                opt, &block);
        const auto backward = [&](int threads) {
          set_num_threads(threads);
          VecF dq(p.q.size()), dk(p.k.size()), dv(p.k.size());
          flash_attention_backward(dq.data(), dk.data(), dv.data(), p.dout.data(), p.q.data(),
                                   p.k.data(), p.v.data(), o.data(), lse.data(), s, tm, opt,
                                   &block);
          for (const VecF* x : {&dk, &dv}) dq.insert(dq.end(), x->begin(), x->end());
          return dq;
        };
        const VecF one = backward(1);
        EXPECT_TRUE(kernels::test::bitwise_equal(one, backward(2)));
        EXPECT_TRUE(kernels::test::bitwise_equal(one, backward(3)));
      }
  set_num_threads(saved);
}

// A block mask of ones changes nothing, to the bit (forward and backward, several tilings).
TEST(FlashAttention, AllOnesBlockMaskIsBitwiseNoBlockMask) {
  Rng rng(36);
  const int64_t N = 700;
  const AttentionShape s{1, N, N, 4, 2, 16};
  const Problem p = random_problem(s, 37);
  const TiledMask tm(stack_masks(N, N, 1, 1, {test::standard_masks(N, rng)[2].columns}));
  const BlockMask ones = test::random_block_mask(rng, 1, 4, N, N, 100);
  const auto run = [&](const FlashOptions& opt, const BlockMask* block) {
    VecF o(p.q.size()), lse(size_t(4 * N)), dq(p.q.size()), dk(p.k.size()), dv(p.k.size());
    flash_attention_forward(o.data(), lse.data(), p.q.data(), p.k.data(), p.v.data(), s, tm, opt,
                            block);
    flash_attention_backward(dq.data(), dk.data(), dv.data(), p.dout.data(), p.q.data(), p.k.data(),
                             p.v.data(), o.data(), lse.data(), s, tm, opt, block);
    for (const VecF* x : {&lse, &dq, &dk, &dv}) o.insert(o.end(), x->begin(), x->end());
    return o;
  };
  for (const FlashOptions& opt : {FlashOptions{}, FlashOptions{.tile_q = 37, .run_cols = 200}}) {
    EXPECT_TRUE(kernels::test::bitwise_equal(run(opt, nullptr), run(opt, &ones)));
  }
}

TEST(FlashAttention, RejectsBadBlockMasks) {
  using fixture::expect_input_error;
  expect_input_error([] { BlockMask(1, 1, 300, 129, std::vector<uint8_t>(5, 1)); },
                     {"expected uint8 [B=1, Hm=1, ceil(Sq/128)=3, ceil(Sk/128)=2] = 6", "got 5"});
  expect_input_error([] { BlockMask(1, 1, 128, 128, {2}); },
                     {"value 2 at flat index 0", "neither 0 (masked) nor 1"});
  expect_input_error([] { BlockMask(1, 0, 128, 128, {}); }, {"block mask", "must be >= 1"});
  const TiledMask tm(ColumnMask::causal_only(1, 8, 8));
  VecF x(1024);
  const auto forward = [&](const BlockMask& block, int64_t Hq, int64_t Hk) {
    flash_attention_forward(x.data(), x.data(), x.data(), x.data(), x.data(), {1, 8, 8, Hq, Hk, 4},
                            tm, {}, &block);
  };
  expect_input_error(
      [&] {
        forward(BlockMask(2, 1, 8, 8, {1, 1}), 1, 1);
      },
      {"block mask is for B=2 Sq=8 Sk=8", "column mask", "B=1 Sq=8 Sk=8"});
  expect_input_error([&] { forward(BlockMask(1, 1, 8, 9, {1}), 1, 1); }, {"Sk=9"});
  expect_input_error(
      [&] {
        forward(BlockMask(1, 3, 8, 8, {1, 1, 1}), 4, 2);
      },
      {"block mask: mask heads Hm = 3", "1, Hq = 4 or Hk = 2"});
  // The naive twin checks too (it indexes the block mask unchecked).
  const BlockMask other_batch(2, 1, 8, 8, {1, 1});
  VecD y(1024);
  expect_input_error(
      [&] {
        naive::masked_attention_forward(y.data(), y.data(), y.data(), y.data(), y.data(),
                                        {1, 8, 8, 1, 1, 4}, tm.mask(), &other_batch);
      },
      {"block mask is for B=2"});
}

TEST(FlashAttention, RejectsMismatchedMasks) {
  const TiledMask tm(ColumnMask::causal_only(1, 8, 8));
  VecF x(1024);
  fixture::expect_input_error(
      [&] {
        flash_attention_forward(x.data(), x.data(), x.data(), x.data(), x.data(),
                                {1, 8, 9, 1, 1, 4}, tm);
      },
      {"mask is for B=1 Sq=8 Sk=8", "Sk=9"});
  fixture::expect_input_error(
      [&] {
        flash_attention_forward(x.data(), x.data(), x.data(), x.data(), x.data(),
                                {1, 8, 8, 3, 2, 4}, tm);
      },
      {"Hq a multiple of Hk"});
}

}  // namespace
}  // namespace tessel::attention
