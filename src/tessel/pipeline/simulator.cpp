#include "tessel/pipeline/simulator.hpp"

#include <algorithm>
#include <cmath>
#include <string>

#include "tessel/core/error.hpp"

namespace tessel::pipeline {

namespace {

constexpr double kNotDone = -1;

}  // namespace

SimResult simulate(const SimOptions& o) {
  const auto& sched = o.schedule;
  validate(sched);
  const int P = sched.stages;
  if (o.costs.size() != 1 && o.costs.size() != size_t(P))
    input_error("pipeline simulator: costs must list 1 or ", P, " stages, got ", o.costs.size());
  auto cost = [&](int s) -> const StageCosts& {
    return o.costs[o.costs.size() == 1 ? 0 : size_t(s)];
  };
  const int v = sched.chunks;
  // Interleaved messages also cross the wrap P - 1 -> 0, the last boundary.
  const int boundaries = v > 1 ? P : P - 1;
  if (o.links.size() > 1 && o.links.size() != size_t(boundaries))
    input_error("pipeline simulator: links must list none, one for all or one per boundary (",
                boundaries, v > 1 ? ", the last the wrap from the last stage to the first" : "",
                "), got ", o.links.size());
  for (const LinkCosts& l : o.links)
    if (!(l.latency >= 0 && l.bandwidth >= 0 && l.bytes >= 0 && std::isfinite(l.transfer())))
      input_error("pipeline simulator: a link's latency, bandwidth and bytes must be finite and ",
                  ">= 0, got ", l.latency, ", ", l.bandwidth, ", ", l.bytes);
  // Time of a message between stages b and (b + 1) mod P.
  auto link = [&](int b) {
    return o.links.empty() ? 0.0 : o.links[o.links.size() == 1 ? 0 : size_t(b)].transfer();
  };
  for (const StageCosts& c : o.costs)
    if (!(c.weight >= 0 && c.weight <= c.backward))
      input_error("pipeline simulator: a stage's weight cost ", c.weight,
                  " is not within [0, its backward ", c.backward, "]");
  const bool flush = sched.kind != ScheduleKind::paci;
  const bool split = sched.kind == ScheduleKind::zb_h1;  // B and W instead of whole backwards
  const int64_t micros = flush ? sched.micro_batches * sched.steps : sched.micro_batches;
  // Virtual stage j = chunk * P + stage runs the model's j-th piece; a chunk's op costs 1/v
  // of the stage's.
  const int V = P * v;
  const double share = 1.0 / v;

  std::vector<std::vector<Op>> ops(static_cast<size_t>(P));
  size_t total_ops = 0;
  for (int s = 0; s < P; ++s) {
    ops[size_t(s)] = stage_ops(sched, s);
    total_ops += ops[size_t(s)].size();
  }
  std::vector<std::vector<double>> f_end(size_t(V), std::vector<double>(size_t(micros), kNotDone));
  auto b_end = f_end;
  std::vector<std::vector<int64_t>> f_version(size_t(V), std::vector<int64_t>(size_t(micros), 0));
  std::vector<size_t> next(size_t(P), 0);
  std::vector<double> free_at(size_t(P), 0);
  std::vector<int64_t> version(size_t(P), 0), live(size_t(P), 0), gapped(size_t(P), 0),
      backwards(size_t(P), 0);

  SimResult r;
  r.busy.assign(size_t(P), 0);
  r.peak_activations.assign(size_t(P), 0);
  r.max_version_gap.assign(size_t(P), 0);
  r.gap_histogram.assign(size_t(P), {});
  r.timeline.reserve(total_ops);  // its largest array: grown by doubling it could take 3x
  auto run = [&](int s, double ready, double duration) {
    const double start = std::max(free_at[size_t(s)], ready);
    free_at[size_t(s)] = start + duration;
    r.busy[size_t(s)] += duration;
    r.timeline.push_back({s, ops[size_t(s)][next[size_t(s)]], start, start + duration});
    ++next[size_t(s)];
    return start + duration;
  };
  auto at_step = [&](int s) {
    return next[size_t(s)] < ops[size_t(s)].size() &&
           ops[size_t(s)][next[size_t(s)]].kind == OpKind::step;
  };

  for (bool progress = true; progress;) {
    progress = false;
    for (int s = 0; s < P; ++s) {
      while (next[size_t(s)] < ops[size_t(s)].size()) {
        const Op op = ops[size_t(s)][next[size_t(s)]];
        const size_t m = size_t(op.micro);
        const int j = virtual_stage(op, s, P);
        if (op.kind == OpKind::forward) {
          double dep = j == 0 ? 0 : f_end[size_t(j - 1)][m];
          if (dep == kNotDone) break;
          f_end[size_t(j)][m] =
              run(s, j == 0 ? 0 : dep + link((j - 1) % P), share * cost(s).forward);
          f_version[size_t(j)][m] = version[size_t(s)];
          r.peak_activations[size_t(s)] =
              std::max(r.peak_activations[size_t(s)], ++live[size_t(s)]);
        } else if (op.kind == OpKind::backward) {
          const bool last = j == V - 1;
          double dep = last ? f_end[size_t(j)][m] : b_end[size_t(j + 1)][m];
          if (dep == kNotDone || f_end[size_t(j)][m] == kNotDone) break;
          b_end[size_t(j)][m] = run(s, last ? dep : dep + link(j % P),
                                    share * (cost(s).backward - (split ? cost(s).weight : 0)));
          live[size_t(s)] -= !split;
          ++backwards[size_t(s)];
          const int64_t gap = version[size_t(s)] - f_version[size_t(j)][m];
          r.max_version_gap[size_t(s)] = std::max(r.max_version_gap[size_t(s)], gap);
          gapped[size_t(s)] += gap != 0;
          auto& histogram = r.gap_histogram[size_t(s)];
          if (histogram.size() <= size_t(gap)) histogram.resize(size_t(gap) + 1);
          ++histogram[size_t(gap)];
        } else if (op.kind == OpKind::weight) {
          if (b_end[size_t(j)][m] == kNotDone) break;
          run(s, b_end[size_t(j)][m], share * cost(s).weight);
          --live[size_t(s)];
        } else if (!flush) {
          run(s, 0, cost(s).step);
          ++version[size_t(s)];
        } else {
          // A flush step: every stage steps together once all have reached it.
          bool all = true;
          for (int q = 0; q < P; ++q)
            all = all && at_step(q) && version[size_t(q)] == version[size_t(s)];
          if (!all) break;
          const double barrier = *std::max_element(free_at.begin(), free_at.end());
          for (int q = 0; q < P; ++q) {
            run(q, barrier, cost(q).step);
            ++version[size_t(q)];
          }
        }
        progress = true;
      }
    }
  }
  for (int s = 0; s < P; ++s)
    TESSEL_CHECK(next[size_t(s)] == ops[size_t(s)].size(), "pipeline simulator: stage ", s,
                 " deadlocked at op ", next[size_t(s)]);
  r.makespan = *std::max_element(free_at.begin(), free_at.end());
  // Each op's and message's time is finite, their sums need not be: an infinite makespan
  // gave a bubble of 1 and throughputs of 0 or NaN.
  if (!std::isfinite(r.makespan))
    input_error("pipeline simulator: the simulated ", schedule_name(sched.kind),
                " makespan is not finite: its ops' costs and message times add up beyond a "
                "double's range");
  double busy = 0;
  for (int s = 0; s < P; ++s) {
    busy += r.busy[size_t(s)];
    r.inconsistent_share.push_back(double(gapped[size_t(s)]) / double(backwards[size_t(s)]));
  }
  r.bubble = r.makespan > 0 ? 1 - busy / (P * r.makespan) : 0;
  r.throughput = r.makespan > 0 ? double(micros) / r.makespan : 0;
  return r;
}

double simulated_ops(const ScheduleOptions& o) {
  // Each micro-batch runs a forward and a backward (ZB-H1: and a W) through every virtual stage.
  const double per_micro_batch =
                   double(o.stages) * o.chunks * (o.kind == ScheduleKind::zb_h1 ? 3 : 2),
               micro_batches = double(o.micro_batches);
  // A local step after every K-th backward of a stage: floor(n / K) per stage (the drain at
  // the horizon's end steps no more).
  if (o.kind == ScheduleKind::paci)
    return micro_batches * per_micro_batch + double(o.stages) * double(o.micro_batches / o.paci_k);
  return double(o.steps) * (micro_batches * per_micro_batch + o.stages);
}

nlohmann::json chrome_trace(const std::vector<OpTiming>& timeline, int stages,
                            double microseconds_per_unit) {
  const bool chunked = std::any_of(timeline.begin(), timeline.end(),
                                   [](const OpTiming& t) { return t.op.chunk > 0; });
  nlohmann::json events = nlohmann::json::array();
  for (int s = 0; s < stages; ++s)
    events.push_back({{"name", "thread_name"},
                      {"ph", "M"},
                      {"pid", 0},
                      {"tid", s},
                      {"args", {{"name", "stage " + std::to_string(s)}}}});
  for (const auto& t : timeline) {
    const char* letter = t.op.kind == OpKind::forward    ? "F"
                         : t.op.kind == OpKind::backward ? "B"
                                                         : "W";
    std::string name = t.op.kind == OpKind::step ? "STEP" : letter;
    if (t.op.kind != OpKind::step) {
      name += std::to_string(t.op.micro);
      if (chunked) name += '.' + std::to_string(t.op.chunk);
    }
    events.push_back({{"name", name},
                      {"ph", "X"},
                      {"pid", 0},
                      {"tid", t.stage},
                      {"ts", t.start * microseconds_per_unit},
                      {"dur", (t.end - t.start) * microseconds_per_unit}});
  }
  return {{"traceEvents", events}, {"displayTimeUnit", "ms"}};
}

}  // namespace tessel::pipeline
