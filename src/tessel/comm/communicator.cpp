#include "tessel/comm/communicator.hpp"

#include <cstdio>
#include <exception>
#include <numeric>
#include <utility>

namespace tessel::comm {

size_t elem_size(ElemType type) {
  switch (type) {
    case ElemType::f32:
    case ElemType::i32:
      return 4;
    case ElemType::f64:
    case ElemType::i64:
      return 8;
    case ElemType::u8:
      return 1;
    case ElemType::bf16:
      return 2;
  }
  TESSEL_CHECK(false, "unknown ElemType ", int(type));
}

const char* elem_type_name(ElemType type) {
  switch (type) {
    case ElemType::f32:
      return "f32";
    case ElemType::f64:
      return "f64";
    case ElemType::i32:
      return "i32";
    case ElemType::i64:
      return "i64";
    case ElemType::u8:
      return "u8";
    case ElemType::bf16:
      return "bf16";
  }
  TESSEL_CHECK(false, "unknown ElemType ", int(type));
}

ElemType elem_type(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return ElemType::f32;
    case DType::bf16:
      return ElemType::bf16;
    case DType::i32:
      return ElemType::i32;
  }
  TESSEL_CHECK(false, "unknown DType ", int(dtype));
}

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return "sum";
    case ReduceOp::max:
      return "max";
    case ReduceOp::min:
      return "min";
  }
  TESSEL_CHECK(false, "unknown ReduceOp ", int(op));
}

std::vector<size_t> packed_displacements(std::span<const size_t> counts) {
  std::vector<size_t> displs(counts.size());
  std::exclusive_scan(counts.begin(), counts.end(), displs.begin(), size_t{0});
  return displs;
}

// ---- Request ----

Request& Request::operator=(Request&& other) noexcept {
  if (this != &other) {
    finish_quietly();
    op_ = std::move(other.op_);
  }
  return *this;
}

Request::~Request() {
  finish_quietly();
}

void Request::wait() {
  if (!op_) return;
  // Drop the operation even when it failed: a failed request is over.
  std::unique_ptr<detail::PendingOp> op = std::move(op_);
  op->wait();
}

bool Request::test() {
  if (!op_) return true;
  bool complete = false;
  try {
    complete = op_->test();
  } catch (...) {
    op_.reset();
    throw;
  }
  if (complete) op_.reset();
  return complete;
}

bool Request::abandon() noexcept {
  // Still in flight: never free what the backend may still use.
  const bool over = !op_ || op_->cancel();
  if (!over) (void)op_.release();
  op_.reset();
  return over;
}

void Request::finish_quietly() noexcept {
  try {
    wait();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tessel: a pending communication request failed on completion: %s\n",
                 e.what());
  }
}

bool all_agree(Communicator& group, bool mine) {
  int32_t ok = mine ? 1 : 0;
  group.all_reduce(std::span<int32_t>(&ok, 1), ReduceOp::min);
  return ok == 1;
}

void wait_all(std::span<Request> requests) {
  std::exception_ptr first;
  for (Request& r : requests) {
    try {
      r.wait();
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

bool test_all(std::span<Request> requests) {
  for (Request& r : requests)
    if (!r.test()) return false;
  return true;
}

bool abandon_all(std::span<Request> requests) noexcept {
  bool over = true;
  for (Request& r : requests) over = r.abandon() && over;
  return over;
}

uint64_t TrafficCounts::total() const {
  return all_reduce + reduce_scatter + all_gather + all_to_all + broadcast + send;
}

// ---- argument checks ----

namespace {

void check_reducible(ElemType type, const char* call) {
  TESSEL_CHECK(type != ElemType::bf16, call, ": bf16 buffers cannot be reduced; reduce in f32");
}

void check_ranks(std::span<const size_t> entries, int size, const char* what, const char* call) {
  TESSEL_CHECK(entries.size() == size_t(size), call, ": ", what, " has ", entries.size(),
               " entries but the communicator has ", size, " ranks");
}

bool overlaps(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  auto pa = reinterpret_cast<uintptr_t>(a), pb = reinterpret_cast<uintptr_t>(b);
  return a_bytes > 0 && b_bytes > 0 && pa < pb + b_bytes && pb < pa + a_bytes;
}

// all_gather(v) allows exactly one overlap: `send` is this rank's block of recv.
void check_gather_overlap(const void* send, size_t send_bytes, const void* recv, size_t recv_bytes,
                          size_t own_offset_bytes, const char* call) {
  if (!overlaps(send, send_bytes, recv, recv_bytes)) return;
  TESSEL_CHECK(send == static_cast<const std::byte*>(recv) + own_offset_bytes, call,
               ": the send buffer overlaps the receive buffer but is not this rank's block");
}

size_t sum(std::span<const size_t> counts) {
  return std::accumulate(counts.begin(), counts.end(), size_t{0});
}

// Of blocks at displs[r] with counts[r] elements: where the one reaching furthest ends, and its
// r (the extent of the buffer the call uses).
std::pair<size_t, size_t> furthest_block(std::span<const size_t> counts,
                                         std::span<const size_t> displs) {
  std::pair<size_t, size_t> end{0, 0};
  for (size_t r = 0; r < counts.size(); ++r)
    if (displs[r] + counts[r] > end.first) end = {displs[r] + counts[r], r};
  return end;
}

}  // namespace

void Communicator::check_blocks(size_t whole, size_t block, const char* call) const {
  TESSEL_CHECK(whole == block * size_t(size()), call, ": buffer of ", whole,
               " elements is not size() = ", size(), " blocks of ", block);
}

size_t Communicator::check_all_to_all(size_t send, size_t recv, const char* call) const {
  TESSEL_CHECK(send == recv && send % size_t(size()) == 0, call, ": send (", send, ") and recv (",
               recv, ") must have the same size, a multiple of size() = ", size());
  return send / size_t(size());
}

void Communicator::check_gatherv(size_t send, size_t recv, std::span<const size_t> recv_counts,
                                 const char* call) const {
  check_ranks(recv_counts, size(), "recv_counts", call);
  TESSEL_CHECK(send == recv_counts[size_t(rank())], call, ": send has ", send,
               " elements but recv_counts[", rank(), "] = ", recv_counts[size_t(rank())]);
  TESSEL_CHECK(recv == sum(recv_counts), call, ": recv has ", recv,
               " elements but the counts add up to ", sum(recv_counts));
}

void Communicator::check_all_to_allv_spans(std::span<const size_t> send_counts,
                                           std::span<const size_t> send_displs,
                                           std::span<const size_t> recv_counts,
                                           std::span<const size_t> recv_displs,
                                           const char* call) const {
  check_ranks(send_counts, size(), "send_counts", call);
  check_ranks(send_displs, size(), "send_displs", call);
  check_ranks(recv_counts, size(), "recv_counts", call);
  check_ranks(recv_displs, size(), "recv_displs", call);
}

void Communicator::check_all_to_allv(size_t send, std::span<const size_t> send_counts,
                                     std::span<const size_t> send_displs, size_t recv,
                                     std::span<const size_t> recv_counts,
                                     std::span<const size_t> recv_displs, const char* call) const {
  check_all_to_allv_spans(send_counts, send_displs, recv_counts, recv_displs, call);
  const auto [send_end, to] = furthest_block(send_counts, send_displs);
  TESSEL_CHECK(send_end <= send, call, ": block for rank ", to, " ends past the send buffer of ",
               send, " elements");
  const auto [recv_end, from] = furthest_block(recv_counts, recv_displs);
  TESSEL_CHECK(recv_end <= recv, call, ": block from rank ", from, " ends past the recv buffer of ",
               recv, " elements");
}

// ---- front ends ----

Request Communicator::counted(uint64_t TrafficCounts::*kind, uint64_t bytes, Request started) {
  traffic_.bytes.*kind += bytes;
  ++(traffic_.calls.*kind);
  return started;
}

std::unique_ptr<Communicator> Communicator::split(int color, int key) {
  return do_split(color, key);
}

Request Communicator::start_all_reduce(void* data, size_t count, ElemType type, ReduceOp op,
                                       Mode mode) {
  check_reducible(type, "all_reduce");
  return counted(&TrafficCounts::all_reduce, count * elem_size(type),
                 do_all_reduce(data, count, type, op, mode));
}

Request Communicator::start_reduce_scatter(const void* send, void* recv, size_t block_count,
                                           ElemType type, ReduceOp op, Mode mode) {
  check_reducible(type, "reduce_scatter");
  const size_t block_bytes = block_count * elem_size(type);
  TESSEL_CHECK(!overlaps(send, block_bytes * size_t(size()), recv, block_bytes),
               "reduce_scatter: send and recv buffers overlap");
  return counted(&TrafficCounts::reduce_scatter, block_bytes * size_t(size()),
                 do_reduce_scatter(send, recv, block_count, type, op, mode));
}

Request Communicator::start_all_gather(const void* send, void* recv, size_t block_count,
                                       ElemType type, Mode mode) {
  const size_t block_bytes = block_count * elem_size(type);
  check_gather_overlap(send, block_bytes, recv, block_bytes * size_t(size()),
                       block_bytes * size_t(rank()), "all_gather");
  return counted(&TrafficCounts::all_gather, block_bytes,
                 do_all_gather(send, recv, block_count, type, mode));
}

Request Communicator::start_all_gatherv(const void* send, void* recv,
                                        std::span<const size_t> recv_counts, ElemType type,
                                        Mode mode) {
  check_ranks(recv_counts, size(), "recv_counts", "all_gatherv");
  const size_t es = elem_size(type);
  const size_t own = size_t(rank());
  const size_t own_offset = sum(recv_counts.first(own));
  check_gather_overlap(send, recv_counts[own] * es, recv, sum(recv_counts) * es, own_offset * es,
                       "all_gatherv");
  return counted(&TrafficCounts::all_gather, recv_counts[own] * es,
                 do_all_gatherv(send, recv, recv_counts, type, mode));
}

Request Communicator::start_all_to_all(const void* send, void* recv, size_t block_count,
                                       ElemType type, Mode mode) {
  const size_t bytes = block_count * elem_size(type) * size_t(size());
  TESSEL_CHECK(!overlaps(send, bytes, recv, bytes), "all_to_all: send and recv buffers overlap");
  return counted(&TrafficCounts::all_to_all, bytes,
                 do_all_to_all(send, recv, block_count, type, mode));
}

Request Communicator::start_all_to_allv(const void* send, std::span<const size_t> send_counts,
                                        std::span<const size_t> send_displs, void* recv,
                                        std::span<const size_t> recv_counts,
                                        std::span<const size_t> recv_displs, ElemType type,
                                        Mode mode) {
  check_all_to_allv_spans(send_counts, send_displs, recv_counts, recv_displs, "all_to_allv");
  const size_t es = elem_size(type);
  TESSEL_CHECK(!overlaps(send, furthest_block(send_counts, send_displs).first * es, recv,
                         furthest_block(recv_counts, recv_displs).first * es),
               "all_to_allv: send and recv buffers overlap");
  return counted(
      &TrafficCounts::all_to_all, sum(send_counts) * es,
      do_all_to_allv(send, send_counts, send_displs, recv, recv_counts, recv_displs, type, mode));
}

Request Communicator::start_broadcast(void* data, size_t count, ElemType type, int root,
                                      Mode mode) {
  TESSEL_CHECK(root >= 0 && root < size(), "broadcast: root ", root, " is not a rank of ", size());
  return counted(&TrafficCounts::broadcast, rank() == root ? count * elem_size(type) : 0,
                 do_broadcast(data, count, type, root, mode));
}

Request Communicator::start_send(const void* data, size_t count, ElemType type, int dest, int tag,
                                 Mode mode) {
  TESSEL_CHECK(dest >= 0 && dest < size(), "send: destination ", dest, " is not a rank of ",
               size());
  TESSEL_CHECK(tag >= 0, "send: tag ", tag, " must be >= 0");
  return counted(&TrafficCounts::send, count * elem_size(type),
                 do_send(data, count, type, dest, tag, mode));
}

Request Communicator::start_recv(void* data, size_t count, ElemType type, int source, int tag,
                                 Mode mode) {
  TESSEL_CHECK(source >= 0 && source < size(), "recv: source ", source, " is not a rank of ",
               size());
  TESSEL_CHECK(tag >= 0, "recv: tag ", tag, " must be >= 0");
  return do_recv(data, count, type, source, tag, mode);
}

// ---- blocking forms ----

void Communicator::all_reduce(void* data, size_t count, ElemType type, ReduceOp op) {
  start_all_reduce(data, count, type, op, Mode::kBlocking).wait();
}
void Communicator::reduce_scatter(const void* send, void* recv, size_t block_count, ElemType type,
                                  ReduceOp op) {
  start_reduce_scatter(send, recv, block_count, type, op, Mode::kBlocking).wait();
}
void Communicator::all_gather(const void* send, void* recv, size_t block_count, ElemType type) {
  start_all_gather(send, recv, block_count, type, Mode::kBlocking).wait();
}
void Communicator::all_gatherv(const void* send, void* recv, std::span<const size_t> recv_counts,
                               ElemType type) {
  start_all_gatherv(send, recv, recv_counts, type, Mode::kBlocking).wait();
}
void Communicator::all_to_all(const void* send, void* recv, size_t block_count, ElemType type) {
  start_all_to_all(send, recv, block_count, type, Mode::kBlocking).wait();
}
void Communicator::all_to_allv(const void* send, std::span<const size_t> send_counts,
                               std::span<const size_t> send_displs, void* recv,
                               std::span<const size_t> recv_counts,
                               std::span<const size_t> recv_displs, ElemType type) {
  start_all_to_allv(send, send_counts, send_displs, recv, recv_counts, recv_displs, type,
                    Mode::kBlocking)
      .wait();
}
void Communicator::broadcast(void* data, size_t count, ElemType type, int root) {
  start_broadcast(data, count, type, root, Mode::kBlocking).wait();
}
void Communicator::send(const void* data, size_t count, ElemType type, int dest, int tag) {
  start_send(data, count, type, dest, tag, Mode::kBlocking).wait();
}
void Communicator::recv(void* data, size_t count, ElemType type, int source, int tag) {
  start_recv(data, count, type, source, tag, Mode::kBlocking).wait();
}
void Communicator::barrier() {
  do_barrier(Mode::kBlocking).wait();
}

// ---- non-blocking forms ----

Request Communicator::iall_reduce(void* data, size_t count, ElemType type, ReduceOp op) {
  return start_all_reduce(data, count, type, op, Mode::kNonBlocking);
}
Request Communicator::ireduce_scatter(const void* send, void* recv, size_t block_count,
                                      ElemType type, ReduceOp op) {
  return start_reduce_scatter(send, recv, block_count, type, op, Mode::kNonBlocking);
}
Request Communicator::iall_gather(const void* send, void* recv, size_t block_count, ElemType type) {
  return start_all_gather(send, recv, block_count, type, Mode::kNonBlocking);
}
Request Communicator::iall_gatherv(const void* send, void* recv,
                                   std::span<const size_t> recv_counts, ElemType type) {
  return start_all_gatherv(send, recv, recv_counts, type, Mode::kNonBlocking);
}
Request Communicator::iall_to_all(const void* send, void* recv, size_t block_count, ElemType type) {
  return start_all_to_all(send, recv, block_count, type, Mode::kNonBlocking);
}
Request Communicator::iall_to_allv(const void* send, std::span<const size_t> send_counts,
                                   std::span<const size_t> send_displs, void* recv,
                                   std::span<const size_t> recv_counts,
                                   std::span<const size_t> recv_displs, ElemType type) {
  return start_all_to_allv(send, send_counts, send_displs, recv, recv_counts, recv_displs, type,
                           Mode::kNonBlocking);
}
Request Communicator::ibroadcast(void* data, size_t count, ElemType type, int root) {
  return start_broadcast(data, count, type, root, Mode::kNonBlocking);
}
Request Communicator::isend(const void* data, size_t count, ElemType type, int dest, int tag) {
  return start_send(data, count, type, dest, tag, Mode::kNonBlocking);
}
Request Communicator::irecv(void* data, size_t count, ElemType type, int source, int tag) {
  return start_recv(data, count, type, source, tag, Mode::kNonBlocking);
}
Request Communicator::ibarrier() {
  return do_barrier(Mode::kNonBlocking);
}

}  // namespace tessel::comm
