#include "tessel/parallel/expert_sharding.hpp"

#include <array>
#include <cmath>
#include <numeric>
#include <set>

#include "tessel/optim/grad_clip.hpp"

namespace tessel::parallel {

model::ExpertShard expert_shard(const comm::Mesh& mesh) {
  return {mesh.coordinate(comm::Axis::ep), mesh.size(comm::Axis::ep)};
}

std::vector<bool> expert_flags(const model::Gpt& model, const ParameterList& params) {
  std::set<std::string> experts;
  for (const Parameter& p : model.expert_parameters()) experts.insert(p.name);
  std::vector<bool> flags;
  for (const Parameter& p : params) flags.push_back(experts.count(p.name) > 0);
  return flags;
}

std::vector<double> grad_squares(const ParameterList& params, const std::vector<bool>& is_expert,
                                 comm::Communicator& ep_group) {
  TESSEL_CHECK(is_expert.size() == params.size(), "one expert flag per parameter");
  std::vector<double> squares, mine;  // mine: the expert ones, in order
  for (const Parameter& p : params)
    squares.push_back(optim::sum_squares(p.grad.f32(), p.grad.numel()));
  for (size_t i = 0; i < params.size(); ++i)
    if (is_expert[i]) mine.push_back(squares[i]);
  if (mine.empty()) return squares;  // the same on every rank of the ep group
  // Gathered, not all-reduced: added in ep-rank order, every rank gets the same bits.
  const size_t n = mine.size(), ranks = size_t(ep_group.size());
  std::vector<double> each(n * ranks);
  ep_group.all_gather(mine.data(), each.data(), n, comm::ElemType::f64);
  for (size_t i = 0, e = 0; i < params.size(); ++i)
    if (is_expert[i]) {
      double sum = each[e];
      for (size_t r = 1; r < ranks; ++r) sum += each[r * n + e];
      squares[i] = sum;
      ++e;
    }
  return squares;
}

ExpertShardedGradients::ExpertShardedGradients(const model::Gpt& model,
                                               comm::Communicator& dense_group,
                                               comm::Communicator& expert_group,
                                               comm::Communicator& ep_group, int64_t bucket_bytes)
    : all_(model.parameters()),
      all_is_expert_(expert_flags(model, all_)),
      ep_(ep_group),
      dense_reducer_(dense_group, model.dense_grads(), bucket_bytes),
      expert_reducer_(expert_group, model.expert_grads(), bucket_bytes) {}

void ExpertShardedGradients::start_from(model::GradsFinal final) {
  dense_reducer_.start_from(final.dense);
  expert_reducer_.start_from(final.experts);
}

void ExpertShardedGradients::reduce(float scale) {
  reduce_together(std::array{&dense_reducer_, &expert_reducer_}, scale);
}

double ExpertShardedGradients::clip(double max_norm) {
  const std::vector<double> squares = grad_squares(all_, all_is_expert_, ep_);
  const double norm = std::sqrt(std::accumulate(squares.begin(), squares.end(), 0.0));
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
