#pragma once
// Single-process backend of Communicator: world size 1, no MPI. Every collective
// is a copy from the send buffer to the receive buffer (a reduction over one rank
// is the identity), so code written for N ranks runs unchanged with one.
//
// Point-to-point to self works through an internal queue with MPI's matching
// rules: a send matches the oldest posted receive with the same tag, else it is
// queued (copied, so send and isend complete at once); a receive takes the oldest
// queued message with its tag, else an irecv stays pending until a matching send.
// A blocking recv, or a wait() on an irecv, with no matching send throws
// tessel::Error: with one process no message can arrive later. The element type
// and count of a matched message must equal the receive's. An irecv whose Request goes
// away unmatched (destroyed or abandoned) is withdrawn at once: a later send is queued,
// never written into its buffer.
#include <deque>
#include <memory>
#include <vector>

#include "tessel/comm/communicator.hpp"

namespace tessel::comm {

namespace detail {
struct PostedRecv;  // an irecv not matched yet, shared with its Request
}

class SingleCommunicator final : public Communicator {
 public:
  SingleCommunicator() = default;
  ~SingleCommunicator() override;

  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string_view backend() const override { return "single"; }
  [[noreturn]] void abort(int exit_code) override;

  // Receives posted with irecv and neither matched nor given up (their Request gone).
  size_t posted_receives() const { return posted_.size(); }

 protected:
  std::unique_ptr<Communicator> do_split(int color, int key) override;
  Request do_all_reduce(void* data, size_t count, ElemType type, ReduceOp op, Mode mode) override;
  Request do_reduce_scatter(const void* send, void* recv, size_t block_count, ElemType type,
                            ReduceOp op, Mode mode) override;
  Request do_all_gather(const void* send, void* recv, size_t block_count, ElemType type,
                        Mode mode) override;
  Request do_all_gatherv(const void* send, void* recv, std::span<const size_t> recv_counts,
                         ElemType type, Mode mode) override;
  Request do_all_to_all(const void* send, void* recv, size_t block_count, ElemType type,
                        Mode mode) override;
  Request do_all_to_allv(const void* send, std::span<const size_t> send_counts,
                         std::span<const size_t> send_displs, void* recv,
                         std::span<const size_t> recv_counts, std::span<const size_t> recv_displs,
                         ElemType type, Mode mode) override;
  Request do_broadcast(void* data, size_t count, ElemType type, int root, Mode mode) override;
  Request do_send(const void* data, size_t count, ElemType type, int dest, int tag,
                  Mode mode) override;
  Request do_recv(void* data, size_t count, ElemType type, int source, int tag, Mode mode) override;
  Request do_barrier(Mode mode) override;

 private:
  struct Message {
    std::vector<std::byte> bytes;
    size_t count;
    ElemType type;
    int tag;
  };
  std::deque<Message> queued_;
  std::deque<std::shared_ptr<detail::PostedRecv>> posted_;
};

}  // namespace tessel::comm
