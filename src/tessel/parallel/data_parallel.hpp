#pragma once
// Data parallelism: the gradient all-reduce over the group the trainer gives (dp x cp for the
// dense range, edp x cp for the experts').
//
// The flat gradient buffer is cut into buckets of about bucket_bytes (bucket_offsets), always
// at the same offsets, each all-reduced on its own, so the result is deterministic for a given
// layout whenever each bucket starts. start_from starts the buckets a backward has finished
// (it visits the buffer from the end: the model's on_grads_final), so their reduction
// overlaps the rest of the backward; reduce starts the rest, waits for all, and scales.
// Gradients are summed, then multiplied by `scale` (1 / global loss-token count):
// the mean over the global batch, whatever the dp size and accumulation.
#include <climits>
#include <cstdint>
#include <span>
#include <vector>

#include "tessel/comm/communicator.hpp"
#include "tessel/core/tensor.hpp"

namespace tessel::parallel {

// Where the buckets of a flat f32 buffer of `numel` elements begin: every bucket_bytes / 4
// elements (at least 1), but at most `max_elems`: MPI counts are int, and a bucket past
// INT_MAX elements (bucket_mb accepts up to 1 TiB) would fail only at the step's end.
std::vector<int64_t> bucket_offsets(int64_t numel, int64_t bucket_bytes,
                                    int64_t max_elems = INT_MAX);

class GradientReducer {
 public:
  GradientReducer(comm::Communicator& dp_group, Tensor flat_grads, int64_t bucket_bytes);
  // Every element at offset >= `from` holds its final gradient for this step: starts the
  // all-reduce (sum) of each bucket wholly past it that has not started, the last first, then
  // lets the started ones progress (MPI moves a non-blocking collective only inside MPI calls).
  // Every rank must pass the same offsets in the same order.
  void start_from(int64_t from);
  // All-reduces (sum) every bucket not yet started, waits for all, then scales by `scale`.
  void reduce(float scale);
  int64_t num_buckets() const { return int64_t(bucket_begin_.size()); }
  int64_t started_buckets() const { return num_buckets() - unstarted_; }

 private:
  comm::Communicator& group_;
  Tensor grads_;
  std::vector<int64_t> bucket_begin_;  // element offsets; bucket i ends where i+1 begins
  int64_t unstarted_;                  // buckets [0, unstarted_) have not started this step
  std::vector<comm::Request> pending_;
};

// reduce(scale) on each of `reducers` (null entries skipped: e.g. a dense range and an
// optional expert range, over different groups), every remaining bucket of every one started
// before any is waited for.
void reduce_together(std::span<GradientReducer* const> reducers, float scale);

}  // namespace tessel::parallel
