#include "tessel/kernels/cpu/attention.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include "tessel/core/error.hpp"
#include "tessel/kernels/cpu/blas.hpp"
#include "tessel/kernels/cpu/fast_exp.hpp"

namespace tessel::kernels {

namespace {

// Query rows per block: each block's scores are a [kRows, keys] tile (per-thread scratch of
// kRows * T floats), so the products are small single-threaded GEMMs instead of per-row dots.
constexpr int64_t kRows = 64;

void check_shape(const AttentionShape& s) {
  TESSEL_CHECK(s.B >= 0 && s.T >= 0 && s.D > 0 && s.Hq > 0 && s.Hkv > 0 && s.Hq % s.Hkv == 0,
               "attention shape B=", s.B, " T=", s.T, " Hq=", s.Hq, " Hkv=", s.Hkv, " D=", s.D);
}

// One block: query rows [i0, i0 + R) of head h against keys [0, i0 + R) (the causal
// prefix), with the row-major views of q/o (row stride Hq D) and k/v (row stride Hkv D).
struct Block {
  int64_t i0, R, J;  // first row, rows, keys
  int64_t q0, kv0;   // offsets of the block's first q/o row and of key 0 for this head
  int64_t ldq, ldkv;
};

Block make_block(const AttentionShape& s, int64_t b, int64_t h, int64_t i0) {
  const int64_t R = std::min(kRows, s.T - i0);
  return {i0,
          R,
          i0 + R,
          ((b * s.T + i0) * s.Hq + h) * s.D,
          (b * s.T * s.Hkv + h / (s.Hq / s.Hkv)) * s.D,
          s.Hq * s.D,
          s.Hkv * s.D};
}

// P[r, j] = exp(S[r, j] - lse_r) for j <= i0 + r, 0 for the masked keys after it.
void probabilities(float* P, const Block& blk, const float* lse) {
  for (int64_t r = 0; r < blk.R; ++r) {
    float* p = P + r * blk.J;
    const int64_t valid = blk.i0 + r + 1;
    const float l = lse[r];
#pragma omp simd
    for (int64_t j = 0; j < valid; ++j) p[j] = detail::fast_expf(p[j] - l);
    std::fill(p + valid, p + blk.J, 0.0f);
  }
}

}  // namespace

// Blocks (b, h, query block) are independent: S = scale Q K^T, row softmax, O = P V.
void causal_attention_forward(float* o, float* lse, const float* q, const float* k, const float* v,
                              const AttentionShape& s) {
  check_shape(s);
  const int64_t nblocks = (s.T + kRows - 1) / kRows;
  const float scale = 1.0f / std::sqrt(float(s.D));
#pragma omp parallel
  {
    std::vector<float> P(kRows * s.T);
#pragma omp for collapse(3) schedule(dynamic)
    for (int64_t b = 0; b < s.B; ++b)
      for (int64_t h = 0; h < s.Hq; ++h)
        for (int64_t blk_i = 0; blk_i < nblocks; ++blk_i) {
          const Block blk = make_block(s, b, h, blk_i * kRows);
          detail::sgemm(false, true, blk.R, blk.J, s.D, scale, q + blk.q0, blk.ldq, k + blk.kv0,
                        blk.ldkv, 0.0f, P.data(), blk.J);
          float* row_lse = lse + (b * s.Hq + h) * s.T + blk.i0;
          for (int64_t r = 0; r < blk.R; ++r) {
            const float* p = P.data() + r * blk.J;
            const int64_t valid = blk.i0 + r + 1;
            float m = -INFINITY;
#pragma omp simd reduction(max : m)
            for (int64_t j = 0; j < valid; ++j) m = p[j] > m ? p[j] : m;
            float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
            for (int64_t j = 0; j < valid; ++j) sum += detail::fast_expf(p[j] - m);
            row_lse[r] = m + logf(sum);
          }
          probabilities(P.data(), blk, row_lse);
          detail::sgemm(false, false, blk.R, s.D, blk.J, 1.0f, P.data(), blk.J, v + blk.kv0,
                        blk.ldkv, 0.0f, o + blk.q0, blk.ldq);
        }
  }
}

// With P recomputed from lse, dP = dO V^T, delta_r = dO_r . O_r, dS = P * (dP - delta):
//   dQ += scale dS K, dK += scale dS^T Q, dV += P^T dO.
// One thread owns each (b, kv head), so dK and dV accumulate in a fixed order over its
// query heads and blocks.
void causal_attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                               const float* k, const float* v, const float* o, const float* lse,
                               const AttentionShape& s) {
  check_shape(s);
  const int64_t nblocks = (s.T + kRows - 1) / kRows, rep = s.Hq / s.Hkv;
  const float scale = 1.0f / std::sqrt(float(s.D));
#pragma omp parallel
  {
    std::vector<float> P(kRows * s.T), dS(kRows * s.T);
#pragma omp for collapse(2) schedule(dynamic)
    for (int64_t b = 0; b < s.B; ++b)
      for (int64_t g = 0; g < s.Hkv; ++g)
        for (int64_t h = g * rep; h < (g + 1) * rep; ++h)
          for (int64_t blk_i = 0; blk_i < nblocks; ++blk_i) {
            const Block blk = make_block(s, b, h, blk_i * kRows);
            const int64_t D = s.D, J = blk.J;
            detail::sgemm(false, true, blk.R, J, D, scale, q + blk.q0, blk.ldq, k + blk.kv0,
                          blk.ldkv, 0.0f, P.data(), J);
            probabilities(P.data(), blk, lse + (b * s.Hq + h) * s.T + blk.i0);
            detail::sgemm(false, true, blk.R, J, D, 1.0f, dout + blk.q0, blk.ldq, v + blk.kv0,
                          blk.ldkv, 0.0f, dS.data(), J);
            for (int64_t r = 0; r < blk.R; ++r) {
              const float* g_r = dout + blk.q0 + r * blk.ldq;
              const float* o_r = o + blk.q0 + r * blk.ldq;
              float delta = 0.0f;
#pragma omp simd reduction(+ : delta)
              for (int64_t d = 0; d < D; ++d) delta += g_r[d] * o_r[d];
              const float* p = P.data() + r * J;
              float* ds = dS.data() + r * J;
#pragma omp simd
              for (int64_t j = 0; j < J; ++j) ds[j] = p[j] * (ds[j] - delta);
            }
            detail::sgemm(false, false, blk.R, D, J, scale, dS.data(), J, k + blk.kv0, blk.ldkv,
                          1.0f, dq + blk.q0, blk.ldq);
            detail::sgemm(true, false, J, D, blk.R, scale, dS.data(), J, q + blk.q0, blk.ldq, 1.0f,
                          dk + blk.kv0, blk.ldkv);
            detail::sgemm(true, false, J, D, blk.R, 1.0f, P.data(), J, dout + blk.q0, blk.ldq, 1.0f,
                          dv + blk.kv0, blk.ldkv);
          }
  }
}

}  // namespace tessel::kernels
