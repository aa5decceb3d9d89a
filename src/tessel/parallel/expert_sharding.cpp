#include "tessel/parallel/expert_sharding.hpp"

#include <cmath>

#include "tessel/optim/grad_clip.hpp"

namespace tessel::parallel {

model::ExpertShard expert_shard(const comm::Mesh& mesh) {
  return {mesh.coordinate(comm::Axis::ep), mesh.size(comm::Axis::ep)};
}

double expert_sharded_grad_norm(const ParameterList& dense, const ParameterList& experts,
                                comm::Communicator& ep_group) {
  const double mine = optim::grad_sum_squares(experts);
  std::vector<double> each(size_t(ep_group.size()));
  ep_group.all_gather(&mine, each.data(), 1, comm::ElemType::f64);
  double total = optim::grad_sum_squares(dense);
  for (double s : each) total += s;
  return std::sqrt(total);
}

ExpertShardedGradients::ExpertShardedGradients(const model::Gpt& model,
                                               comm::Communicator& dense_group,
                                               comm::Communicator& expert_group,
                                               comm::Communicator& ep_group, int64_t bucket_bytes)
    : all_(model.parameters()),
      dense_(model.dense_parameters()),
      experts_(model.expert_parameters()),
      ep_(ep_group),
      dense_reducer_(dense_group, model.dense_grads(), bucket_bytes),
      expert_reducer_(expert_group, model.expert_grads(), bucket_bytes) {}

void ExpertShardedGradients::start_from(model::GradsFinal final) {
  dense_reducer_.start_from(final.dense);
  expert_reducer_.start_from(final.experts);
}

void ExpertShardedGradients::reduce(float scale) {
  dense_reducer_.reduce(scale);
  expert_reducer_.reduce(scale);
}

double ExpertShardedGradients::clip(double max_norm) {
  const double norm = expert_sharded_grad_norm(dense_, experts_, ep_);
  optim::scale_to_max_norm(all_, norm, max_norm);
  return norm;
}

ExpertShardedOptimizer::ExpertShardedOptimizer(
    const optim::OptimizerConfig& config, ParameterList dense, ParameterList experts,
    comm::Communicator& dense_group, comm::Communicator& expert_group,
    const std::map<std::string, std::vector<int64_t>>& row_blocks, std::string prefix)
    : prefix_(std::move(prefix)) {
  for (const Parameter& p : experts) expert_names_.insert(p.name);
  // Row blocks of the dense parameters held here only (a pipeline stage holds some).
  std::map<std::string, std::vector<int64_t>> blocks;
  for (const Parameter& p : dense)
    if (auto it = row_blocks.find(p.name); it != row_blocks.end()) blocks.insert(*it);
  dense_ = optim::make_optimizer(config, std::move(dense), &dense_group, blocks);
  if (!experts.empty()) experts_ = optim::make_optimizer(config, std::move(experts), &expert_group);
}

void ExpertShardedOptimizer::step(double lr_scale) {
  dense_->step(lr_scale);
  if (experts_) experts_->step(lr_scale);
}

ExpertShardedOptimizer::SplitState ExpertShardedOptimizer::split_state() {
  SplitState out;
  auto add = [](std::vector<optim::StateTensor>& to, optim::StateTensor st,
                const std::string& prefix) {
    st.name = prefix + st.name;
    to.push_back(std::move(st));
  };
  for (auto& st : dense_->state()) add(st.is_shard() ? out.shards : out.replicated, st, prefix_);
  if (!experts_) return out;
  for (auto& st : experts_->state()) {
    const size_t slash = st.name.rfind('/');
    const bool per_expert =
        slash != std::string::npos && expert_names_.count(st.name.substr(slash + 1));
    add(st.is_shard() ? out.shards
        : per_expert  ? out.own
                      : out.replicated,
        st, prefix_ + "experts/");
  }
  return out;
}

std::vector<optim::StateTensor> ExpertShardedOptimizer::state() {
  SplitState split = split_state();
  for (auto* part : {&split.own, &split.shards})
    for (auto& st : *part) split.replicated.push_back(std::move(st));
  return split.replicated;
}

}  // namespace tessel::parallel
