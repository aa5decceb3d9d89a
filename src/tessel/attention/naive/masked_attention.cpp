// The dense twin of flash_attention.cpp: every score of every row, the ColumnMask and the block
// mask tested element by element, plain softmax. O(Sq * Sk) work per head.
#include <cmath>
#include <limits>
#include <vector>

#include "tessel/attention/flash_attention.hpp"

namespace tessel::attention::naive {

namespace {

// Offset of the D-vector of (batch b, position pos, head h) in a [B, seq, heads, D] tensor.
int64_t at(const AttentionShape& s, int64_t b, int64_t pos, int64_t seq, int64_t heads, int64_t h) {
  return ((b * seq + pos) * heads + h) * s.D;
}

// The masks one (batch b, query head h) reads: column mask head hm, block mask head hb (found
// once per head, not per element).
struct HeadMasks {
  const ColumnMask& mask;
  const BlockMask* block;
  int64_t b, h, hm, hb;

  HeadMasks(const ColumnMask& m, const BlockMask* bm, const AttentionShape& s, int64_t b_,
            int64_t h_)
      : mask(m),
        block(bm),
        b(b_),
        h(h_),
        hm(m.head_for(h_, s.Hq, s.Hk)),
        hb(bm ? bm->head_for(h_, s.Hq, s.Hk) : 0) {}

  // Whether row i sees key j: the column mask AND the block mask (when given).
  bool visible(int64_t i, int64_t j) const {
    return mask.visible(b, hm, i, j) && (block == nullptr || block->allows(b, hb, i, j));
  }
};

// Probabilities of row i of head h: p[j] = exp(s_ij - lse_i) over visible keys, 0 elsewhere.
template <class T>
void row_probabilities(std::vector<T>& p, T lse_i, const T* q, const T* k, const AttentionShape& s,
                       const HeadMasks& masks, int64_t i) {
  const int64_t b = masks.b, h = masks.h;
  const int64_t g = h / (s.Hq / s.Hk);
  const T scale = T(1) / std::sqrt(T(s.D));
  const T* qi = q + at(s, b, i, s.Sq, s.Hq, h);
  for (int64_t j = 0; j < s.Sk; ++j) {
    p[size_t(j)] = 0;
    if (!masks.visible(i, j) || lse_i == -std::numeric_limits<T>::infinity()) continue;
    const T* kj = k + at(s, b, j, s.Sk, s.Hk, g);
    T dot = 0;
    for (int64_t d = 0; d < s.D; ++d) dot += qi[d] * kj[d];
    p[size_t(j)] = std::exp(dot * scale - lse_i);
  }
}

// Log-sum-exp of row i's visible scaled scores; -inf when none is visible.
template <class T>
T row_lse(const T* q, const T* k, const AttentionShape& s, const HeadMasks& masks, int64_t i) {
  const int64_t b = masks.b, h = masks.h;
  const int64_t g = h / (s.Hq / s.Hk);
  const T scale = T(1) / std::sqrt(T(s.D));
  const T* qi = q + at(s, b, i, s.Sq, s.Hq, h);
  std::vector<T> sc;
  T mx = -std::numeric_limits<T>::infinity();
  for (int64_t j = 0; j < s.Sk; ++j) {
    if (!masks.visible(i, j)) continue;
    const T* kj = k + at(s, b, j, s.Sk, s.Hk, g);
    T dot = 0;
    for (int64_t d = 0; d < s.D; ++d) dot += qi[d] * kj[d];
    sc.push_back(dot * scale);
    mx = std::max(mx, sc.back());
  }
  if (sc.empty()) return mx;
  T sum = 0;
  for (T x : sc) sum += std::exp(x - mx);
  return mx + std::log(sum);
}

}  // namespace

template <class T>
void masked_attention_forward(T* o, T* lse, const T* q, const T* k, const T* v,
                              const AttentionShape& s, const ColumnMask& mask,
                              const BlockMask* block) {
  if (block) block->check_fits(mask, s.Hq, s.Hk);  // it is indexed without bounds checks
  std::vector<T> p(size_t(s.Sk));
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.Hq; ++h) {
      const HeadMasks masks(mask, block, s, b, h);
      for (int64_t i = 0; i < s.Sq; ++i) {
        const T l = row_lse(q, k, s, masks, i);
        lse[(b * s.Hq + h) * s.Sq + i] = l;
        row_probabilities(p, l, q, k, s, masks, i);
        T* oi = o + ((b * s.Sq + i) * s.Hq + h) * s.D;
        for (int64_t d = 0; d < s.D; ++d) oi[d] = 0;
        for (int64_t j = 0; j < s.Sk; ++j) {
          const T* vj = v + at(s, b, j, s.Sk, s.Hk, h / (s.Hq / s.Hk));
          for (int64_t d = 0; d < s.D; ++d) oi[d] += p[size_t(j)] * vj[d];
        }
      }
    }
}

template <class T>
void masked_attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k,
                               const T* v, const T* o, const T* lse, const AttentionShape& s,
                               const ColumnMask& mask, const BlockMask* block) {
  if (block) block->check_fits(mask, s.Hq, s.Hk);
  const T scale = T(1) / std::sqrt(T(s.D));
  std::vector<T> p(size_t(s.Sk));
  for (int64_t b = 0; b < s.B; ++b)
    for (int64_t h = 0; h < s.Hq; ++h) {
      const int64_t g = h / (s.Hq / s.Hk);
      const HeadMasks masks(mask, block, s, b, h);
      for (int64_t i = 0; i < s.Sq; ++i) {
        row_probabilities(p, lse[(b * s.Hq + h) * s.Sq + i], q, k, s, masks, i);
        const T* gi = dout + at(s, b, i, s.Sq, s.Hq, h);
        const T* oi = o + at(s, b, i, s.Sq, s.Hq, h);
        const T* qi = q + at(s, b, i, s.Sq, s.Hq, h);
        T* dqi = dq + ((b * s.Sq + i) * s.Hq + h) * s.D;
        T delta = 0;
        for (int64_t d = 0; d < s.D; ++d) delta += gi[d] * oi[d];
        for (int64_t j = 0; j < s.Sk; ++j) {
          if (p[size_t(j)] == 0) continue;
          const int64_t kv = ((b * s.Sk + j) * s.Hk + g) * s.D;
          T dp = 0;
          for (int64_t d = 0; d < s.D; ++d) dp += gi[d] * v[kv + d];
          const T ds = p[size_t(j)] * (dp - delta);
          for (int64_t d = 0; d < s.D; ++d) {
            dqi[d] += scale * ds * k[kv + d];
            dk[kv + d] += scale * ds * qi[d];
            dv[kv + d] += p[size_t(j)] * gi[d];
          }
        }
      }
    }
}

template void masked_attention_forward<float>(float*, float*, const float*, const float*,
                                              const float*, const AttentionShape&,
                                              const ColumnMask&, const BlockMask*);
template void masked_attention_forward<double>(double*, double*, const double*, const double*,
                                               const double*, const AttentionShape&,
                                               const ColumnMask&, const BlockMask*);
template void masked_attention_backward<float>(float*, float*, float*, const float*, const float*,
                                               const float*, const float*, const float*,
                                               const float*, const AttentionShape&,
                                               const ColumnMask&, const BlockMask*);
template void masked_attention_backward<double>(double*, double*, double*, const double*,
                                                const double*, const double*, const double*,
                                                const double*, const double*, const AttentionShape&,
                                                const ColumnMask&, const BlockMask*);

}  // namespace tessel::attention::naive
