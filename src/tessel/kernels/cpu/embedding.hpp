#pragma once
// Embedding lookup: y[n, :] = table[ids[n], :], table [V, C], ids [N] in [0, V).
// Out-of-range ids throw tessel::InputError naming the id.
// The backward scatter-adds in a fixed order (parallel over columns, never over
// tokens), so it is deterministic.
#include <cstdint>

namespace tessel::kernels {

void embedding_forward(float* y, const int32_t* ids, const float* table, int64_t N, int64_t V,
                       int64_t C);
void embedding_backward(float* dtable, const float* dy, const int32_t* ids, int64_t N, int64_t V,
                        int64_t C);

namespace naive {
template <class T>
void embedding_forward(T* y, const int32_t* ids, const T* table, int64_t N, int64_t V, int64_t C);
template <class T>
void embedding_backward(T* dtable, const T* dy, const int32_t* ids, int64_t N, int64_t V,
                        int64_t C);
}  // namespace naive

}  // namespace tessel::kernels
