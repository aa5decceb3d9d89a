#include "tessel/parallel/expert_parallel.hpp"

#include <numeric>

namespace tessel::parallel {

void ExpertParallelComm::exchange_counts(const int64_t* send, int64_t* recv, size_t n) {
  ep_.all_to_all(send, recv, n, comm::ElemType::i64);
}

void ExpertParallelComm::exchange_rows(const float* send, std::span<const size_t> send_counts,
                                       float* recv, std::span<const size_t> recv_counts) {
  const auto send_displs = comm::packed_displacements(send_counts);
  const auto recv_displs = comm::packed_displacements(recv_counts);
  ep_.all_to_allv(send, send_counts, send_displs, recv, recv_counts, recv_displs,
                  comm::ElemType::f32);
}

void ExpertParallelComm::sum_counters(int32_t* data, size_t n) {
  balance_.all_reduce(data, n, comm::ElemType::i32, comm::ReduceOp::sum);
}

void ExpertParallelComm::sum_values(double* data, size_t n) {
  balance_.all_reduce(data, n, comm::ElemType::f64, comm::ReduceOp::sum);
}

void ExpertParallelComm::max_values(float* data, size_t n) {
  balance_.all_reduce(data, n, comm::ElemType::f32, comm::ReduceOp::max);
}

void ExpertParallelComm::sum_micro_batch_counters(int32_t* data, size_t n) {
  if (micro_batch_ && micro_batch_->size() > 1)
    micro_batch_->all_reduce(data, n, comm::ElemType::i32, comm::ReduceOp::sum);
}

void ExpertParallelComm::sum_micro_batch_values(double* data, size_t n) {
  if (micro_batch_ && micro_batch_->size() > 1)
    micro_batch_->all_reduce(data, n, comm::ElemType::f64, comm::ReduceOp::sum);
}

std::vector<int32_t> ExpertParallelComm::gather_micro_batch(std::span<const int32_t> send) {
  if (!micro_batch_ || micro_batch_->size() == 1) return {send.begin(), send.end()};
  const int64_t mine = int64_t(send.size());
  std::vector<int64_t> sizes(size_t(micro_batch_->size()));
  micro_batch_->all_gather(std::span<const int64_t>(&mine, 1), sizes);
  const std::vector<size_t> counts(sizes.begin(), sizes.end());
  std::vector<int32_t> all(std::accumulate(counts.begin(), counts.end(), size_t(0)));
  micro_batch_->all_gatherv(send.data(), all.data(), counts, comm::ElemType::i32);
  return all;
}

}  // namespace tessel::parallel
