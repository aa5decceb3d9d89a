#pragma once
// Pipeline schedules as per-stage instruction lists (spec pipeline.md §2, §3, §4.1): the
// simulator here and the stage executor (issue #7, still to come) run the same lists.
//   GPipe   all forwards of the step, then all backwards, then a flush STEP;
//   1F1B    min(P - 1 - s, M) warm-up forwards, then F(next) / B(oldest) pairs, then the
//           remaining backwards, then a flush STEP (peak live activations min(P - s, M));
//   PACI(K) the 1F1B pattern over the endless micro-batch stream, never flushed: a local
//           STEP after every K-th backward of the stage. A finite horizon of n micro-batches
//           ends with the remaining backwards (the drain a real run does only at its end).
// Micro-batches are numbered globally 0, 1, 2, ...: flush step t holds t*M .. t*M + M - 1.
#include <cstdint>
#include <string>
#include <vector>

namespace tessel::pipeline {

enum class ScheduleKind { gpipe, one_f_one_b, paci };

enum class OpKind { forward, backward, step };

struct Op {
  OpKind kind;
  int64_t micro = -1;  // the micro-batch of a forward or backward; -1 for a step
  bool operator==(const Op&) const = default;
};

struct ScheduleOptions {
  ScheduleKind kind = ScheduleKind::one_f_one_b;
  int stages = 1;             // P
  int64_t micro_batches = 1;  // M per flush step; PACI: the horizon n
  int64_t steps = 1;          // flush steps (GPipe, 1F1B); ignored by PACI
  int64_t paci_k = 1;         // PACI: local backwards per local step
};

// InputError naming the field for P < 1, M < 1, steps < 1 or K < 1.
void validate(const ScheduleOptions& options);
// The instruction list of stage s (0 = first) for the whole horizon.
std::vector<Op> stage_ops(const ScheduleOptions& options, int stage);
ScheduleKind parse_schedule(const std::string& name);  // gpipe | 1f1b | paci
const char* schedule_name(ScheduleKind kind);

}  // namespace tessel::pipeline
