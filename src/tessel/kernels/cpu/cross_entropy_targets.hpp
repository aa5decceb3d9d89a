#pragma once
// Target validation shared by the fast and naive cross-entropy kernels.
#include <cstdint>

#include "tessel/core/error.hpp"

namespace tessel::kernels::detail {

// Throws InputError naming the first weighted token whose target is outside [0, V).
template <class T>
void check_targets(const int32_t* targets, const T* weight, int64_t N, int64_t V) {
  for (int64_t n = 0; n < N; ++n)
    if (weight[n] != T(0) && (targets[n] < 0 || targets[n] >= V))
      input_error("cross-entropy: target ", targets[n], " of token ", n,
                  " is outside the vocabulary [0, ", V, ")");
}

}  // namespace tessel::kernels::detail
