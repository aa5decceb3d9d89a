#include "tessel/core/threading.hpp"

#include <omp.h>

#include "tessel/core/error.hpp"

extern "C" void openblas_set_num_threads(int);

namespace tessel {

// OpenBLAS is its OpenMP build: both calls set the same pool; the second keeps
// OpenBLAS's own record of the count in step.
void set_num_threads(int n) {
  if (n < 1) input_error("threads must be at least 1, got ", n);
  omp_set_num_threads(n);
  openblas_set_num_threads(n);
}

int num_threads() {
  return omp_get_max_threads();
}

}  // namespace tessel
