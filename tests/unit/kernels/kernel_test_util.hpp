#pragma once
// Helpers for the kernel tests: random inputs and shapes, f32 <-> f64 copies, error
// norms and central finite differences of a scalar loss.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <type_traits>
#include <vector>

#include "tessel/core/rng.hpp"

namespace tessel::kernels::test {

using VecF = std::vector<float>;
using VecD = std::vector<double>;

inline VecF randn(Rng& rng, size_t n, float stddev = 1.0f) {
  VecF x(n);
  rng.fill_normal(x.data(), int64_t(n), 0.0f, stddev);
  return x;
}

inline VecD to_f64(const VecF& x) {
  return VecD(x.begin(), x.end());
}

// max_i |got_i - want_i| / max(max_i |want_i|, floor): the error relative to the largest
// reference magnitude, so near-zero entries do not dominate; `floor` makes it absolute
// where the reference is (near) zero by construction. A NaN anywhere makes it NaN, which
// fails every EXPECT_LT.
template <class V>
double rel_error(const V& got, const VecD& want, double floor = 1e-30) {
  EXPECT_EQ(got.size(), want.size());
  double err = 0, scale = floor;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = std::abs(double(got[i]) - want[i]);
    if (!(d <= err)) err = d;
    if (!(std::abs(want[i]) <= scale)) scale = std::abs(want[i]);
  }
  return err / scale;
}

// max_i |got_i - want_i| (NaN-propagating), for kernels whose natural scale is known.
template <class V>
double abs_error(const V& got, const VecD& want) {
  EXPECT_EQ(got.size(), want.size());
  double err = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = std::abs(double(got[i]) - want[i]);
    if (!(d <= err)) err = d;
  }
  return err;
}

// Uniform integer in [lo, hi].
inline int64_t uniform_int(Rng& rng, int64_t lo, int64_t hi) {
  return lo + int64_t(rng.below(uint64_t(hi - lo + 1)));
}

// Shapes drawn at random beside each test's fixed list.
constexpr int kRandomShapes = 5;

// The fixed shapes, then kRandomShapes drawn by `draw(rng)` from one seeded Rng: the
// same shapes on every run; the tests name the shape of a failure with SCOPED_TRACE.
template <class Draw, class S = std::invoke_result_t<Draw&, Rng&>>
std::vector<S> with_random(std::type_identity_t<std::vector<S>> shapes, Draw draw) {
  Rng rng(20250101);
  for (int i = 0; i < kRandomShapes; ++i) shapes.push_back(draw(rng));
  return shapes;
}

inline double dot(const VecD& a, const VecD& b) {
  double s = 0;
  for (size_t i = 0; i < a.size(); ++i) s += a[i] * b[i];
  return s;
}

// d loss / d x by central differences, perturbing x in place (restored afterwards).
// With eps = 1e-6 in f64 the truncation error is ~1e-12 and the rounding error ~1e-10
// relative to the loss, so a 1e-6 relative tolerance has a wide margin.
inline VecD numeric_grad(VecD& x, const std::function<double()>& loss, double eps = 1e-6) {
  VecD g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double saved = x[i];
    x[i] = saved + eps;
    const double lp = loss();
    x[i] = saved - eps;
    const double lm = loss();
    x[i] = saved;
    g[i] = (lp - lm) / (2 * eps);
  }
  return g;
}

// got - base: the part a backward call added into a gradient that started at base.
template <class V>
V added(const V& got, const V& base) {
  V d(got.size());
  for (size_t i = 0; i < got.size(); ++i) d[i] = got[i] - base[i];
  return d;
}

inline bool bitwise_equal(const VecF& a, const VecF& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

// Tolerances used across the kernel tests.
constexpr double kFastVsNaive = 2e-5;  // f32 kernel vs f64 reference, relative to max |ref|
constexpr double kFiniteDiff = 1e-6;   // f64 analytic backward vs central differences

}  // namespace tessel::kernels::test
