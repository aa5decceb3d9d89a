#pragma once
// Token-id validation shared by the fast and naive embedding kernels.
#include <cstdint>

#include "tessel/core/error.hpp"

namespace tessel::kernels::detail {

// Throws InputError naming the first id outside [0, V).
inline void check_embedding_ids(const int32_t* ids, int64_t N, int64_t V) {
  for (int64_t n = 0; n < N; ++n)
    if (ids[n] < 0 || ids[n] >= V)
      input_error("embedding: token id ", ids[n], " at position ", n,
                  " is outside the vocabulary [0, ", V, ")");
}

}  // namespace tessel::kernels::detail
