#include "tessel/kernels/cpu/activations.hpp"

#include "tessel/kernels/cpu/fast_exp.hpp"

namespace tessel::kernels {

namespace {

constexpr float kSqrt2OverPi = 0.7978845608028654f;
constexpr float kGeluCubic = 0.044715f;

inline float sigmoid(float g) {
  return 1.0f / (1.0f + detail::fast_expf(-g));
}

// 0.5 (1 + tanh(u)) = sigmoid(2u): one exp per element, no cancellation near u = 0.
inline float gelu_gate(float x) {
  return sigmoid(2.0f * kSqrt2OverPi * (x + kGeluCubic * x * x * x));
}

}  // namespace

void gelu_forward(float* y, const float* x, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) y[i] = x[i] * gelu_gate(x[i]);
}

// d/dx [x s] with s = sigmoid(2u): s + x * 2 s (1 - s) du/dx.
void gelu_backward(float* dx, const float* dy, const float* x, int64_t n) {
#pragma omp parallel for simd schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float s = gelu_gate(x[i]);
    const float du = kSqrt2OverPi * (1.0f + 3.0f * kGeluCubic * x[i] * x[i]);
    dx[i] += dy[i] * (s + 2.0f * x[i] * s * (1.0f - s) * du);
  }
}

void swiglu_forward(float* y, const float* x, int64_t N, int64_t H) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* gate = x + n * 2 * H;
    const float* up = gate + H;
    float* yr = y + n * H;
#pragma omp simd
    for (int64_t i = 0; i < H; ++i) yr[i] = gate[i] * sigmoid(gate[i]) * up[i];
  }
}

// d silu(g)/dg = s (1 + g (1 - s)), s = sigmoid(g).
void swiglu_backward(float* dx, const float* dy, const float* x, int64_t N, int64_t H) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const float* gate = x + n * 2 * H;
    const float* up = gate + H;
    const float* dyr = dy + n * H;
    float* dgate = dx + n * 2 * H;
    float* dup = dgate + H;
#pragma omp simd
    for (int64_t i = 0; i < H; ++i) {
      const float g = gate[i];
      const float s = sigmoid(g);
      dgate[i] += dyr[i] * up[i] * s * (1.0f + g * (1.0f - s));
      dup[i] += dyr[i] * g * s;
    }
  }
}

}  // namespace tessel::kernels
