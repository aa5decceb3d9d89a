#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "tessel/core/error.hpp"
#include "tessel/core/rng.hpp"
#include "tessel/core/threading.hpp"
#include "tessel/optim/adamw.hpp"

using namespace tessel;
using namespace tessel::optim;

namespace {

constexpr float kEps32 = std::numeric_limits<float>::epsilon();

std::vector<float> normal(int64_t n, uint64_t seed, float stddev = 1.0f) {
  std::vector<float> x(static_cast<size_t>(n));
  Rng rng(seed);
  rng.fill_normal(x.data(), n, 0.0f, stddev);
  return x;
}

std::vector<double> to_double(const std::vector<float>& x) {
  return {x.begin(), x.end()};
}

AdamWHyper hyper() {
  return AdamWHyper{1e-2, 0.9, 0.95, 1e-8, 0.1};
}

}  // namespace

// Fast f32 against naive f64 over several steps with fresh gradients, on odd sizes and one
// above the parallel threshold. Tolerance: each step adds a few f32 roundings to p (relative
// to |p|) and to the update (relative to lr), so after K steps
// |p - p_ref| <= 16 * K * eps_f32 * (|p_ref| + lr); m and v likewise relative to the size of
// their terms (m cancels: its scale is the same average of |g|, tracked as `scale`).
TEST(AdamWKernel, FastMatchesNaiveDouble) {
  const AdamWHyper h = hyper();
  const int steps = 6;
  for (int64_t n : {1, 7, 33, 1000, 70001}) {
    std::vector<float> p = normal(n, 1), m(static_cast<size_t>(n)), v(static_cast<size_t>(n));
    std::vector<double> pd = to_double(p), md(static_cast<size_t>(n)), vd(static_cast<size_t>(n));
    std::vector<double> scale(static_cast<size_t>(n));
    for (int t = 1; t <= steps; ++t) {
      std::vector<float> g = normal(n, 100 + t, 0.1f);
      std::vector<double> gd = to_double(g);
      adamw_update(p.data(), g.data(), m.data(), v.data(), n, h, t);
      naive::adamw_update(pd.data(), gd.data(), md.data(), vd.data(), n, h, t);
      for (int64_t i = 0; i < n; ++i)
        scale[i] = h.beta1 * scale[i] + (1 - h.beta1) * std::abs(gd[i]);
    }
    const double tol = 16.0 * steps * kEps32;
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_NEAR(p[i], pd[i], tol * (std::abs(pd[i]) + h.lr)) << "n=" << n << " i=" << i;
      ASSERT_NEAR(m[i], md[i], tol * scale[i]) << "n=" << n << " i=" << i;
      ASSERT_NEAR(v[i], vd[i], tol * vd[i] + 1e-12) << "n=" << n << " i=" << i;
    }
  }
}

// The naive f32 instantiation agrees with naive f64 to the same bound.
TEST(AdamWKernel, NaiveFloatMatchesNaiveDouble) {
  const AdamWHyper h = hyper();
  const int64_t n = 257;
  std::vector<float> p = normal(n, 2), g = normal(n, 3, 0.5f), m(static_cast<size_t>(n)),
                     v(static_cast<size_t>(n));
  std::vector<double> pd = to_double(p), gd = to_double(g), md(static_cast<size_t>(n)),
                      vd(static_cast<size_t>(n));
  for (int t = 1; t <= 3; ++t) {
    naive::adamw_update(p.data(), g.data(), m.data(), v.data(), n, h, t);
    naive::adamw_update(pd.data(), gd.data(), md.data(), vd.data(), n, h, t);
  }
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_NEAR(p[i], pd[i], 16.0 * 3 * kEps32 * (std::abs(pd[i]) + h.lr)) << i;
  }
}

// First step from zero state, closed form: m_hat = g, v_hat = g^2, so
// p1 = p0 * (1 - lr*wd) - lr * g / (|g| + eps). Tolerance 8 eps_f32 * (|p1| + lr).
TEST(AdamWKernel, FirstStepClosedForm) {
  const AdamWHyper h = hyper();
  std::vector<float> p = {1.0f, -2.0f, 0.5f, 3.0f, -0.25f, 0.0f};
  std::vector<float> g = {0.3f, -1e-3f, 0.0f, 5.0f, 1e-9f, -2.0f};
  const std::vector<float> p0 = p;
  const int64_t n = int64_t(p.size());
  std::vector<float> m(p.size()), v(p.size());
  adamw_update(p.data(), g.data(), m.data(), v.data(), n, h, 1);
  for (int64_t i = 0; i < n; ++i) {
    double gi = g[i];
    double expect =
        double(p0[i]) * (1 - h.lr * h.weight_decay) - h.lr * gi / (std::abs(gi) + h.eps);
    EXPECT_NEAR(p[i], expect, 8 * kEps32 * (std::abs(expect) + h.lr)) << i;
  }
  // A zero gradient moves the parameter by weight decay only.
  EXPECT_EQ(p[2], float(0.5 * (1 - h.lr * h.weight_decay)));
}

// A constant gradient keeps m_hat = g and v_hat = g^2 at every step (what bias correction
// is for), so without decay p_k = p0 - k * lr * g / (|g| + eps). Tolerance as above with K=20.
TEST(AdamWKernel, ConstantGradientBiasCorrection) {
  AdamWHyper h = hyper();
  h.weight_decay = 0;
  const int64_t n = 5;
  std::vector<float> p = {1, 2, 3, 4, 5}, g = {0.5f, -0.25f, 2.0f, -4.0f, 1e-3f};
  std::vector<float> m(5), v(5);
  const int steps = 20;
  for (int t = 1; t <= steps; ++t) adamw_update(p.data(), g.data(), m.data(), v.data(), n, h, t);
  for (int64_t i = 0; i < n; ++i) {
    double gi = g[i];
    double expect = (i + 1) - steps * h.lr * gi / (std::abs(gi) + h.eps);
    EXPECT_NEAR(p[i], expect, 16.0 * steps * kEps32 * (std::abs(expect) + h.lr)) << i;
  }
}

// Elementwise kernel: the result is bitwise the same for 1 and 2 threads.
TEST(AdamWKernel, BitwiseIndependentOfThreads) {
  const int64_t n = 100003;
  const AdamWHyper h = hyper();
  std::vector<float> results[2];
  const int saved = num_threads();
  for (int k = 0; k < 2; ++k) {
    set_num_threads(k + 1);
    std::vector<float> p = normal(n, 5), g = normal(n, 6), m(static_cast<size_t>(n)),
                       v(static_cast<size_t>(n));
    for (int t = 1; t <= 3; ++t) adamw_update(p.data(), g.data(), m.data(), v.data(), n, h, t);
    results[k] = p;
  }
  set_num_threads(saved);
  EXPECT_EQ(results[0], results[1]);
}

TEST(AdamWKernel, StepCountsFromOne) {
  float p = 1, g = 1, m = 0, v = 0;
  EXPECT_THROW(adamw_update(&p, &g, &m, &v, 1, hyper(), 0), Error);
  EXPECT_THROW(naive::adamw_update(&p, &g, &m, &v, 1, hyper(), 0), Error);
}
