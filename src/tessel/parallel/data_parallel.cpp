#include "tessel/parallel/data_parallel.hpp"

#include <algorithm>

#include "tessel/core/error.hpp"

namespace tessel::parallel {

GradientReducer::GradientReducer(comm::Communicator& dp_group, Tensor flat_grads,
                                 int64_t bucket_bytes)
    : group_(dp_group), grads_(std::move(flat_grads)) {
  TESSEL_CHECK(bucket_bytes > 0, "bucket size must be positive");
  int64_t per_bucket = std::max<int64_t>(1, bucket_bytes / int64_t(sizeof(float)));
  for (int64_t b = 0; b < grads_.numel(); b += per_bucket) bucket_begin_.push_back(b);
}

void GradientReducer::reduce(float scale) {
  float* g = grads_.f32();
  int64_t n = grads_.numel();
  if (group_.size() > 1) {
    std::vector<comm::Request> pending;
    pending.reserve(bucket_begin_.size());
    for (size_t i = 0; i < bucket_begin_.size(); ++i) {
      int64_t begin = bucket_begin_[i];
      int64_t end = i + 1 < bucket_begin_.size() ? bucket_begin_[i + 1] : n;
      pending.push_back(group_.iall_reduce(g + begin, size_t(end - begin), comm::ElemType::f32,
                                           comm::ReduceOp::sum));
    }
    comm::wait_all(pending);
  }
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) g[i] *= scale;
}

}  // namespace tessel::parallel
