#pragma once
// The optimizer interface the trainer, the checkpoint and the parallel layer see.
//
// An optimizer updates a ParameterList (views into the model's flat value and gradient
// buffers) from its gradients. Its state is a list of named tensors that view the
// optimizer's own buffers: the checkpoint saves them and loads them back in place
// (bitwise), so a resumed run continues exactly. Several optimizers over disjoint tag
// groups (Muon for hidden matrices, AdamW for the rest: issue #4) keep state names
// unique by prefixing them with their own name ("adamw.m/<param>").
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "tessel/core/parameter.hpp"
#include "tessel/core/tensor.hpp"

namespace tessel::optim {

// One named state tensor, a view of optimizer-owned memory: writing into `tensor`
// restores that state in place.
struct StateTensor {
  std::string name;
  Tensor tensor;
};

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  // Applies one update to every parameter from its gradient. Each optimizer's learning
  // rate is its configured base lr times `lr_scale` (LrSchedule::scale of this step), so
  // optimizers with different base lrs share one schedule.
  virtual void step(double lr_scale) = 0;
  // All state in a fixed order: the step counter first, then per-parameter buffers in
  // parameter order.
  virtual std::vector<StateTensor> state() = 0;
  virtual std::string name() const = 0;
  // Updates taken so far (restored with the state).
  virtual int64_t step_count() const = 0;
};

// The `optim` table of the run config. Field names match the config keys; errors name them.
struct OptimizerConfig {
  std::string name = "adamw";  // "adamw" (issue #4 adds "muon", "dion2", "dion3")
  double lr = 3e-3;            // peak learning rate (base lr of AdamW)
  double min_lr = 3e-4;        // learning rate after the cosine decay
  int64_t warmup_steps = 50;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.1;
  // Comma-separated parameter tags that get weight decay (core/parameter.hpp names).
  std::string decay_tags = "hidden_matrix,embedding,head";
};

// Checks every field's range; throws InputError naming the field (`optim.beta1`, ...).
// The schedule's fields (min_lr, warmup_steps) are checked with `train.steps` by LrSchedule.
void validate(const OptimizerConfig& config);

// Parses `optim.decay_tags` ("a,b"; empty = no decay); throws InputError on an unknown tag.
std::vector<ParamTag> parse_decay_tags(const std::string& text);

// The optimizer named by `config.name` over `params` (validated first); throws InputError
// naming `optim.name` for an unknown name.
std::unique_ptr<Optimizer> make_optimizer(const OptimizerConfig& config, ParameterList params);

}  // namespace tessel::optim
