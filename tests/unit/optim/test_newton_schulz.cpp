#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "svd_util.hpp"
#include "tessel/core/error.hpp"
#include "tessel/core/rng.hpp"
#include "tessel/optim/newton_schulz.hpp"
#include "tessel/optim/optimizer.hpp"

using namespace tessel;
using namespace tessel::optim;
using tessel::optim::test::rel_frobenius;
using tessel::optim::test::svd;

namespace {

std::vector<float> gaussian(uint64_t seed, int64_t rows, int64_t cols) {
  std::vector<float> x(size_t(rows * cols));
  Rng rng(seed);
  rng.fill_normal(x.data(), rows * cols, 0.0f, 1.0f);
  return x;
}

std::vector<double> f64(const std::vector<float>& x) {
  return {x.begin(), x.end()};
}

std::vector<float> orth(const std::vector<float>& U, int64_t r, int64_t c, const NsOptions& o) {
  std::vector<float> out(U.size());
  orthogonalize(U.data(), r, c, o, out.data());
  return out;
}

NsOptions options(const std::string& set, int steps, bool gram, int64_t gram_min = 1) {
  NsOptions o;
  o.coefficients = ns_coefficients(set, steps);
  o.gram = gram;
  o.gram_min = gram_min;
  return o;
}

double scalar_map(std::span<const NsTriple> coefficients, double s) {
  for (const NsTriple& k : coefficients) s = k.a * s + k.b * s * s * s + k.c * s * s * s * s * s;
  return s;
}

// The spec's numeric check of the coefficient tables on the scalar map. Polar Express past
// its 5 steps repeats the limit triple, which converges to 1 (measured [0.994, 1.008] after
// 6); fewer than 5 are refused (the table's first triples overshoot: 1.58 after 4).
TEST(NewtonSchulz, ScalarMapBands) {
  const auto pe = ns_coefficients("polar_express", 5);
  const auto pe6 = ns_coefficients("polar_express", 6), pe12 = ns_coefficients("polar_express", 12);
  const auto kj = ns_coefficients("keller", 5);
  EXPECT_THROW(ns_coefficients("polar_express", 4), Error);
  for (double s = 1e-3; s <= 1.0; s *= 1.01) {
    EXPECT_GE(scalar_map(pe, s), 0.85) << s;
    EXPECT_LE(scalar_map(pe, s), 1.15) << s;
    EXPECT_NEAR(scalar_map(pe6, s), 1.0, 0.01) << s;
    EXPECT_NEAR(scalar_map(pe12, s), 1.0, 1e-9) << s;
    if (s >= 1.3e-3) {
      EXPECT_GE(scalar_map(kj, s), 0.6) << s;
      EXPECT_LE(scalar_map(kj, s), 1.21) << s;
    }
  }
}

// Converging coefficients (Polar Express, 8 steps) give U V^T of an SVD within 1e-3
// (relative Frobenius), on both paths, wide and tall, and the naive f64 twin too.
TEST(NewtonSchulz, PolarExpressMatchesSvd) {
  for (auto [r, c] : {std::pair<int64_t, int64_t>{64, 160}, {200, 80}}) {
    SCOPED_TRACE(testing::Message() << r << "x" << c);
    auto U = gaussian(uint64_t(r * c), r, c);
    const auto want = svd(f64(U), r, c).polar;
    for (bool gram : {false, true}) {
      const NsOptions o = options("polar_express", 8, gram);
      EXPECT_EQ(uses_gram(o, r, c), gram);
      EXPECT_LT(rel_frobenius(orth(U, r, c, o), want), 1e-3) << "gram " << gram;
      std::vector<double> Ud = f64(U), out(Ud.size());
      naive::orthogonalize<double>(Ud.data(), r, c, o, out.data());
      EXPECT_LT(rel_frobenius(out, want), 1e-3) << "naive, gram " << gram;
    }
  }
}

// KellerJordan's 5 steps: on a Gaussian of aspect ratio 3 every singular value of O lies in
// [0.6, 1.25] and its singular vectors are those of U (polar(O) = polar(U) to 1e-4).
TEST(NewtonSchulz, KellerSingularValueBand) {
  const int64_t r = 48, c = 144;
  auto U = gaussian(7, r, c);
  const auto want = svd(f64(U), r, c);
  for (bool gram : {false, true}) {
    auto O = orth(U, r, c, options("keller", 5, gram));
    const auto got = svd(f64(O), r, c);
    EXPECT_LE(got.sigma.front(), 1.25);
    EXPECT_GE(got.sigma.back(), 0.6);
    EXPECT_LT(rel_frobenius(got.polar, want.polar), 1e-4);
  }
}

// Same recurrences in exact arithmetic: Gram and standard NS agree within 1e-5 in f64 (the
// naive twins) and within 5e-3 in f32 (the fast kernels), one restart before step 2.
TEST(NewtonSchulz, GramMatchesStandard) {
  const auto coeffs = ns_coefficients("keller", 5);
  const std::vector<int> restart = {2}, none = {};
  for (double alpha : {1.5, 2.0, 4.0, 8.0}) {
    for (int64_t n : {64, 256}) {
      const int64_t m = int64_t(alpha * double(n));
      SCOPED_TRACE(testing::Message() << n << "x" << m);
      auto X = gaussian(uint64_t(n + m), n, m);
      double inv = 0;
      for (float x : X) inv += double(x) * x;
      inv = 1.0 / std::sqrt(inv);
      for (float& x : X) x = float(x * inv);
      if (n == 64) {
        std::vector<double> s = f64(X), g = s, g0 = s;
        naive::newton_schulz<double>(s.data(), n, m, coeffs);
        naive::gram_newton_schulz<double>(g.data(), n, m, coeffs, restart);
        naive::gram_newton_schulz<double>(g0.data(), n, m, coeffs, none);
        EXPECT_LT(rel_frobenius(g, s), 1e-5);
        EXPECT_LT(rel_frobenius(g0, s), 1e-5);  // without a restart too, in f64
      }
      std::vector<float> s = X, g = X;
      newton_schulz(s.data(), n, m, coeffs, true);
      gram_newton_schulz(g.data(), n, m, coeffs, restart);
      EXPECT_LT(rel_frobenius(g, f64(s)), 5e-3);
    }
  }
}

// The largest case of the acceptance range, once: n = 1024, aspect 1.5, f32.
TEST(NewtonSchulz, GramMatchesStandardAt1024) {
  const int64_t n = 1024, m = 1536;
  auto U = gaussian(11, n, m);
  auto s = orth(U, n, m, options("keller", 5, false));
  auto g = orth(U, n, m, options("keller", 5, true));
  EXPECT_LT(rel_frobenius(g, f64(s)), 5e-3);
}

// U = A diag(s) B^T with orthonormal A, B and s log-spaced over [1e-4, 1] (condition 1e4),
// 8 KellerJordan steps: without restarts the f32 Gram recurrence drifts from standard NS
// (measured 0.12-0.14), restarts before steps 2 and 5 keep it within 2e-4 (measured 6.5e-5 to
// 7.8e-5 over 1-16 BLAS threads; the bound leaves 2.5x of that for other BLAS builds).
namespace {
// A diag(s) B^T with orthonormal A [n, n], B [n, m] and s log-spaced over [1e-4, 1], normalized.
std::vector<float> ill_conditioned(int64_t n, int64_t m) {
  auto A = orth(gaussian(21, n, n), n, n, options("polar_express", 12, false));
  auto B = orth(gaussian(22, n, m), n, m, options("polar_express", 12, false));
  std::vector<float> X(size_t(n * m), 0.0f);
  for (int64_t i = 0; i < n; ++i) {
    const float s = float(std::pow(1e-4, double(i) / double(n - 1)));
    for (int64_t p = 0; p < n; ++p)
      for (int64_t j = 0; j < m; ++j)
        X[size_t(p * m + j)] += A[size_t(p * n + i)] * s * B[size_t(i * m + j)];
  }
  double ss = 0;
  for (float x : X) ss += double(x) * x;
  for (float& x : X) x = float(x / std::sqrt(ss));
  return X;
}
}  // namespace

TEST(NewtonSchulz, RestartFixesIllConditionedDrift) {
  const int64_t n = 64, m = 256;
  const NsOptions o = options("keller", 8, false);
  const std::vector<float> X = ill_conditioned(n, m);
  std::vector<float> s = X, g = X, g0 = X;
  newton_schulz(s.data(), n, m, o.coefficients, true);
  const std::vector<int> restart = {2, 5}, none = {};
  gram_newton_schulz(g.data(), n, m, o.coefficients, restart);
  gram_newton_schulz(g0.data(), n, m, o.coefficients, none);
  const double with = rel_frobenius(g, f64(s)), without = rel_frobenius(g0, f64(s));
  EXPECT_LT(with, 2e-4);
  EXPECT_GT(without, 1e-2);
}

// Many steps (20, the last triple repeated) on the ill-conditioned input: with the default
// restarts (every 3 steps) the f32 Gram recurrence stays with standard NS; with the one restart
// of 5 steps it drifts away.
TEST(NewtonSchulz, DefaultRestartsKeepManyGramStepsWithStandard) {
  const int64_t n = 64, m = 256, steps = 20;
  const std::vector<float> X = ill_conditioned(n, m);
  const auto coeffs = ns_coefficients("keller", steps);
  OptimizerConfig config;
  config.ns_steps = steps;
  const auto chosen = ns_restart_steps(config);
  const std::vector<int> every_third(chosen.begin(), chosen.end()), once = {2};
  std::vector<float> s = X, g = X, g1 = X;
  newton_schulz(s.data(), n, m, coeffs, true);
  gram_newton_schulz(g.data(), n, m, coeffs, every_third);
  gram_newton_schulz(g1.data(), n, m, coeffs, once);
  EXPECT_LT(rel_frobenius(g, f64(s)), 5e-3);
  const double once_error = rel_frobenius(g1, f64(s));
  EXPECT_FALSE(once_error < 5e-3) << once_error;  // NaN counts as drift
}

// A rank-deficient input (a step's gradient over fewer tokens than the short side) has zero
// singular values that rounding leaves slightly negative in the Gram matrix; each step scales
// them by about a^2 = 11.9, so 10 steps without a restart blow them up (in training: a weight of
// 1e25 after one step, one restart for 12 steps). orthogonalize then gives standard NS's result,
// bitwise. With the default restarts it keeps the Gram result on a full-rank input.
TEST(NewtonSchulz, DriftedGramResultIsRedoneByStandard) {
  const int64_t n = 64, m = 256, rank = 16, steps = 12;
  const std::vector<float> A = gaussian(31, n, rank), B = gaussian(32, rank, m);
  std::vector<float> low_rank(size_t(n * m), 0.0f);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t r = 0; r < rank; ++r)
      for (int64_t j = 0; j < m; ++j)
        low_rank[size_t(i * m + j)] += A[size_t(i * rank + r)] * B[size_t(r * m + j)];
  NsOptions once = options("keller", steps, true), standard = options("keller", steps, false);
  once.restarts = {2};
  double start_ss = 0;
  for (float x : low_rank) start_ss += double(x) * x;
  std::vector<float> drifted = low_rank;  // normalized, as the core expects
  for (float& x : drifted) x = float(x / std::sqrt(start_ss));
  gram_newton_schulz(drifted.data(), n, m, once.coefficients, once.restarts);
  double ss = 0;
  for (float x : drifted) ss += double(x) * x;
  EXPECT_FALSE(ss <= 2.25 * double(n)) << ss;  // the raw recurrence leaves every set's band
  EXPECT_EQ(orth(low_rank, n, m, once), orth(low_rank, n, m, standard));
  std::vector<float> naive_f32(low_rank.size());  // the twin redoes it the same way
  naive::orthogonalize(low_rank.data(), n, m, once, naive_f32.data());
  std::vector<double> naive_f64(low_rank.size());
  const std::vector<double> low_rank_f64 = f64(low_rank);
  naive::orthogonalize(low_rank_f64.data(), n, m, once, naive_f64.data());
  // Against f64: 5.5 % measured for both, the 48 zero singular values that f32 rounding seeds
  // and 12 steps amplify (standard NS's own error); a drifted result is off by orders more.
  EXPECT_LT(rel_frobenius(orth(low_rank, n, m, once), naive_f64), 0.1);
  EXPECT_LT(rel_frobenius(naive_f32, naive_f64), 0.1);

  const std::vector<float> X = ill_conditioned(n, m);
  NsOptions chosen_restarts = once;
  OptimizerConfig config;
  config.ns_steps = steps;
  const auto chosen = ns_restart_steps(config);
  chosen_restarts.restarts.assign(chosen.begin(), chosen.end());
  // orthogonalize's normalization, then the Gram core: kept as it is.
  std::vector<float> gram = X;
  double gram_ss = 0;
  for (float x : gram) gram_ss += double(x) * x;
  const float inv = float(1.0 / (std::sqrt(gram_ss) + 1e-7));
  for (float& x : gram) x *= inv;
  gram_newton_schulz(gram.data(), n, m, chosen_restarts.coefficients, chosen_restarts.restarts);
  EXPECT_EQ(orth(X, n, m, chosen_restarts), gram);
}

// NS(U^T) = NS(U)^T bitwise on both paths (the transpose comes before the normalization).
TEST(NewtonSchulz, TransposeIsBitwise) {
  const int64_t r = 40, c = 130;
  auto U = gaussian(5, r, c);
  std::vector<float> Ut(U.size());
  for (int64_t i = 0; i < r; ++i)
    for (int64_t j = 0; j < c; ++j) Ut[size_t(j * r + i)] = U[size_t(i * c + j)];
  for (bool gram : {false, true})
    for (bool aol : {false, true}) {
      NsOptions o = options("keller", 5, gram);
      o.aol = aol;
      auto O = orth(U, r, c, o), Ot = orth(Ut, c, r, o);
      bool same = true;
      for (int64_t i = 0; i < r; ++i)
        for (int64_t j = 0; j < c; ++j)
          same = same && O[size_t(i * c + j)] == Ot[size_t(j * r + i)];
      EXPECT_TRUE(same) << "gram " << gram << ", aol " << aol;
    }
}

// The fast f32 paths against their naive f64 twins (same recurrences), with either scaling.
TEST(NewtonSchulz, FastMatchesNaive) {
  for (auto [r, c] : {std::pair<int64_t, int64_t>{1, 1}, {3, 7}, {33, 17}, {70, 300}}) {
    SCOPED_TRACE(testing::Message() << r << "x" << c);
    auto U = gaussian(uint64_t(r + 3 * c), r, c);
    for (bool gram : {false, true})
      for (bool aol : {false, true}) {
        NsOptions o = options("keller", 5, gram);
        o.aol = aol;
        std::vector<double> Ud = f64(U), want(Ud.size());
        naive::orthogonalize<double>(Ud.data(), r, c, o, want.data());
        EXPECT_LT(rel_frobenius(orth(U, r, c, o), want), 1e-4)
            << "gram " << gram << ", aol " << aol;
      }
  }
}

// The spec's first YOU triple; fewer steps take the table's last ones; more than 5 are refused.
TEST(NewtonSchulz, YouTable) {
  const auto five = ns_coefficients("you", 5), three = ns_coefficients("you", 3);
  EXPECT_EQ(five.front().a, 4.0848);
  EXPECT_EQ(five.front().b, -6.8946);
  EXPECT_EQ(five.front().c, 2.9270);
  ASSERT_EQ(three.size(), 3u);
  for (size_t t = 0; t < 3; ++t) {
    EXPECT_EQ(three[t].a, five[t + 2].a);
    EXPECT_EQ(three[t].b, five[t + 2].b);
    EXPECT_EQ(three[t].c, five[t + 2].c);
  }
  EXPECT_THROW(ns_coefficients("you", 6), Error);
}

// A gradient-like [r, c]: rank 4 plus 0.2 x Gaussian noise.
std::vector<float> low_rank_plus_noise(int64_t r, int64_t c, uint64_t seed) {
  auto U = gaussian(seed, r, c);
  const auto L = gaussian(seed + 1, r, 4), R = gaussian(seed + 2, 4, c);
  for (int64_t i = 0; i < r; ++i)
    for (int64_t j = 0; j < c; ++j) {
      float s = 0;
      for (int64_t k = 0; k < 4; ++k) s += L[size_t(i * 4 + k)] * R[size_t(k * c + j)];
      U[size_t(i * c + j)] = 0.2f * U[size_t(i * c + j)] + s;
    }
  return U;
}

// D U with D_ii = (sum_j |U U^T|_ij)^(-1/2), U wide, by plain loops in double: what the AOL
// scaling orthogonalizes.
std::vector<double> aol_scaled(const std::vector<float>& U, int64_t r, int64_t c) {
  std::vector<double> out = f64(U);
  for (int64_t i = 0; i < r; ++i) {
    double row = 0;
    for (int64_t k = 0; k < r; ++k) {
      double g = 0;
      for (int64_t j = 0; j < c; ++j) g += double(U[size_t(i * c + j)]) * U[size_t(k * c + j)];
      row += std::fabs(g);
    }
    for (int64_t j = 0; j < c; ++j) out[size_t(i * c + j)] /= std::sqrt(row);
  }
  return out;
}

// Turbo-Muon's AOL scaling (NsOptions::aol), on gradient-like matrices of aspect ratio 4, both
// paths: with no NS step it is D U exactly (relative 1e-6) and its largest singular value is at
// most 1, like the Frobenius scaling's, while its smallest is larger; converged (Polar Express,
// 8 steps) the result is the polar factor of D U (1e-3), not of U (D is not a multiple of I);
// after YOU's last 4 steps the smallest singular value is at least 0.8, where the Frobenius
// scaling leaves it below 0.7 (measured: 0.94 / 0.83 against 0.68 / 0.57), and within 0.2 of
// the Frobenius scaling's after all 5 (0.98 / 0.98): AOL gets most of one step's way; all stay
// at most 1.15. The scaling does not depend on the matrix's scale (x 1e-6: relative 1e-5), and a
// zero row stays zero.
TEST(NewtonSchulz, AolScalingStartsCloserToOrthogonal) {
  for (auto [r, c] : {std::pair<int64_t, int64_t>{64, 256}, {96, 384}}) {
    SCOPED_TRACE(testing::Message() << r << "x" << c);
    const auto U = low_rank_plus_noise(r, c, uint64_t(r + c));
    const auto scaled = aol_scaled(U, r, c);
    for (bool gram : {false, true}) {
      SCOPED_TRACE(gram ? "gram" : "standard");
      NsOptions o = options("you", 4, gram);
      NsOptions frobenius = o;
      o.aol = true;
      o.coefficients.clear();
      frobenius.coefficients.clear();
      const auto start = orth(U, r, c, o);
      EXPECT_LT(rel_frobenius(start, scaled), 1e-6);
      const auto aol0 = svd(f64(start), r, c).sigma,
                 frob0 = svd(f64(orth(U, r, c, frobenius)), r, c).sigma;
      EXPECT_LE(aol0.front(), 1.0 + 1e-6);
      EXPECT_LE(frob0.front(), 1.0 + 1e-6);
      EXPECT_GT(aol0.back(), 1.2 * frob0.back());
      o.coefficients = ns_coefficients("polar_express", 8);
      const auto converged = orth(U, r, c, o);
      EXPECT_LT(rel_frobenius(converged, svd(scaled, r, c).polar), 1e-3);
      EXPECT_GT(rel_frobenius(converged, svd(f64(U), r, c).polar), 1e-2);
      o.coefficients = frobenius.coefficients = ns_coefficients("you", 4);
      const auto aol4 = svd(f64(orth(U, r, c, o)), r, c).sigma;
      const auto frob4 = svd(f64(orth(U, r, c, frobenius)), r, c).sigma;
      frobenius.coefficients = ns_coefficients("you", 5);
      const auto frob5 = svd(f64(orth(U, r, c, frobenius)), r, c).sigma;
      EXPECT_GE(aol4.back(), 0.8);
      EXPECT_LT(frob4.back(), 0.7);
      EXPECT_GE(aol4.back(), frob5.back() - 0.2);
      for (double top : {aol4.front(), frob4.front(), frob5.front()}) EXPECT_LE(top, 1.15);
      auto tiny = U;
      for (float& x : tiny) x *= 1e-6f;
      tiny.resize(size_t((r - 1) * c));
      tiny.resize(size_t(r * c), 0.0f);  // the last row zero
      auto scaled_up = tiny;
      for (float& x : scaled_up) x *= 1e6f;
      const auto small = orth(tiny, r, c, o), big = orth(scaled_up, r, c, o);
      EXPECT_LT(rel_frobenius(small, f64(big)), 1e-5);
      for (int64_t j = 0; j < c; ++j) ASSERT_EQ(small[size_t((r - 1) * c + j)], 0.0f);
    }
  }
}

}  // namespace
