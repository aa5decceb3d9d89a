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
//
// Sharded (ZeRO-1) over `group` (the ranks whose parameters and gradients are replicated):
// the parameters' elements, concatenated in list order, are split into P contiguous ranges
// of ceil(total/P) (the last short or empty). Each rank keeps m and v of its range only,
// updates those elements, and one all_gatherv per step gives every rank every updated
// element. The update is elementwise, so the parameters are bitwise those of the replicated
// optimizer, with 1/P of its state memory for one extra all-gather of the parameters.
// state() is collective then: it gathers whole m and v (so a checkpoint does not depend on
// P), and the next step() takes its range from them (a loaded checkpoint lands there). So a
// checkpoint save or load holds the whole state, as replicated AdamW always does: sharding
// lowers the memory between checkpoints, not the run's peak (writing each rank's range as a
// checkpoint shard of its own would).
class AdamW : public Optimizer {
 public:
  // `base.lr` is the lr at lr_scale 1. Parameters whose tag is in `decay_tags` get
  // `base.weight_decay`; the others none. A `group` of more than one rank shards the state.
  AdamW(ParameterList params, const AdamWHyper& base, std::vector<ParamTag> decay_tags,
        comm::Communicator* group = nullptr);

  void step(double lr_scale) override;
  std::vector<StateTensor> state() override;
  std::string name() const override { return "adamw"; }
  int64_t step_count() const override { return step_.i32()[0]; }

  // Weight decay this parameter gets (0 when its tag is not a decay tag).
  double weight_decay_of(const Parameter& param) const;
  // Elements of m (and of v) this rank keeps: all of them unless sharded.
  int64_t state_elements() const { return m_.numel(); }

 private:
  bool sharded() const { return group_ != nullptr && group_->size() > 1; }
  // Calls f(parameter index, first element within it, count, offset in the concatenation)
  // for every piece of the parameters that lies in [lo_, hi_).
  template <class F>
  void for_each_own_piece(F&& f) const;
  // After state(): this rank's ranges of whole_m_ and whole_v_ (a loaded checkpoint, or what
  // state() gathered) into tensors of their own, and the whole ones released.
  void take_loaded_range();

  ParameterList params_;
  AdamWHyper base_;
  std::vector<ParamTag> decay_tags_;
  comm::Communicator* group_;
  Tensor step_;  // i32 [1]
  Tensor m_;     // f32 [hi_ - lo_]: elements lo_.. of the concatenation (a view after state())
  Tensor v_;
  std::vector<int64_t> offsets_;  // start of each parameter in the concatenation
  int64_t total_ = 0;
  int64_t lo_ = 0, hi_ = 0;           // this rank's range (all elements unless sharded)
  bool contiguous_ = false;           // the parameters are one buffer, in list order
  std::vector<size_t> range_counts_;  // every rank's range size (the all_gatherv counts)
  Tensor whole_m_, whole_v_;          // sharded: [total_] gathered by state(), until a step
};

}  // namespace tessel::optim
