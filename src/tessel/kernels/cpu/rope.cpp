#include "tessel/kernels/cpu/rope.hpp"

#include <cmath>
#include <vector>

#include "tessel/core/error.hpp"

namespace tessel::kernels {

namespace {

// Rotates every head of every token by its angle; sign = +1 forward, -1 for the inverse.
// accumulate: out += rotation(in) instead of out = rotation(in).
template <bool accumulate>
void rotate(float* out, const float* in, const int32_t* pos, int64_t N, int64_t H, int64_t D,
            float theta, float sign) {
  TESSEL_CHECK(D % 2 == 0, "rope head dim must be even, got ", D);
  const int64_t half = D / 2;
  std::vector<double> freq(half);
  for (int64_t i = 0; i < half; ++i)
    freq[i] = std::pow(double(theta), -2.0 * double(i) / double(D));
#pragma omp parallel
  {
    std::vector<float> cs(half), sn(half);  // per-thread angle tables of one token
#pragma omp for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      // Angles in double: pos * freq reaches thousands of radians.
      for (int64_t i = 0; i < half; ++i) {
        const double a = double(pos[n]) * freq[i];
        cs[i] = float(std::cos(a));
        sn[i] = sign * float(std::sin(a));
      }
      for (int64_t h = 0; h < H; ++h) {
        const float* x = in + (n * H + h) * D;
        float* y = out + (n * H + h) * D;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float a = x[i], b = x[i + half];  // read both before writing (in place)
          const float ya = a * cs[i] - b * sn[i];
          const float yb = a * sn[i] + b * cs[i];
          if constexpr (accumulate) {
            y[i] += ya;
            y[i + half] += yb;
          } else {
            y[i] = ya;
            y[i + half] = yb;
          }
        }
      }
    }
  }
}

}  // namespace

void rope_forward(float* y, const float* x, const int32_t* pos, int64_t N, int64_t H, int64_t D,
                  float theta) {
  rotate<false>(y, x, pos, N, H, D, theta, 1.0f);
}

void rope_backward(float* dx, const float* dy, const int32_t* pos, int64_t N, int64_t H, int64_t D,
                   float theta) {
  rotate<true>(dx, dy, pos, N, H, D, theta, -1.0f);
}

}  // namespace tessel::kernels
