#pragma once
// GELU (tanh approximation, as GPT-2) and SwiGLU.
//   gelu(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
//   swiglu:  x [N, 2H] holds per row [gate (H) | up (H)]; y [N, H] = silu(gate) * up,
//            silu(g) = g * sigmoid(g)
#include <cstdint>

namespace tessel::kernels {

void gelu_forward(float* y, const float* x, int64_t n);
void gelu_backward(float* dx, const float* dy, const float* x, int64_t n);
void swiglu_forward(float* y, const float* x, int64_t N, int64_t H);
void swiglu_backward(float* dx, const float* dy, const float* x, int64_t N, int64_t H);

namespace naive {
template <class T>
void gelu_forward(T* y, const T* x, int64_t n);
template <class T>
void gelu_backward(T* dx, const T* dy, const T* x, int64_t n);
template <class T>
void swiglu_forward(T* y, const T* x, int64_t N, int64_t H);
template <class T>
void swiglu_backward(T* dx, const T* dy, const T* x, int64_t N, int64_t H);
}  // namespace naive

}  // namespace tessel::kernels
