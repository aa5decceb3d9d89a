#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <numeric>
#include <string>
#include <vector>

#include "support/expect_input_error.hpp"
#include "support/param_fixture.hpp"
#include "tessel/optim/muon.hpp"
#include "tessel/optim/newton_schulz.hpp"
#include "tessel/optim/row_selection.hpp"

using namespace tessel;
using namespace tessel::optim;
using tessel::fixture::ParamSet;

namespace {

// The f32 recurrences of the reference below and of Muon round alike, but the compiler may
// contract a * b + c differently in the two places: compare relative to the largest value.
constexpr double kTol = 1e-5;

double rel_diff(const std::vector<float>& a, const std::vector<float>& b) {
  EXPECT_EQ(a.size(), b.size());
  double d = 0, s = 1e-30;
  for (size_t i = 0; i < a.size(); ++i) {
    d = std::max(d, std::abs(double(a[i]) - double(b[i])));
    s = std::max(s, std::abs(double(b[i])));
  }
  return d / s;
}

std::vector<float> values_of(const Tensor& t) {
  return {t.f32(), t.f32() + t.numel()};
}

const Tensor& state_named(std::vector<StateTensor>& st, const std::string& name) {
  for (auto& s : st)
    if (s.name == name) return s.tensor;
  ADD_FAILURE() << "no state " << name;
  return st[0].tensor;
}

MuonHyper hyper(MuonVariant v = MuonVariant::muon) {
  MuonHyper h;
  h.variant = v;
  h.lr = 0.05;
  h.weight_decay = 0.1;
  h.ns.gram_min = 8;  // Gram NS on the small wide test matrices too
  return h;
}

AdamWHyper adam() {
  return {1e-2, 0.9, 0.95, 1e-8, 0.1};
}
const std::vector<ParamTag> kDecay = {ParamTag::hidden_matrix, ParamTag::embedding, ParamTag::head};

// Muon on one matrix, from the spec's formulas.
struct Reference {
  MuonHyper h;
  std::map<std::string, std::vector<float>> B;
  void step(Parameter& p, double lr) {
    const int64_t rows = p.value.shape()[0], cols = p.value.shape()[1], n = rows * cols;
    auto& b = B[p.name];
    b.resize(size_t(n), 0.0f);
    std::vector<float> U(static_cast<size_t>(n)), O(static_cast<size_t>(n));
    const float mu = float(h.momentum), c = h.lerp ? float(1.0 - h.momentum) : 1.0f;
    for (int64_t i = 0; i < n; ++i) {
      const float g = p.grad.f32()[i];
      b[size_t(i)] = mu * b[size_t(i)] + c * g;
      U[size_t(i)] = h.nesterov ? c * g + mu * b[size_t(i)] : b[size_t(i)];
    }
    orthogonalize(U.data(), rows, cols, h.ns, O.data());
    const float s = float(lr * lr_adjust(h.lr_rule, rows, cols));
    const float decay = float(1.0 - lr * h.weight_decay);
    for (int64_t i = 0; i < n; ++i) p.value.f32()[i] = p.value.f32()[i] * decay - s * O[size_t(i)];
  }
};

TEST(Muon, LrAdjustUnitValues) {
  EXPECT_DOUBLE_EQ(lr_adjust(LrRule::spectral_norm, 4096, 1024), 2.0);
  EXPECT_DOUBLE_EQ(lr_adjust(LrRule::spectral_norm, 1024, 4096), 0.5);
  EXPECT_DOUBLE_EQ(lr_adjust(LrRule::spectral_norm, 768, 768), 1.0);
  EXPECT_DOUBLE_EQ(lr_adjust(LrRule::rms_norm, 4096, 1024), 12.8);
  EXPECT_DOUBLE_EQ(lr_adjust(LrRule::rms_norm, 1024, 4096), 12.8);
  EXPECT_NEAR(lr_adjust(LrRule::rms_norm, 768, 768), 0.2 * std::sqrt(768.0), 1e-12);
  EXPECT_DOUBLE_EQ(lr_adjust(LrRule::keller, 4096, 1024), 2.0);
  EXPECT_DOUBLE_EQ(lr_adjust(LrRule::keller, 1024, 4096), 1.0);
  EXPECT_DOUBLE_EQ(lr_adjust(LrRule::keller, 768, 768), 1.0);
}

// Hidden matrices follow the reference Muon (sum and lerp forms, with and without Nesterov,
// every lr rule); every other tag, 2-D embedding and head included, follows AdamW bitwise.
TEST(Muon, RoutesByTagAndMatchesReference) {
  for (bool lerp : {false, true})
    for (bool nesterov : {false, true})
      for (LrRule rule : {LrRule::spectral_norm, LrRule::rms_norm, LrRule::keller}) {
        SCOPED_TRACE(testing::Message()
                     << "lerp " << lerp << " nesterov " << nesterov << " rule " << int(rule));
        MuonHyper h = hyper();
        h.lerp = lerp;
        h.nesterov = nesterov;
        h.lr_rule = rule;
        ParamSet got(fixture::muon_test_specs(), 1), want(fixture::muon_test_specs(), 1);
        Muon opt(got.params, h, adam(), kDecay, nullptr);
        ParameterList rest;
        for (const Parameter& p : want.params)
          if (p.tag != ParamTag::hidden_matrix) rest.push_back(p);
        AdamW ref_adam(rest, adam(), kDecay);
        Reference ref{h, {}};
        for (int s = 0; s < 3; ++s) {
          got.random_grads(10 + s);
          want.random_grads(10 + s);
          const double scale = 0.5 + 0.25 * s;
          opt.step(scale);
          ref_adam.step(scale);
          for (Parameter& p : want.params)
            if (p.tag == ParamTag::hidden_matrix) ref.step(p, h.lr * scale);
        }
        for (size_t i = 0; i < got.params.size(); ++i) {
          const auto a = values_of(got.params[i].value), b = values_of(want.params[i].value);
          if (got.params[i].tag == ParamTag::hidden_matrix)
            EXPECT_LT(rel_diff(a, b), kTol) << got.params[i].name;
          else
            EXPECT_EQ(a, b) << got.params[i].name;
        }
        EXPECT_EQ(opt.step_count(), 3);
      }
}

// Row blocks (fused QKV per block) are orthogonalized separately: a [24, 16] matrix split
// 8/8/8 moves like three [8, 16] matrices.
TEST(Muon, RowBlocksAreOrthogonalizedSeparately) {
  ParamSet got({{"qkv", ParamTag::hidden_matrix, {24, 16}}}, 2);
  ParamSet want({{"q", ParamTag::hidden_matrix, {8, 16}},
                 {"k", ParamTag::hidden_matrix, {8, 16}},
                 {"v", ParamTag::hidden_matrix, {8, 16}}},
                2);
  Muon a(got.params, hyper(), adam(), kDecay, nullptr, {{"qkv", {8, 8, 8}}});
  Muon b(want.params, hyper(), adam(), kDecay, nullptr);
  EXPECT_EQ(a.matrices(), 3);
  for (int s = 0; s < 2; ++s) {
    got.random_grads(s);
    want.random_grads(s);
    a.step(1.0);
    b.step(1.0);
  }
  EXPECT_EQ(got.snapshot(), want.snapshot());
  EXPECT_EQ(qkv_row_blocks("blocks", 8, 4, 2), (std::vector<int64_t>{8, 4, 4}));
  EXPECT_EQ(qkv_row_blocks("heads", 8, 4, 2), std::vector<int64_t>(8, 2));
  EXPECT_TRUE(qkv_row_blocks("none", 8, 4, 2).empty());
}

// Dion2 with f = 1, ef_decay = mu (sum accumulation) equals non-Nesterov sum-form Muon.
TEST(Dion2, FullFractionEqualsMuon) {
  MuonHyper d = hyper(MuonVariant::dion2);
  d.fraction = 1.0;
  d.ef_decay = d.momentum;
  ParamSet a(fixture::muon_test_specs(), 3), b(fixture::muon_test_specs(), 3);
  Muon dion(a.params, d, adam(), kDecay, nullptr);
  Muon muon(b.params, hyper(), adam(), kDecay, nullptr);
  for (int s = 0; s < 4; ++s) {
    a.random_grads(20 + s);
    b.random_grads(20 + s);
    dion.step(1.0);
    muon.step(1.0);
  }
  EXPECT_LT(rel_diff(a.snapshot(), b.snapshot()), kTol);
}

// One Dion2 step from a known momentum M0: the selected rows are the top-k l1 rows of
// M0 + G; unselected W rows only decay and their M rows are M0 + G; selected M rows are
// exactly ef_decay * (M0 + G).
TEST(Dion2, SelectionAndErrorFeedback) {
  for (MuonVariant v : {MuonVariant::dion2, MuonVariant::dion3}) {
    const MuonHyper h = hyper(v);
    const int64_t rows = 40, cols = 8;
    ParamSet ps({{"w", ParamTag::hidden_matrix, {rows, cols}}}, 4);
    Muon opt(ps.params, h, adam(), kDecay, nullptr);
    auto st = opt.state();
    const std::string mname = opt.name() + ".m/w";
    Tensor m = state_named(st, mname);
    Rng rng(5);
    rng.fill_normal(m.f32(), m.numel(), 0.0f, 1.0f);
    const auto M0 = values_of(m), W0 = ps.snapshot();
    ps.random_grads(6);
    std::vector<float> acc(M0.size());
    for (size_t i = 0; i < acc.size(); ++i) acc[i] = M0[i] + ps.grads.f32()[i];
    const auto sel = select_rows(acc.data(), rows, cols, cols, h.fraction);
    ASSERT_EQ(int64_t(sel.size()), 10);  // ceil(0.25 * 40)
    opt.step(1.0);
    st = opt.state();
    const auto M1 = values_of(state_named(st, mname)), W1 = ps.snapshot();
    const float decay = float(1.0 - h.lr * h.weight_decay), ef = float(h.ef_decay);
    for (int64_t r = 0; r < rows; ++r) {
      const bool selected = std::find(sel.begin(), sel.end(), r) != sel.end();
      for (int64_t j = 0; j < cols; ++j) {
        const size_t i = size_t(r * cols + j);
        if (selected) {
          EXPECT_EQ(M1[i], ef * acc[i]) << r;
          EXPECT_NE(W1[i], W0[i] * decay) << r;
        } else {
          EXPECT_EQ(M1[i], acc[i]) << r;
          EXPECT_EQ(W1[i], W0[i] * decay) << r;
        }
      }
    }
  }
}

// One Dion2 / Dion3 step's values from the spec, written out here: the selected rows are the
// top-k l1 rows of M0 + G (k = ceil(f rows) = 10 of 40, ties to the lower row); their
// submatrix A [k, cols] is orthogonalized (the naive f64 twin, same coefficients); Dion3 then
// applies NorMuon per row from v = 0 (v = (1 - beta2) mean_j O_ij^2, O / (sqrt(v) + eps),
// rescaled to the Frobenius norm of O); the step is lr * sqrt(k / cols) (spectral_norm of the
// submatrix shape, spec section 5.5) times that. No weight decay: unselected rows stay bitwise.
// Tolerance 1e-4 of the largest update entry: the f32 Gram NS against its f64 twin (1e-4 in
// FastMatchesNaive; measured 1.3e-6 to 1.7e-6 here). The full shape's lr_adjust would double
// the step (an error of 1.0 in those units), skipping NorMuon is off by 0.17 (measured).
TEST(Dion2, SelectedRowsMoveByTheSpecsUpdate) {
  for (MuonVariant v : {MuonVariant::dion2, MuonVariant::dion3}) {
    SCOPED_TRACE(v == MuonVariant::dion2 ? "dion2" : "dion3");
    MuonHyper h = hyper(v);
    h.weight_decay = 0;
    const int64_t rows = 40, cols = 8, k = 10;
    ParamSet ps({{"w", ParamTag::hidden_matrix, {rows, cols}}}, 4);
    Muon opt(ps.params, h, adam(), kDecay, nullptr);
    auto st = opt.state();
    Tensor m = state_named(st, opt.name() + ".m/w");
    Rng(5).fill_normal(m.f32(), m.numel(), 0.0f, 1.0f);
    const auto M0 = values_of(m), W0 = ps.snapshot();
    ps.random_grads(6);
    std::vector<float> acc(M0.size());
    for (size_t i = 0; i < acc.size(); ++i) acc[i] = M0[i] + ps.grads.f32()[i];
    // The k rows of largest l1 norm, ties to the lower row, in increasing row order.
    std::vector<double> score(static_cast<size_t>(rows), 0.0);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < cols; ++j)
        score[size_t(r)] += std::abs(double(acc[size_t(r * cols + j)]));
    std::vector<int64_t> sel(static_cast<size_t>(rows));
    std::iota(sel.begin(), sel.end(), int64_t(0));
    std::stable_sort(sel.begin(), sel.end(),
                     [&](int64_t a, int64_t b) { return score[size_t(a)] > score[size_t(b)]; });
    sel.resize(size_t(k));
    std::sort(sel.begin(), sel.end());
    std::vector<double> A(size_t(k * cols)), O(size_t(k * cols));
    for (int64_t i = 0; i < k; ++i)
      for (int64_t j = 0; j < cols; ++j)
        A[size_t(i * cols + j)] = acc[size_t(sel[size_t(i)] * cols + j)];
    naive::orthogonalize<double>(A.data(), k, cols, h.ns, O.data());
    if (v == MuonVariant::dion3) {
      double before = 0, after = 0;
      for (int64_t i = 0; i < k; ++i) {
        double ss = 0;
        for (int64_t j = 0; j < cols; ++j) ss += O[size_t(i * cols + j)] * O[size_t(i * cols + j)];
        const double second_moment = (1 - h.normuon_beta2) * ss / double(cols);
        const double inv = 1 / (std::sqrt(second_moment) + h.normuon_eps);
        before += ss;
        after += ss * inv * inv;
        for (int64_t j = 0; j < cols; ++j) O[size_t(i * cols + j)] *= inv;
      }
      for (double& o : O) o *= std::sqrt(before / after);
    }
    const double step = h.lr * std::sqrt(double(k) / double(cols));
    opt.step(1.0);
    const auto W1 = ps.snapshot();
    double err = 0, largest = 0;
    size_t next = 0;
    for (int64_t r = 0; r < rows; ++r) {
      const bool selected = next < sel.size() && sel[next] == r;
      for (int64_t j = 0; j < cols; ++j) {
        const size_t i = size_t(r * cols + j);
        if (!selected) {
          EXPECT_EQ(W1[i], W0[i]) << r;
          continue;
        }
        const double want = step * O[size_t(int64_t(next) * cols + j)];
        err = std::max(err, std::abs((double(W0[i]) - double(W1[i])) - want));
        largest = std::max(largest, std::abs(want));
      }
      next += selected;
    }
    ASSERT_EQ(next, sel.size());
    EXPECT_LT(err, 1e-4 * largest) << "largest update " << largest;
  }
}

TEST(RowSelection, CountAndDeterministicTieBreak) {
  EXPECT_EQ(selected_count(0.25, 40), 10);
  EXPECT_EQ(selected_count(0.1, 30), 3);  // 0.1 * 30 is 3.0000000000000004 in double
  EXPECT_EQ(selected_count(0.25, 3), 1);
  EXPECT_EQ(selected_count(0.01, 5), 1);
  EXPECT_EQ(selected_count(1.0, 7), 7);
  EXPECT_EQ(selected_count(0.5, 0), 0);
  // Rows 1, 2, 4 tie on |.|_1 = 3; row 3 is largest: k = 3 takes 3, then 1 and 2.
  const std::vector<float> X = {1, 0, 1, -2, 3, 0, 2, 2, 0, -1, 2, 0, 0, 0, 1};
  EXPECT_EQ(select_rows(X.data(), 5, 3, 3, 0.6), (std::vector<int64_t>{1, 2, 3}));
}

// A NaN score (a row holding NaN) ranks below every number, ties among NaNs going to the
// lower row: the order stays a strict weak order, so the choice stays deterministic.
TEST(RowSelection, NanScoresRankLowest) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // Row scores (2 columns): NaN, 1, 5, NaN, 3, 2, NaN, 4, 0, NaN.
  const std::vector<float> X = {nan, 0, 1, 0,   2, 3, 1, nan, 3,   0,
                                1,   1, 0, nan, 4, 0, 0, 0,   nan, nan};
  EXPECT_EQ(select_rows(X.data(), 10, 2, 2, 0.3), (std::vector<int64_t>{2, 4, 7}));
  // k = 7: the 6 numbered rows, then the lowest NaN row.
  EXPECT_EQ(select_rows(X.data(), 10, 2, 2, 0.7), (std::vector<int64_t>{0, 1, 2, 4, 5, 7, 8}));
  const std::vector<float> all_nan(8, nan);
  EXPECT_EQ(select_rows(all_nan.data(), 4, 2, 2, 0.5), (std::vector<int64_t>{0, 1}));
}

// NorMuon keeps the Frobenius norm, divides each row by sqrt(v) + eps after updating the
// given rows' v entries, and leaves the other entries of v alone.
TEST(RowSelection, NorMuonNormalization) {
  const int64_t k = 3, cols = 4;
  std::vector<float> O = {1, 2, 3, 4, 0.5f, 0.5f, 0.5f, 0.5f, -1, 0, 0, 2};
  std::vector<float> v = {9, 0.25f, 7, 1, 5};
  const std::vector<int64_t> ids = {1, 3, 4};
  const auto O0 = O, v0 = v;
  normuon_normalize(O.data(), k, cols, ids.data(), v.data(), 0.9, 1e-8);
  EXPECT_EQ(v[0], v0[0]);
  EXPECT_EQ(v[2], v0[2]);
  double before = 0, after = 0;
  std::vector<double> row_scale(static_cast<size_t>(k));
  for (int64_t i = 0; i < k; ++i) {
    double ss = 0;
    for (int64_t j = 0; j < cols; ++j)
      ss += double(O0[size_t(i * cols + j)]) * O0[size_t(i * cols + j)];
    const double vi = 0.9 * v0[size_t(ids[size_t(i)])] + 0.1 * ss / double(cols);
    EXPECT_NEAR(v[size_t(ids[size_t(i)])], vi, 1e-6 * vi);
    row_scale[size_t(i)] = 1.0 / (std::sqrt(vi) + 1e-8);
    before += ss;
    after += ss * row_scale[size_t(i)] * row_scale[size_t(i)];
  }
  const double global = std::sqrt(before / after);
  for (int64_t i = 0; i < k; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      const double want = O0[size_t(i * cols + j)] * row_scale[size_t(i)] * global;
      EXPECT_NEAR(O[size_t(i * cols + j)], want, 1e-6 * std::abs(want) + 1e-7);
    }
}

// Save, run on, restore into a fresh optimizer: the following steps repeat bitwise (every
// variant, every mode, one process).
TEST(MuonState, RoundTripIsBitwise) {
  for (MuonVariant v : {MuonVariant::muon, MuonVariant::dion2, MuonVariant::dion3})
    for (MuonMode mode : {MuonMode::sharded, MuonMode::replicated, MuonMode::allgather}) {
      MuonHyper h = hyper(v);
      h.mode = mode;
      h.nesterov = v == MuonVariant::muon;
      ParamSet ps(fixture::muon_test_specs(), 7);
      Muon opt(ps.params, h, adam(), kDecay, nullptr);
      for (int s = 0; s < 3; ++s) ps.random_grads(30 + s), opt.step(1.0);
      std::vector<Tensor> saved;
      std::vector<std::string> names;
      for (const StateTensor& s : opt.state())
        saved.push_back(s.tensor.clone()), names.push_back(s.name);
      EXPECT_EQ(names[0], opt.name() + ".step");
      EXPECT_NE(std::find(names.begin(), names.end(), "adamw.m/embed"), names.end());
      const auto params = ps.snapshot();
      for (int s = 0; s < 2; ++s) ps.random_grads(40 + s), opt.step(0.7);
      const auto expected = ps.snapshot();
      std::memcpy(ps.values.f32(), params.data(), params.size() * sizeof(float));
      Muon fresh(ps.params, h, adam(), kDecay, nullptr);
      auto st = fresh.state();
      ASSERT_EQ(st.size(), saved.size());
      for (size_t i = 0; i < st.size(); ++i) {
        EXPECT_EQ(st[i].name, names[i]);
        std::memcpy(st[i].tensor.raw(), saved[i].raw(), saved[i].bytes());
      }
      EXPECT_EQ(fresh.step_count(), 3);
      for (int s = 0; s < 2; ++s) ps.random_grads(40 + s), fresh.step(0.7);
      EXPECT_EQ(ps.snapshot(), expected) << opt.name() << " mode " << int(mode);
    }
}

using tessel::fixture::expect_input_error;

TEST(MuonFactory, NamesAndBadConfig) {
  ParamSet ps(fixture::muon_test_specs(), 8);
  for (const char* name : {"muon", "dion2", "dion3"}) {
    OptimizerConfig c;
    c.name = name;
    EXPECT_EQ(make_optimizer(c, ps.params)->name(), name);
  }
  auto with = [&](auto mutate) {
    OptimizerConfig c;
    c.name = "muon";
    mutate(c);
    return [c, &ps] { make_optimizer(c, ps.params); };
  };
  expect_input_error(with([](OptimizerConfig& c) { c.muon_lr = 0; }), {"optim.muon_lr"});
  expect_input_error(with([](OptimizerConfig& c) { c.momentum = 1; }), {"optim.momentum"});
  expect_input_error(with([](OptimizerConfig& c) { c.momentum_form = "ema"; }),
                     {"optim.momentum_form", "sum, lerp"});
  expect_input_error(with([](OptimizerConfig& c) { c.lr_rule = "x"; }), {"optim.lr_rule"});
  expect_input_error(with([](OptimizerConfig& c) { c.ns_coefficients = "turbo"; }),
                     {"optim.ns_coefficients"});
  expect_input_error(with([](OptimizerConfig& c) {
                       c.ns_coefficients = "you";
                       c.ns_steps = 6;
                     }),
                     {"optim.ns_steps", "<= 5"});
  // Polar Express's table is used whole: 4 steps leave singular values up to 1.58.
  for (int64_t steps : {1, 4})
    expect_input_error(with([&](OptimizerConfig& c) {
                         c.ns_coefficients = "polar_express";
                         c.ns_steps = steps;
                       }),
                       {"optim.ns_steps = " + std::to_string(steps), ">= 5",
                        "optim.ns_coefficients = polar_express"});
  for (int64_t steps : {5, 8})
    EXPECT_NO_THROW(with([&](OptimizerConfig& c) {
      c.ns_coefficients = "polar_express";
      c.ns_steps = steps;
    })())
        << steps;
  expect_input_error(with([](OptimizerConfig& c) { c.ns_normalize = "spectral"; }),
                     {"optim.ns_normalize"});
  expect_input_error(with([](OptimizerConfig& c) { c.ns_steps = 0; }), {"optim.ns_steps"});
  expect_input_error(with([](OptimizerConfig& c) { c.ns_restarts = "2,x"; }),
                     {"optim.ns_restarts"});
  // A restart precedes one of steps 1 .. ns_steps - 1.
  expect_input_error(with([](OptimizerConfig& c) { c.ns_restarts = "2,5"; }),
                     {"optim.ns_restarts = \"2,5\"", "5 is no step of optim.ns_steps = 5"});
  expect_input_error(with([](OptimizerConfig& c) {
                       c.ns_steps = 2;
                       c.ns_restarts = "2";
                     }),
                     {"optim.ns_restarts = \"2\"", "optim.ns_steps = 2"});
  EXPECT_NO_THROW(with([](OptimizerConfig& c) { c.ns_restarts = "1,4"; })());
  for (const char* unordered : {"2,2", "3,2", "3,3,1"})
    expect_input_error(with([&](OptimizerConfig& c) { c.ns_restarts = unordered; }),
                       {"optim.ns_restarts", "in increasing order"});
  EXPECT_NO_THROW(with([](OptimizerConfig& c) {
    c.ns_steps = 2;
    c.ns_restarts = "";
  })());
  // The default follows ns_steps: before steps 2, 5, 8, ... where there are such steps.
  const std::pair<int64_t, std::vector<int64_t>> defaults[] = {
      {1, {}}, {2, {}}, {3, {2}}, {5, {2}}, {6, {2, 5}}, {8, {2, 5}}, {12, {2, 5, 8, 11}}};
  for (const auto& [steps, restarts] : defaults) {
    OptimizerConfig c;
    c.ns_steps = steps;
    EXPECT_NO_THROW(validate(c)) << steps;
    EXPECT_EQ(ns_restart_steps(c), restarts) << steps;
  }
  expect_input_error(with([](OptimizerConfig& c) { c.ns_gram_min = 0; }), {"optim.ns_gram_min"});
  expect_input_error(with([](OptimizerConfig& c) { c.fraction = 0; }), {"optim.fraction"});
  expect_input_error(with([](OptimizerConfig& c) { c.ef_decay = 2; }), {"optim.ef_decay"});
  expect_input_error(with([](OptimizerConfig& c) { c.selection_scope = "all"; }),
                     {"optim.selection_scope"});
  expect_input_error(with([](OptimizerConfig& c) { c.normuon_beta2 = 1; }),
                     {"optim.normuon_beta2"});
  expect_input_error(with([](OptimizerConfig& c) { c.muon_mode = "fsdp"; }), {"optim.muon_mode"});
  expect_input_error(with([](OptimizerConfig& c) { c.qkv_split = "rows"; }), {"optim.qkv_split"});
}

}  // namespace

// optim.ns_normalize = aol reaches every hidden matrix's orthogonalization, through Muon and
// Dion2's row selection alike: one step from the same parameters and gradients moves every
// hidden matrix differently from the Frobenius scaling, and every other parameter (AdamW) the
// same, bitwise.
TEST(MuonFactory, AolScalingReachesEveryHiddenMatrix) {
  for (const char* name : {"muon", "dion2"}) {
    SCOPED_TRACE(name);
    auto stepped = [&](const char* normalize) {
      ParamSet ps(fixture::muon_test_specs(), 8);
      ps.random_grads(9);
      OptimizerConfig c;
      c.name = name;
      c.ns_normalize = normalize;
      make_optimizer(c, ps.params)->step(1.0);
      std::map<std::string, std::vector<float>> out;
      for (const Parameter& p : ps.params)
        out[p.name] = {p.value.f32(), p.value.f32() + p.value.numel()};
      return std::make_pair(out, ps.params);
    };
    const auto [frobenius, params] = stepped("frobenius");
    const auto aol = stepped("aol").first;
    for (const Parameter& p : params)
      EXPECT_EQ(frobenius.at(p.name) != aol.at(p.name), p.tag == ParamTag::hidden_matrix) << p.name;
  }
}
