#pragma once
// exp for f32 that inlines and vectorizes inside `#pragma omp simd` loops (a call to expf
// does neither without -ffast-math). Cody-Waite range reduction x = n ln2 + r, |r| <= ln2/2,
// and the Cephes degree-6 polynomial for e^r: within 2 ulp of expf over the normal range.
// Results below the smallest subnormal give 0, above FLT_MAX +inf; NaN stays NaN.
#include <bit>
#include <cmath>
#include <cstdint>

namespace tessel::kernels::detail {

inline float fast_expf(float x) {
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2Hi = 0.693359375f;  // ln 2 = kLn2Hi + kLn2Lo, kLn2Hi exact in 9 bits
  constexpr float kLn2Lo = -2.12194440e-4f;
  constexpr float kRound = 12582912.0f;    // 1.5 * 2^23: adding it rounds to an integer
  constexpr float kMaxArg = 88.7228394f;   // ln FLT_MAX
  constexpr float kMinArg = -103.972084f;  // ln of the smallest subnormal
  // Clamped with comparisons (they vectorize, fmin/fmax do not); NaN passes through.
  float xc = x < kMinArg ? kMinArg : x;
  xc = xc > kMaxArg ? kMaxArg : xc;
  const float t = std::fma(xc, kLog2e, kRound);
  const float n = t - kRound;
  // n in [-150, 128]; its integer value is in the low mantissa bits of t (no float->int cast).
  const int32_t ni = std::bit_cast<int32_t>(t) - std::bit_cast<int32_t>(kRound);
  float r = std::fma(-n, kLn2Hi, xc);
  r = std::fma(-n, kLn2Lo, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p, r * r, r + 1.0f);
  // 2^n = 2^n1 2^n2 with both halves in the normal exponent range, so results near
  // FLT_MAX and subnormal results need no special case.
  const int32_t n1 = ni >> 1, n2 = ni - n1;
  const float y = p * std::bit_cast<float>(uint32_t(n1 + 127) << 23) *
                  std::bit_cast<float>(uint32_t(n2 + 127) << 23);
  return x < kMinArg ? 0.0f : (x > kMaxArg ? INFINITY : y);
}

}  // namespace tessel::kernels::detail
