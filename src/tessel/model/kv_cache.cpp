#include "tessel/model/kv_cache.hpp"

#include <algorithm>

#include "tessel/attention/flash_attention.hpp"
#include "tessel/core/error.hpp"

namespace tessel::model {

KvCache::KvCache(const Gpt& gpt)
    : config_(gpt.config()),
      blocks_(gpt.block_range().last - gpt.block_range().first),
      capacity_(gpt.config().max_seq),
      Hq_(gpt.config().heads),
      Hk_(gpt.config().num_kv_heads()),
      D_(gpt.config().head_dim()),
      k_(size_t(blocks_)),
      v_(size_t(blocks_)) {}

void KvCache::clear() {
  length_ = rows_ = block_ = 0;
}

void KvCache::begin(int64_t rows) {
  TESSEL_CHECK(rows >= 1, "a forward through the KV cache needs new positions");
  TESSEL_CHECK(length_ + rows <= capacity_, rows, " new positions after ", length_,
               " cached exceed max_seq = ", capacity_);
  TESSEL_CHECK(block_ == 0, "a forward through the KV cache did not reach every block");
  rows_ = rows;
  // Bottom-right causal: new row i (position length_ + i) sees keys 0 .. length_ + i (the last
  // model.attention_window of them when set).
  mask_ = attention::TiledMask(attention_mask(config_, nullptr, 1, rows, length_ + rows));
  const auto size = size_t((length_ + rows) * Hk_ * D_);
  for (int64_t b = 0; b < blocks_; ++b) k_[size_t(b)].resize(size), v_[size_t(b)].resize(size);
}

void KvCache::forward(float* o, float* lse, const float* q, const float* k, const float* v) {
  TESSEL_CHECK(rows_ > 0, "KvCache::begin was not called before the forward");
  const int64_t row = Hk_ * D_, keys = length_ + rows_;
  float* kc = k_[size_t(block_)].data();
  float* vc = v_[size_t(block_)].data();
  std::copy(k, k + rows_ * row, kc + length_ * row);
  std::copy(v, v + rows_ * row, vc + length_ * row);
  attention::flash_attention_forward(o, lse, q, kc, vc, {1, rows_, keys, Hq_, Hk_, D_}, mask_);
  if (++block_ == blocks_) {  // the forward's last block: the new positions are cached
    block_ = 0;
    length_ = keys;
    rows_ = 0;
  }
}

void KvCache::backward(float*, float*, float*, const float*, const float*, const float*,
                       const float*, const float*, const float*) {
  TESSEL_CHECK(false, "the KV cache serves inference only: no backward");
}

}  // namespace tessel::model
