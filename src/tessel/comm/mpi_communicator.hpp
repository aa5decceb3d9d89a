#pragma once
// MPI backend of Communicator (OpenMPI; any MPI-3 library works). Every MPI error
// becomes a tessel::Error carrying MPI's error string: the communicator is created
// with MPI_ERRORS_RETURN, which its splits inherit.
//
// Blocking calls map to MPI's blocking collectives (the tuned algorithms), the i*
// forms to MPI-3 non-blocking collectives; non-blocking operations progress inside
// MPI calls, so test() or wait() them. MPI counts are int: a count or displacement
// past INT_MAX elements is an Error (split the buffer), and so is a reduce_scatter,
// all_gather or all_to_all whose whole buffer (size() blocks) has more than INT_MAX
// elements, however small each block. Abandoning a Request cancels a pending receive; a
// pending send or collective cannot be cancelled and is left in flight.
#include <mpi.h>

#include "tessel/comm/communicator.hpp"

namespace tessel::comm {

// Throws tessel::Error "<call> failed: <MPI error string>" unless rc is MPI_SUCCESS.
void mpi_check(int rc, const char* call);

class MpiCommunicator final : public Communicator {
 public:
  // Takes ownership of `comm` (freed on destruction unless it is a predefined
  // communicator or MPI is already finalized) and sets MPI_ERRORS_RETURN on it.
  explicit MpiCommunicator(MPI_Comm comm);
  // A communicator over MPI_COMM_WORLD's processes, duplicated so that tessel's
  // messages never mix with other users of MPI_COMM_WORLD.
  static std::unique_ptr<MpiCommunicator> dup_world();
  ~MpiCommunicator() override;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string_view backend() const override { return "mpi"; }
  [[noreturn]] void abort(int exit_code) override;

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
  MPI_Comm comm_;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace tessel::comm
