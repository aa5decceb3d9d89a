#include "tessel/kernels/cpu/attention.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

namespace tessel::kernels::naive {

namespace {
// Flat offsets of q/o [B, T, Hq, D] and k/v [B, T, Hkv, D].
inline int64_t qidx(const AttentionShape& s, int64_t b, int64_t t, int64_t h) {
  return ((b * s.T + t) * s.Hq + h) * s.D;
}
inline int64_t kvidx(const AttentionShape& s, int64_t b, int64_t t, int64_t h) {
  return ((b * s.T + t) * s.Hkv + h / (s.Hq / s.Hkv)) * s.D;
}

// Scaled scores of query row i against keys 0..i.
template <class T>
std::vector<T> scores(const T* q, const T* k, const AttentionShape& s, int64_t b, int64_t h,
                      int64_t i) {
  const T scale = T(1) / std::sqrt(T(s.D));
  std::vector<T> sc(i + 1);
  for (int64_t j = 0; j <= i; ++j) {
    T acc = 0;
    for (int64_t d = 0; d < s.D; ++d) acc += q[qidx(s, b, i, h) + d] * k[kvidx(s, b, j, h) + d];
    sc[j] = scale * acc;
  }
  return sc;
}
}  // namespace

template <class T>
void causal_attention_forward(T* o, T* lse, const T* q, const T* k, const T* v,
                              const AttentionShape& s) {
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.Hq; ++h)
      for (int64_t i = 0; i < s.T; ++i) {
        const std::vector<T> sc = scores(q, k, s, b, h, i);
        T m = sc[0];
        for (T x : sc) m = std::max(m, x);
        T sum = 0;
        for (T x : sc) sum += std::exp(x - m);
        for (int64_t d = 0; d < s.D; ++d) {
          T acc = 0;
          for (int64_t j = 0; j <= i; ++j)
            acc += std::exp(sc[j] - m) / sum * v[kvidx(s, b, j, h) + d];
          o[qidx(s, b, i, h) + d] = acc;
        }
        lse[(b * s.Hq + h) * s.T + i] = m + std::log(sum);
      }
}

// Softmax Jacobian per row: ds_j = p_j (dp_j - sum_l p_l dp_l), dp_j = dout_i . v_j.
// Unlike the fast kernel it uses neither o nor lse.
template <class T>
void causal_attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k,
                               const T* v, const T* o, const T* lse, const AttentionShape& s) {
  const T scale = T(1) / std::sqrt(T(s.D));
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.Hq; ++h)
      for (int64_t i = 0; i < s.T; ++i) {
        std::vector<T> p = scores(q, k, s, b, h, i);
        T m = p[0];
        for (T x : p) m = std::max(m, x);
        T sum = 0;
        for (T& x : p) sum += (x = std::exp(x - m));
        for (T& x : p) x /= sum;
        std::vector<T> dp(i + 1, T(0));
        T pdp = 0;
        for (int64_t j = 0; j <= i; ++j) {
          for (int64_t d = 0; d < s.D; ++d)
            dp[j] += dout[qidx(s, b, i, h) + d] * v[kvidx(s, b, j, h) + d];
          pdp += p[j] * dp[j];
        }
        for (int64_t j = 0; j <= i; ++j) {
          const T ds = p[j] * (dp[j] - pdp);
          for (int64_t d = 0; d < s.D; ++d) {
            dq[qidx(s, b, i, h) + d] += scale * ds * k[kvidx(s, b, j, h) + d];
            dk[kvidx(s, b, j, h) + d] += scale * ds * q[qidx(s, b, i, h) + d];
            dv[kvidx(s, b, j, h) + d] += p[j] * dout[qidx(s, b, i, h) + d];
          }
        }
      }
}

#define TESSEL_INSTANTIATE(T)                                                                    \
  template void causal_attention_forward<T>(T*, T*, const T*, const T*, const T*,                \
                                            const AttentionShape&);                              \
  template void causal_attention_backward<T>(T*, T*, T*, const T*, const T*, const T*, const T*, \
                                             const T*, const T*, const AttentionShape&);
TESSEL_INSTANTIATE(float)
TESSEL_INSTANTIATE(double)
#undef TESSEL_INSTANTIATE

}  // namespace tessel::kernels::naive
