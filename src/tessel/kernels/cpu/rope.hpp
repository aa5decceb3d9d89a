#pragma once
// Rotary position embedding on x [N, H, D] (N tokens, H heads, head dim D even),
// "rotate-half" pairing: element i pairs with i + D/2 for i < D/2,
//   freq_i = theta^(-2i/D), angle = pos[n] * freq_i,
//   y_i        = x_i cos - x_{i+D/2} sin
//   y_{i+D/2}  = x_i sin + x_{i+D/2} cos
// pos [N] holds each token's position (so packed or context-parallel tokens carry
// their own). y may equal x (in place). Backward applies the inverse rotation.
#include <cstdint>

namespace tessel::kernels {

void rope_forward(float* y, const float* x, const int32_t* pos, int64_t N, int64_t H, int64_t D,
                  float theta);
void rope_backward(float* dx, const float* dy, const int32_t* pos, int64_t N, int64_t H, int64_t D,
                   float theta);

namespace naive {
template <class T>
void rope_forward(T* y, const T* x, const int32_t* pos, int64_t N, int64_t H, int64_t D, T theta);
template <class T>
void rope_backward(T* dx, const T* dy, const int32_t* pos, int64_t N, int64_t H, int64_t D,
                   T theta);
}  // namespace naive

}  // namespace tessel::kernels
