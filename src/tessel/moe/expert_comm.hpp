#pragma once
// What an MoE layer needs from the processes around it, and nothing more: the token
// exchange over the expert-parallel (ep) group and the sums over the balancing group
// (every rank that trains the layer on its own tokens: the dp x cp group, which contains the
// ep group). The model stays free of parallelism: the trainer hands it an implementation.
//   - LocalExpertComm (here): one process, every expert local; exchanges are copies and
//     sums are the identity.
//   - parallel::ExpertParallelComm (parallel/expert_parallel.hpp): backed by the
//     comm::Communicator of the mesh's ep, dp x cp and cp groups.
// Every call is collective over its group: all ranks make the same calls in the same order.
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace tessel::moe {

class ExpertComm {
 public:
  virtual ~ExpertComm() = default;
  virtual int ep_size() const = 0;
  virtual int ep_rank() const = 0;
  // Over the ep group: send[ep_size() * n] -> recv[ep_size() * n]; block d of send goes to
  // ep rank d, block s of recv comes from ep rank s.
  virtual void exchange_counts(const int64_t* send, int64_t* recv, size_t n) = 0;
  // Over the ep group: send_counts[d] floats (packed back to back in `send`) go to ep rank
  // d; recv_counts[s] floats from ep rank s land packed in `recv`.
  virtual void exchange_rows(const float* send, std::span<const size_t> send_counts, float* recv,
                             std::span<const size_t> recv_counts) = 0;
  // In place, element-wise sums over the balancing group.
  virtual void sum_counters(int32_t* data, size_t n) = 0;
  virtual void sum_values(double* data, size_t n) = 0;
  // In place, element-wise maxima over the balancing group (the histogram quantile's range).
  virtual void max_values(float* data, size_t n) = 0;
  // In place, element-wise sums over the micro-batch group: the ranks that hold parts of
  // this rank's micro-batch (the cp group under context parallelism; else this rank alone).
  // The balancing terms defined per micro-batch (aux, LEI, z-loss, qb_avg, Sinkhorn's
  // scaling) use them.
  virtual void sum_micro_batch_counters(int32_t* data, size_t n) = 0;
  virtual void sum_micro_batch_values(double* data, size_t n) = 0;
  // The micro-batch group's `send`s concatenated in group rank order (expert capacity over a
  // micro-batch split by context parallelism); `send` alone without such a group.
  virtual std::vector<int32_t> gather_micro_batch(std::span<const int32_t> send) = 0;
};

class LocalExpertComm final : public ExpertComm {
 public:
  int ep_size() const override { return 1; }
  int ep_rank() const override { return 0; }
  void exchange_counts(const int64_t* send, int64_t* recv, size_t n) override;
  void exchange_rows(const float* send, std::span<const size_t> send_counts, float* recv,
                     std::span<const size_t> recv_counts) override;
  void sum_counters(int32_t*, size_t) override {}
  void sum_values(double*, size_t) override {}
  void max_values(float*, size_t) override {}
  void sum_micro_batch_counters(int32_t*, size_t) override {}
  void sum_micro_batch_values(double*, size_t) override {}
  std::vector<int32_t> gather_micro_batch(std::span<const int32_t> send) override {
    return {send.begin(), send.end()};
  }
};

}  // namespace tessel::moe
