#pragma once
// Approximate polar factor O ~ U_s V_s^T of U = U_s S V_s^T by quintic Newton-Schulz (NS)
// (spec muon_dion3.md, sections 2-3).
//
// orthogonalize(U [rows, cols]):
//   1. X = U, transposed when rows > cols, so X is [n, m] with n <= m (short side first);
//   2. X /= ||X||_F + 1e-7 (norm summed in double), so every singular value is <= 1; or, with
//      NsOptions::aol (Turbo-Muon, arXiv 2512.04632), the AOL rescaling X <- D X, D_ii =
//      (sum_j |X X^T|_ij)^(-1/2), which also bounds the singular values by 1 but on gradients
//      typically leaves the small ones larger, so one step fewer gets most of the way to the
//      band of the full count (its Gram is the first NS step's, computed once). The spec
//      writes |X^T X|; the short side's X X^T is the Gram NS reuses, so the scaled side is the
//      short one: U's rows, or a tall U's columns, and a square U's rows. D is not a multiple
//      of I, so the result approximates the polar factor of D U (U D when tall), not of U: the
//      update's direction changes slightly (Turbo-Muon reports loss +0.002 at one step fewer);
//   3. one NS core on X (below); 4. the transpose undone.
// Transposing before normalizing makes orthogonalize(U^T) == orthogonalize(U)^T bitwise for a
// non-square U (with AOL not for a square one: its rows are scaled either way).
//
// Standard NS, per step t with triple (a, b, c):  A = X X^T;  B = b A + c A^2;  X = a X + B X.
// Each step maps every singular value s to a s + b s^3 + c s^5.
//
// Gram NS does the same steps in the n x n space. R = X0 X0^T, Q = I; per step t:
//   Z = b R + c R^2;  Q = Q Z + a Q (= Z + a I right after a (re)start);
//   unless t is the last step or the step before a restart:
//     RZ = R Z + a R;  R = Z RZ + a RZ.
//   Before each restart step t: X = Q X; R = X X^T; Q = I.
//   Output Q X.
// R, Z, Q, RZ are polynomials in R0 (symmetric and commuting): X X^T and R^2 use SYRK, the
// products of two of them the lower-tile kernel (kernels/cpu/symmetric.hpp). Restarts
// re-derive R from X and stop the drift that finite precision causes (the Gram form squares
// the condition number).
//
// orthogonalize uses Gram NS when `gram` is set and gram_min <= n < m; otherwise standard NS
// (square matrices gain nothing from the Gram form: spec section 3.2). A Gram result whose
// singular values cannot come from the coefficients (mean square over 1.5^2, or not finite:
// every set keeps them <= 1.21) drifted for lack of restarts; standard NS then redoes it.
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace tessel::optim {

struct NsTriple {
  double a, b, c;
};

// "keller": KellerJordan's (3.4445, -4.7750, 2.0315) at every step (singular values end
// roughly in [0.7, 1.2], by design). "polar_express": the published 5-step Polar Express
// table (safety factor applied), then the limit (15/8, -10/8, 3/8) for further steps, which
// converge to 1; fewer than 5 steps are an error (the table's first triples overshoot, up to
// 1.97, and only its later ones bring every singular value back into [0.86, 1.14]).
// "you": the 5-step table of Dao-AILab's gram-newton-schulz README (spec section 2), as
// Turbo-Muon's reference code lists it (thib-s/flash-newton-schulz); fewer steps take its last
// ones (what Turbo-Muon runs after the AOL rescaling), more than 5 are an error.
std::vector<NsTriple> ns_coefficients(const std::string& set, int steps);

struct NsOptions {
  std::vector<NsTriple> coefficients = ns_coefficients("keller", 5);
  bool gram = true;
  std::vector<int> restarts = {2};  // 0-based steps before which Gram NS restarts
  int64_t gram_min = 64;            // smallest short side that uses Gram NS (bench_optim)
  bool symmetric = true;            // standard NS: SYRK for A and A^2 (false: GEMM only)
  bool aol = false;                 // step 2 by the AOL rescaling (Turbo-Muon), not ||X||_F
};

// Whether orthogonalize takes the Gram path for a [rows, cols] input.
bool uses_gram(const NsOptions& options, int64_t rows, int64_t cols);

// out [rows, cols] = polar approximation of U [rows, cols] (steps 1-4 above). out != U.
void orthogonalize(const float* U, int64_t rows, int64_t cols, const NsOptions& options,
                   float* out);

// The cores, in place on a normalized X [n, m], n <= m; `first_gram` (if set) is X X^T
// [n, n], full, which the first step then takes instead of computing it.
void newton_schulz(float* X, int64_t n, int64_t m, std::span<const NsTriple> coefficients,
                   bool symmetric, const float* first_gram = nullptr);
void gram_newton_schulz(float* X, int64_t n, int64_t m, std::span<const NsTriple> coefficients,
                        std::span<const int> restarts, const float* first_gram = nullptr);

namespace naive {
// The same recurrences with plain loops (naive::gemm) in T (float and double instantiated);
// orthogonalize has its own transpose and scalings too, sharing no code with the fast path.
template <class T>
void newton_schulz(T* X, int64_t n, int64_t m, std::span<const NsTriple> coefficients);
template <class T>
void gram_newton_schulz(T* X, int64_t n, int64_t m, std::span<const NsTriple> coefficients,
                        std::span<const int> restarts);
template <class T>
void orthogonalize(const T* U, int64_t rows, int64_t cols, const NsOptions& options, T* out);
}  // namespace naive

}  // namespace tessel::optim
