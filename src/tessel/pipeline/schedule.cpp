#include "tessel/pipeline/schedule.hpp"

#include <algorithm>

#include "tessel/core/error.hpp"

namespace tessel::pipeline {

namespace {

// The 1F1B pattern over n forwards and n backwards, numbered 0 .. n - 1 in the order each
// kind runs and mapped to ops by `at(kind, number)`: `warmup` forwards, then F(next) /
// B(oldest) pairs, then the remaining backwards. With `step_every` > 0 a STEP follows every
// step_every-th backward (PACI). With `weight_lag` >= 0 the backwards are ZB-H1's B and a W
// follows for the oldest backwards while more than weight_lag wait for theirs; the list ends
// with the remaining Ws.
template <class At>
void one_f_one_b(std::vector<Op>& ops, int64_t warmup, int64_t n, At at, int64_t step_every,
                 int64_t weight_lag = -1) {
  int64_t next_f = 0, next_b = 0, next_w = 0;
  auto backward = [&] {
    ops.push_back(at(OpKind::backward, next_b++));
    if (step_every > 0 && next_b % step_every == 0) ops.push_back({OpKind::step});
    while (weight_lag >= 0 && next_b - next_w > weight_lag)
      ops.push_back(at(OpKind::weight, next_w++));
  };
  for (int64_t i = 0; i < warmup; ++i) ops.push_back(at(OpKind::forward, next_f++));
  while (next_f < n) {
    ops.push_back(at(OpKind::forward, next_f++));
    backward();
  }
  while (next_b < n) backward();
  while (weight_lag >= 0 && next_w < next_b) ops.push_back(at(OpKind::weight, next_w++));
}

// 1F1B over micro-batches first .. first + n - 1 of stage s: min(P - 1 - s, n) warm-up
// forwards.
void plain_one_f_one_b(std::vector<Op>& ops, int stages, int stage, int64_t first, int64_t n,
                       int64_t step_every, int64_t weight_lag = -1) {
  one_f_one_b(
      ops, std::min<int64_t>(stages - 1 - stage, n), n,
      [first](OpKind kind, int64_t k) {
        return Op{kind, first + k};
      },
      step_every, weight_lag);
}

// Megatron's interleaved 1F1B (arXiv 2104.04473) over the M micro-batches from `first` of
// stage s with v chunks: the forwards run in groups of P micro-batches, each group through
// chunk 0, then chunk 1, .. chunk v - 1, before the next group (forward k: chunk (k / P) % v,
// micro-batch (k / (P v)) P + k % P); the backwards the same with the chunks in reverse.
// Warm-up 2 (P - 1 - s) + (v - 1) P forwards: stage s's first backward (virtual stage
// (v - 1) P + s) needs the first micro-batch through all v P virtual stages and back to it.
// Megatron runs all forwards first when M = P; here that case needs nothing of its own: the
// simulator meets the closed form and the executor runs M = P without deadlock as it is.
void interleaved(std::vector<Op>& ops, int stages, int chunks, int stage, int64_t first,
                 int64_t M) {
  const int64_t P = stages, v = chunks, n = M * v;
  const int64_t warmup = std::min(2 * (P - 1 - stage) + (v - 1) * P, n);
  one_f_one_b(
      ops, warmup, n,
      [=](OpKind kind, int64_t k) {
        const int64_t group = k / P % v;
        return Op{kind, first + k / (P * v) * P + k % P,
                  int(kind == OpKind::forward ? group : v - 1 - group)};
      },
      0);
}

}  // namespace

void validate(const ScheduleOptions& o) {
  if (o.stages < 1) input_error("pipeline: stages must be >= 1, got ", o.stages);
  if (o.micro_batches < 1)
    input_error("pipeline: micro_batches must be >= 1, got ", o.micro_batches);
  if (o.steps < 1) input_error("pipeline: steps must be >= 1, got ", o.steps);
  if (o.paci_k < 1) input_error("pipeline: paci_k must be >= 1, got ", o.paci_k);
  if (o.chunks < 1) input_error("pipeline: chunks must be >= 1, got ", o.chunks);
  if (o.kind == ScheduleKind::interleaved) {
    if (o.chunks < 2)
      input_error("pipeline: interleaved needs chunks >= 2 (model chunks per stage), got ",
                  o.chunks);
    if (o.micro_batches % o.stages != 0)
      input_error("pipeline: interleaved needs micro_batches divisible by stages, got ",
                  o.micro_batches, " micro_batches for ", o.stages, " stages");
  } else if (o.chunks != 1) {
    input_error("pipeline: chunks must be 1 under ", schedule_name(o.kind), ", got ", o.chunks);
  }
}

std::vector<Op> stage_ops(const ScheduleOptions& o, int stage) {
  validate(o);
  TESSEL_CHECK(stage >= 0 && stage < o.stages, "stage ", stage, " of ", o.stages);
  std::vector<Op> ops;
  if (o.kind == ScheduleKind::paci) {
    plain_one_f_one_b(ops, o.stages, stage, 0, o.micro_batches, o.paci_k);
    return ops;
  }
  for (int64_t t = 0; t < o.steps; ++t) {
    const int64_t first = t * o.micro_batches;
    if (o.kind == ScheduleKind::gpipe) {
      for (int64_t m = 0; m < o.micro_batches; ++m) ops.push_back({OpKind::forward, first + m});
      for (int64_t m = 0; m < o.micro_batches; ++m) ops.push_back({OpKind::backward, first + m});
    } else if (o.kind == ScheduleKind::interleaved) {
      interleaved(ops, o.stages, o.chunks, stage, first, o.micro_batches);
    } else {
      // ZB-H1's W lags s micro-batches on stage s.
      plain_one_f_one_b(ops, o.stages, stage, first, o.micro_batches, 0,
                        o.kind == ScheduleKind::zb_h1 ? stage : -1);
    }
    ops.push_back({OpKind::step});
  }
  return ops;
}

std::optional<ScheduleKind> find_schedule(const std::string& name) {
  for (ScheduleKind kind : {ScheduleKind::gpipe, ScheduleKind::one_f_one_b,
                            ScheduleKind::interleaved, ScheduleKind::zb_h1, ScheduleKind::paci})
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
    case ScheduleKind::interleaved:
      return "interleaved";
  }
  return "?";
}

}  // namespace tessel::pipeline
