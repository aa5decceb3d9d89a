#pragma once
// Column-sparse attention mask (FlashMask; spec: specs/flashmask.md §1-§2).
//
// Row i = query position in [0, Sq), column j = key position in [0, Sk). Each key column j
// carries up to two half-open intervals of MASKED query rows:
//   masked(i, j)  <=>  i in [LTS_j, LTE_j)  or  i in [UTS_j, UTE_j)
// plus, with `causal`, the bottom-right aligned causal bound: row i sees key j only if
// j <= i + (Sk - Sq). All values lie in [0, Sq]; Sq means "no mask below".
//
// Input layout (the spec's): int32 [B, Hm, Sk, V] with
//   causal,     V = 1: [LTS]                 (LTE = Sq, no upper interval)
//   causal,     V = 2: [LTS, LTE]
//   non-causal, V = 2: [LTS, UTE]            (LTE = Sq, UTS = 0)
//   non-causal, V = 4: [LTS, LTE, UTS, UTE]
// The mask stores the canonical 4-vector expansion, planar per (batch, mask head):
// vector(b, hm, v)[j] for v in {LTS, LTE, UTS, UTE} - 16 bytes per key column, O(Sk) per
// batch and head; nothing O(Sq * Sk) is ever built (only the test oracle below does).
//
// Mask heads broadcast over query heads: Hm = 1 (one mask for all heads), Hm = Hq (one per
// query head) or Hm = Hk (one per key/value head, shared by its query-head group).
#include <cstdint>
#include <vector>

namespace tessel::attention {

enum MaskVector : int { kLTS = 0, kLTE = 1, kUTS = 2, kUTE = 3 };

// Head broadcasting shared by the column and the block mask: the head of a mask with Hm heads
// that query head h of Hq (with Hk key/value heads) reads. `what` names the mask in the
// InputError raised when Hm is none of 1, Hq, Hk.
int64_t broadcast_head(const char* what, int64_t Hm, int64_t h, int64_t Hq, int64_t Hk);
void check_broadcast_heads(const char* what, int64_t Hm, int64_t Hq, int64_t Hk);

class ColumnMask {
 public:
  ColumnMask() = default;
  // `values` is int32 [B, Hm, Sk, V] as above. Throws InputError naming the violated invariant
  // (shape, V for the causal flag, a value outside [0, Sq], a start after its end).
  ColumnMask(int64_t B, int64_t Hm, int64_t Sq, int64_t Sk, int V, bool causal,
             const std::vector<int32_t>& values);
  // The plain causal mask (no interval masks at all).
  static ColumnMask causal_only(int64_t B, int64_t Sq, int64_t Sk);

  int64_t batch() const { return B_; }
  int64_t mask_heads() const { return Hm_; }
  int64_t rows() const { return Sq_; }  // Sq
  int64_t cols() const { return Sk_; }  // Sk
  bool causal() const { return causal_; }

  // Canonical vector v (kLTS...kUTE) of (b, hm): Sk int32 values.
  const int32_t* vector(int64_t b, int64_t hm, int v) const {
    return data_.data() + ((b * Hm_ + hm) * 4 + v) * Sk_;
  }
  // The mask head that query head h of Hq (with Hk key/value heads) reads; InputError when
  // Hm is none of 1, Hq, Hk.
  int64_t head_for(int64_t h, int64_t Hq, int64_t Hk) const;
  void check_heads(int64_t Hq, int64_t Hk) const;

  // Whether row i may attend to column j under mask head (b, hm) (interval mask and causal).
  bool visible(int64_t b, int64_t hm, int64_t i, int64_t j) const;

  // Bytes of the stored vectors.
  int64_t bytes() const { return int64_t(data_.size() * sizeof(int32_t)); }

 private:
  int64_t B_ = 0, Hm_ = 0, Sq_ = 0, Sk_ = 0;
  bool causal_ = true;
  std::vector<int32_t> data_;  // [B, Hm, 4, Sk]
};

namespace naive {
// Test oracle: the dense boolean matrix, 1 = visible, [B, Hm, Sq, Sk]. O(Sq * Sk) memory.
std::vector<uint8_t> dense_mask(const ColumnMask& mask);
}  // namespace naive

}  // namespace tessel::attention
