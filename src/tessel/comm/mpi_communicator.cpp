#include "tessel/comm/mpi_communicator.hpp"

#include <climits>
#include <cstdlib>
#include <string>

namespace tessel::comm {

void mpi_check(int rc, const char* call) {
  if (rc == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(rc, text, &length) != MPI_SUCCESS) length = 0;
  throw Error(tessel::detail::concat(call, " failed: ",
                                     length > 0 ? std::string(text, size_t(length))
                                                : tessel::detail::concat("MPI error code ", rc)));
}

namespace {

MPI_Datatype mpi_type(ElemType type) {
  switch (type) {
    case ElemType::f32:
      return MPI_FLOAT;
    case ElemType::f64:
      return MPI_DOUBLE;
    case ElemType::i32:
      return MPI_INT32_T;
    case ElemType::i64:
      return MPI_INT64_T;
    case ElemType::u8:
      return MPI_UINT8_T;
    case ElemType::bf16:
      return MPI_UINT16_T;
  }
  TESSEL_CHECK(false, "unknown ElemType ", int(type));
}

MPI_Op mpi_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return MPI_SUM;
    case ReduceOp::max:
      return MPI_MAX;
    case ReduceOp::min:
      return MPI_MIN;
  }
  TESSEL_CHECK(false, "unknown ReduceOp ", int(op));
}

int to_int(size_t n, const char* call) {
  TESSEL_CHECK(n <= size_t(INT_MAX), call, ": ", n,
               " elements exceed MPI's int count limit; split the buffer");
  return int(n);
}

std::vector<int> to_ints(std::span<const size_t> values, const char* call) {
  std::vector<int> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) out[i] = to_int(values[i], call);
  return out;
}

// A started MPI operation and the arrays MPI reads until it completes.
class MpiPending final : public detail::PendingOp {
 public:
  void wait() override {
    MPI_Status status;
    mpi_check(MPI_Wait(&request, &status), "MPI_Wait");
    check_received(status);
  }
  bool test() override {
    int complete = 0;
    MPI_Status status;
    mpi_check(MPI_Test(&request, &complete, &status), "MPI_Test");
    if (complete) check_received(status);
    return complete != 0;
  }
  bool cancel() noexcept override {
    MPI_Status status;
    // A cancelled receive's wait is local (MPI 3.1 §3.8.4): it returns even if no peer sends.
    if (expect_count >= 0)
      return MPI_Cancel(&request) == MPI_SUCCESS && MPI_Wait(&request, &status) == MPI_SUCCESS;
    int complete = 0;  // sends and collectives cannot be cancelled: over only if complete
    return MPI_Test(&request, &complete, &status) == MPI_SUCCESS && complete != 0;
  }

  MPI_Request request = MPI_REQUEST_NULL;
  std::vector<int> counts, displs, counts2, displs2;
  // For a receive: the element count the message must have (-1: not a receive).
  int expect_count = -1;
  MPI_Datatype expect_type = MPI_DATATYPE_NULL;

  void check_received(const MPI_Status& status) const {
    if (expect_count < 0) return;
    int count = 0;
    mpi_check(MPI_Get_count(&status, expect_type, &count), "MPI_Get_count");
    TESSEL_CHECK(count == expect_count, "recv from rank ", status.MPI_SOURCE, " tag ",
                 status.MPI_TAG, ": expected ", expect_count, " elements but the message has ",
                 count);
  }
};

}  // namespace

MpiCommunicator::MpiCommunicator(MPI_Comm comm) : comm_(comm) {
  mpi_check(MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  mpi_check(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank");
  mpi_check(MPI_Comm_size(comm_, &size_), "MPI_Comm_size");
}

std::unique_ptr<MpiCommunicator> MpiCommunicator::dup_world() {
  MPI_Comm comm = MPI_COMM_NULL;
  mpi_check(MPI_Comm_dup(MPI_COMM_WORLD, &comm), "MPI_Comm_dup");
  return std::make_unique<MpiCommunicator>(comm);
}

MpiCommunicator::~MpiCommunicator() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized && comm_ != MPI_COMM_WORLD && comm_ != MPI_COMM_SELF && comm_ != MPI_COMM_NULL)
    MPI_Comm_free(&comm_);
}

void MpiCommunicator::abort(int exit_code) {
  MPI_Abort(comm_, exit_code);
  std::abort();  // MPI_Abort does not return; this satisfies [[noreturn]]
}

std::unique_ptr<Communicator> MpiCommunicator::do_split(int color, int key) {
  MPI_Comm out = MPI_COMM_NULL;
  mpi_check(MPI_Comm_split(comm_, color < 0 ? MPI_UNDEFINED : color, key, &out), "MPI_Comm_split");
  if (out == MPI_COMM_NULL) return nullptr;
  return std::make_unique<MpiCommunicator>(out);
}

Request MpiCommunicator::do_all_reduce(void* data, size_t count, ElemType type, ReduceOp op,
                                       Mode mode) {
  const int n = to_int(count, "all_reduce");
  if (mode == Mode::kBlocking) {
    mpi_check(MPI_Allreduce(MPI_IN_PLACE, data, n, mpi_type(type), mpi_op(op), comm_),
              "MPI_Allreduce");
    return {};
  }
  auto p = std::make_unique<MpiPending>();
  mpi_check(MPI_Iallreduce(MPI_IN_PLACE, data, n, mpi_type(type), mpi_op(op), comm_, &p->request),
            "MPI_Iallreduce");
  return Request(std::move(p));
}

Request MpiCommunicator::do_reduce_scatter(const void* send, void* recv, size_t block_count,
                                           ElemType type, ReduceOp op, Mode mode) {
  const int n = to_int(block_count, "reduce_scatter");
  to_int(block_count * size_t(size_), "reduce_scatter");
  if (mode == Mode::kBlocking) {
    mpi_check(MPI_Reduce_scatter_block(send, recv, n, mpi_type(type), mpi_op(op), comm_),
              "MPI_Reduce_scatter_block");
    return {};
  }
  auto p = std::make_unique<MpiPending>();
  mpi_check(
      MPI_Ireduce_scatter_block(send, recv, n, mpi_type(type), mpi_op(op), comm_, &p->request),
      "MPI_Ireduce_scatter_block");
  return Request(std::move(p));
}

Request MpiCommunicator::do_all_gather(const void* send, void* recv, size_t block_count,
                                       ElemType type, Mode mode) {
  const int n = to_int(block_count, "all_gather");
  to_int(block_count * size_t(size_), "all_gather");
  const void* own = static_cast<std::byte*>(recv) + block_count * elem_size(type) * size_t(rank_);
  const void* sendbuf = send == own ? MPI_IN_PLACE : send;
  if (mode == Mode::kBlocking) {
    mpi_check(MPI_Allgather(sendbuf, n, mpi_type(type), recv, n, mpi_type(type), comm_),
              "MPI_Allgather");
    return {};
  }
  auto p = std::make_unique<MpiPending>();
  mpi_check(MPI_Iallgather(sendbuf, n, mpi_type(type), recv, n, mpi_type(type), comm_, &p->request),
            "MPI_Iallgather");
  return Request(std::move(p));
}

Request MpiCommunicator::do_all_gatherv(const void* send, void* recv,
                                        std::span<const size_t> recv_counts, ElemType type,
                                        Mode mode) {
  auto p = std::make_unique<MpiPending>();
  const std::vector<size_t> displs = packed_displacements(recv_counts);
  p->counts = to_ints(recv_counts, "all_gatherv");
  p->displs = to_ints(displs, "all_gatherv");
  const int own = p->counts[size_t(rank_)];
  const void* own_block = static_cast<std::byte*>(recv) + displs[size_t(rank_)] * elem_size(type);
  const void* sendbuf = send == own_block ? MPI_IN_PLACE : send;
  if (mode == Mode::kBlocking) {
    mpi_check(MPI_Allgatherv(sendbuf, own, mpi_type(type), recv, p->counts.data(), p->displs.data(),
                             mpi_type(type), comm_),
              "MPI_Allgatherv");
    return {};
  }
  mpi_check(MPI_Iallgatherv(sendbuf, own, mpi_type(type), recv, p->counts.data(), p->displs.data(),
                            mpi_type(type), comm_, &p->request),
            "MPI_Iallgatherv");
  return Request(std::move(p));
}

Request MpiCommunicator::do_all_to_all(const void* send, void* recv, size_t block_count,
                                       ElemType type, Mode mode) {
  const int n = to_int(block_count, "all_to_all");
  to_int(block_count * size_t(size_), "all_to_all");
  if (mode == Mode::kBlocking) {
    mpi_check(MPI_Alltoall(send, n, mpi_type(type), recv, n, mpi_type(type), comm_),
              "MPI_Alltoall");
    return {};
  }
  auto p = std::make_unique<MpiPending>();
  mpi_check(MPI_Ialltoall(send, n, mpi_type(type), recv, n, mpi_type(type), comm_, &p->request),
            "MPI_Ialltoall");
  return Request(std::move(p));
}

Request MpiCommunicator::do_all_to_allv(const void* send, std::span<const size_t> send_counts,
                                        std::span<const size_t> send_displs, void* recv,
                                        std::span<const size_t> recv_counts,
                                        std::span<const size_t> recv_displs, ElemType type,
                                        Mode mode) {
  auto p = std::make_unique<MpiPending>();
  p->counts = to_ints(send_counts, "all_to_allv");
  p->displs = to_ints(send_displs, "all_to_allv");
  p->counts2 = to_ints(recv_counts, "all_to_allv");
  p->displs2 = to_ints(recv_displs, "all_to_allv");
  if (mode == Mode::kBlocking) {
    mpi_check(MPI_Alltoallv(send, p->counts.data(), p->displs.data(), mpi_type(type), recv,
                            p->counts2.data(), p->displs2.data(), mpi_type(type), comm_),
              "MPI_Alltoallv");
    return {};
  }
  mpi_check(
      MPI_Ialltoallv(send, p->counts.data(), p->displs.data(), mpi_type(type), recv,
                     p->counts2.data(), p->displs2.data(), mpi_type(type), comm_, &p->request),
      "MPI_Ialltoallv");
  return Request(std::move(p));
}

Request MpiCommunicator::do_broadcast(void* data, size_t count, ElemType type, int root,
                                      Mode mode) {
  const int n = to_int(count, "broadcast");
  if (mode == Mode::kBlocking) {
    mpi_check(MPI_Bcast(data, n, mpi_type(type), root, comm_), "MPI_Bcast");
    return {};
  }
  auto p = std::make_unique<MpiPending>();
  mpi_check(MPI_Ibcast(data, n, mpi_type(type), root, comm_, &p->request), "MPI_Ibcast");
  return Request(std::move(p));
}

Request MpiCommunicator::do_send(const void* data, size_t count, ElemType type, int dest, int tag,
                                 Mode mode) {
  const int n = to_int(count, "send");
  if (mode == Mode::kBlocking) {
    mpi_check(MPI_Send(data, n, mpi_type(type), dest, tag, comm_), "MPI_Send");
    return {};
  }
  auto p = std::make_unique<MpiPending>();
  mpi_check(MPI_Isend(data, n, mpi_type(type), dest, tag, comm_, &p->request), "MPI_Isend");
  return Request(std::move(p));
}

Request MpiCommunicator::do_recv(void* data, size_t count, ElemType type, int source, int tag,
                                 Mode mode) {
  auto p = std::make_unique<MpiPending>();
  p->expect_count = to_int(count, "recv");
  p->expect_type = mpi_type(type);
  if (mode == Mode::kBlocking) {
    MPI_Status status;
    mpi_check(MPI_Recv(data, p->expect_count, p->expect_type, source, tag, comm_, &status),
              "MPI_Recv");
    p->check_received(status);
    return {};
  }
  mpi_check(MPI_Irecv(data, p->expect_count, p->expect_type, source, tag, comm_, &p->request),
            "MPI_Irecv");
  return Request(std::move(p));
}

Request MpiCommunicator::do_barrier(Mode mode) {
  if (mode == Mode::kBlocking) {
    mpi_check(MPI_Barrier(comm_), "MPI_Barrier");
    return {};
  }
  auto p = std::make_unique<MpiPending>();
  mpi_check(MPI_Ibarrier(comm_, &p->request), "MPI_Ibarrier");
  return Request(std::move(p));
}

}  // namespace tessel::comm
