#include "tessel/attention/flash_attention.hpp"

#include <algorithm>
#include <cmath>
#include <vector>

#include "tessel/core/error.hpp"
#include "tessel/kernels/cpu/blas.hpp"
#include "tessel/kernels/cpu/fast_exp.hpp"

namespace tessel::attention {

namespace kd = kernels::detail;

namespace {

// A run of consecutive computed key tiles: columns [c0, c1), and whether any tile in it is
// partial (needs the element-wise mask).
struct Run {
  int64_t c0, c1;
  bool partial;
};

// Tiles per run: as many whole key tiles as fit in opt.run_cols, at least one.
int64_t tiles_per_run(const FlashOptions& opt, const TiledMask& m) {
  return std::max<int64_t>(1, opt.run_cols / m.tile_k());
}

// The runs of query rows [r0, r1) of mask head (b, hm): maximal stretches of non-skipped key
// tiles, each split into the fewest near-equal whole-tile pieces of at most opt.run_cols
// columns (so a stretch slightly over the limit does not leave one short, slow GEMM).
void plan_runs(std::vector<Run>& runs, std::vector<TileKind>& kinds, const TiledMask& m, int64_t b,
               int64_t hm, int64_t r0, int64_t r1, const FlashOptions& opt) {
  runs.clear();
  const int64_t Sk = m.mask().cols(), tk = m.tile_k(), nt = m.num_key_tiles();
  const int64_t max_tiles = tiles_per_run(opt, m);
  kinds.resize(size_t(nt));
  for (int64_t n = 0; n < nt; ++n) {
    TileKind kind = m.classify(b, hm, r0, r1, n);
    if (kind == TileKind::skip && !opt.skip_tiles) kind = TileKind::partial;
    kinds[size_t(n)] = kind;
  }
  for (int64_t n0 = 0; n0 < nt;) {
    if (kinds[size_t(n0)] == TileKind::skip) {
      ++n0;
      continue;
    }
    int64_t n1 = n0;
    while (n1 < nt && kinds[size_t(n1)] != TileKind::skip) ++n1;
    const int64_t pieces = (n1 - n0 + max_tiles - 1) / max_tiles;
    for (int64_t p = 0; p < pieces; ++p) {
      const int64_t a = n0 + (n1 - n0) * p / pieces, e = n0 + (n1 - n0) * (p + 1) / pieces;
      bool partial = false;
      for (int64_t n = a; n < e; ++n) partial |= kinds[size_t(n)] == TileKind::partial;
      runs.push_back({a * tk, std::min(Sk, e * tk), partial});
    }
    n0 = n1;
  }
}

// Sets S[r, j - c0] = -inf wherever row r0 + r may not see column j, over the partial tiles of
// the run (unmasked tiles of the run are left alone).
void apply_mask(float* S, int64_t ldS, const Run& run, const std::vector<TileKind>& kinds,
                const TiledMask& m, int64_t b, int64_t hm, int64_t r0, int64_t R) {
  const ColumnMask& mask = m.mask();
  const int32_t* lts = mask.vector(b, hm, kLTS);
  const int32_t* lte = mask.vector(b, hm, kLTE);
  const int32_t* uts = mask.vector(b, hm, kUTS);
  const int32_t* ute = mask.vector(b, hm, kUTE);
  const int64_t off = mask.cols() - mask.rows();
  // Without the causal bound the limit is past every column.
  const int64_t causal_off = mask.causal() ? off : mask.cols();
  const int64_t tk = m.tile_k();
  for (int64_t c0 = run.c0; c0 < run.c1; c0 += tk) {
    if (kinds[size_t(c0 / tk)] != TileKind::partial) continue;
    const int64_t c1 = std::min(run.c1, c0 + tk);
    if (!m.intervals_touch(b, hm, r0, r0 + R, c0 / tk)) {  // only the causal bound masks
      for (int64_t r = 0; r < R; ++r) {
        const int64_t first_masked = std::clamp(r0 + r + causal_off + 1, c0, c1);
        std::fill(S + r * ldS + (first_masked - run.c0), S + r * ldS + (c1 - run.c0), -INFINITY);
      }
      continue;
    }
    for (int64_t r = 0; r < R; ++r) {
      const int32_t i = int32_t(r0 + r);
      const int64_t last = r0 + r + causal_off;  // last visible column under causality
      float* s = S + r * ldS - run.c0;
#pragma omp simd
      for (int64_t j = c0; j < c1; ++j) {
        const bool masked = j > last || (i >= lts[j] && i < lte[j]) || (i >= uts[j] && i < ute[j]);
        s[j] = masked ? -INFINITY : s[j];
      }
    }
  }
}

struct Layout {
  int64_t ldq, ldkv;
  int64_t q_offset(const AttentionShape& s, int64_t b, int64_t h, int64_t r) const {
    return ((b * s.Sq + r) * s.Hq + h) * s.D;
  }
  int64_t kv_offset(const AttentionShape& s, int64_t b, int64_t g, int64_t c) const {
    return ((b * s.Sk + c) * s.Hk + g) * s.D;
  }
};

// What forward and backward derive from the shape and options, after checking them.
struct Setup {
  int64_t query_tiles, run_cols;
  Layout layout;
  float scale;
};

Setup setup(const AttentionShape& s, const TiledMask& tm, const FlashOptions& opt) {
  check_mask_fits(tm, s);
  TESSEL_CHECK(opt.tile_q >= 1 && opt.run_cols >= 1, "tile_q = ", opt.tile_q,
               " run_cols = ", opt.run_cols);
  return {(s.Sq + opt.tile_q - 1) / opt.tile_q, tiles_per_run(opt, tm) * tm.tile_k(),
          Layout{s.Hq * s.D, s.Hk * s.D}, 1.0f / std::sqrt(float(s.D))};
}

}  // namespace

void check_mask_fits(const TiledMask& tm, const AttentionShape& s) {
  if (s.B < 1 || s.Sq < 1 || s.Sk < 1 || s.D < 1 || s.Hq < 1 || s.Hk < 1 || s.Hq % s.Hk != 0)
    input_error("attention shape B=", s.B, " Sq=", s.Sq, " Sk=", s.Sk, " Hq=", s.Hq, " Hk=", s.Hk,
                " D=", s.D, ": sizes must be >= 1 and Hq a multiple of Hk");
  const ColumnMask& m = tm.mask();
  if (m.batch() != s.B || m.rows() != s.Sq || m.cols() != s.Sk)
    input_error("attention mask is for B=", m.batch(), " Sq=", m.rows(), " Sk=", m.cols(),
                " but the inputs have B=", s.B, " Sq=", s.Sq, " Sk=", s.Sk);
  m.check_heads(s.Hq, s.Hk);
}

// Online softmax over the runs of each query tile (spec §4.3).
void flash_attention_forward(float* o, float* lse, const float* q, const float* k, const float* v,
                             const AttentionShape& s, const TiledMask& tm,
                             const FlashOptions& opt) {
  const Setup st = setup(s, tm, opt);
  const int64_t D = s.D, Br = opt.tile_q, rep = s.Hq / s.Hk;
  const Layout& L = st.layout;
#pragma omp parallel
  {
    std::vector<float> S(static_cast<size_t>(Br * st.run_cols)), acc(static_cast<size_t>(Br * D));
    std::vector<float> m(static_cast<size_t>(Br)), l(static_cast<size_t>(Br));
    std::vector<Run> runs;
    std::vector<TileKind> kinds;
#pragma omp for collapse(3) schedule(dynamic)
    for (int64_t b = 0; b < s.B; ++b)
      for (int64_t h = 0; h < s.Hq; ++h)
        for (int64_t qt = 0; qt < st.query_tiles; ++qt) {
          const int64_t r0 = qt * Br, R = std::min(Br, s.Sq - r0), g = h / rep;
          const int64_t hm = tm.mask().head_for(h, s.Hq, s.Hk);
          plan_runs(runs, kinds, tm, b, hm, r0, r0 + R, opt);
          std::fill(m.begin(), m.end(), -INFINITY);
          std::fill(l.begin(), l.end(), 0.0f);
          std::fill(acc.begin(), acc.end(), 0.0f);
          const float* qt_ptr = q + L.q_offset(s, b, h, r0);
          for (const Run& run : runs) {
            const int64_t J = run.c1 - run.c0;
            const int64_t kv0 = L.kv_offset(s, b, g, run.c0);
            kd::sgemm(false, true, R, J, D, st.scale, qt_ptr, L.ldq, k + kv0, L.ldkv, 0.0f,
                      S.data(), J);
            if (run.partial) apply_mask(S.data(), J, run, kinds, tm, b, hm, r0, R);
            for (int64_t r = 0; r < R; ++r) {
              float* p = S.data() + r * J;
              float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
              for (int64_t j = 0; j < J; ++j) mx = p[j] > mx ? p[j] : mx;
              const float m_new = std::max(m[size_t(r)], mx);
              if (m_new == -INFINITY) {  // nothing visible yet: P = 0, nothing to rescale
                std::fill(p, p + J, 0.0f);
                continue;
              }
              float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
              for (int64_t j = 0; j < J; ++j) {
                p[j] = kd::fast_expf(p[j] - m_new);
                sum += p[j];
              }
              const float alpha = kd::fast_expf(m[size_t(r)] - m_new);  // 0 when m was -inf
              l[size_t(r)] = alpha * l[size_t(r)] + sum;
              m[size_t(r)] = m_new;
              if (alpha != 1.0f) {
                float* a = acc.data() + r * D;
#pragma omp simd
                for (int64_t d = 0; d < D; ++d) a[d] *= alpha;
              }
            }
            kd::sgemm(false, false, R, D, J, 1.0f, S.data(), J, v + kv0, L.ldkv, 1.0f, acc.data(),
                      D);
          }
          float* row_lse = lse + (b * s.Hq + h) * s.Sq + r0;
          for (int64_t r = 0; r < R; ++r) {
            float* out = o + L.q_offset(s, b, h, r0 + r);
            const float lr = l[size_t(r)];
            if (lr == 0.0f) {  // a row with no visible key
              std::fill(out, out + D, 0.0f);
              row_lse[r] = -INFINITY;
              continue;
            }
            const float inv = 1.0f / lr;
            const float* a = acc.data() + r * D;
#pragma omp simd
            for (int64_t d = 0; d < D; ++d) out[d] = a[d] * inv;
            row_lse[r] = m[size_t(r)] + std::log(lr);
          }
        }
  }
}

// Spec §4.4 with P recomputed from lse: dP = dO V^T, delta_r = dO_r . O_r,
// dS = P * (dP - delta); dQ += scale dS K, dK += scale dS^T Q, dV += P^T dO.
void flash_attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                              const float* k, const float* v, const float* o, const float* lse,
                              const AttentionShape& s, const TiledMask& tm,
                              const FlashOptions& opt) {
  const Setup st = setup(s, tm, opt);
  const int64_t D = s.D, Br = opt.tile_q, rep = s.Hq / s.Hk;
  const Layout& L = st.layout;
#pragma omp parallel
  {
    std::vector<float> P(static_cast<size_t>(Br * st.run_cols)),
        dS(static_cast<size_t>(Br * st.run_cols));
    std::vector<float> delta(static_cast<size_t>(Br));
    std::vector<Run> runs;
    std::vector<TileKind> kinds;
#pragma omp for collapse(2) schedule(dynamic)
    for (int64_t b = 0; b < s.B; ++b)
      for (int64_t g = 0; g < s.Hk; ++g)
        for (int64_t h = g * rep; h < (g + 1) * rep; ++h) {
          const int64_t hm = tm.mask().head_for(h, s.Hq, s.Hk);
          for (int64_t qt = 0; qt < st.query_tiles; ++qt) {
            const int64_t r0 = qt * Br, R = std::min(Br, s.Sq - r0);
            plan_runs(runs, kinds, tm, b, hm, r0, r0 + R, opt);
            if (runs.empty()) continue;
            const int64_t q0 = L.q_offset(s, b, h, r0);
            const float* row_lse = lse + (b * s.Hq + h) * s.Sq + r0;
            for (int64_t r = 0; r < R; ++r) {
              const float* g_r = dout + q0 + r * L.ldq;
              const float* o_r = o + q0 + r * L.ldq;
              float d_r = 0.0f;
#pragma omp simd reduction(+ : d_r)
              for (int64_t d = 0; d < D; ++d) d_r += g_r[d] * o_r[d];
              delta[size_t(r)] = d_r;
            }
            for (const Run& run : runs) {
              const int64_t J = run.c1 - run.c0;
              const int64_t kv0 = L.kv_offset(s, b, g, run.c0);
              kd::sgemm(false, true, R, J, D, st.scale, q + q0, L.ldq, k + kv0, L.ldkv, 0.0f,
                        P.data(), J);
              if (run.partial) apply_mask(P.data(), J, run, kinds, tm, b, hm, r0, R);
              kd::sgemm(false, true, R, J, D, 1.0f, dout + q0, L.ldq, v + kv0, L.ldkv, 0.0f,
                        dS.data(), J);
              for (int64_t r = 0; r < R; ++r) {
                float* p = P.data() + r * J;
                float* ds = dS.data() + r * J;
                const float lr = row_lse[r], d_r = delta[size_t(r)];
                if (lr == -INFINITY) {  // a row with no visible key: no gradient
                  std::fill(p, p + J, 0.0f);
                  std::fill(ds, ds + J, 0.0f);
                  continue;
                }
#pragma omp simd
                for (int64_t j = 0; j < J; ++j) {
                  p[j] = kd::fast_expf(p[j] - lr);
                  ds[j] = p[j] * (ds[j] - d_r);
                }
              }
              kd::sgemm(false, false, R, D, J, st.scale, dS.data(), J, k + kv0, L.ldkv, 1.0f,
                        dq + q0, L.ldq);
              kd::sgemm(true, false, J, D, R, st.scale, dS.data(), J, q + q0, L.ldq, 1.0f, dk + kv0,
                        L.ldkv);
              kd::sgemm(true, false, J, D, R, 1.0f, P.data(), J, dout + q0, L.ldq, 1.0f, dv + kv0,
                        L.ldkv);
            }
          }
        }
  }
}

namespace {

AttentionShape shape_of(const Tensor& q, const Tensor& k, const Tensor& v) {
  if (q.ndim() != 4 || k.ndim() != 4 || v.shape() != k.shape() || q.dim(0) != k.dim(0) ||
      q.dim(3) != k.dim(3))
    input_error("attention inputs must be q [B, Sq, Hq, D], k and v [B, Sk, Hk, D]");
  return {q.dim(0), q.dim(1), k.dim(1), q.dim(2), k.dim(2), q.dim(3)};
}

Tensor as_f32(const Tensor& t) {
  if (t.dtype() == DType::f32) return t;
  if (t.dtype() == DType::bf16) return t.to(DType::f32);
  input_error("attention inputs must be f32 or bf16");
}

}  // namespace

FlashForward flash_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                     const TiledMask& mask, const FlashOptions& opt) {
  const AttentionShape s = shape_of(q, k, v);
  const Tensor q32 = as_f32(q), k32 = as_f32(k), v32 = as_f32(v);
  FlashForward out{Tensor({s.B, s.Sq, s.Hq, s.D}), Tensor({s.B, s.Hq, s.Sq})};
  flash_attention_forward(out.o.f32(), out.lse.f32(), q32.f32(), k32.f32(), v32.f32(), s, mask,
                          opt);
  return out;
}

FlashGradients flash_attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k,
                                        const Tensor& v, const FlashForward& fwd,
                                        const TiledMask& mask, const FlashOptions& opt) {
  const AttentionShape s = shape_of(q, k, v);
  if (dout.shape() != fwd.o.shape() || fwd.o.shape() != q.shape())
    input_error("attention backward: dout and o must have the shape of q");
  const Tensor q32 = as_f32(q), k32 = as_f32(k), v32 = as_f32(v), do32 = as_f32(dout);
  FlashGradients g{Tensor::zeros(q.shape()), Tensor::zeros(k.shape()), Tensor::zeros(v.shape())};
  flash_attention_backward(g.dq.f32(), g.dk.f32(), g.dv.f32(), do32.f32(), q32.f32(), k32.f32(),
                           v32.f32(), fwd.o.f32(), fwd.lse.f32(), s, mask, opt);
  return g;
}

}  // namespace tessel::attention
