#pragma once
// Expert-sharded training: the placement of a Gpt's experts on the mesh and the update that
// goes with it. Each rank of an ep group holds E / ep experts of every MoE block (the model
// allocates only those: model::ExpertShard); the dense parameters are replicated over dp.
//   - gradients: the dense range of the flat buffer is summed over the dp (x cp) group, the
//     experts' range over the edp (x cp) group (the ranks holding the same experts);
//   - clipping: global norm^2 = the sum, in registry order, of each parameter's gradient
//     squares, an expert slot's summed over the ep ranks (each holds its own experts in the
//     slot) in ep-rank order first, so every
//     rank scales by the same bits, and a pipeline (which adds its stages' sums the same way)
//     by the bits of the plain loop;
//   - optimizer: the configured optimizer over the dense parameters and dp, and a second one
//     over the experts and edp (ZeRO-1 sharding of the Muon family over edp); the expert
//     one's state names carry the prefix "experts/" (under a pipeline "stage<s>/experts/"),
//     so they do not depend on ep.
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "tessel/comm/mesh.hpp"
#include "tessel/model/gpt.hpp"
#include "tessel/optim/optimizer.hpp"
#include "tessel/parallel/data_parallel.hpp"

namespace tessel::parallel {

// This rank's experts: shard (ep coordinate) of the ep degree.
model::ExpertShard expert_shard(const comm::Mesh& mesh);

// Which of `params` are expert parameters of `model` (by name).
std::vector<bool> expert_flags(const model::Gpt& model, const ParameterList& params);

// Each gradient's sum of squares, in the order of `params`; an expert parameter's (is_expert)
// summed over the ep group in ep-rank order: each ep rank holds other experts in that slot, so
// such an entry is the slot's, no one parameter's (only the total is used; the dense ones are
// alike on every ep rank). Collective over ep_group when any is an expert.
std::vector<double> grad_squares(const ParameterList& params, const std::vector<bool>& is_expert,
                                 comm::Communicator& ep_group);

// The gradient all-reduces and the clipping of a model placed by expert_shard. The groups
// must outlive it; dense_group is dp x cp, expert_group edp x cp (Axis::dp_cp, edp_cp).
class ExpertShardedGradients {
 public:
  ExpertShardedGradients(const model::Gpt& model, comm::Communicator& dense_group,
                         comm::Communicator& expert_group, comm::Communicator& ep_group,
                         int64_t bucket_bytes);
  // Starts the all-reduce of the buckets a backward has finished (model::Activations::
  // on_grads_final), so that it overlaps the rest of the backward.
  void start_from(model::GradsFinal final);
  // Sums every gradient over its group, then multiplies by `scale` (GradientReducer).
  void reduce(float scale);
  // Scales every gradient by min(1, max_norm / (norm + 1e-6)) (optim::clip_grad_norm) with
  // the expert-sharded global norm; returns the norm.
  double clip(double max_norm);
  // The all-reduces per step (each a bucket of the dense or the expert range).
  int64_t num_buckets() const {
    return dense_reducer_.num_buckets() + expert_reducer_.num_buckets();
  }

 private:
  ParameterList all_;
  std::vector<bool> all_is_expert_;
  comm::Communicator& ep_;
  GradientReducer dense_reducer_, expert_reducer_;
};

// The optimizer of a model placed by expert_shard (see the top of this file): over its dense
// and expert parameters (the model's, or a pipeline stage's share of them). Every state name
// starts with `prefix` (a pipeline's "stage<s>/"). step() is collective over both groups.
class ExpertShardedOptimizer final : public optim::Optimizer {
 public:
  ExpertShardedOptimizer(const optim::OptimizerConfig& config, ParameterList dense,
                         ParameterList experts, comm::Communicator& dense_group,
                         comm::Communicator& expert_group,
                         const std::map<std::string, std::vector<int64_t>>& row_blocks,
                         std::string prefix = "");
  void step(double lr_scale) override;
  // The state in three: what every rank holds alike (the dense optimizer's whole state and the
  // expert optimizer's step counters); this rank's own: its experts' whole tensors (those
  // whose name ends in "/<expert parameter name>"); and the row shards of either optimizer
  // (ZeRO-1 state: the dp or edp rank's rows, alike on the ranks that differ only in cp).
  struct SplitState {
    std::vector<optim::StateTensor> replicated, own, shards;
  };
  SplitState split_state();
  std::vector<optim::StateTensor> state() override;  // replicated, own, then shards
  std::string name() const override { return dense_->name(); }
  int64_t step_count() const override { return dense_->step_count(); }

 private:
  std::string prefix_;
  std::unique_ptr<optim::Optimizer> dense_, experts_;  // experts_ null without experts
  std::set<std::string> expert_names_;                 // the expert parameters'
};

}  // namespace tessel::parallel
