#pragma once
// Plain causal attention with grouped-query heads (the correct reference that
// FlashMask attention, issue #3, is tested against and falls back to).
//   q [B, T, Hq, D], k and v [B, T, Hkv, D], Hq % Hkv == 0;
//     query head h reads kv head h / (Hq / Hkv)
//   o [B, T, Hq, D]; lse [B, Hq, T] = log-sum-exp of the scaled scores of each row
//   scores s_ij = scale * q_i . k_j for j <= i, scale = 1/sqrt(D)
// The backward recomputes probabilities from lse (no T x T buffer is kept).
#include <cstdint>

namespace tessel::kernels {

struct AttentionShape {
  int64_t B, T, Hq, Hkv, D;
};

void causal_attention_forward(float* o, float* lse, const float* q, const float* k, const float* v,
                              const AttentionShape& s);
// Adds into dq, dk, dv.
void causal_attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                               const float* k, const float* v, const float* o, const float* lse,
                               const AttentionShape& s);

namespace naive {
template <class T>
void causal_attention_forward(T* o, T* lse, const T* q, const T* k, const T* v,
                              const AttentionShape& s);
template <class T>
void causal_attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k,
                               const T* v, const T* o, const T* lse, const AttentionShape& s);
}  // namespace naive

}  // namespace tessel::kernels
