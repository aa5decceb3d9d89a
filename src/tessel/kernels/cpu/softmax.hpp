#pragma once
// Row softmax over the last dimension C of x [N, C] (max-subtracted, stable).
#include <cstdint>

namespace tessel::kernels {

void softmax_forward(float* y, const float* x, int64_t N, int64_t C);
// dx += y * (dy - sum(dy * y)) per row.
void softmax_backward(float* dx, const float* dy, const float* y, int64_t N, int64_t C);

namespace naive {
template <class T>
void softmax_forward(T* y, const T* x, int64_t N, int64_t C);
template <class T>
void softmax_backward(T* dx, const T* dy, const T* y, int64_t N, int64_t C);
}  // namespace naive

}  // namespace tessel::kernels
