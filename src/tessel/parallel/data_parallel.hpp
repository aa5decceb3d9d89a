#pragma once
// Data parallelism: the gradient all-reduce over the dp group.
//
// The flat gradient buffer is cut into buckets of about bucket_bytes, always at the
// same offsets and reduced in the same order, so the reduction is deterministic for
// a given layout. Every bucket's all-reduce is started non-blocking before any is
// waited on, after the last backward of the step: nothing overlaps the backward yet (with
// or without a pipeline; starting each bucket as the last backward completes it would).
// Gradients are summed, then multiplied by `scale` (1 / global loss-token count):
// the mean over the global batch, whatever the dp size and accumulation.
#include <cstdint>
#include <vector>

#include "tessel/comm/communicator.hpp"
#include "tessel/core/tensor.hpp"

namespace tessel::parallel {

class GradientReducer {
 public:
  GradientReducer(comm::Communicator& dp_group, Tensor flat_grads, int64_t bucket_bytes);
  // All-reduces (sum) every bucket over the dp group, then scales by `scale`.
  void reduce(float scale);
  int64_t num_buckets() const { return int64_t(bucket_begin_.size()); }

 private:
  comm::Communicator& group_;
  Tensor grads_;
  std::vector<int64_t> bucket_begin_;  // element offsets; bucket i ends where i+1 begins
};

}  // namespace tessel::parallel
