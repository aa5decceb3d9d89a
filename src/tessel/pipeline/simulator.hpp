#pragma once
// Event-driven pipeline simulator (spec pipeline.md §4.3) over the schedules' instruction
// lists: each stage runs its list in order, one op at a time; F_s(m) waits for F_{s-1}(m)
// plus the message's time over the link between them, B_s(m) for B_{s+1}(m) plus that link's
// time (the last stage: for its own F(m)), ZB-H1's W_s(m) for the stage's own B_s(m); a flush
// STEP is a barrier of all stages, a PACI STEP is local. Interleaved (v chunks per stage):
// the same over the virtual stages j = chunk P + s, 0 .. v P - 1 (F_j(m) waits for F_{j-1}(m),
// B_j(m) for B_{j+1}(m), the last virtual stage's B for its F), with messages from virtual
// stage j to j + 1 over the link from stage j mod P to (j + 1) mod P (P - 1 -> 0 is the wrap);
// StageCosts stay a stage's whole work per micro-batch, of which each chunk's op costs 1/v. Links
// carry any number of messages at once (no contention) and compute does not wait for a send.
// Reports makespan, bubble = 1 - sum(busy) / (P * makespan), throughput, peak live activations per
// stage and the forward/backward weight-version gaps (versions = local steps taken).
#include <cstdint>
#include <nlohmann/json.hpp>
#include <vector>

#include "tessel/pipeline/schedule.hpp"

namespace tessel::pipeline {

struct StageCosts {
  double forward = 1;
  double backward = 2;  // the whole backward (input and weight gradients)
  double step = 0;      // optimizer step
  // The weight-gradient part of `backward`, in [0, backward]: ZB-H1 runs B = backward - weight
  // and W = weight; the other schedules run the whole backward.
  double weight = 0;
};

// The link between stages s and s + 1: an activation (forward) or gradient (backward) message
// of `bytes` takes latency + bytes / bandwidth over it.
struct LinkCosts {
  double latency = 0;
  double bandwidth = 0;  // bytes per time unit; 0 = no time beyond the latency
  double bytes = 0;      // per message: the boundary's f32 activations of one micro-batch
  double transfer() const { return latency + (bandwidth > 0 ? bytes / bandwidth : 0.0); }
};

struct SimOptions {
  ScheduleOptions schedule;
  std::vector<StageCosts> costs;  // one per stage, or one for all
  // One per boundary s -> s + 1 (P - 1 of them; interleaved: P, the last the wrap from stage
  // P - 1 to stage 0), or one for all; none: free.
  std::vector<LinkCosts> links;
};

struct OpTiming {
  int stage = 0;
  Op op;
  double start = 0, end = 0;
};

struct SimResult {
  double makespan = 0;
  double bubble = 0;
  double throughput = 0;                   // micro-batches per time unit
  std::vector<double> busy;                // per stage
  std::vector<int64_t> peak_activations;   // per stage: most forwards awaiting their backward
                                           // (ZB-H1: their W; interleaved: chunk forwards)
  std::vector<int64_t> max_version_gap;    // per stage: max over micro-batches of v_B - v_F
  std::vector<double> inconsistent_share;  // per stage: share of backwards with v_B != v_F
  std::vector<std::vector<int64_t>> gap_histogram;  // per stage: [gap] -> backwards
  std::vector<OpTiming> timeline;                   // every op, in execution order per stage
};

SimResult simulate(const SimOptions& options);

// The ops (forwards, backwards and Ws of a micro-batch through one chunk, steps) `schedule`
// runs on all its stages, counted without listing them; a double, which no size wraps. The
// simulator keeps each op and its timing and each (virtual stage, micro-batch)'s times: about
// 90 bytes an op.
double simulated_ops(const ScheduleOptions& schedule);
// The most ops a simulation for `tessel simulate` may run: about 0.4 GB.
constexpr int64_t kMaxSimulatedOps = int64_t(1) << 22;

// Chrome trace (Perfetto, chrome://tracing): one track per stage, one slice per op, named
// F3 (forward of micro-batch 3), B3, W3, STEP; when any op has a chunk > 0 (interleaved) also
// by chunk: F3.1 = micro-batch 3 through chunk 1. `microseconds_per_unit` scales the op times.
nlohmann::json chrome_trace(const std::vector<OpTiming>& timeline, int stages,
                            double microseconds_per_unit);

}  // namespace tessel::pipeline
