#pragma once
// The keys and values of the positions a generation has already run, per block, so that each
// new token costs one position's forward instead of the whole window's. It runs through the
// model's own forward: installed as the micro-batch's attention hook (ModelInputs::attention),
// each block's call appends that block's new keys and values (rotated, as the forward hands
// them over) and attends the new queries to every cached position, bottom-right causal
// (flash_attention_forward with Sq new rows over Sk = cached + new keys) and within
// model.attention_window when it is set. Inference only: one
// sequence (B = 1), no backward.
#include <cstdint>
#include <vector>

#include "tessel/attention/attention_hook.hpp"
#include "tessel/attention/tiled_mask.hpp"
#include "tessel/model/gpt.hpp"

namespace tessel::model {

class KvCache final : public attention::AttentionHook {
 public:
  // For `gpt`'s blocks, up to max_seq positions.
  explicit KvCache(const Gpt& gpt);

  int64_t length() const { return length_; }  // positions cached
  void clear();
  // Announces a forward of one sequence over `rows` >= 1 new positions (length() ..
  // length() + rows - 1): call before each forward the cache is the hook of.
  // TESSEL_CHECK: they fit in max_seq.
  void begin(int64_t rows);

  void forward(float* o, float* lse, const float* q, const float* k, const float* v) override;
  void backward(float*, float*, float*, const float*, const float*, const float*, const float*,
                const float*, const float*) override;  // TESSEL_CHECK: inference only

 private:
  GptConfig config_;  // the masks follow its attention window
  int64_t blocks_, capacity_, Hq_, Hk_, D_;
  int64_t length_ = 0, rows_ = 0, block_ = 0;  // block_: the next call's block
  attention::TiledMask mask_;                  // of the forward announced by begin()
  std::vector<std::vector<float>> k_, v_;      // per block [positions, Hk, D], grown as needed
};

}  // namespace tessel::model
