#include "tessel/kernels/cpu/gemm_peak.hpp"

#include <algorithm>
#include <vector>

#include "tessel/core/error.hpp"
#include "tessel/core/rng.hpp"
#include "tessel/core/timer.hpp"
#include "tessel/kernels/cpu/gemm.hpp"

namespace tessel::kernels {

double measure_gemm_peak_gflops(int64_t size, double min_seconds) {
  TESSEL_CHECK(size > 0, "gemm peak size ", size);
  const int64_t n2 = size * size;
  std::vector<float> a(n2), b(n2), c(n2, 0.0f);
  Rng rng(1);
  rng.fill_uniform(a.data(), n2, -1.0f, 1.0f);
  rng.fill_uniform(b.data(), n2, -1.0f, 1.0f);
  const auto call = [&] {
    gemm(false, false, size, size, size, 1.0f, a.data(), size, b.data(), size, 0.0f, c.data(),
         size);
  };
  call();  // warm-up: thread pool start, page faults, caches
  const double flops = 2.0 * double(size) * double(size) * double(size);
  double best = 0.0;
  const Timer total;
  do {
    const Timer t;
    call();
    best = std::max(best, flops / std::max(t.seconds(), 1e-12) * 1e-9);
  } while (total.seconds() < min_seconds);
  return best;
}

}  // namespace tessel::kernels
