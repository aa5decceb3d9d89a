#include "tessel/kernels/cpu/attention.hpp"

#include <cmath>
#include <vector>

#include "tessel/core/error.hpp"
#include "tessel/kernels/cpu/fast_exp.hpp"

namespace tessel::kernels {

namespace {

inline float dot(const float* a, const float* b, int64_t D) {
  float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
  for (int64_t d = 0; d < D; ++d) acc += a[d] * b[d];
  return acc;
}

inline void axpy(float* y, float alpha, const float* x, int64_t D) {
#pragma omp simd
  for (int64_t d = 0; d < D; ++d) y[d] += alpha * x[d];
}

void check_shape(const AttentionShape& s) {
  TESSEL_CHECK(s.Hq > 0 && s.Hkv > 0 && s.Hq % s.Hkv == 0, "attention heads Hq=", s.Hq,
               " Hkv=", s.Hkv);
}

}  // namespace

// Rows (b, h, i) are independent: each is computed by one thread with per-thread score
// scratch of size T. Interleaved rows balance the triangular work.
void causal_attention_forward(float* o, float* lse, const float* q, const float* k, const float* v,
                              const AttentionShape& s) {
  check_shape(s);
  const int64_t B = s.B, T = s.T, Hq = s.Hq, Hkv = s.Hkv, D = s.D, rep = Hq / Hkv;
  const float scale = 1.0f / std::sqrt(float(D));
#pragma omp parallel
  {
    std::vector<float> p(T);
#pragma omp for collapse(3) schedule(static, 1)
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < Hq; ++h)
        for (int64_t i = 0; i < T; ++i) {
          const float* qi = q + ((b * T + i) * Hq + h) * D;
          const float* kb = k + (b * T * Hkv + h / rep) * D;  // row j at kb + j * Hkv * D
          const float* vb = v + (b * T * Hkv + h / rep) * D;
          float m = -INFINITY;
          for (int64_t j = 0; j <= i; ++j) {
            p[j] = scale * dot(qi, kb + j * Hkv * D, D);
            m = std::fmax(m, p[j]);
          }
          float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
          for (int64_t j = 0; j <= i; ++j) {
            p[j] = detail::fast_expf(p[j] - m);
            sum += p[j];
          }
          float* oi = o + ((b * T + i) * Hq + h) * D;
          for (int64_t d = 0; d < D; ++d) oi[d] = 0.0f;
          const float inv = 1.0f / sum;
          for (int64_t j = 0; j <= i; ++j) axpy(oi, p[j] * inv, vb + j * Hkv * D, D);
          lse[(b * Hq + h) * T + i] = m + logf(sum);
        }
  }
}

// With p_ij = exp(s_ij - lse_i), dp_ij = dout_i . v_j, delta_i = dout_i . o_i:
//   ds_ij = p_ij (dp_ij - delta_i), dq_i += scale ds_ij k_j, dk_j += scale ds_ij q_i,
//   dv_j += p_ij dout_i.
// One thread owns each (b, kv head), so dk and dv accumulate in a fixed order over its query
// heads and rows; probabilities are recomputed one at a time (no scratch).
void causal_attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                               const float* k, const float* v, const float* o, const float* lse,
                               const AttentionShape& s) {
  check_shape(s);
  const int64_t B = s.B, T = s.T, Hq = s.Hq, Hkv = s.Hkv, D = s.D, rep = Hq / Hkv;
  const float scale = 1.0f / std::sqrt(float(D));
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < B; ++b)
    for (int64_t g = 0; g < Hkv; ++g) {
      const int64_t kv0 = (b * T * Hkv + g) * D;  // row j of k, v, dk, dv at kv0 + j * Hkv * D
      for (int64_t h = g * rep; h < (g + 1) * rep; ++h)
        for (int64_t i = 0; i < T; ++i) {
          const int64_t qi0 = ((b * T + i) * Hq + h) * D;
          const float* qi = q + qi0;
          const float* gi = dout + qi0;
          float* dqi = dq + qi0;
          const float l = lse[(b * Hq + h) * T + i];
          const float delta = dot(gi, o + qi0, D);
          for (int64_t j = 0; j <= i; ++j) {
            const int64_t kj0 = kv0 + j * Hkv * D;
            const float p = detail::fast_expf(scale * dot(qi, k + kj0, D) - l);
            const float ds = p * (dot(gi, v + kj0, D) - delta);
            axpy(dqi, scale * ds, k + kj0, D);
            axpy(dk + kj0, scale * ds, qi, D);
            axpy(dv + kj0, p, gi, D);
          }
        }
    }
}

}  // namespace tessel::kernels
