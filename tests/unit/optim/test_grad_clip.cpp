#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "tessel/comm/single_communicator.hpp"
#include "tessel/core/rng.hpp"
#include "tessel/core/threading.hpp"
#include "tessel/optim/grad_clip.hpp"

using namespace tessel;
using namespace tessel::optim;

namespace {

// Parameters of the given sizes with normal(0, 1) gradients; values unused.
struct Grads {
  std::vector<Tensor> owned;
  ParameterList params;
  Grads(const std::vector<int64_t>& sizes, uint64_t seed) {
    Rng rng(seed);
    for (size_t i = 0; i < sizes.size(); ++i) {
      Tensor g({sizes[i]});
      rng.fill_normal(g.f32(), sizes[i], 0.0f, 1.0f);
      params.push_back({std::string("p").append(std::to_string(i)), ParamTag::hidden_matrix,
                        Tensor({sizes[i]}), g});
      owned.push_back(g);
    }
  }
  std::vector<float> flat() const {
    std::vector<float> out;
    for (const Parameter& p : params)
      out.insert(out.end(), p.grad.f32(), p.grad.f32() + p.grad.numel());
    return out;
  }
};

const std::vector<int64_t> kSizes = {1, 0, 7, 4095, 4097, 100003, 33};

}  // namespace

// Fast (chunked, parallel) against naive (sequential), both double sums of exact f32
// squares: only the summation order differs, rel 1e-12 (n ~ 1e5 positive terms).
TEST(GradNorm, FastMatchesNaive) {
  Grads g(kSizes, 1);
  double fast = global_grad_norm(g.params);
  double ref = naive::global_grad_norm(g.params);
  EXPECT_NEAR(fast, ref, 1e-12 * ref);
  EXPECT_GT(ref, 0.0);
}

// Closed form: N = 10000 elements equal to 0.5 give sqrt(2500) = 50, exact in double.
TEST(GradNorm, ClosedForm) {
  Grads g({6000, 4000}, 2);
  for (Parameter& p : g.params)
    for (int64_t i = 0; i < p.grad.numel(); ++i) p.grad.f32()[i] = -0.5f;
  EXPECT_EQ(global_grad_norm(g.params), 50.0);
  EXPECT_EQ(global_grad_norm(ParameterList{}), 0.0);
}

// Fixed order: bitwise the same norm with 1 and 2 threads.
TEST(GradNorm, BitwiseIndependentOfThreads) {
  Grads g(kSizes, 3);
  const int saved = num_threads();
  set_num_threads(1);
  double one = global_grad_norm(g.params);
  set_num_threads(2);
  double two = global_grad_norm(g.params);
  set_num_threads(saved);
  EXPECT_EQ(one, two);
}

// Above max_norm every gradient is scaled by max_norm / (norm + 1e-6) (one f32 multiply,
// so each element matches to 1 ulp of the scaled value); the new norm is max_norm to 1e-6.
TEST(GradClip, ScalesAboveMaxNorm) {
  Grads g(kSizes, 4);
  const std::vector<float> before = g.flat();
  const double norm0 = naive::global_grad_norm(g.params);
  const double max_norm = 1.0;
  const double returned = clip_grad_norm(g.params, max_norm);
  EXPECT_NEAR(returned, norm0, 1e-12 * norm0);
  const float s = float(max_norm / (norm0 + 1e-6));
  const std::vector<float> after = g.flat();
  for (size_t i = 0; i < after.size(); ++i) {
    ASSERT_NEAR(after[i], before[i] * s,
                std::abs(before[i] * s) * std::numeric_limits<float>::epsilon())
        << i;
  }
  EXPECT_NEAR(naive::global_grad_norm(g.params), max_norm, 1e-6);
}

// Below max_norm, and with max_norm <= 0, the gradients stay bitwise unchanged and the
// returned value is still the norm.
TEST(GradClip, NoOpWhenWithinBoundsOrDisabled) {
  Grads g(kSizes, 5);
  const std::vector<float> before = g.flat();
  const double norm0 = naive::global_grad_norm(g.params);
  EXPECT_NEAR(clip_grad_norm(g.params, 2 * norm0), norm0, 1e-12 * norm0);
  EXPECT_EQ(g.flat(), before);
  EXPECT_NEAR(clip_grad_norm(g.params, 0.0), norm0, 1e-12 * norm0);
  EXPECT_NEAR(clip_grad_norm(g.params, -1.0), norm0, 1e-12 * norm0);
  EXPECT_EQ(g.flat(), before);
}

// A non-finite norm is returned and the gradients are left alone.
TEST(GradClip, NonFiniteNormLeavesGradients) {
  Grads g({5, 3}, 6);
  g.params[1].grad.f32()[2] = std::numeric_limits<float>::infinity();
  const std::vector<float> before = g.flat();
  EXPECT_TRUE(std::isinf(clip_grad_norm(g.params, 1.0)));
  EXPECT_EQ(g.flat(), before);
  g.params[0].grad.f32()[0] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(std::isnan(clip_grad_norm(g.params, 1.0)));
}

// With a one-rank group the all-reduce is the identity: bitwise the nullptr result.
TEST(GradNorm, SingleRankGroupIsIdentity) {
  Grads g(kSizes, 7);
  comm::SingleCommunicator single;
  EXPECT_EQ(global_grad_norm(g.params, &single), global_grad_norm(g.params));
}
