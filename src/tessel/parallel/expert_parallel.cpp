#include "tessel/parallel/expert_parallel.hpp"

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

void ExpertParallelComm::sum_micro_batch_counters(int32_t* data, size_t n) {
  if (micro_batch_ && micro_batch_->size() > 1)
    micro_batch_->all_reduce(data, n, comm::ElemType::i32, comm::ReduceOp::sum);
}

void ExpertParallelComm::sum_micro_batch_values(double* data, size_t n) {
  if (micro_batch_ && micro_batch_->size() > 1)
    micro_batch_->all_reduce(data, n, comm::ElemType::f64, comm::ReduceOp::sum);
}

}  // namespace tessel::parallel
