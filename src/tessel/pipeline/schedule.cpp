#include "tessel/pipeline/schedule.hpp"

#include <algorithm>

#include "tessel/core/error.hpp"

namespace tessel::pipeline {

namespace {

// The 1F1B pattern of stage s over micro-batches first .. first + n - 1; with `step_every`
// > 0 a STEP follows every step_every-th backward (PACI), counting from `first`. With
// `weight_lag` >= 0 the backwards are ZB-H1's B and a W follows for the oldest micro-batches
// while more than weight_lag wait for theirs; the list ends with the remaining Ws.
void one_f_one_b(std::vector<Op>& ops, int stages, int stage, int64_t first, int64_t n,
                 int64_t step_every, int64_t weight_lag = -1) {
  const int64_t warmup = std::min<int64_t>(stages - 1 - stage, n);
  int64_t next_f = first, next_b = first, next_w = first, backwards = 0;
  auto backward = [&] {
    ops.push_back({OpKind::backward, next_b++});
    if (step_every > 0 && ++backwards % step_every == 0) ops.push_back({OpKind::step});
    while (weight_lag >= 0 && next_b - next_w > weight_lag)
      ops.push_back({OpKind::weight, next_w++});
  };
  for (int64_t i = 0; i < warmup; ++i) ops.push_back({OpKind::forward, next_f++});
  while (next_f < first + n) {
    ops.push_back({OpKind::forward, next_f++});
    backward();
  }
  while (next_b < first + n) backward();
  while (weight_lag >= 0 && next_w < next_b) ops.push_back({OpKind::weight, next_w++});
}

}  // namespace

void validate(const ScheduleOptions& o) {
  if (o.stages < 1) input_error("pipeline: stages must be >= 1, got ", o.stages);
  if (o.micro_batches < 1)
    input_error("pipeline: micro_batches must be >= 1, got ", o.micro_batches);
  if (o.steps < 1) input_error("pipeline: steps must be >= 1, got ", o.steps);
  if (o.paci_k < 1) input_error("pipeline: paci_k must be >= 1, got ", o.paci_k);
}

std::vector<Op> stage_ops(const ScheduleOptions& o, int stage) {
  validate(o);
  TESSEL_CHECK(stage >= 0 && stage < o.stages, "stage ", stage, " of ", o.stages);
  std::vector<Op> ops;
  if (o.kind == ScheduleKind::paci) {
    one_f_one_b(ops, o.stages, stage, 0, o.micro_batches, o.paci_k);
    return ops;
  }
  for (int64_t t = 0; t < o.steps; ++t) {
    const int64_t first = t * o.micro_batches;
    if (o.kind == ScheduleKind::gpipe) {
      for (int64_t m = 0; m < o.micro_batches; ++m) ops.push_back({OpKind::forward, first + m});
      for (int64_t m = 0; m < o.micro_batches; ++m) ops.push_back({OpKind::backward, first + m});
    } else {
      // ZB-H1's W lags s micro-batches on stage s.
      one_f_one_b(ops, o.stages, stage, first, o.micro_batches, 0,
                  o.kind == ScheduleKind::zb_h1 ? stage : -1);
    }
    ops.push_back({OpKind::step});
  }
  return ops;
}

std::optional<ScheduleKind> find_schedule(const std::string& name) {
  for (ScheduleKind kind :
       {ScheduleKind::gpipe, ScheduleKind::one_f_one_b, ScheduleKind::zb_h1, ScheduleKind::paci})
    if (name == schedule_name(kind)) return kind;
  return std::nullopt;
}

ScheduleKind parse_schedule(const std::string& name) {
  if (const auto kind = find_schedule(name)) return *kind;
  input_error("pipeline schedule: expected ", kScheduleNames, ", got '", name, "'");
}

const char* schedule_name(ScheduleKind kind) {
  switch (kind) {
    case ScheduleKind::gpipe:
      return "gpipe";
    case ScheduleKind::one_f_one_b:
      return "1f1b";
    case ScheduleKind::paci:
      return "paci";
    case ScheduleKind::zb_h1:
      return "zb-h1";
  }
  return "?";
}

}  // namespace tessel::pipeline
