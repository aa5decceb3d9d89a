#pragma once
// AdamW (Loshchilov & Hutter; the PyTorch torch.optim.AdamW update), decoupled weight decay:
//   p *= 1 - lr*wd
//   m  = beta1*m + (1-beta1)*g;   v = beta2*v + (1-beta2)*g^2
//   p -= lr * (m / (1-beta1^t)) / (sqrt(v / (1-beta2^t)) + eps)        t = step, from 1
#include <cstdint>
#include <string>
#include <vector>

#include "tessel/optim/optimizer.hpp"

namespace tessel::optim {

struct AdamWHyper {
  double lr = 1e-3;  // the learning rate of this step
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.0;
};

// One AdamW step over n elements: p, m, v [n] updated in place from g [n]. `step` is the
// 1-based number of this update (bias correction). Elementwise: bitwise independent of the
// thread count.
void adamw_update(float* p, const float* g, float* m, float* v, int64_t n, const AdamWHyper& h,
                  int64_t step);

namespace naive {
// The formula above, term by term, in T (float and double instantiated).
template <class T>
void adamw_update(T* p, const T* g, T* m, T* v, int64_t n, const AdamWHyper& h, int64_t step);
}  // namespace naive

// AdamW over a parameter list. State: "adamw.step" (i32 [1], updates taken), then per
// parameter "adamw.m/<name>" and "adamw.v/<name>" (f32, the parameter's shape).
class AdamW : public Optimizer {
 public:
  // `base.lr` is the lr at lr_scale 1. Parameters whose tag is in `decay_tags` get
  // `base.weight_decay`; the others none.
  AdamW(ParameterList params, const AdamWHyper& base, std::vector<ParamTag> decay_tags);

  void step(double lr_scale) override;
  std::vector<StateTensor> state() override;
  std::string name() const override { return "adamw"; }
  int64_t step_count() const override { return step_.i32()[0]; }

  // Weight decay this parameter gets (0 when its tag is not a decay tag).
  double weight_decay_of(const Parameter& param) const;

 private:
  ParameterList params_;
  AdamWHyper base_;
  std::vector<ParamTag> decay_tags_;
  Tensor step_;  // i32 [1]
  Tensor m_;     // f32 [total elements], parameter order
  Tensor v_;
  std::vector<int64_t> offsets_;  // start of each parameter in m_ and v_
};

}  // namespace tessel::optim
