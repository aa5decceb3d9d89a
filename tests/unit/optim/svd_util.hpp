#pragma once
// Reference polar factors and singular values from LAPACK's dgesvd (in the OpenBLAS that
// tessel links), for the Newton-Schulz tests.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

extern "C" void dgesvd_(const char* jobu, const char* jobvt, const int* m, const int* n, double* a,
                        const int* lda, double* s, double* u, const int* ldu, double* vt,
                        const int* ldvt, double* work, const int* lwork, int* info);

namespace tessel::optim::test {

struct Svd {
  std::vector<double> polar;  // U V^T, row-major [rows, cols]
  std::vector<double> sigma;  // descending
};

// A row-major [r, c] is the column-major [c, r] matrix B = A^T; polar(B) = U_b VT_b read back
// row-major is polar(B)^T = polar(A).
inline Svd svd(std::vector<double> A, int64_t r, int64_t c) {
  const int m = int(c), n = int(r), k = std::min(m, n);
  std::vector<double> s(static_cast<size_t>(k)), u(size_t(m) * size_t(k)),
      vt(size_t(k) * size_t(n));
  int lwork = -1, info = 0;
  double query = 0;
  dgesvd_("S", "S", &m, &n, A.data(), &m, s.data(), u.data(), &m, vt.data(), &k, &query, &lwork,
          &info);
  lwork = int(query);
  std::vector<double> work(static_cast<size_t>(lwork));
  dgesvd_("S", "S", &m, &n, A.data(), &m, s.data(), u.data(), &m, vt.data(), &k, work.data(),
          &lwork, &info);
  EXPECT_EQ(info, 0);
  Svd out{std::vector<double>(size_t(m) * size_t(n), 0.0), s};
  for (int j = 0; j < n; ++j)  // column-major [m, n] = U [m, k] * VT [k, n]
    for (int p = 0; p < k; ++p)
      for (int i = 0; i < m; ++i)
        out.polar[size_t(j) * size_t(m) + size_t(i)] +=
            u[size_t(p) * size_t(m) + size_t(i)] * vt[size_t(j) * size_t(k) + size_t(p)];
  return out;
}

// ||got - want||_F / ||want||_F.
template <class V>
double rel_frobenius(const V& got, const std::vector<double>& want) {
  EXPECT_EQ(got.size(), want.size());
  double d = 0, w = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    d += (double(got[i]) - want[i]) * (double(got[i]) - want[i]);
    w += want[i] * want[i];
  }
  return std::sqrt(d / w);
}

}  // namespace tessel::optim::test
