#pragma once
// Fractional row selection (Dion2) and the NorMuon per-neuron normalization (Dion3), spec
// muon_dion3.md section 5.
#include <cstdint>
#include <vector>

namespace tessel::optim {

// k = max(1, ceil(f * n)) rows of n (0 when n = 0). The product is rounded down by 1e-9
// first, so f * n that is an integer in exact arithmetic (0.1 * 30) gives that integer.
int64_t selected_count(double fraction, int64_t n);

// The rows (0-based, ascending) with the selected_count(fraction, n) largest l1 norms among
// the n rows of X (row i at X + i * stride, `cols` values; norms summed in double in column
// order). Ties go to the lower row number, so the choice is deterministic; a NaN score
// ranks below every number.
std::vector<int64_t> select_rows(const float* X, int64_t n, int64_t cols, int64_t stride,
                                 double fraction);

// NorMuon on the orthogonalized rows O [k, cols] whose neurons (selection slices) have
// second-moment entries v[ids[i]]:
//   r_i = mean_j O_ij^2;  v_i = beta2 v_i + (1 - beta2) r_i;  O_ij /= sqrt(v_i) + eps;
//   then O *= ||O_before||_F / ||O_after||_F (norms in double).
// Only the given neurons' entries of v change. Always per row, also where the spec takes
// columns (a wide O): the rows are Muon's selection slices (docs/architecture.md).
void normuon_normalize(float* O, int64_t k, int64_t cols, const int64_t* ids, float* v,
                       double beta2, double eps);

}  // namespace tessel::optim
