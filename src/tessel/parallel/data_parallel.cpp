#include "tessel/parallel/data_parallel.hpp"

#include <algorithm>

#include "tessel/core/error.hpp"

namespace tessel::parallel {

std::vector<int64_t> bucket_offsets(int64_t numel, int64_t bucket_bytes, int64_t max_elems) {
  TESSEL_CHECK(bucket_bytes > 0 && max_elems > 0, "bucket size must be positive");
  const int64_t per_bucket =
      std::clamp<int64_t>(bucket_bytes / int64_t(sizeof(float)), 1, max_elems);
  std::vector<int64_t> offsets;
  for (int64_t b = 0; b < numel; b += per_bucket) offsets.push_back(b);
  return offsets;
}

GradientReducer::GradientReducer(comm::Communicator& dp_group, Tensor flat_grads,
                                 int64_t bucket_bytes)
    : group_(dp_group),
      grads_(std::move(flat_grads)),
      bucket_begin_(bucket_offsets(grads_.numel(), bucket_bytes)) {
  unstarted_ = num_buckets();
  pending_.reserve(bucket_begin_.size());
}

void GradientReducer::start_from(int64_t from) {
  if (group_.size() == 1) return;
  float* g = grads_.f32();
  for (; unstarted_ > 0 && bucket_begin_[size_t(unstarted_ - 1)] >= from; --unstarted_) {
    const int64_t begin = bucket_begin_[size_t(unstarted_ - 1)];
    const int64_t end =
        unstarted_ < num_buckets() ? bucket_begin_[size_t(unstarted_)] : grads_.numel();
    pending_.push_back(group_.iall_reduce(g + begin, size_t(end - begin), comm::ElemType::f32,
                                          comm::ReduceOp::sum));
  }
  comm::test_all(pending_);
}

void GradientReducer::reduce(float scale) {
  // Also when a wait throws, the next step starts with no bucket started (the requests'
  // destructors wait for them).
  struct NextStep {
    GradientReducer& reducer;
    ~NextStep() {
      reducer.pending_.clear();
      reducer.unstarted_ = reducer.num_buckets();
    }
  } next_step{*this};
  start_from(0);
  comm::wait_all(pending_);
  float* g = grads_.f32();
  const int64_t n = grads_.numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) g[i] *= scale;
}

void reduce_together(std::span<GradientReducer* const> reducers, float scale) {
  for (GradientReducer* r : reducers)
    if (r) r->start_from(0);
  for (GradientReducer* r : reducers)
    if (r) r->reduce(scale);
}

}  // namespace tessel::parallel
