#include "tessel/train/pipeline_profile.hpp"

#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tessel/core/error.hpp"
#include "tessel/pipeline/schedule.hpp"
#include "tessel/train/config.hpp"
#include "tessel/train/pipeline_trainer.hpp"

namespace tessel::train {

PipelineProfile read_pipeline_profile(const std::string& run_dir, int64_t skip) {
  if (skip < 0) input_error("skip must be >= 0, got ", skip);
  const std::string config_path = run_dir + "/config.toml";
  std::ifstream config_file(config_path);
  if (!config_file) input_error(config_path, ": cannot read (is ", run_dir, " a run directory?)");
  std::stringstream text;
  text << config_file.rdbuf();
  const Config config = parse_config(text.str(), config_path, {});

  // The last record of each step: a resumed run rewrites the steps after its checkpoint.
  std::map<int64_t, nlohmann::json> records;
  std::ifstream in(run_dir + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains("pipeline") || !j.contains("step_seconds")) continue;
    const auto step = j["step"].get<int64_t>();  // before j moves (operator= takes it by value)
    records[step] = std::move(j);
  }
  PipelineProfile p;
  p.micro_batches = micro_batches_per_step(config);
  std::vector<double> forward, backward, optimizer;  // sums per stage
  int64_t steps = 0, micro_batches = 0;
  double seconds = 0;
  int64_t horizon_end = -1;  // PACI: the horizon whose totals were added last
  for (const auto& [step, j] : records) {
    const nlohmann::json& pipe = j["pipeline"];
    // A PACI record repeats its horizon's totals; a flush record holds its own step's.
    const int64_t first = pipe.contains("horizon") ? pipe["horizon"][0].get<int64_t>() : step;
    const int64_t last = pipe.contains("horizon") ? pipe["horizon"][1].get<int64_t>() : step;
    if (first <= skip) continue;
    if (p.schedule.empty()) {
      p.schedule = pipe["schedule"].get<std::string>();
      p.first_step = step;
      const size_t stages = pipe["stages"].size();
      forward.assign(stages, 0.0), backward.assign(stages, 0.0), optimizer.assign(stages, 0.0);
    }
    p.last_step = step;
    ++steps;
    seconds += j["step_seconds"].get<double>();
    if (last == horizon_end) continue;  // this horizon's totals are in
    horizon_end = last;
    micro_batches += (last - first + 1) * p.micro_batches;
    const nlohmann::json& stages = pipe["stages"];
    if (stages.size() != forward.size())
      input_error(run_dir, "/metrics.jsonl: step ", step, " has ", stages.size(),
                  " stages, earlier steps ", forward.size());
    for (size_t s = 0; s < stages.size(); ++s) {
      forward[s] += stages[s]["forward_seconds"].get<double>();
      backward[s] += stages[s]["backward_seconds"].get<double>();
      optimizer[s] += stages[s]["optimizer_seconds"].get<double>();
    }
  }
  if (steps == 0)
    input_error(run_dir, "/metrics.jsonl: no pipeline step records after step ", skip,
                " (a run with parallel.pp > 1 or pipeline.schedule writes them)");
  p.step_seconds = seconds / double(steps);
  const auto m = double(micro_batches), windows = m / double(p.micro_batches);
  for (size_t s = 0; s < forward.size(); ++s)
    p.costs.push_back({forward[s] / m, backward[s] / m, optimizer[s] / windows});
  return p;
}

std::vector<SimulatedSchedule> simulate_schedules(const std::vector<pipeline::StageCosts>& costs,
                                                  int64_t micro_batches, int64_t steps) {
  using pipeline::ScheduleKind;
  const int P = int(costs.size());
  std::vector<SimulatedSchedule> out;
  for (const ScheduleKind kind :
       {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::paci}) {
    pipeline::SimOptions sim;
    sim.schedule = kind == ScheduleKind::paci
                       ? pipeline::ScheduleOptions{kind, P, micro_batches * steps, 1, micro_batches}
                       : pipeline::ScheduleOptions{kind, P, micro_batches, steps, 1};
    sim.costs = costs;
    const pipeline::SimResult r = pipeline::simulate(sim);
    out.push_back(
        {pipeline::schedule_name(kind), r.makespan / double(steps), r.bubble, r.peak_activations});
  }
  return out;
}

}  // namespace tessel::train
