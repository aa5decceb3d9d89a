#include "tessel/train/pipeline_trainer.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <numeric>
#include <set>
#include <string>

#include "tessel/core/error.hpp"
#include "tessel/core/timer.hpp"
#include "tessel/moe/layer.hpp"
#include "tessel/optim/grad_clip.hpp"
#include "tessel/train/batch_inputs.hpp"
#include "tessel/train/stage_partition.hpp"

namespace tessel::train {

bool pipeline_enabled(const Config& c) {
  return c.parallel.pp > 1 || !c.pipeline.schedule.empty();
}

pipeline::ScheduleKind pipeline_schedule(const Config& c) {
  return c.pipeline.schedule.empty() ? pipeline::ScheduleKind::one_f_one_b
                                     : pipeline::parse_schedule(c.pipeline.schedule);
}

int64_t micro_batches_per_step(const Config& c) {
  if (pipeline_enabled(c) && pipeline_schedule(c) == pipeline::ScheduleKind::paci &&
      c.pipeline.paci_k > 0)
    return c.pipeline.paci_k;
  return c.train.accum;
}

int64_t pipeline_chunks(const Config& c) {
  if (!pipeline_enabled(c) || pipeline_schedule(c) != pipeline::ScheduleKind::interleaved) return 1;
  return c.pipeline.chunks > 0 ? c.pipeline.chunks : 2;
}

std::vector<int64_t> pipeline_boundaries(const Config& c) {
  const int64_t chunks = pipeline_chunks(c);
  return stage_boundaries(
      stage_layout(c.pipeline.layout, layer_costs(c.model, c.train.seq_len), c.parallel.pp * chunks,
                   chunks > 1 ? "parallel.pp x pipeline.chunks" : "parallel.pp"));
}

void validate_pipeline(const Config& c) {
  if (!pipeline_enabled(c)) {
    // A pipeline key set without a pipeline would be silently ignored.
    const char* set = !c.pipeline.layout.empty()     ? "pipeline.layout"
                      : c.pipeline.paci_k != 0       ? "pipeline.paci_k"
                      : c.pipeline.paci_stash        ? "pipeline.paci_stash"
                      : c.pipeline.paci_predict != 0 ? "pipeline.paci_predict"
                      : c.pipeline.chunks != 0       ? "pipeline.chunks"
                                                     : nullptr;
    if (set)
      input_error("config key '", set, "' needs pipeline parallelism: set parallel.pp > 1 or ",
                  "pipeline.schedule");
    return;
  }
  const std::string& name = c.pipeline.schedule;
  if (!name.empty() && !pipeline::find_schedule(name))
    input_error("config key 'pipeline.schedule' = \"", name, "\": expected ",
                pipeline::kScheduleNames, " (or \"\" for 1f1b)");
  if (c.pipeline.chunks != 0 && pipeline_schedule(c) != pipeline::ScheduleKind::interleaved)
    input_error("config key 'pipeline.chunks' = ", c.pipeline.chunks,
                " needs pipeline.schedule = interleaved");
  if (pipeline_schedule(c) == pipeline::ScheduleKind::interleaved) {
    if (c.pipeline.chunks < 0 || c.pipeline.chunks == 1)
      input_error("config key 'pipeline.chunks' must be >= 2 (0 = 2) with pipeline.schedule = ",
                  "interleaved (one chunk per stage is 1f1b), got ", c.pipeline.chunks);
    if (c.parallel.pp < 2)
      input_error("pipeline.schedule = interleaved needs parallel.pp >= 2, got ", c.parallel.pp);
    if (c.train.accum % c.parallel.pp != 0)
      input_error("pipeline.schedule = interleaved needs train.accum divisible by parallel.pp = ",
                  c.parallel.pp, " (micro-batches enter in groups of pp), got ", c.train.accum);
  }
  if (c.pipeline.paci_k < 0)
    input_error("config key 'pipeline.paci_k' must be >= 0 (0 = train.accum), got ",
                c.pipeline.paci_k);
  if (!(c.pipeline.paci_predict >= 0 && c.pipeline.paci_predict <= 4))
    input_error(
        "config key 'pipeline.paci_predict' must be in [0, 4] (a share of the last "
        "step; 0 = off), got ",
        c.pipeline.paci_predict);
  for (const auto& [set, key] :
       {std::pair{c.pipeline.paci_stash, "pipeline.paci_stash"},
        std::pair{c.pipeline.paci_predict != 0, "pipeline.paci_predict"}}) {
    if (!set) continue;
    if (pipeline_schedule(c) != pipeline::ScheduleKind::paci)
      input_error("config key '", key, "' needs pipeline.schedule = paci");
    // The last stage's forwards are never stale: a single stage would ignore either option.
    if (c.parallel.pp < 2)
      input_error("config key '", key,
                  "' needs parallel.pp > 1 (a single stage's forwards are never stale)");
  }
  // Both read the weights before the last STEP: the stash runs a stale backward against
  // them, the prediction moves a stale forward away from them.
  if (c.pipeline.paci_stash && c.pipeline.paci_predict != 0)
    input_error(
        "config keys 'pipeline.paci_stash' and 'pipeline.paci_predict' exclude each "
        "other: set at most one");
  if (c.pipeline.paci_k != 0 && pipeline_schedule(c) != pipeline::ScheduleKind::paci)
    input_error("config key 'pipeline.paci_k' = ", c.pipeline.paci_k,
                " needs pipeline.schedule = paci (the flush schedules take train.accum "
                "micro-batches per step)");
  // The stash holds one version back: every gap, ceil((pp - 1) / K), must be at most 1.
  if (c.pipeline.paci_stash && micro_batches_per_step(c) < c.parallel.pp - 1)
    input_error("config key 'pipeline.paci_stash' = true needs pipeline.paci_k (or train.accum) ",
                ">= parallel.pp - 1 = ", c.parallel.pp - 1, ", got ", micro_batches_per_step(c));
  if (pipeline_schedule(c) == pipeline::ScheduleKind::paci) {
    // PACI steps each stage alone; a tied weight would need the first and last stage to
    // agree on it at every local step, a cross-stage collective PACI is meant to avoid.
    if (c.model.tied_head && c.parallel.pp > 1)
      input_error(
          "config key 'model.tied_head' = true is not available with pipeline.schedule = "
          "paci and parallel.pp > 1 (the first and last stage would have to sync the tied "
          "weight at every local step); set model.tied_head = false or use a flush schedule "
          "(gpipe, 1f1b, interleaved, zb-h1)");
    // A stale backward runs against newer weights than its forward did; only the stash puts
    // the forward's weights back before it, so that a recomputed forward is the forward.
    if (c.train.recompute != model::Recompute::none && c.parallel.pp > 1 && !c.pipeline.paci_stash)
      input_error(
          "config key 'train.recompute' = blocks with pipeline.schedule = paci needs "
          "pipeline.paci_stash = true (without it a stale micro-batch's recomputed forward "
          "would see newer weights than its forward did)");
    if (c.train.checkpoint_policy != "fixed")
      input_error("config key 'train.checkpoint_policy' = ", c.train.checkpoint_policy,
                  " is not available with pipeline.schedule = paci (its horizons end at "
                  "checkpoints known in advance); use fixed");
  }
  pipeline_boundaries(c);  // InputError for a bad layout, or too few blocks for the stages
}

std::vector<model::BlockRange> pipeline_block_ranges(const Config& config, const comm::Mesh& mesh) {
  if (!pipeline_enabled(config)) return {model::BlockRange{}};
  const auto bounds = pipeline_boundaries(config);
  const auto P = size_t(config.parallel.pp);
  std::vector<model::BlockRange> chunks;
  for (auto j = size_t(mesh.coordinate(comm::Axis::pp)); j + 1 < bounds.size(); j += P)
    chunks.push_back({bounds[j], bounds[j + 1], j == 0, j + 2 == bounds.size()});
  return chunks;
}

std::vector<int> parameter_stages(const model::Gpt& model, const std::vector<int64_t>& boundaries,
                                  int stages) {
  const int last = int(boundaries.size()) - 2;
  std::vector<int> out;
  for (const Parameter& p : model.parameters()) {
    int stage = last;  // final norm, head
    if (p.name.rfind("blocks.", 0) == 0) {
      const int64_t block = std::stoll(p.name.substr(7));
      // The last stage starting at or before the block (stages without blocks come earlier).
      stage =
          int(std::upper_bound(boundaries.begin(), boundaries.end(), block) - boundaries.begin()) -
          1;
    } else if (p.tag == ParamTag::embedding || p.tag == ParamTag::position_embedding) {
      stage = 0;
    }
    out.push_back(stage % stages);  // virtual stage j is on stage j % P
  }
  return out;
}

namespace {

ParameterList stage_parameters(const model::Gpt& model, const std::vector<int>& stages, int s) {
  ParameterList out;
  for (size_t i = 0; i < stages.size(); ++i)
    if (stages[i] == s) out.push_back(model.parameters()[i]);
  return out;
}

// The whole model's registry positions of stage s's parameters, in stage_parameters' order.
std::vector<int64_t> stage_registry_positions(const model::Gpt& model,
                                              const std::vector<int>& stages, int s) {
  std::vector<int64_t> out;
  for (size_t i = 0; i < stages.size(); ++i)
    if (stages[i] == s) out.push_back(model.registry_position(i));
  return out;
}

// The flat element range [begin, end) of `params` in `model`, which must be contiguous there
// (a stage's dense parameters are, as registry order follows the stages; so are all its
// parameters with its experts, which end the flat buffers, though not in registry order: a
// shared expert or a dense block registered after the experts lies before them).
std::pair<int64_t, int64_t> flat_range(const model::Gpt& model, const ParameterList& params) {
  if (params.empty()) return {0, 0};  // a stage without parameters
  int64_t begin = std::numeric_limits<int64_t>::max(), end = 0, total = 0;
  const float* base = model.flat_params().f32();
  for (const Parameter& p : params) {
    const int64_t at = p.value.f32() - base;
    begin = std::min(begin, at);
    end = std::max(end, at + p.value.numel());
    total += p.value.numel();
  }
  TESSEL_CHECK(total == end - begin, "a stage's parameters are not contiguous");
  return {begin, end};
}

// `params` in two, each in order: the dense ones and the model's experts.
std::pair<ParameterList, ParameterList> split_experts(const model::Gpt& model,
                                                      const ParameterList& params) {
  const std::vector<bool> expert = parallel::expert_flags(model, params);
  std::pair<ParameterList, ParameterList> out;
  for (size_t i = 0; i < params.size(); ++i)
    (expert[i] ? out.second : out.first).push_back(params[i]);
  return out;
}

}  // namespace

std::unique_ptr<parallel::ExpertShardedOptimizer> make_stage_optimizer(
    const Config& config, const model::Gpt& model, const comm::Mesh& mesh,
    const std::map<std::string, std::vector<int64_t>>& row_blocks) {
  // Only this rank's stage: the other stages' optimizer state (momentum, Adam moments,
  // scratch) lives on their own ranks, so each rank holds 1/P of it.
  const int stage = mesh.coordinate(comm::Axis::pp);
  const ParameterList own = stage_parameters(
      model, parameter_stages(model, pipeline_boundaries(config), config.parallel.pp), stage);
  auto [dense, experts] = split_experts(model, own);
  return std::make_unique<parallel::ExpertShardedOptimizer>(
      config.optim, std::move(dense), std::move(experts), mesh.group(comm::Axis::dp),
      mesh.group(comm::Axis::edp), row_blocks, "stage" + std::to_string(stage) + "/");
}

PipelineTrainer::PipelineTrainer(const Config& config, const comm::Mesh& mesh, model::Gpt& model,
                                 data::DataLoader& loader, optim::Optimizer& optimizer,
                                 const optim::LrSchedule& schedule)
    : config_(config),
      pp_(mesh.group(comm::Axis::pp)),
      ep_(mesh.group(comm::Axis::ep)),
      grad_group_(mesh.group(comm::Axis::dp_cp)),
      model_(model),
      optimizer_(optimizer),
      schedule_(schedule),
      kind_(pipeline_schedule(config)),
      stage_(pp_.rank()),
      stages_(pp_.size()),
      micro_per_step_(micro_batches_per_step(config)),
      param_stage_(parameter_stages(model, pipeline_boundaries(config), config.parallel.pp)),
      own_params_(stage_parameters(model, param_stage_, stage_)),
      own_dense_(split_experts(model, own_params_).first),
      own_experts_(split_experts(model, own_params_).second),
      own_is_expert_(parallel::expert_flags(model, own_params_)),
      own_positions_(stage_registry_positions(model, param_stage_, stage_)),
      own_range_(flat_range(model, own_dense_)),
      tied_(config.model.tied_head && stages_ > 1),
      ends_(tied_ ? pp_.split(stage_ == 0 || stage_ == stages_ - 1 ? 0 : 1, stage_) : nullptr),
      work_(
          model, pipeline_boundaries(config), stage_, stages_, loader, config,
          mesh.group(comm::Axis::cp), max_live_activations(),
          [this](int64_t version) { on_step(version); }, own_stale_weights(config),
          [this](int64_t micro, const model::Activations& acts) {
            if (!run_moe_.empty())
              run_moe_.at(size_t(micro / micro_per_step_ - run_step_)).add(acts);
          }),
      executor_(pp_, work_) {
  const std::vector<model::BlockRange> chunks = pipeline_block_ranges(config, mesh);
  const std::vector<model::BlockRange>& held = model.block_ranges();
  TESSEL_CHECK(std::equal(held.begin(), held.end(), chunks.begin(), chunks.end(),
                          [](const model::BlockRange& a, const model::BlockRange& b) {
                            return a.first == b.first && a.last == b.last &&
                                   a.embedding == b.embedding && a.head == b.head;
                          }),
               "the model holds other parts than stage ", stage_, "'s");
  const auto [begin, end] = own_range_;
  const int64_t bucket_bytes = config.parallel.bucket_bytes();
  reducer_.emplace(grad_group_, model.flat_grads().view(begin, {end - begin}), bucket_bytes);
  if (!own_experts_.empty())  // every expert held is this stage's: summed over edp x cp
    expert_reducer_.emplace(mesh.group(comm::Axis::edp_cp), model.expert_grads(), bucket_bytes);
}

int64_t PipelineTrainer::max_live_activations() const {
  switch (kind_) {
    case pipeline::ScheduleKind::gpipe:
    case pipeline::ScheduleKind::interleaved:  // per chunk; made on first use
      return micro_per_step_;
    case pipeline::ScheduleKind::zb_h1:  // P - s forwards awaiting B, s backwards awaiting W
      return stages_;
    default:
      return stages_ - stage_;
  }
}

StaleWeights PipelineTrainer::own_stale_weights(const Config& config) const {
  using Mode = StaleWeights::Mode;
  const Mode mode = config.pipeline.paci_stash          ? Mode::stash
                    : config.pipeline.paci_predict != 0 ? Mode::predict
                                                        : Mode::plain;
  // The last stage's forwards are never stale.
  if (mode == Mode::plain || stage_ == stages_ - 1) return {};
  const auto [begin, end] = flat_range(model_, own_params_);  // with the experts
  StaleWeights stale{mode, model_.flat_params().view(begin, {end - begin})};
  if (mode == Mode::predict) {
    stale.window = micro_per_step_;
    stale.share = config.pipeline.paci_predict;
  }
  return stale;
}

void PipelineTrainer::on_step(int64_t version) {
  const int64_t update = run_step_ + (version - run_version_) + 1;  // counted from 1
  const StageWindow w = work_.take_window();
  const bool flush = kind_ != pipeline::ScheduleKind::paci;
  const bool end_stage = stage_ == 0 || stage_ == stages_ - 1;
  // The cross-stage collectives of a flush step wait for the slowest stage: timed apart
  // from the step's own work (`sync_seconds` in the records).
  auto across_stages = [this](auto collective) {
    const Timer t;
    collective();
    sync_seconds_ += t.seconds();
  };
  if (tied_ && end_stage) {  // lookups' part (first stage) + head's part (last stage)
    Tensor g = model_.parameter("embed.weight").grad;
    across_stages([&] { ends_->all_reduce(std::span<float>(g.f32(), size_t(g.numel()))); });
  }
  double stats[2] = {w.loss_sum, w.loss_tokens};
  grad_group_.all_reduce(std::span<double>(stats, 2));
  TESSEL_CHECK(stats[1] > 0, "a training step without loss tokens");
  const float scale = float(1.0 / stats[1]) * hooks_.gradient_scale(update);
  parallel::reduce_together(std::array{&*reducer_, expert_reducer_ ? &*expert_reducer_ : nullptr},
                            scale);
  // The stage's sums of squares (an expert's summed over ep), in registry order.
  const std::vector<double> squares = parallel::grad_squares(own_params_, own_is_expert_, ep_);
  double norm = 0;
  if (flush) {
    // Each from its stage at its place in the whole model's registry, then the last stage's
    // loss sum: added in registry order, as the plain loop adds them (ExpertShardedGradients).
    // Every entry but one is 0 in the all-reduce, so its order changes no bit.
    const auto registry = size_t(model_.registry_size());
    std::vector<double> sums(registry + 1, 0.0);
    for (size_t j = 0; j < squares.size(); ++j) sums[size_t(own_positions_[j])] = squares[j];
    if (work_.last_stage()) sums.back() = stats[0];
    across_stages([&] { pp_.all_reduce(std::span<double>(sums)); });
    norm = std::sqrt(std::accumulate(sums.begin(), sums.end() - 1, 0.0));
    stats[0] = sums.back();
  } else {
    norm = std::sqrt(std::accumulate(squares.begin(), squares.end(), 0.0));
  }
  if (!std::isfinite(norm))
    optim::check_finite_grad_norm(
        norm, "step " + std::to_string(update) + ": stage " + std::to_string(stage_),
        hooks_.diverged(flush));
  if (!flush && on_window && work_.last_stage()) {  // after the check: no NaN progress line
    on_window(update, stats[0] / stats[1], norm, window_timer_.seconds());
    window_timer_.reset();
  }
  optim::scale_to_max_norm(own_params_, norm, config_.train.grad_clip);
  const bool apply = hooks_.before_update(update, norm);
  TESSEL_CHECK(apply || flush, "PACI skipped update ", update);
  if (apply) {
    optimizer_.step(schedule_.scale(update));
    model_.update_balance();  // MoE balancing: beta from this window's micro-batches
  } else {
    model_.discard_balance();  // a spike's loads must not reach the next update
  }
  model_.zero_grads();
  if (tied_ && end_stage) {
    Tensor e = model_.parameter("embed.weight").value;
    across_stages([&] { ends_->broadcast(std::span<float>(e.f32(), size_t(e.numel())), 0); });
  }
  run_windows_.push_back({stats[0], stats[1], norm, 0, {}, std::nullopt});
  hooks_.after_update(update);
}

PipelineStep PipelineTrainer::step(int64_t step, const UpdateHooks& hooks) {
  if (!pending_.empty()) {
    TESSEL_CHECK(step == next_step_, "pipeline step ", step, ", expected ", next_step_);
    PipelineStep r = std::move(pending_.front());
    pending_.pop_front();
    ++next_step_;
    return r;
  }
  const bool paci = kind_ == pipeline::ScheduleKind::paci;
  int64_t end = step + 1;
  if (paci) {  // drain only where the trainer validates or saves, or at the end
    const auto& t = config_.train;
    auto next_multiple = [&](int64_t every) {
      return every > 0 ? (step / every + 1) * every : t.steps;
    };
    end = std::min({t.steps, next_multiple(t.eval_every),
                    t.checkpoint_policy == "fixed" ? next_multiple(t.checkpoint_every) : t.steps});
  }
  const int64_t windows = end - step;
  run_step_ = step;
  run_version_ = executor_.version();
  hooks_ = hooks;
  run_windows_.clear();
  if (const MoeMetrics moe(model_); !moe.empty()) run_moe_.assign(size_t(windows), moe);
  const uint64_t all_to_all_bytes = ep_.traffic().bytes.all_to_all;
  model_.zero_grads();
  sync_seconds_ = 0;
  Timer timer;
  window_timer_.reset();
  pipeline::ScheduleOptions options{kind_,
                                    stages_,
                                    paci ? windows * micro_per_step_ : micro_per_step_,
                                    1,
                                    paci ? micro_per_step_ : 1,
                                    work_.chunks()};
  work_.begin_run(step * micro_per_step_);
  pipeline::StageStats stats;
  try {
    stats = executor_.run(options, step * micro_per_step_);
  } catch (const moe::RouterOverflow& e) {  // met on this stage alone: no collective
    // The stage's next update: under PACI a micro-batch may run ahead of it.
    const int64_t update = step + 1 + int64_t(run_windows_.size());
    throw DivergenceError("step " + std::to_string(update) + ": stage " + std::to_string(stage_) +
                          ": " + e.what() + hooks_.diverged(false));
  }
  hooks_ = {};  // they refer to the caller's step: only this run's updates may call them
  TESSEL_CHECK(int64_t(run_windows_.size()) == windows, "stage ", stage_, " took ",
               run_windows_.size(), " steps in a run of ", windows);

  // Every stage's record: busy and waiting seconds, version gaps, live activations.
  constexpr size_t kFields = 11;
  std::vector<double> per_stage(kFields * size_t(stages_), 0.0);
  double* mine = per_stage.data() + kFields * size_t(stage_);
  const double own_step_seconds = stats.step_seconds - sync_seconds_;
  // backward_seconds is the whole backward; under ZB-H1 weight_seconds is its W part.
  const double backward_seconds = stats.backward_seconds + stats.weight_seconds;
  mine[0] = stats.forward_seconds + backward_seconds + own_step_seconds;
  mine[1] = stats.wait_seconds;
  mine[2] = double(stats.max_version_gap);
  mine[3] = double(stats.inconsistent_backwards);
  mine[4] = double(stats.peak_live_activations);
  mine[5] = stats.forward_seconds;
  mine[6] = backward_seconds;
  mine[7] = own_step_seconds;
  mine[8] = sync_seconds_;
  mine[9] = double(work_.activation_bytes());
  mine[10] = stats.weight_seconds;
  // PACI: the last stage's loss sums, the first's token counts, each stage's norms.
  const size_t fields = 2 + size_t(stages_);
  std::vector<double> window_values(paci ? fields * size_t(windows) : 0, 0.0);
  for (int64_t j = 0; paci && j < windows; ++j) {
    double* v = window_values.data() + fields * size_t(j);
    if (work_.last_stage()) v[0] = run_windows_[size_t(j)].loss_sum;
    if (work_.first_stage()) v[1] = run_windows_[size_t(j)].loss_tokens;
    v[2 + size_t(stage_)] = run_windows_[size_t(j)].grad_norm;
  }
  per_stage.insert(per_stage.end(), window_values.begin(), window_values.end());
  // MoE: each window's statistics of this stage's blocks over dp x cp; the sum over pp below
  // joins the stages' blocks (and their all-to-all bytes).
  std::vector<double> moe_values;
  for (MoeMetrics& m : run_moe_) {
    m.add_all_to_all_bytes(double(ep_.traffic().bytes.all_to_all - all_to_all_bytes) /
                           double(windows));
    moe_values.insert(moe_values.end(), m.values().begin(), m.values().end());
  }
  if (!moe_values.empty()) grad_group_.all_reduce(std::span<double>(moe_values));
  const size_t moe_at = per_stage.size();
  per_stage.insert(per_stage.end(), moe_values.begin(), moe_values.end());
  pp_.all_reduce(std::span<double>(per_stage));
  for (size_t j = 0, at = moe_at; j < run_moe_.size(); ++j) {
    std::span<double> v = run_moe_[j].values();
    std::copy_n(per_stage.begin() + std::ptrdiff_t(at), v.size(), v.begin());
    at += v.size();
  }
  auto window_moe = [&](int64_t j) {
    return run_moe_.empty() ? std::optional<MoeMetrics>() : run_moe_[size_t(j)];
  };
  nlohmann::json metrics = {{"schedule", pipeline::schedule_name(kind_)},
                            {"micro_batches", micro_per_step_}};
  if (work_.chunks() > 1) metrics["chunks"] = work_.chunks();
  for (int s = 0; s < stages_; ++s) {
    const double* r = per_stage.data() + kFields * size_t(s);
    metrics["stages"].push_back({{"busy_seconds", r[0]},
                                 {"wait_seconds", r[1]},
                                 {"max_version_gap", int64_t(r[2])},
                                 {"inconsistent_backwards", int64_t(r[3])},
                                 {"peak_live_activations", int64_t(r[4])},
                                 {"forward_seconds", r[5]},
                                 {"backward_seconds", r[6]},
                                 {"optimizer_seconds", r[7]},
                                 {"sync_seconds", r[8]},
                                 {"activation_bytes", int64_t(r[9])},
                                 {"weight_seconds", r[10]}});
  }
  const double seconds = timer.seconds();
  if (!paci) {
    PipelineStep r = run_windows_.front();
    r.seconds = seconds;
    r.metrics = std::move(metrics);
    r.moe = window_moe(0);
    return r;
  }
  metrics["horizon"] = {step + 1, end};
  const double* v = per_stage.data() + kFields * size_t(stages_);
  for (int64_t j = 0; j < windows; ++j, v += fields) {
    PipelineStep r{v[0], v[1], 0, seconds / double(windows), metrics, window_moe(j)};
    double squares = 0;
    for (int s = 0; s < stages_; ++s) {
      squares += v[2 + s] * v[2 + s];
      r.metrics["stages"][size_t(s)]["grad_norm"] = v[2 + s];
    }
    r.grad_norm = std::sqrt(squares);
    pending_.push_back(std::move(r));
  }
  next_step_ = step;
  return this->step(step, hooks);
}

template <class Forward>
auto PipelineTrainer::through_chunk(int chunk, size_t elems, Forward forward) {
  constexpr int kTag = 0;  // between executor runs no message is in flight
  std::vector<float> input(work_.first_virtual(chunk) ? 0 : elems);
  std::vector<float> output(work_.last_virtual(chunk) ? 0 : elems);
  if (!input.empty()) pp_.recv(input, (stage_ + stages_ - 1) % stages_, kTag);
  auto result = forward(std::span<const float>(input), std::span<float>(output));
  if (!output.empty()) pp_.send(output, (stage_ + 1) % stages_, kTag);
  return result;
}

std::vector<double> PipelineTrainer::validation_sums(const std::vector<data::Batch>& batches,
                                                     std::span<const int64_t> source,
                                                     int64_t data_sets, MoeMetrics& moe,
                                                     const std::function<void()>& on_batch) {
  std::vector<double> sums(size_t(2 * data_sets), 0.0);
  // An MoE stage's forwards exchange tokens over its ep group: every rank runs as many as
  // the one with the most validation batches, the others on batches without loss tokens
  // (the same count on every stage: each stage's ep group spans the same dp coordinates).
  auto rounds = int64_t(batches.size());
  ep_.all_reduce(std::span<int64_t>(&rounds, 1), comm::ReduceOp::max);
  const data::Batch idle = idle_batch(config_.train.seq_len);
  for (int64_t i = 0; i < rounds; ++i) {
    const data::Batch& b = i < int64_t(batches.size()) ? batches[size_t(i)] : idle;
    const size_t elems = work_.boundary_elems(b);
    for (int chunk = 0; chunk < work_.chunks(); ++chunk) {
      const StageWindow r = through_chunk(
          chunk, elems, [&](auto in, auto out) { return work_.evaluate(chunk, b, in, out); });
      if (i >= int64_t(batches.size())) continue;
      if (work_.last_virtual(chunk)) {
        const auto d = size_t(source[size_t(i)]);
        sums[2 * d] += r.loss_sum, sums[2 * d + 1] += r.loss_tokens;
      }
      moe.add(*r.activations);
    }
    on_batch();
  }
  pp_.all_reduce(std::span<double>(sums));  // the last stage's sums; + 0 is exact
  if (!moe.empty()) {  // each stage's blocks over dp x cp, then the stages' joined
    grad_group_.all_reduce(moe.values());
    pp_.all_reduce(moe.values());
  }
  return sums;
}

std::vector<float> PipelineTrainer::next_token_logits(std::span<const int32_t> window) {
  const size_t elems = window.size() * size_t(model_.config().width);
  std::vector<float> logits;
  for (int chunk = 0; chunk < work_.chunks(); ++chunk) {
    std::vector<float> mine = through_chunk(chunk, elems, [&](auto in, auto out) {
      return work_.next_token_logits(chunk, window, in, out);
    });
    if (work_.last_virtual(chunk)) logits = std::move(mine);
  }
  logits.resize(size_t(model_.config().vocab));
  pp_.broadcast(std::span<float>(logits), stages_ - 1);
  return logits;
}

}  // namespace tessel::train
