#pragma once
// Expert parallelism: the MoE layer's ExpertComm backed by comm::Communicator. Tokens are
// exchanged over the mesh's ep group (all_to_all of counts, then all_to_allv of rows);
// balancing sums and maxima (EQB histograms, global loads, the histogram quantile's range)
// run over the dp x cp group, which holds every rank that trains the layer on its own tokens
// (the ep group is folded inside it); the per-micro-batch sums over the cp group, whose ranks
// hold the parts of one micro-batch.
#include "tessel/comm/communicator.hpp"
#include "tessel/moe/expert_comm.hpp"

namespace tessel::parallel {

class ExpertParallelComm final : public moe::ExpertComm {
 public:
  // The communicators must outlive this object. micro_batch_group null: this rank holds
  // whole micro-batches (generation, where every cp rank runs the same forwards).
  ExpertParallelComm(comm::Communicator& ep_group, comm::Communicator& balance_group,
                     comm::Communicator* micro_batch_group)
      : ep_(ep_group), balance_(balance_group), micro_batch_(micro_batch_group) {}
  int ep_size() const override { return ep_.size(); }
  int ep_rank() const override { return ep_.rank(); }
  void exchange_counts(const int64_t* send, int64_t* recv, size_t n) override;
  void exchange_rows(const float* send, std::span<const size_t> send_counts, float* recv,
                     std::span<const size_t> recv_counts) override;
  void sum_counters(int32_t* data, size_t n) override;
  void sum_values(double* data, size_t n) override;
  void max_values(float* data, size_t n) override;
  void sum_micro_batch_counters(int32_t* data, size_t n) override;
  void sum_micro_batch_values(double* data, size_t n) override;
  std::vector<int32_t> gather_micro_batch(std::span<const int32_t> send) override;

 private:
  comm::Communicator& ep_;
  comm::Communicator& balance_;
  comm::Communicator* micro_batch_;
};

}  // namespace tessel::parallel
