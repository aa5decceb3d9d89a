#pragma once
// Pipeline schedules as per-stage instruction lists (spec pipeline.md §2, §3, §4.1): the
// simulator here and the stage executor run the same lists.
//   GPipe   all forwards of the step, then all backwards, then a flush STEP;
//   1F1B    min(P - 1 - s, M) warm-up forwards, then F(next) / B(oldest) pairs, then the
//           remaining backwards, then a flush STEP (peak live activations min(P - s, M));
//   interleaved  Megatron's interleaved 1F1B (arXiv 2104.04473): each stage holds v >= 2 model
//           chunks, chunk c of stage s being virtual stage c P + s, and M must be divisible
//           by P. Forwards run in groups of P micro-batches, a group through chunk 0, then
//           chunk 1, .., then the next group; backwards likewise with the chunks reversed.
//           Stage s warms up with min(2 (P - 1 - s) + (v - 1) P, M v) chunk forwards, then
//           F(next) / B(oldest) pairs, then the remaining backwards, then a flush STEP (peak
//           live chunk activations: warm-up + 1, capped at M v; each 1/v of a stage's). With
//           uniform costs the step takes (M + (P - 1) / v)(F + B), a bubble 1/v of 1F1B's,
//           for v times the messages;
//   ZB-H1   Zero Bubble's H1 (arXiv 2401.10241): 1F1B with each backward split into B (the
//           input gradient, on the critical path) and W (the weight gradient, filling the
//           gaps). Stage s runs 1F1B's list with B for backward; after every B it runs W for
//           the oldest micro-batches whose W is pending while more than s are (W lags s
//           micro-batches on stage s); before the STEP every remaining W. Peak live
//           activations min(P, M) (a micro-batch lives from its F to its W). With M >= P and
//           W <= F, W <= B on every stage (uniform costs) the step takes
//           M (F + B + W) + (P - 1)(F + B - W), a bubble of (P - 1)(F + B - W) against 1F1B's
//           (P - 1)(F + B + W); with W > F or W > B it takes longer than that, and for M < P
//           the closed form does not apply;
//   PACI(K) the 1F1B pattern over the endless micro-batch stream, never flushed: a local
//           STEP after every K-th backward of the stage. A finite horizon of n micro-batches
//           ends with the remaining backwards (the drain a real run does only at its end).
// Micro-batches are numbered globally 0, 1, 2, ...: flush step t holds t*M .. t*M + M - 1.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace tessel::pipeline {

enum class ScheduleKind { gpipe, one_f_one_b, paci, zb_h1, interleaved };

// `weight` is ZB-H1's W, the weight-gradient half of a backward; in a ZB-H1 list `backward` is
// its B, the input-gradient half. The other schedules run whole backwards and no W.
enum class OpKind { forward, backward, weight, step };

struct Op {
  OpKind kind;
  int64_t micro = -1;  // the micro-batch of a forward, backward or weight; -1 for a step
  int chunk = 0;       // interleaved: the model chunk (virtual stage chunk * P + stage); else 0
  bool operator==(const Op&) const = default;
};

struct ScheduleOptions {
  ScheduleKind kind = ScheduleKind::one_f_one_b;
  int stages = 1;             // P
  int64_t micro_batches = 1;  // M per flush step; PACI: the horizon n
  int64_t steps = 1;          // flush steps (GPipe, 1F1B, ZB-H1); ignored by PACI
  int64_t paci_k = 1;         // PACI: local backwards per local step
  int chunks = 1;             // v, model chunks per stage: >= 2 for interleaved, else 1
};

// The model's piece that `op` runs on `stage` of `stages`: virtual stage chunk P + stage (the
// stage itself with one chunk).
inline int virtual_stage(const Op& op, int stage, int stages) {
  return op.chunk * stages + stage;
}

// InputError naming the field for P < 1, M < 1, steps < 1, K < 1, chunks < 1, interleaved
// with chunks < 2 or M not divisible by P, or chunks != 1 under another schedule.
void validate(const ScheduleOptions& options);
// The instruction list of stage s (0 = first) for the whole horizon.
std::vector<Op> stage_ops(const ScheduleOptions& options, int stage);
inline constexpr const char* kScheduleNames = "gpipe, 1f1b, interleaved, zb-h1 or paci";
std::optional<ScheduleKind> find_schedule(const std::string& name);  // by schedule_name
ScheduleKind parse_schedule(const std::string& name);  // find_schedule, else InputError
const char* schedule_name(ScheduleKind kind);

}  // namespace tessel::pipeline
