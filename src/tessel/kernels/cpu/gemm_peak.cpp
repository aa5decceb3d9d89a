#include "tessel/kernels/cpu/gemm_peak.hpp"

#include <cblas.h>
#include <omp.h>

#include <algorithm>
#include <vector>

#include "tessel/core/error.hpp"
#include "tessel/core/rng.hpp"
#include "tessel/core/timer.hpp"
#include "tessel/kernels/cpu/gemm.hpp"

namespace tessel::kernels {

// Times tessel's gemm (single-threaded OpenBLAS per OpenMP thread) and OpenBLAS's own
// threading over the same thread count and keeps the best rate of either, so a weaker GEMM
// path never flatters the MFU.
double measure_gemm_peak_gflops(int64_t size, double min_seconds) {
  TESSEL_CHECK(size > 0, "gemm peak size ", size);
  const int64_t n2 = size * size;
  const int n = int(size);
  std::vector<float> a(n2), b(n2), c(n2, 0.0f);
  Rng rng(1);
  rng.fill_uniform(a.data(), n2, -1.0f, 1.0f);
  rng.fill_uniform(b.data(), n2, -1.0f, 1.0f);
  const auto pooled = [&] {
    gemm(false, false, size, size, size, 1.0f, a.data(), size, b.data(), size, 0.0f, c.data(),
         size);
  };
  const auto blas_threaded = [&] {
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n,
                0.0f, c.data(), n);
  };
  const double flops = 2.0 * double(size) * double(size) * double(size);
  double best = 0.0;
  // Each path gets its own phase (a warm-up call, then half the time): alternating call by
  // call would leave one pool spinning while the other is timed.
  const auto phase = [&](const auto& call) {
    call();
    const Timer total;
    do {
      const Timer t;
      call();
      best = std::max(best, flops / std::max(t.seconds(), 1e-12) * 1e-9);
    } while (total.seconds() < 0.5 * min_seconds);
  };
  openblas_set_num_threads(omp_get_max_threads());  // the next gemm() call sets it back to 1
  phase(blas_threaded);
  phase(pooled);  // last, so OpenBLAS is left single-threaded as every gemm call expects
  return best;
}

}  // namespace tessel::kernels
