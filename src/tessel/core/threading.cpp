#include "tessel/core/threading.hpp"

#include <omp.h>

#include "tessel/core/error.hpp"

extern "C" void openblas_set_num_threads(int);

namespace tessel {

void set_num_threads(int n) {
  if (n < 1) input_error("threads must be at least 1, got ", n);
  omp_set_num_threads(n);
  openblas_set_num_threads(n);
}

int num_threads() {
  return omp_get_max_threads();
}

int default_num_threads() {
  return omp_get_max_threads();
}

}  // namespace tessel
