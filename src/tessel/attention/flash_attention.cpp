#include "tessel/attention/flash_attention.hpp"

#include <algorithm>
#include <atomic>
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

// The masks one (batch, query head) reads: column mask head hm and, with a block mask, its head
// hb.
struct HeadMasks {
  const TiledMask& tm;
  const BlockMask* block;
  int64_t b, hm, hb;
};

HeadMasks head_masks(const TiledMask& tm, const BlockMask* block, const AttentionShape& s,
                     int64_t b, int64_t h) {
  return {tm, block, b, tm.mask().head_for(h, s.Hq, s.Hk),
          block ? block->head_for(h, s.Hq, s.Hk) : 0};
}

// Tiles per run: as many whole key tiles as fit in opt.run_cols, at least one.
int64_t tiles_per_run(const FlashOptions& opt, const TiledMask& m) {
  return std::max<int64_t>(1, opt.run_cols / m.tile_k());
}

// The runs of query rows [r0, r1) under `masks` over key tiles [n_begin, n_end):
// maximal stretches of non-skipped key tiles, each split into the fewest near-equal whole-tile
// pieces of at most opt.run_cols columns (so a stretch slightly over the limit does not leave
// one short, slow GEMM). kinds[n] is set for the tiles of the range.
void plan_runs(std::vector<Run>& runs, std::vector<TileKind>& kinds, const HeadMasks& masks,
               int64_t r0, int64_t r1, int64_t n_begin, int64_t n_end, const FlashOptions& opt) {
  runs.clear();
  const TiledMask& m = masks.tm;
  const int64_t Sk = m.mask().cols(), tk = m.tile_k();
  const int64_t max_tiles = tiles_per_run(opt, m);
  kinds.resize(size_t(m.num_key_tiles()));
  for (int64_t n = n_begin; n < n_end; ++n) {
    TileKind kind = classify_tile(m, masks.block, masks.b, masks.hm, masks.hb, r0, r1, n);
    if (kind == TileKind::skip && !opt.skip_tiles) kind = TileKind::partial;
    kinds[size_t(n)] = kind;
  }
  for (int64_t n0 = n_begin; n0 < n_end;) {
    if (kinds[size_t(n0)] == TileKind::skip) {
      ++n0;
      continue;
    }
    int64_t n1 = n0;
    while (n1 < n_end && kinds[size_t(n1)] != TileKind::skip) ++n1;
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

// Sets S[r, j - run.c0] = -inf in the run's columns of every block that is off for row r0 + r.
// Over the whole run: its unmasked tiles lie in blocks that are on.
void apply_block_mask(float* S, int64_t ldS, const Run& run, const BlockMask& block, int64_t b,
                      int64_t hb, int64_t r0, int64_t R) {
  constexpr int64_t K = BlockMask::kBlock;
  for (int64_t r = 0; r < R; ++r)
    for (int64_t bc = run.c0 / K; bc * K < run.c1; ++bc) {
      if (block.on(b, hb, (r0 + r) / K, bc)) continue;
      float* row = S + r * ldS;  // column j at row[j - run.c0]
      std::fill(row + (std::max(run.c0, bc * K) - run.c0),
                row + (std::min(run.c1, (bc + 1) * K) - run.c0), -INFINITY);
    }
}

// Sets S[r, j - run.c0] = -inf wherever row r0 + r may not see column j: the block mask over the
// run, the column mask over its partial tiles (unmasked tiles are left alone).
void apply_mask(float* S, int64_t ldS, const Run& run, const std::vector<TileKind>& kinds,
                const HeadMasks& masks, int64_t r0, int64_t R) {
  if (masks.block) apply_block_mask(S, ldS, run, *masks.block, masks.b, masks.hb, r0, R);
  const TiledMask& m = masks.tm;
  const int64_t b = masks.b, hm = masks.hm;
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
      float* s = S + r * ldS + (c0 - run.c0);    // column j at s[j - c0]
#pragma omp simd
      for (int64_t j = c0; j < c1; ++j) {
        const bool masked = j > last || (i >= lts[j] && i < lte[j]) || (i >= uts[j] && i < ute[j]);
        s[j - c0] = masked ? -INFINITY : s[j - c0];
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

Setup setup(const AttentionShape& s, const TiledMask& tm, const BlockMask* block,
            const FlashOptions& opt) {
  check_mask_fits(tm, s, block);
  TESSEL_CHECK(opt.tile_q >= 1 && opt.run_cols >= 1, "tile_q = ", opt.tile_q,
               " run_cols = ", opt.run_cols);
  return {(s.Sq + opt.tile_q - 1) / opt.tile_q, tiles_per_run(opt, tm) * tm.tile_k(),
          Layout{s.Hq * s.D, s.Hk * s.D}, 1.0f / std::sqrt(float(s.D))};
}

}  // namespace

void check_mask_fits(const TiledMask& tm, const AttentionShape& s, const BlockMask* block) {
  if (s.B < 1 || s.Sq < 1 || s.Sk < 1 || s.D < 1 || s.Hq < 1 || s.Hk < 1 || s.Hq % s.Hk != 0)
    input_error("attention shape B=", s.B, " Sq=", s.Sq, " Sk=", s.Sk, " Hq=", s.Hq, " Hk=", s.Hk,
                " D=", s.D, ": sizes must be >= 1 and Hq a multiple of Hk");
  const ColumnMask& m = tm.mask();
  if (m.batch() != s.B || m.rows() != s.Sq || m.cols() != s.Sk)
    input_error("attention mask is for B=", m.batch(), " Sq=", m.rows(), " Sk=", m.cols(),
                " but the inputs have B=", s.B, " Sq=", s.Sq, " Sk=", s.Sk);
  m.check_heads(s.Hq, s.Hk);
  if (block) block->check_fits(m, s.Hq, s.Hk);
}

// Online softmax over the runs of each query tile (spec §4.3).
void flash_attention_forward(float* o, float* lse, const float* q, const float* k, const float* v,
                             const AttentionShape& s, const TiledMask& tm, const FlashOptions& opt,
                             const BlockMask* block) {
  const Setup st = setup(s, tm, block, opt);
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
          const HeadMasks masks = head_masks(tm, block, s, b, h);
          plan_runs(runs, kinds, masks, r0, r0 + R, 0, tm.num_key_tiles(), opt);
          std::fill(m.begin(), m.end(), -INFINITY);
          std::fill(l.begin(), l.end(), 0.0f);
          std::fill(acc.begin(), acc.end(), 0.0f);
          const float* qt_ptr = q + L.q_offset(s, b, h, r0);
          for (const Run& run : runs) {
            const int64_t J = run.c1 - run.c0;
            const int64_t kv0 = L.kv_offset(s, b, g, run.c0);
            kd::sgemm(false, true, R, J, D, st.scale, qt_ptr, L.ldq, k + kv0, L.ldkv, 0.0f,
                      S.data(), J);
            if (run.partial) apply_mask(S.data(), J, run, kinds, masks, r0, R);
            for (int64_t r = 0; r < R; ++r) {
              float* p = S.data() + r * J;
              float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
              for (int64_t j = 0; j < J; ++j) mx = p[j] > mx ? p[j] : mx;
              const float m_new = std::max(m[size_t(r)], mx);
              if (m_new == -INFINITY) {  // nothing visible yet: P = 0, nothing to rescale
                // ...or only NaN scores, which the max passes over: NaN in, NaN out (a row
                // with l = NaN ends as NaN, as the naive twin's does).
                if (std::any_of(p, p + J, [](float x) { return std::isnan(x); }))
                  l[size_t(r)] = NAN;
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

namespace {

// The backward's dQ in a fixed order (spec §4.4). Work items are (batch, kv head, key chunk),
// numbered chunk-innermost and taken in increasing order; each walks the same steps (query
// head of the group, query tile). An item's dQ contribution to one step's tile waits in a slot
// here until every lower chunk of its (batch, kv head) has added or passed that step, then is
// added to dq: dq sums in chunk order whoever runs what. Waiting contributions move on with
// the thread to its next item, so a thread waits only when its slots are full (or at the end).
class OrderedDq {
 public:
  OrderedDq(std::vector<std::atomic<int>>& done, int64_t chunks, int64_t steps, int64_t Br,
            int64_t D, int64_t ldq)
      : done_(done),
        chunks_(chunks),
        steps_(steps),
        D_(D),
        ldq_(ldq),
        tile_(Br * D),
        buf_(static_cast<size_t>(kSlots * Br * D)) {}

  // The slot for item's contribution at step (R rows to add at dst); waits when all are taken.
  float* reserve(int64_t item, int64_t step, float* dst, int64_t R) {
    if (count_ == kSlots) add_front(true);
    const int64_t slot = (head_ + count_++) % kSlots;
    pending_[size_t(slot)] = {item, step, dst, R};
    return buf_.data() + slot * tile_;
  }
  // item has computed every step before pos: adds what may be added, publishes progress.
  void progress(int64_t item, int64_t pos) {
    item_ = item, pos_ = pos;
    while (count_ > 0 && add_front(false)) {
    }
    publish(item);
  }
  // Adds everything still waiting.
  void drain() {
    while (count_ > 0) add_front(true);
  }

 private:
  static constexpr int64_t kSlots = 8;
  struct Entry {
    int64_t item, step;
    float* dst;
    int64_t R;
  };

  // Adds the oldest contribution once every lower chunk has passed its step (waiting for that
  // when asked); false if it may not be added yet.
  bool add_front(bool wait) {
    const Entry e = pending_[size_t(head_)];
    const int64_t first = e.item - e.item % chunks_;
    for (int64_t i = first; i < e.item; ++i)
      for (int v; (v = done_[size_t(i)].load(std::memory_order_acquire)) <= e.step;) {
        if (!wait) return false;
        done_[size_t(i)].wait(v, std::memory_order_acquire);
      }
    const float* src = buf_.data() + head_ * tile_;
    for (int64_t r = 0; r < e.R; ++r) {
      float* d = e.dst + r * ldq_;
      const float* s = src + r * D_;
#pragma omp simd
      for (int64_t j = 0; j < D_; ++j) d[j] += s[j];
    }
    head_ = (head_ + 1) % kSlots, --count_;
    publish(e.item);
    return true;
  }
  // done[item] = steps of item settled: up to its first waiting contribution, else as far as
  // it has computed (all steps once another item is current).
  void publish(int64_t item) {
    int64_t settled = item == item_ ? pos_ : steps_;
    for (int64_t n = 0; n < count_; ++n) {
      const Entry& e = pending_[size_t((head_ + n) % kSlots)];
      if (e.item == item) {
        settled = e.step;
        break;
      }
    }
    std::atomic<int>& d = done_[size_t(item)];
    if (d.load(std::memory_order_relaxed) == int(settled)) return;
    d.store(int(settled), std::memory_order_release);
    d.notify_all();
  }

  std::vector<std::atomic<int>>& done_;
  int64_t chunks_, steps_, D_, ldq_, tile_;
  std::vector<float> buf_;
  Entry pending_[kSlots]{};
  int64_t head_ = 0, count_ = 0, item_ = -1, pos_ = 0;
};

}  // namespace

// Spec §4.4 with P recomputed from lse: dP = dO V^T, delta_r = dO_r . O_r,
// dS = P * (dP - delta); dQ += scale dS K, dK += scale dS^T Q, dV += P^T dO. Column-parallel:
// each (batch, kv head, chunk of run_cols key columns) owns that chunk's dK and dV; dQ sums
// through OrderedDq. The partition depends on the options only, never on the thread count.
void flash_attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                              const float* k, const float* v, const float* o, const float* lse,
                              const AttentionShape& s, const TiledMask& tm, const FlashOptions& opt,
                              const BlockMask* block) {
  const Setup st = setup(s, tm, block, opt);
  const int64_t D = s.D, Br = opt.tile_q, rep = s.Hq / s.Hk, Qt = st.query_tiles;
  const int64_t chunk_tiles = st.run_cols / tm.tile_k();
  const int64_t chunks = (tm.num_key_tiles() + chunk_tiles - 1) / chunk_tiles;
  const int64_t items = s.B * s.Hk * chunks, steps = rep * Qt;
  const Layout& L = st.layout;
  std::vector<float> delta(static_cast<size_t>(s.B * s.Hq * s.Sq));  // laid out as lse
  std::vector<std::atomic<int>> done(static_cast<size_t>(items));
  std::atomic<int64_t> next_item{0};
#pragma omp parallel
  {
#pragma omp for
    for (int64_t i = 0; i < s.B * s.Sq * s.Hq; ++i) {
      const float *g_r = dout + i * D, *o_r = o + i * D;
      float d_r = 0.0f;
#pragma omp simd reduction(+ : d_r)
      for (int64_t d = 0; d < D; ++d) d_r += g_r[d] * o_r[d];
      const int64_t b = i / (s.Sq * s.Hq), r = i / s.Hq % s.Sq, h = i % s.Hq;
      delta[size_t((b * s.Hq + h) * s.Sq + r)] = d_r;
    }
    std::vector<float> P(static_cast<size_t>(Br * st.run_cols)),
        dS(static_cast<size_t>(Br * st.run_cols));
    std::vector<Run> runs;
    std::vector<TileKind> kinds;
    OrderedDq ordered(done, chunks, steps, Br, D, L.ldq);
    // Items in increasing order (not an omp schedule) so a lower chunk is always under way.
    for (int64_t item; (item = next_item.fetch_add(1)) < items;) {
      const int64_t b = item / (s.Hk * chunks), g = item / chunks % s.Hk;
      const int64_t n0 = item % chunks * chunk_tiles;
      const int64_t n1 = std::min(tm.num_key_tiles(), n0 + chunk_tiles);
      // Query tiles from the last down: under causal-like masks a chunk then visits the tiles
      // its lower neighbours visit in the same order, so its contributions rarely wait.
      for (int64_t step = 0; step < steps; ++step) {
        const int64_t h = g * rep + step / Qt, r0 = (Qt - 1 - step % Qt) * Br;
        const int64_t R = std::min(Br, s.Sq - r0);
        const HeadMasks masks = head_masks(tm, block, s, b, h);
        plan_runs(runs, kinds, masks, r0, r0 + R, n0, n1, opt);
        const int64_t q0 = L.q_offset(s, b, h, r0);
        const float* row_lse = lse + (b * s.Hq + h) * s.Sq + r0;
        const float* row_delta = delta.data() + (b * s.Hq + h) * s.Sq + r0;
        float* dq_part = runs.empty() ? nullptr : ordered.reserve(item, step, dq + q0, R);
        for (const Run& run : runs) {
          const int64_t J = run.c1 - run.c0;
          const int64_t kv0 = L.kv_offset(s, b, g, run.c0);
          kd::sgemm(false, true, R, J, D, st.scale, q + q0, L.ldq, k + kv0, L.ldkv, 0.0f, P.data(),
                    J);
          if (run.partial) apply_mask(P.data(), J, run, kinds, masks, r0, R);
          kd::sgemm(false, true, R, J, D, 1.0f, dout + q0, L.ldq, v + kv0, L.ldkv, 0.0f, dS.data(),
                    J);
          for (int64_t r = 0; r < R; ++r) {
            float* p = P.data() + r * J;
            float* ds = dS.data() + r * J;
            const float lr = row_lse[r], d_r = row_delta[r];
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
          kd::sgemm(false, false, R, D, J, st.scale, dS.data(), J, k + kv0, L.ldkv,
                    &run == runs.data() ? 0.0f : 1.0f, dq_part, D);
          kd::sgemm(true, false, J, D, R, st.scale, dS.data(), J, q + q0, L.ldq, 1.0f, dk + kv0,
                    L.ldkv);
          kd::sgemm(true, false, J, D, R, 1.0f, P.data(), J, dout + q0, L.ldq, 1.0f, dv + kv0,
                    L.ldkv);
        }
        ordered.progress(item, step + 1);
      }
    }
    ordered.drain();
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
                                     const TiledMask& mask, const FlashOptions& opt,
                                     const BlockMask* block) {
  const AttentionShape s = shape_of(q, k, v);
  const Tensor q32 = as_f32(q), k32 = as_f32(k), v32 = as_f32(v);
  FlashForward out{Tensor({s.B, s.Sq, s.Hq, s.D}), Tensor({s.B, s.Hq, s.Sq})};
  flash_attention_forward(out.o.f32(), out.lse.f32(), q32.f32(), k32.f32(), v32.f32(), s, mask, opt,
                          block);
  return out;
}

FlashGradients flash_attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k,
                                        const Tensor& v, const FlashForward& fwd,
                                        const TiledMask& mask, const FlashOptions& opt,
                                        const BlockMask* block) {
  const AttentionShape s = shape_of(q, k, v);
  if (dout.shape() != fwd.o.shape() || fwd.o.shape() != q.shape())
    input_error("attention backward: dout and o must have the shape of q");
  const Tensor q32 = as_f32(q), k32 = as_f32(k), v32 = as_f32(v), do32 = as_f32(dout);
  FlashGradients g{Tensor::zeros(q.shape()), Tensor::zeros(k.shape()), Tensor::zeros(v.shape())};
  flash_attention_backward(g.dq.f32(), g.dk.f32(), g.dv.f32(), do32.f32(), q32.f32(), k32.f32(),
                           v32.f32(), fwd.o.f32(), fwd.lse.f32(), s, mask, opt, block);
  return g;
}

}  // namespace tessel::attention
