#include "tessel/train/pipeline_profile.hpp"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>

#include "tessel/core/error.hpp"
#include "tessel/data/corpus.hpp"
#include "tessel/pipeline/schedule.hpp"
#include "tessel/train/config.hpp"
#include "tessel/train/metrics.hpp"
#include "tessel/train/pipeline_trainer.hpp"

namespace tessel::train {

namespace {

// The step records of the run's last attempt that wrote any, the last record of each step,
// by step; the step that attempt started from. Each attempt starts with a "start" record (a
// resumed attempt may run another schedule); one that wrote no step record (it failed early,
// or an older tessel's run with nothing to train) does not hide the one before it.
std::pair<std::map<int64_t, JsonLine>, int64_t> last_attempt_records(const std::string& path) {
  bool cut_line = false;  // being written, or a crash's: the trainer drops it on resume
  std::map<int64_t, JsonLine> records, trained;
  int64_t start_step = 0, trained_start = 0;
  for (JsonLine& l : read_json_lines(path, "metrics", cut_line)) {
    const nlohmann::json& j = l.record;
    if (j.value("event", "") == "start") {
      if (!records.empty()) trained = std::move(records), trained_start = start_step;
      records.clear();
      start_step = j.value("start_step", int64_t(0));
    }
    if (!j.contains("pipeline") || !j.contains("step_seconds")) continue;
    const auto step = j.at("step").get<int64_t>();  // before l moves into the map
    records[step] = std::move(l);
  }
  if (records.empty()) return {std::move(trained), trained_start};
  return {std::move(records), start_step};
}

// A measured time of a step record: InputError naming path:line when it is negative or not
// finite (a NaN or infinity, which JSON holds as null), which would give negative costs or a
// bubble above 1.
double seconds_of(const nlohmann::json& value, const std::string& path, int64_t line,
                  const std::string& name) {
  if (!(value.is_number() && value.get<double>() >= 0))
    input_error(path, ":", line, ": ", name, " = ", value.dump(),
                " must be finite and >= 0 (null: NaN or infinite)");
  return value.get<double>();
}

}  // namespace

PipelineProfile read_pipeline_profile(const std::string& run_dir, int64_t skip) {
  if (skip < 0) input_error("skip must be >= 0, got ", skip);
  const std::string config_path = run_dir + "/config.toml";
  if (!std::filesystem::is_regular_file(config_path))
    input_error(config_path, ": cannot read (is ", run_dir, " a run directory?)");
  const Config config =  // the last attempt's
      parse_stored_config(data::read_file(config_path), config_path);
  if (!pipeline_enabled(config))
    input_error(run_dir, ": not a pipeline run (its config.toml has parallel.pp = 1 and no ",
                "pipeline.schedule)");

  const std::string metrics_path = run_dir + "/metrics.jsonl";
  const auto [records, start_step] = last_attempt_records(metrics_path);
  PipelineProfile p;
  p.message_bytes = double(config.train.micro_batch) *
                    double(config.train.seq_len / config.parallel.cp) * double(config.model.width) *
                    double(sizeof(float));
  // The records' own count (config.toml is the last accepted attempt's, which may not be the
  // one whose records these are); records written before they held it: the config's.
  p.micro_batches = micro_batches_per_step(config);
  std::vector<double> forward, backward, weight, optimizer;  // sums per stage
  int64_t steps = 0, micro_batches = 0;
  double seconds = 0;
  int64_t horizon_end = -1;  // PACI: the horizon whose totals were added last
  int64_t skipped = 0;       // records of horizons (steps) that begin within the skip
  int64_t line = 0;          // of the record being read
  try {
    for (const auto& [step, l] : records) {
      const nlohmann::json& j = l.record;
      line = l.line;
      const nlohmann::json& pipe = j.at("pipeline");
      // A PACI record repeats its horizon's totals; a flush record holds its own step's.
      const bool paci = pipe.contains("horizon");
      const int64_t first = paci ? pipe.at("horizon").at(0).get<int64_t>() : step;
      const int64_t last = paci ? pipe.at("horizon").at(1).get<int64_t>() : step;
      if (first <= start_step + skip) {
        ++skipped;
        continue;
      }
      if (p.schedule.empty()) {
        p.schedule = pipe.at("schedule").get<std::string>();
        p.micro_batches = pipe.value("micro_batches", p.micro_batches);
        p.chunks = pipe.value("chunks", 1);
        p.first_step = step;
        const size_t stages = pipe.at("stages").size();
        forward.assign(stages, 0.0), backward.assign(stages, 0.0), weight.assign(stages, 0.0);
        optimizer.assign(stages, 0.0);
      }
      p.last_step = step;
      ++steps;
      seconds += seconds_of(j.at("step_seconds"), metrics_path, line, "step_seconds");
      if (last == horizon_end) continue;  // this horizon's totals are in
      horizon_end = last;
      micro_batches += (last - first + 1) * p.micro_batches;
      const nlohmann::json& stages = pipe.at("stages");
      if (stages.size() != forward.size())
        input_error(metrics_path, ":", line, ": step ", step, " has ", stages.size(),
                    " stages, step ", p.first_step, " ", forward.size());
      for (size_t s = 0; s < stages.size(); ++s) {
        auto cost = [&](const char* name) {
          return seconds_of(stages[s].at(name), metrics_path, line,
                            detail::concat("stage ", s, "'s ", name));
        };
        forward[s] += cost("forward_seconds");
        backward[s] += cost("backward_seconds");
        // ZB-H1's Ws; 0 or absent elsewhere
        if (stages[s].contains("weight_seconds")) weight[s] += cost("weight_seconds");
        optimizer[s] += cost("optimizer_seconds");
      }
    }
  } catch (const nlohmann::json::exception& e) {  // e.g. records older than the stage split
    input_error(metrics_path, ":", line,
                ": a pipeline step record without the stage costs: ", e.what());
  }
  if (steps == 0 && skipped > 0)
    input_error(metrics_path, ": every step record of the last attempt belongs to a step or ",
                "PACI horizon (one per validation or checkpoint interval) that begins within ",
                "--skip ", skip, " of its start at step ", start_step, "; lower --skip");
  if (steps == 0) input_error(metrics_path, ": no pipeline step records");
  p.step_seconds = seconds / double(steps);
  const auto m = double(micro_batches), windows = m / double(p.micro_batches);
  for (size_t s = 0; s < forward.size(); ++s)
    p.costs.push_back({forward[s] / m, backward[s] / m, optimizer[s] / windows, weight[s] / m});
  return p;
}

std::vector<SimulatedSchedule> simulate_schedules(const std::vector<pipeline::StageCosts>& costs,
                                                  int64_t micro_batches, int64_t steps,
                                                  const pipeline::LinkCosts& link, int chunks) {
  using pipeline::ScheduleKind;
  const int P = int(costs.size());
  // ZB-H1 needs the split of each backward into B and W, which only a run of its own measures;
  // any assumed split (half the backward for a GEMM's two gradients, say) would be wrong for
  // the weightless attention, so without measured Ws it is left out and the caller says so.
  const bool measured_w = std::any_of(costs.begin(), costs.end(),
                                      [](const pipeline::StageCosts& c) { return c.weight > 0; });
  std::vector<ScheduleKind> kinds = {ScheduleKind::gpipe, ScheduleKind::one_f_one_b};
  // Megatron's interleaving deals out micro-batches in groups of P, and one stage has no
  // neighbour to interleave with (it would only send each chunk's output to itself).
  if (P > 1 && micro_batches % P == 0) kinds.push_back(ScheduleKind::interleaved);
  kinds.push_back(ScheduleKind::paci);
  if (measured_w) kinds.push_back(ScheduleKind::zb_h1);
  std::vector<pipeline::SimOptions> sims;
  for (const ScheduleKind kind : kinds) {
    pipeline::SimOptions sim;
    sim.schedule = kind == ScheduleKind::paci
                       ? pipeline::ScheduleOptions{kind, P, micro_batches * steps, 1, micro_batches}
                       : pipeline::ScheduleOptions{kind, P, micro_batches, steps, 1};
    // The simulator charges each chunk's op 1/v of the stage's costs; v times the messages.
    if (kind == ScheduleKind::interleaved) sim.schedule.chunks = chunks;
    sim.costs = costs;
    sim.links = {link};
    // Refused before any schedule runs, not after minutes and gigabytes.
    const double ops = pipeline::simulated_ops(sim.schedule);
    if (ops > double(pipeline::kMaxSimulatedOps)) {
      char count[32];  // a double of any size, in digits
      std::snprintf(count, sizeof count, "%.0f", ops);
      input_error("simulate: ", steps, " steps of ", micro_batches, " micro-batches on ", P,
                  " stages are ", count, " ops under ", pipeline::schedule_name(kind),
                  ", more than the simulator's ", pipeline::kMaxSimulatedOps,
                  " (about 0.4 GB of memory); lower --steps or --micro-batches");
    }
    sims.push_back(std::move(sim));
  }
  std::vector<SimulatedSchedule> out;
  for (const pipeline::SimOptions& sim : sims) {
    const pipeline::SimResult r = pipeline::simulate(sim);
    // A step of 0 s (every cost 0, no message time) has no throughput to compare (0/0 = NaN).
    if (!(r.makespan > 0))
      input_error("simulate: the simulated ", pipeline::schedule_name(sim.schedule.kind),
                  " step takes 0 s: the stage costs are all 0 and no message takes time, so no "
                  "schedule can be compared with another");
    out.push_back({pipeline::schedule_name(sim.schedule.kind), r.makespan / double(steps), r.bubble,
                   r.peak_activations});
  }
  return out;
}

}  // namespace tessel::train
