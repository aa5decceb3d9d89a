#pragma once
// An attention implementation that replaces the kernel call of every layer for one
// micro-batch (model::ModelInputs::attention). The trainer installs context-parallel attention
// (parallel::ContextParallelAttention) through it, so the model never sees a communicator.
// Arguments are those of flash_attention_forward / flash_attention_backward over the
// micro-batch's own tokens, q [B, T, Hq, D], k and v [B, T, Hk, D], lse [B, Hq, T]; the hook
// applies its own mask. backward adds into dq, dk, dv.
namespace tessel::attention {

class AttentionHook {
 public:
  virtual ~AttentionHook() = default;
  virtual void forward(float* o, float* lse, const float* q, const float* k, const float* v) = 0;
  virtual void backward(float* dq, float* dk, float* dv, const float* dout, const float* q,
                        const float* k, const float* v, const float* o, const float* lse) = 0;
};

}  // namespace tessel::attention
