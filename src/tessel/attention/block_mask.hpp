#pragma once
// FlashMask-3's optional block mask (spec specs/flashmask.md §2), ANDed with a ColumnMask:
//   visible(i, j) = column mask visible(i, j) and block(i / kBlock, j / kBlock)
// Input: [B, Hm, ceil(Sq / kBlock), ceil(Sk / kBlock)], 1 = the block may be attended, 0 = every
// element of the kBlock x kBlock block is masked (the last block row and column are cut at Sq
// and Sk). The spec gives no dtype; uint8, and Hm in {1, Hq, Hk} broadcast as the column mask's
// heads but chosen independently of its Hm, are tessel's choices (upstream takes int32 with the
// column mask's Hm). The grid is anchored top-left: block row i / kBlock over the call's rows,
// not shifted by Sk - Sq as the bottom-right causal bound is. O(Sq * Sk / kBlock^2) bytes per
// (b, mask head).
//
// The kernel's tiles need not be blocks: cover() says whether the blocks a tile touches are all
// off (the tile is skipped), some off (partial) or all on (the column mask decides).
#include <cstddef>
#include <cstdint>
#include <vector>

#include "tessel/attention/mask.hpp"

namespace tessel::attention {

enum class BlockCover : uint8_t { none, some, all };  // of the touched blocks, how many are on

class BlockMask {
 public:
  static constexpr int64_t kBlock = 128;  // rows and columns per block (FlashMask-3's)

  BlockMask() = default;
  // Throws InputError on a size that is not [B, Hm, ceil(Sq / kBlock), ceil(Sk / kBlock)] or a
  // value other than 0 and 1.
  BlockMask(int64_t B, int64_t Hm, int64_t Sq, int64_t Sk, std::vector<uint8_t> values);

  int64_t batch() const { return B_; }
  int64_t mask_heads() const { return Hm_; }
  int64_t rows() const { return Sq_; }  // Sq
  int64_t cols() const { return Sk_; }  // Sk
  // Blocks covering n rows or columns: ceil(n / kBlock).
  static int64_t blocks(int64_t n) { return (n + kBlock - 1) / kBlock; }
  int64_t block_rows() const { return blocks(Sq_); }
  int64_t block_cols() const { return blocks(Sk_); }

  // Whether block (br, bc) of mask head (b, hm) is on.
  bool on(int64_t b, int64_t hm, int64_t br, int64_t bc) const {
    return data_[std::size_t(((b * Hm_ + hm) * block_rows() + br) * block_cols() + bc)] != 0;
  }
  // Whether the block mask lets row i attend to column j.
  bool allows(int64_t b, int64_t hm, int64_t i, int64_t j) const {
    return on(b, hm, i / kBlock, j / kBlock);
  }
  // The blocks touched by rows [r0, r1) x columns [c0, c1) (both non-empty).
  BlockCover cover(int64_t b, int64_t hm, int64_t r0, int64_t r1, int64_t c0, int64_t c1) const;

  int64_t head_for(int64_t h, int64_t Hq, int64_t Hk) const;
  // InputError unless batch, Sq and Sk are the column mask's and Hm fits Hq and Hk.
  void check_fits(const ColumnMask& mask, int64_t Hq, int64_t Hk) const;

 private:
  int64_t B_ = 0, Hm_ = 0, Sq_ = 0, Sk_ = 0;
  std::vector<uint8_t> data_;  // [B, Hm, block_rows, block_cols]
};

}  // namespace tessel::attention
