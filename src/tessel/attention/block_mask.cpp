#include "tessel/attention/block_mask.hpp"

#include "tessel/core/error.hpp"

namespace tessel::attention {

BlockMask::BlockMask(int64_t B, int64_t Hm, int64_t Sq, int64_t Sk, std::vector<uint8_t> values)
    : B_(B), Hm_(Hm), Sq_(Sq), Sk_(Sk), data_(std::move(values)) {
  if (B < 1 || Hm < 1 || Sq < 1 || Sk < 1)
    input_error("block mask: batch, mask heads, Sq and Sk must be >= 1, got B=", B, " Hm=", Hm,
                " Sq=", Sq, " Sk=", Sk);
  const int64_t expected = B * Hm * block_rows() * block_cols();
  if (int64_t(data_.size()) != expected)
    input_error("block mask: expected uint8 [B=", B, ", Hm=", Hm, ", ceil(Sq/", kBlock,
                ")=", block_rows(), ", ceil(Sk/", kBlock, ")=", block_cols(), "] = ", expected,
                " values, got ", data_.size());
  for (size_t x = 0; x < data_.size(); ++x)
    if (data_[x] > 1)
      input_error("block mask: value ", int(data_[x]), " at flat index ", x,
                  " is neither 0 (masked) nor 1 (attended)");
}

BlockCover BlockMask::cover(int64_t b, int64_t hm, int64_t r0, int64_t r1, int64_t c0,
                            int64_t c1) const {
  bool any_on = false, any_off = false;
  for (int64_t br = r0 / kBlock; br <= (r1 - 1) / kBlock; ++br)
    for (int64_t bc = c0 / kBlock; bc <= (c1 - 1) / kBlock; ++bc) {
      (on(b, hm, br, bc) ? any_on : any_off) = true;
      if (any_on && any_off) return BlockCover::some;
    }
  return any_on ? BlockCover::all : BlockCover::none;
}

int64_t BlockMask::head_for(int64_t h, int64_t Hq, int64_t Hk) const {
  return broadcast_head("block mask", Hm_, h, Hq, Hk);
}

void BlockMask::check_fits(const ColumnMask& mask, int64_t Hq, int64_t Hk) const {
  if (B_ != mask.batch() || Sq_ != mask.rows() || Sk_ != mask.cols())
    input_error("block mask is for B=", B_, " Sq=", Sq_, " Sk=", Sk_,
                " but the column mask it is combined with has B=", mask.batch(),
                " Sq=", mask.rows(), " Sk=", mask.cols());
  check_broadcast_heads("block mask", Hm_, Hq, Hk);
}

}  // namespace tessel::attention
