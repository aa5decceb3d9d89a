#include "tessel/optim/newton_schulz.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "tessel/core/error.hpp"
#include "tessel/kernels/cpu/gemm.hpp"
#include "tessel/kernels/cpu/symmetric.hpp"

namespace tessel::optim {

namespace {

constexpr double kNormEps = 1e-7;
constexpr double kAolFloor = 1e-12;  // smallest row sum of |X X^T|, relative to the largest
// Every coefficient set maps singular values in [0, 1] to at most 1.21 (exact arithmetic, any
// step count), so an output's squared Frobenius norm over its n rows is at most 1.21^2; a Gram
// result beyond 1.5^2 (or not finite) is a drifted recurrence, not a rounding of the true one.
constexpr double kMaxMeanSquaredSingular = 1.5 * 1.5;

// Runs `gram_core` on the normalized X [n, m]. Too few restarts let the Gram recurrence drift,
// in f32 far enough to blow a weight up (1e25 in one step with one restart for 12 steps): a
// result whose squared Frobenius norm over n leaves the band above (or is not a number) puts X
// back and returns false, for standard NS, whose result the Gram one only re-associates.
template <class T, class GramCore>
bool gram_result_kept(std::vector<T>& X, int64_t n, GramCore gram_core) {
  std::vector<T> start = X;
  gram_core();
  double ss = 0;
  for (T x : X) ss += double(x) * double(x);
  if (ss <= kMaxMeanSquaredSingular * double(n)) return true;
  X = std::move(start);
  return false;
}

bool restarts_before(std::span<const int> restarts, int64_t t) {
  return t > 0 && std::find(restarts.begin(), restarts.end(), int(t)) != restarts.end();
}

// AOL rescaling (Prach & Lampert's almost-orthogonal layers, Turbo-Muon's preconditioner):
// X <- D X with D_ii = (sum_j |X X^T|_ij)^(-1/2), which bounds ||D X||_2 by 1 like the
// Frobenius normalization; on a gradient the rows' sums are typically far below the whole
// Frobenius sum, so the small singular values start larger. `gram` [n, n] holds X X^T on entry
// and (D X)(D X)^T on return, the first step's Gram, which the core need not compute again.
// A row sum is floored relative to the largest (kAolFloor), not absolutely, so the result does
// not depend on the gradient's scale; an all-zero X stays zero.
void aol_rescale(float* X, int64_t n, int64_t m, float* gram) {
  std::vector<double> rows(static_cast<size_t>(n), 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j) rows[size_t(i)] += std::fabs(double(gram[i * n + j]));
  const double floor = std::max(kAolFloor * *std::max_element(rows.begin(), rows.end()),
                                std::numeric_limits<double>::min());
  std::vector<float> d(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    d[size_t(i)] = float(1.0 / std::sqrt(std::max(rows[size_t(i)], floor)));
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t j = 0; j < m; ++j) X[i * m + j] *= d[size_t(i)];
    for (int64_t j = 0; j < n; ++j) gram[i * n + j] *= d[size_t(i)] * d[size_t(j)];
  }
}

}  // namespace

std::vector<NsTriple> ns_coefficients(const std::string& set, int steps) {
  TESSEL_CHECK(steps >= 0, "ns steps ", steps);
  if (set == "keller") return std::vector<NsTriple>(size_t(steps), {3.4445, -4.7750, 2.0315});
  if (set == "you") {
    // Dao-AILab's table, as Turbo-Muon's reference implementation lists it (see the header).
    static const NsTriple table[] = {{4.0848, -6.8946, 2.9270},
                                     {3.9505, -6.3029, 2.6377},
                                     {3.7418, -5.5913, 2.3037},
                                     {2.8769, -3.1427, 1.2046},
                                     {2.8366, -3.0525, 1.2012}};
    TESSEL_CHECK(steps <= 5, "the you coefficient set has 5 steps, asked for ", steps);
    return {std::end(table) - steps, std::end(table)};
  }
  if (set == "polar_express") {
    static const NsTriple table[] = {
        {8.156554524902461, -22.48329292557795, 15.878769915207462},
        {4.042929935166739, -2.808917465908714, 0.5000178451051316},
        {3.8916678022926607, -2.772484153217685, 0.5060648178503393},
        {3.285753657755655, -2.3681294933425376, 0.46449024233003106},
        {2.3465413258596377, -1.7097828382687081, 0.42323551169305323}};
    TESSEL_CHECK(steps >= 5, "the polar_express coefficient set needs at least its 5 steps, ",
                 "asked for ", steps);
    std::vector<NsTriple> out;
    for (int t = 0; t < steps; ++t)
      out.push_back(t < 5 ? table[t] : NsTriple{15.0 / 8, -10.0 / 8, 3.0 / 8});
    return out;
  }
  TESSEL_CHECK(false, "unknown Newton-Schulz coefficient set ", set);
  return {};
}

bool uses_gram(const NsOptions& o, int64_t rows, int64_t cols) {
  const int64_t n = std::min(rows, cols), m = std::max(rows, cols);
  return o.gram && n >= o.gram_min && n < m;
}

void newton_schulz(float* X, int64_t n, int64_t m, std::span<const NsTriple> coefficients,
                   bool symmetric, const float* first_gram) {
  using kernels::gemm;
  std::vector<float> A(size_t(n * n)), B(size_t(n * n)), Y(size_t(n * m));
  for (const NsTriple& k : coefficients) {
    if (first_gram)
      std::copy(first_gram, first_gram + n * n, A.data());
    else if (symmetric)
      kernels::syrk(n, m, 1.0f, X, 0.0f, A.data());
    else
      gemm(false, true, n, n, m, 1.0f, X, m, X, m, 0.0f, A.data(), n);
    first_gram = nullptr;
    B = A;  // B = b A + c A^2 (A^2 = A A^T)
    if (symmetric)
      kernels::syrk(n, n, float(k.c), A.data(), float(k.b), B.data());
    else
      gemm(false, false, n, n, n, float(k.c), A.data(), n, A.data(), n, float(k.b), B.data(), n);
    std::copy(X, X + n * m, Y.data());  // X = a X + B X
    gemm(false, false, n, m, n, 1.0f, B.data(), n, X, m, float(k.a), Y.data(), m);
    std::copy(Y.begin(), Y.end(), X);
  }
}

void gram_newton_schulz(float* X, int64_t n, int64_t m, std::span<const NsTriple> coefficients,
                        std::span<const int> restarts, const float* first_gram) {
  using kernels::commuting_product;
  using kernels::gemm;
  using kernels::syrk;
  const int64_t T = int64_t(coefficients.size());
  if (T == 0) return;
  const size_t nn = size_t(n * n);
  std::vector<float> R(nn), Q(nn), Z(nn), RZ(nn), tmp(nn), Y(size_t(n * m));
  auto apply_q = [&] {  // X = Q X
    gemm(false, false, n, m, n, 1.0f, Q.data(), n, X, m, 0.0f, Y.data(), m);
    std::copy(Y.begin(), Y.end(), X);
  };
  if (first_gram)
    std::copy(first_gram, first_gram + n * n, R.data());
  else
    syrk(n, m, 1.0f, X, 0.0f, R.data());
  bool fresh = true;
  for (int64_t t = 0; t < T; ++t) {
    const NsTriple& k = coefficients[size_t(t)];
    if (restarts_before(restarts, t)) {
      apply_q();
      syrk(n, m, 1.0f, X, 0.0f, R.data());
      fresh = true;
    }
    Z = R;  // Z = b R + c R^2
    syrk(n, n, float(k.c), R.data(), float(k.b), Z.data());
    if (fresh) {
      Q = Z;
      for (int64_t i = 0; i < n; ++i) Q[size_t(i * n + i)] += float(k.a);
      fresh = false;
    } else {
      tmp = Q;  // Q = Q Z + a Q
      commuting_product(n, 1.0f, Q.data(), Z.data(), float(k.a), tmp.data());
      std::swap(Q, tmp);
    }
    if (t + 1 < T && !restarts_before(restarts, t + 1)) {
      RZ = R;  // RZ = R Z + a R
      commuting_product(n, 1.0f, R.data(), Z.data(), float(k.a), RZ.data());
      R = RZ;  // R = Z RZ + a RZ
      commuting_product(n, 1.0f, Z.data(), RZ.data(), float(k.a), R.data());
    }
  }
  apply_q();
}

// Steps 1-4 of the header: the short side first, scaled, one core, the transpose undone.
void orthogonalize(const float* U, int64_t rows, int64_t cols, const NsOptions& o, float* out) {
  TESSEL_CHECK(rows > 0 && cols > 0, "orthogonalize of a ", rows, "x", cols, " matrix");
  const bool tall = rows > cols;
  const int64_t n = tall ? cols : rows, m = tall ? rows : cols;
  std::vector<float> X(size_t(n * m));
  if (tall)
    kernels::transpose(U, rows, cols, X.data());
  else
    std::copy(U, U + n * m, X.data());
  // With AOL the rescaled X's Gram is the first step's, handed to the core.
  std::vector<float> gram;
  if (o.aol) {
    gram.resize(size_t(n * n));
    kernels::syrk(n, m, 1.0f, X.data(), 0.0f, gram.data());
    aol_rescale(X.data(), n, m, gram.data());
  } else {
    double ss = 0;
    for (float x : X) ss += double(x) * double(x);
    const float inv = float(1.0 / (std::sqrt(ss) + kNormEps));
    for (float& x : X) x *= inv;
  }
  const float* first_gram = o.aol ? gram.data() : nullptr;
  const bool gram_done =
      uses_gram(o, rows, cols) && gram_result_kept(X, n, [&] {
        gram_newton_schulz(X.data(), n, m, o.coefficients, o.restarts, first_gram);
      });
  if (!gram_done) newton_schulz(X.data(), n, m, o.coefficients, o.symmetric, first_gram);
  if (tall)
    kernels::transpose(X.data(), n, m, out);
  else
    std::copy(X.begin(), X.end(), out);
}

namespace naive {

template <class T>
void newton_schulz(T* X, int64_t n, int64_t m, std::span<const NsTriple> coefficients) {
  using kernels::naive::gemm;
  std::vector<T> A(size_t(n * n)), B(size_t(n * n)), Y(size_t(n * m));
  for (const NsTriple& k : coefficients) {
    gemm<T>(false, true, n, n, m, T(1), X, m, X, m, T(0), A.data(), n);
    gemm<T>(false, false, n, n, n, T(1), A.data(), n, A.data(), n, T(0), B.data(), n);
    for (size_t i = 0; i < B.size(); ++i) B[i] = T(k.b) * A[i] + T(k.c) * B[i];
    gemm<T>(false, false, n, m, n, T(1), B.data(), n, X, m, T(0), Y.data(), m);
    for (int64_t i = 0; i < n * m; ++i) X[i] = T(k.a) * X[i] + Y[size_t(i)];
  }
}

template <class T>
void gram_newton_schulz(T* X, int64_t n, int64_t m, std::span<const NsTriple> coefficients,
                        std::span<const int> restarts) {
  using kernels::naive::gemm;
  const int64_t T_ = int64_t(coefficients.size());
  if (T_ == 0) return;
  const size_t nn = size_t(n * n);
  std::vector<T> R(nn), Q(nn), Z(nn), RZ(nn), P(nn), Y(size_t(n * m));
  auto mul = [&](const std::vector<T>& A, const std::vector<T>& B, std::vector<T>& C) {
    gemm<T>(false, false, n, n, n, T(1), A.data(), n, B.data(), n, T(0), C.data(), n);
  };
  auto gram = [&] { gemm<T>(false, true, n, n, m, T(1), X, m, X, m, T(0), R.data(), n); };
  auto apply_q = [&] {
    gemm<T>(false, false, n, m, n, T(1), Q.data(), n, X, m, T(0), Y.data(), m);
    std::copy(Y.begin(), Y.end(), X);
  };
  gram();
  for (size_t i = 0; i < nn; ++i) Q[i] = i % size_t(n + 1) == 0 ? T(1) : T(0);
  for (int64_t t = 0; t < T_; ++t) {
    const NsTriple& k = coefficients[size_t(t)];
    if (restarts_before(restarts, t)) {
      apply_q();
      gram();
      for (size_t i = 0; i < nn; ++i) Q[i] = i % size_t(n + 1) == 0 ? T(1) : T(0);
    }
    mul(R, R, Z);
    for (size_t i = 0; i < nn; ++i) Z[i] = T(k.b) * R[i] + T(k.c) * Z[i];
    mul(Q, Z, P);
    for (size_t i = 0; i < nn; ++i) Q[i] = P[i] + T(k.a) * Q[i];
    if (t + 1 < T_ && !restarts_before(restarts, t + 1)) {
      mul(R, Z, P);
      for (size_t i = 0; i < nn; ++i) RZ[i] = P[i] + T(k.a) * R[i];
      mul(Z, RZ, P);
      for (size_t i = 0; i < nn; ++i) R[i] = P[i] + T(k.a) * RZ[i];
    }
  }
  apply_q();
}

// Written apart from the fast path (its own transpose, scalings and Gram), so that a slip in
// either shows as a difference: X [n, m] is U, or U^T when tall, read element by element.
template <class T>
void orthogonalize(const T* U, int64_t rows, int64_t cols, const NsOptions& o, T* out) {
  TESSEL_CHECK(rows > 0 && cols > 0, "orthogonalize of a ", rows, "x", cols, " matrix");
  const bool tall = rows > cols;
  const int64_t n = tall ? cols : rows, m = tall ? rows : cols;
  auto u_index = [&](int64_t i, int64_t j) { return tall ? j * cols + i : i * cols + j; };
  std::vector<T> X(size_t(n * m));
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < m; ++j) X[size_t(i * m + j)] = U[u_index(i, j)];
  if (o.aol) {
    // D_ii = (sum_k |X X^T|_ik)^(-1/2), each row's sum floored at kAolFloor times the largest.
    std::vector<double> sums(static_cast<size_t>(n), 0.0);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t k = 0; k < n; ++k) {
        double g = 0;
        for (int64_t j = 0; j < m; ++j)
          g += double(X[size_t(i * m + j)]) * double(X[size_t(k * m + j)]);
        sums[size_t(i)] += std::fabs(g);
      }
    double largest = 0;
    for (double x : sums) largest = std::max(largest, x);
    const double floor = std::max(kAolFloor * largest, std::numeric_limits<double>::min());
    for (int64_t i = 0; i < n; ++i) {
      const T d = T(1.0 / std::sqrt(std::max(sums[size_t(i)], floor)));
      for (int64_t j = 0; j < m; ++j) X[size_t(i * m + j)] *= d;
    }
  } else {
    double ss = 0;
    for (int64_t i = 0; i < n * m; ++i) ss += double(X[size_t(i)]) * double(X[size_t(i)]);
    const T inv = T(1.0 / (std::sqrt(ss) + kNormEps));
    for (int64_t i = 0; i < n * m; ++i) X[size_t(i)] *= inv;
  }
  // The twin's cores compute the first Gram themselves; a drifted Gram result is redone too.
  const bool gram_done = uses_gram(o, rows, cols) && gram_result_kept(X, n, [&] {
                           gram_newton_schulz<T>(X.data(), n, m, o.coefficients, o.restarts);
                         });
  if (!gram_done) newton_schulz<T>(X.data(), n, m, o.coefficients);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < m; ++j) out[u_index(i, j)] = X[size_t(i * m + j)];
}

#define TESSEL_INSTANTIATE(T)                                                          \
  template void newton_schulz<T>(T*, int64_t, int64_t, std::span<const NsTriple>);     \
  template void gram_newton_schulz<T>(T*, int64_t, int64_t, std::span<const NsTriple>, \
                                      std::span<const int>);                           \
  template void orthogonalize<T>(const T*, int64_t, int64_t, const NsOptions&, T*);
TESSEL_INSTANTIATE(float)
TESSEL_INSTANTIATE(double)
#undef TESSEL_INSTANTIATE

}  // namespace naive

}  // namespace tessel::optim
