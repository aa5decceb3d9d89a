#pragma once
// FlashMask attention on CPU (spec §4): tiled flash attention with online softmax over a
// column-sparse mask. Each (query tile, key tile) pair is classified from the mask's tile
// summaries: skipped tiles are never loaded or multiplied, partial tiles get the element-wise
// mask, unmasked tiles no mask work. Runs of consecutive computed key tiles are multiplied as
// one GEMM (at most FlashOptions::run_cols columns), so dense regions run at GEMM speed.
// An optional BlockMask (FlashMask-3's 128 x 128 blocks, block_mask.hpp) is ANDed in: tiles
// touching only off blocks are skipped, tiles touching some are partial and get the off blocks'
// columns masked per row; nullptr (the default) computes exactly what it did without one.
//
//   q [B, Sq, Hq, D], k and v [B, Sk, Hk, D], Hq % Hk == 0 (query head h reads kv head
//   h / (Hq / Hk)); o [B, Sq, Hq, D]; lse [B, Hq, Sq] log-sum-exp of each row's scaled scores
//   s_ij = q_i . k_j / sqrt(D) over its visible keys.
// A row that sees no key gets o = 0, lse = -inf and contributes zero gradients (never NaN); a
// row with a NaN score gets NaN (not taken for a masked one when all its scores are NaN).
//
// Parallelism (OpenMP): the forward over (batch, query head, query tile); the backward over
// (batch, kv head, chunk of run_cols key columns), the chunk's worker owning its dK and dV and
// adding its dQ contributions to each query tile in chunk order (spec §4.4), so it uses up to
// B x Hk x ceil(Sk / run_cols) threads (at batch 1 with one kv head too; one below
// Sk = run_cols) and every gradient accumulates in a fixed order:
// results are bitwise reproducible for a fixed tile configuration whatever the thread count.
// f32 compute; bf16 inputs through the Tensor overloads.
#include <cstdint>

#include "tessel/attention/tiled_mask.hpp"
#include "tessel/core/tensor.hpp"

namespace tessel::attention {

struct AttentionShape {
  int64_t B, Sq, Sk, Hq, Hk, D;
};

struct FlashOptions {
  int64_t tile_q = 128;  // query rows per tile (the key tile is the TiledMask's)
  // Most key columns per GEMM (per-thread scratch tile_q x run_cols), rounded down to whole key
  // tiles; also the width of the backward's key chunks.
  int64_t run_cols = 512;
  bool skip_tiles = true;  // false: compute fully masked tiles too (the benchmark baseline)
};

// Throws InputError when the mask (or the block mask) does not fit the shape (batch, Sq, Sk,
// mask heads).
void check_mask_fits(const TiledMask& mask, const AttentionShape& s,
                     const BlockMask* block = nullptr);

void flash_attention_forward(float* o, float* lse, const float* q, const float* k, const float* v,
                             const AttentionShape& s, const TiledMask& mask,
                             const FlashOptions& opt = {}, const BlockMask* block = nullptr);
// Adds into dq, dk, dv.
void flash_attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                              const float* k, const float* v, const float* o, const float* lse,
                              const AttentionShape& s, const TiledMask& mask,
                              const FlashOptions& opt = {}, const BlockMask* block = nullptr);

// Tensor forms: q, k, v f32 or bf16 (converted to f32 once); outputs f32.
struct FlashForward {
  Tensor o, lse;
};
FlashForward flash_attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                     const TiledMask& mask, const FlashOptions& opt = {},
                                     const BlockMask* block = nullptr);
struct FlashGradients {
  Tensor dq, dk, dv;
};
FlashGradients flash_attention_backward(const Tensor& dout, const Tensor& q, const Tensor& k,
                                        const Tensor& v, const FlashForward& fwd,
                                        const TiledMask& mask, const FlashOptions& opt = {},
                                        const BlockMask* block = nullptr);

namespace naive {
// Dense reference with the same semantics: every score computed, the mask applied from the
// ColumnMask (and the block mask) element by element. O(Sq * Sk) work; instantiated for float
// and double.
template <class T>
void masked_attention_forward(T* o, T* lse, const T* q, const T* k, const T* v,
                              const AttentionShape& s, const ColumnMask& mask,
                              const BlockMask* block = nullptr);
template <class T>
void masked_attention_backward(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k,
                               const T* v, const T* o, const T* lse, const AttentionShape& s,
                               const ColumnMask& mask, const BlockMask* block = nullptr);
}  // namespace naive

}  // namespace tessel::attention
