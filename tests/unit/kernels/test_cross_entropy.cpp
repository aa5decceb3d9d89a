#include <gtest/gtest.h>

#include <cmath>

#include "kernel_test_util.hpp"
#include "tessel/core/error.hpp"
#include "tessel/kernels/cpu/cross_entropy.hpp"

using namespace tessel;
using namespace tessel::kernels;
using namespace tessel::kernels::test;

namespace {
// Every third token is out of the loss with target -1; the others have weight 1 or 0.5.
void make_batch(Rng& rng, int64_t N, int64_t V, std::vector<int32_t>& targets, VecF& weight) {
  targets.resize(N);
  weight.resize(N);
  for (int64_t n = 0; n < N; ++n) {
    const bool masked = n % 3 == 1;
    targets[n] = masked ? -1 : int32_t(rng.below(uint64_t(V)));
    weight[n] = masked ? 0.0f : (n % 3 == 0 ? 1.0f : 0.5f);
  }
}
}  // namespace

// The fixed shapes, then random ones with N <= 40, V <= 1000. The forward takes a row in
// blocks of 2048 columns, rescaling the running sum when a later block holds a larger
// maximum: V = 2049 and 5000 cross blocks, and their row 0 rises to its maximum in the last.
TEST(CrossEntropy, FastMatchesNaive) {
  for (auto [N, V] :
       with_random({{1, 7}, {13, 50}, {32, 1000}, {3, 2049}, {4, 5000}}, [](Rng& rng) {
         return std::pair{uniform_int(rng, 1, 40), uniform_int(rng, 1, 1000)};
       })) {
    SCOPED_TRACE(::testing::Message() << "N=" << N << " V=" << V);
    Rng rng(1);
    VecF logits = randn(rng, N * V, 4.0f), dl0 = randn(rng, N * V), weight;
    if (V > 2048)
      for (int64_t v = 0; v < V; ++v) logits[size_t(v)] = 12.0f * float(v) / float(V);
    std::vector<int32_t> targets;
    make_batch(rng, N, V, targets, weight);
    if (N == 1) weight[0] = 1.0f;
    VecD ld = to_f64(logits), wd = to_f64(weight);
    VecF lse(N);
    VecD lsed(N);
    const double loss =
        cross_entropy_forward(lse.data(), logits.data(), targets.data(), weight.data(), N, V);
    const double want =
        naive::cross_entropy_forward(lsed.data(), ld.data(), targets.data(), wd.data(), N, V);
    // lse - logit cancels when the target dominates, so the f32 error is relative to the
    // magnitude of the terms, sum_n w_n |lse_n|, not to the loss.
    double magnitude = 0;
    for (int64_t n = 0; n < N; ++n) magnitude += wd[n] * std::abs(lsed[n]);
    EXPECT_NEAR(loss, want, kFastVsNaive * magnitude);
    EXPECT_LT(rel_error(lse, lsed), kFastVsNaive);
    const float scale = 0.25f;
    VecF dl = dl0;
    VecD dld = to_f64(dl0);
    cross_entropy_backward(dl.data(), logits.data(), lse.data(), targets.data(), weight.data(),
                           scale, N, V);
    naive::cross_entropy_backward(dld.data(), ld.data(), lsed.data(), targets.data(), wd.data(),
                                  double(scale), N, V);
    // Each row is scale * w * (p - onehot): the error is relative to scale (w <= 1).
    EXPECT_LT(abs_error(added(dl, dl0), added(dld, to_f64(dl0))) / scale, kFastVsNaive);
  }
}

// N = 5, V = 6, then random shapes with N <= 6, 2 <= V <= 8.
TEST(CrossEntropy, NaiveBackwardMatchesFiniteDifferences) {
  for (auto [N, V] : with_random({{5, 6}}, [](Rng& rng) {
         return std::pair{uniform_int(rng, 1, 6), uniform_int(rng, 2, 8)};
       })) {
    SCOPED_TRACE(::testing::Message() << "N=" << N << " V=" << V);
    Rng rng(2);
    VecD logits = to_f64(randn(rng, N * V, 2.0f));
    VecF weight;
    std::vector<int32_t> targets;
    make_batch(rng, N, V, targets, weight);
    const VecD wd = to_f64(weight);
    const double scale = 0.3;
    VecD lse(N);
    const auto loss = [&] {
      return scale * naive::cross_entropy_forward(lse.data(), logits.data(), targets.data(),
                                                  wd.data(), N, V);
    };
    loss();
    VecD dl(N * V, 0.0);
    naive::cross_entropy_backward(dl.data(), logits.data(), lse.data(), targets.data(), wd.data(),
                                  scale, N, V);
    EXPECT_LT(rel_error(dl, numeric_grad(logits, loss)), kFiniteDiff);
  }
}

// Masked tokens (weight 0, target -1) add nothing to the loss or to their gradient rows.
TEST(CrossEntropy, IgnoresWeightZeroTokens) {
  const int64_t N = 6, V = 9;
  Rng rng(3);
  VecF logits = randn(rng, N * V), weight;
  std::vector<int32_t> targets;
  make_batch(rng, N, V, targets, weight);
  VecF lse(N);
  const double loss =
      cross_entropy_forward(lse.data(), logits.data(), targets.data(), weight.data(), N, V);
  double want = 0;  // closed form over the weighted tokens only
  for (int64_t n = 0; n < N; ++n) {
    if (weight[n] == 0.0f) continue;
    double sum = 0;
    for (int64_t j = 0; j < V; ++j) sum += std::exp(double(logits[n * V + j]));
    want += weight[n] * (std::log(sum) - logits[n * V + targets[n]]);
  }
  EXPECT_NEAR(loss, want, 1e-5 * std::abs(want));
  VecF dl(N * V, 0.0f);
  cross_entropy_backward(dl.data(), logits.data(), lse.data(), targets.data(), weight.data(), 1.0f,
                         N, V);
  for (int64_t n = 0; n < N; ++n)
    for (int64_t j = 0; j < V; ++j)
      if (weight[n] == 0.0f) {
        EXPECT_EQ(dl[n * V + j], 0.0f);
      }
}

TEST(CrossEntropy, RejectsOutOfRangeTargetsOfWeightedTokens) {
  const int64_t V = 4;
  VecF logits(2 * V, 0.0f), lse(2), weight = {1.0f, 1.0f};
  const std::vector<int32_t> targets = {0, 4};
  EXPECT_THROW(
      cross_entropy_forward(lse.data(), logits.data(), targets.data(), weight.data(), 2, V),
      InputError);
}

TEST(CrossEntropy, BackwardIsDeterministic) {
  const int64_t N = 48, V = 777;
  Rng rng(4);
  VecF logits = randn(rng, N * V), weight, lse(N);
  std::vector<int32_t> targets;
  make_batch(rng, N, V, targets, weight);
  const double l0 =
      cross_entropy_forward(lse.data(), logits.data(), targets.data(), weight.data(), N, V);
  const double l1 =
      cross_entropy_forward(lse.data(), logits.data(), targets.data(), weight.data(), N, V);
  EXPECT_EQ(l0, l1);
  VecF dl[2];
  for (VecF& d : dl) {
    d.assign(N * V, 0.0f);
    cross_entropy_backward(d.data(), logits.data(), lse.data(), targets.data(), weight.data(), 0.5f,
                           N, V);
  }
  EXPECT_TRUE(bitwise_equal(dl[0], dl[1]));
}
