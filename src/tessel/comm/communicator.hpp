#pragma once
// The one communication interface of tessel. Every collective and every
// point-to-point transfer of the system goes through a Communicator; backends are
// MPI (MpiCommunicator, also across machines) and a single process
// (SingleCommunicator, world size 1). Obtain the world with init_communication()
// (world.hpp) and process groups from a Mesh (mesh.hpp).
//
// Buffers are typed by ElemType. Each call has an untyped form (pointer, element
// count, ElemType) and a typed form over contiguous ranges (std::vector, std::span,
// std::array) whose element type selects the ElemType. Counts and displacements are in
// elements, never bytes.
//
// Collective rules (as in MPI): every rank of the communicator makes the same
// collective calls in the same order, blocking and non-blocking alike; send and
// receive buffers of one call must not overlap unless the call says so.
//
// Non-blocking calls (i*) start the operation and return a Request. The buffers
// must stay valid and untouched until the request completes (wait() or test()
// returning true). A Request that is destroyed while pending waits for completion;
// abandon() gives it up instead (for unwinding from an error, when peers may never take
// part).
//
// Determinism: reductions are computed by the backend's fixed algorithms. For a
// fixed communicator size, message size and call form, MPI picks the same algorithm
// and reduction order every time, and tessel adds no reordering, so results repeat
// bitwise. Blocking and non-blocking forms may use different algorithms, so a
// floating-point sum from all_reduce and from iall_reduce need not agree bitwise: use
// one form consistently for a given reduction.
//
// Traffic: every communicator counts, per collective kind, the calls this rank made
// and the bytes of its send buffer (see Traffic). Counts are logical payload and do
// not depend on the algorithm the backend uses internally.
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <ranges>
#include <span>
#include <string_view>
#include <type_traits>
#include <vector>

#include "tessel/core/error.hpp"
#include "tessel/core/tensor.hpp"

namespace tessel::comm {

// Element types a buffer can hold. bf16 is raw 16-bit storage (uint16_t, as in
// tessel/core/bf16.hpp): it can be moved (gather, all-to-all, broadcast, send) but not
// reduced; reduce in f32.
enum class ElemType : uint8_t { f32, f64, i32, i64, u8, bf16 };
size_t elem_size(ElemType type);
const char* elem_type_name(ElemType type);  // "f32", "f64", "i32", "i64", "u8", "bf16"
// The comm element type of a tensor dtype (f32, bf16, i32).
ElemType elem_type(DType dtype);

template <class T>
inline constexpr bool kIsElement =
    std::is_same_v<T, float> || std::is_same_v<T, double> || std::is_same_v<T, int32_t> ||
    std::is_same_v<T, int64_t> || std::is_same_v<T, uint8_t> || std::is_same_v<T, uint16_t>;

template <class T>
requires kIsElement<T>
constexpr ElemType elem_type_of() {
  if constexpr (std::is_same_v<T, float>) return ElemType::f32;
  if constexpr (std::is_same_v<T, double>) return ElemType::f64;
  if constexpr (std::is_same_v<T, int32_t>) return ElemType::i32;
  if constexpr (std::is_same_v<T, int64_t>) return ElemType::i64;
  if constexpr (std::is_same_v<T, uint8_t>) return ElemType::u8;
  if constexpr (std::is_same_v<T, uint16_t>) return ElemType::bf16;
}

// A contiguous range of a supported element type (read-only use).
template <class R>
concept InBuffer = std::ranges::contiguous_range<R> && std::ranges::sized_range<R> &&
    kIsElement<std::remove_cv_t<std::ranges::range_value_t<R>>>;
// A contiguous range the call writes into.
template <class R>
concept OutBuffer =
    InBuffer<R> && !std::is_const_v<std::remove_reference_t<std::ranges::range_reference_t<R>>>;

// A buffer a non-blocking call may go on using after it returns: an lvalue, or a view such as
// std::span. A temporary vector would be destroyed while MPI still reads or writes it, so the
// non-blocking forms refuse it at compile time.
template <class R>
concept LastingBuffer = std::ranges::borrowed_range<R>;

template <class R>
using buffer_elem_t = std::remove_cv_t<std::ranges::range_value_t<R>>;
template <class A, class B>
concept SameElement = std::same_as<buffer_elem_t<A>, buffer_elem_t<B>>;

enum class ReduceOp : uint8_t { sum, max, min };
const char* reduce_op_name(ReduceOp op);

// Displacements of blocks packed back to back: out[i] = counts[0] + ... + counts[i-1].
std::vector<size_t> packed_displacements(std::span<const size_t> counts);

// ---------------------------------------------------------------------------
// Request: the handle of a started non-blocking operation. Movable, not copyable.
// A default-constructed Request is complete.

namespace detail {
// A backend's in-flight operation; owns whatever must outlive the call (counts arrays).
class PendingOp {
 public:
  virtual ~PendingOp() = default;
  virtual void wait() = 0;  // blocks until complete; throws tessel::Error on failure
  virtual bool test() = 0;  // true once complete; throws tessel::Error on failure
  // Gives the operation up without waiting for peers: true once it is over (complete, or a
  // receive cancelled unmatched, which never writes its buffer), so it may be destroyed; false
  // while the backend may still use it and its buffers (Request::abandon then leaks it).
  virtual bool cancel() noexcept { return false; }
};
}  // namespace detail

class Request {
 public:
  Request() = default;
  explicit Request(std::unique_ptr<detail::PendingOp> op) : op_(std::move(op)) {}
  Request(Request&&) noexcept = default;
  // Completes the request held so far (as the destructor does), then takes `other`'s.
  Request& operator=(Request&& other) noexcept;
  // Waits if still pending. A destructor cannot throw, so a failure is printed to
  // stderr instead.
  ~Request();

  // Blocks until the operation completes; a no-op once complete.
  void wait();
  // Progresses the operation; true once complete.
  bool test();
  bool done() const { return op_ == nullptr; }
  // Gives the operation up without waiting: for a rank unwinding from an error, whose peers
  // may never send, receive or join what is pending (waiting could then deadlock every rank).
  // A receive not yet matched is cancelled and never writes its buffer; anything else still
  // in flight is left to the process's end (as AsyncCheckpointer leaves its agreement): its
  // buffers may still be read or written, and the communicator may hold its stray messages,
  // so end the job rather than communicate on; the caller must then keep them allocated. Returns
  // false in that case, true when nothing is left in flight. Afterwards done() is true.
  bool abandon() noexcept;

 private:
  void finish_quietly() noexcept;
  std::unique_ptr<detail::PendingOp> op_;
};

// Waits for every request, even when one fails; then rethrows the first failure.
void wait_all(std::span<Request> requests);
// Tests the requests in order up to the first still pending; true when all are complete.
// Testing one pending request drives the backend's progress for all (MPI moves
// non-blocking operations only inside MPI calls), so call it between long computations.
bool test_all(std::span<Request> requests);
// Request::abandon on each; true when none was left in flight (their buffers may be freed).
bool abandon_all(std::span<Request> requests) noexcept;

class Communicator;
// Collective: true on every rank iff `mine` is true on every rank (so all ranks take the
// same branch after a step that may fail on some of them).
bool all_agree(Communicator& group, bool mine);

// ---------------------------------------------------------------------------
// Traffic counters.

// One counter per collective kind. Variants count under their base kind
// (all_gatherv under all_gather, all_to_allv under all_to_all); blocking and
// non-blocking forms count alike. `send` counts point-to-point sends.
struct TrafficCounts {
  uint64_t all_reduce = 0;
  uint64_t reduce_scatter = 0;
  uint64_t all_gather = 0;
  uint64_t all_to_all = 0;
  uint64_t broadcast = 0;
  uint64_t send = 0;
  uint64_t total() const;
  bool operator==(const TrafficCounts&) const = default;
};

// bytes: the size of this rank's send buffer in each call: all_reduce the whole
// buffer; reduce_scatter the whole input (size() blocks); all_gather(v) this rank's
// block; all_to_all(v) everything it sends, its own block included; broadcast the
// buffer on the root and 0 elsewhere; send the message. Receives count nothing.
// calls: the number of such calls this rank made (receives and barriers excluded; a call
// rejected with an Error counts nothing).
struct Traffic {
  TrafficCounts bytes;
  TrafficCounts calls;
};

// ---------------------------------------------------------------------------

class Communicator {
 public:
  virtual ~Communicator() = default;
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string_view backend() const = 0;  // "mpi" or "single"

  // Splits into sub-groups, collectively: ranks passing the same color form one
  // group, ordered by key (ties by rank in this communicator). A negative color
  // takes no part and gets nullptr. The new communicator has its own traffic counters.
  std::unique_ptr<Communicator> split(int color, int key);

  // Terminates every process of the job with `exit_code` (use on a fatal error on one
  // rank so the others do not hang in a collective).
  [[noreturn]] virtual void abort(int exit_code) = 0;

  const Traffic& traffic() const { return traffic_; }
  void reset_traffic() { traffic_ = Traffic{}; }

  // ---- untyped calls; `count` and `block_count` are in elements of `type` ----

  // data[count]: in place, every rank gets the element-wise reduction over ranks.
  void all_reduce(void* data, size_t count, ElemType type, ReduceOp op);
  // send[size() * block_count] -> recv[block_count]: rank r gets block r of the
  // element-wise reduction.
  void reduce_scatter(const void* send, void* recv, size_t block_count, ElemType type, ReduceOp op);
  // send[block_count] -> recv[size() * block_count], block r from rank r. `send` may be
  // this rank's own block inside recv (in place).
  void all_gather(const void* send, void* recv, size_t block_count, ElemType type);
  // send[recv_counts[rank()]] -> recv[sum of recv_counts], rank r's block packed at
  // displacement recv_counts[0] + ... + recv_counts[r-1]. `send` may be this rank's
  // own block inside recv (in place).
  void all_gatherv(const void* send, void* recv, std::span<const size_t> recv_counts,
                   ElemType type);
  // send[size() * block_count] -> recv[size() * block_count]: block d of send goes to
  // rank d, block s of recv comes from rank s.
  void all_to_all(const void* send, void* recv, size_t block_count, ElemType type);
  // send_counts[d] elements at send + send_displs[d] go to rank d; recv_counts[s]
  // elements from rank s land at recv + recv_displs[s]. All spans have size() entries;
  // send_counts[d] on this rank must equal recv_counts[this rank] on rank d. The blocks'
  // extents in send and in recv must not overlap.
  void all_to_allv(const void* send, std::span<const size_t> send_counts,
                   std::span<const size_t> send_displs, void* recv,
                   std::span<const size_t> recv_counts, std::span<const size_t> recv_displs,
                   ElemType type);
  // data[count]: root's values overwrite everyone's.
  void broadcast(void* data, size_t count, ElemType type, int root);
  // data[count] to rank `dest`, matched by `tag` (>= 0) and order, like MPI.
  void send(const void* data, size_t count, ElemType type, int dest, int tag);
  // data[count] from rank `source`; the message must have exactly `count` elements.
  void recv(void* data, size_t count, ElemType type, int source, int tag);
  void barrier();

  // Non-blocking forms, same arguments; the result is ready once the Request completes.
  Request iall_reduce(void* data, size_t count, ElemType type, ReduceOp op);
  Request ireduce_scatter(const void* send, void* recv, size_t block_count, ElemType type,
                          ReduceOp op);
  Request iall_gather(const void* send, void* recv, size_t block_count, ElemType type);
  Request iall_gatherv(const void* send, void* recv, std::span<const size_t> recv_counts,
                       ElemType type);
  Request iall_to_all(const void* send, void* recv, size_t block_count, ElemType type);
  Request iall_to_allv(const void* send, std::span<const size_t> send_counts,
                       std::span<const size_t> send_displs, void* recv,
                       std::span<const size_t> recv_counts, std::span<const size_t> recv_displs,
                       ElemType type);
  Request ibroadcast(void* data, size_t count, ElemType type, int root);
  Request isend(const void* data, size_t count, ElemType type, int dest, int tag);
  Request irecv(void* data, size_t count, ElemType type, int source, int tag);
  Request ibarrier();

  // ---- typed calls over contiguous ranges; sizes are checked ----

  template <OutBuffer R>
  void all_reduce(R&& data, ReduceOp op = ReduceOp::sum) {
    all_reduce(std::ranges::data(data), std::ranges::size(data), elem_type_of<buffer_elem_t<R>>(),
               op);
  }
  template <OutBuffer R>
  requires LastingBuffer<R> Request iall_reduce(R&& data, ReduceOp op = ReduceOp::sum) {
    return iall_reduce(std::ranges::data(data), std::ranges::size(data),
                       elem_type_of<buffer_elem_t<R>>(), op);
  }

  // send[size() * n] -> recv[n].
  template <InBuffer S, OutBuffer R>
  requires SameElement<S, R>
  void reduce_scatter(const S& send, R&& recv, ReduceOp op = ReduceOp::sum) {
    check_blocks(std::ranges::size(send), std::ranges::size(recv), "reduce_scatter");
    reduce_scatter(std::ranges::data(send), std::ranges::data(recv), std::ranges::size(recv),
                   elem_type_of<buffer_elem_t<R>>(), op);
  }
  template <InBuffer S, OutBuffer R>
  requires SameElement<S, R> && LastingBuffer<S> && LastingBuffer<R> Request
  ireduce_scatter(S&& send, R&& recv, ReduceOp op = ReduceOp::sum) {
    check_blocks(std::ranges::size(send), std::ranges::size(recv), "ireduce_scatter");
    return ireduce_scatter(std::ranges::data(send), std::ranges::data(recv),
                           std::ranges::size(recv), elem_type_of<buffer_elem_t<R>>(), op);
  }

  // send[n] -> recv[size() * n].
  template <InBuffer S, OutBuffer R>
  requires SameElement<S, R>
  void all_gather(const S& send, R&& recv) {
    check_blocks(std::ranges::size(recv), std::ranges::size(send), "all_gather");
    all_gather(std::ranges::data(send), std::ranges::data(recv), std::ranges::size(send),
               elem_type_of<buffer_elem_t<R>>());
  }
  template <InBuffer S, OutBuffer R>
  requires SameElement<S, R> && LastingBuffer<S> && LastingBuffer<R> Request iall_gather(S&& send,
                                                                                         R&& recv) {
    check_blocks(std::ranges::size(recv), std::ranges::size(send), "iall_gather");
    return iall_gather(std::ranges::data(send), std::ranges::data(recv), std::ranges::size(send),
                       elem_type_of<buffer_elem_t<R>>());
  }

  // send[recv_counts[rank()]] -> recv[sum of recv_counts].
  template <InBuffer S, OutBuffer R>
  requires SameElement<S, R>
  void all_gatherv(const S& send, R&& recv, std::span<const size_t> recv_counts) {
    check_gatherv(std::ranges::size(send), std::ranges::size(recv), recv_counts, "all_gatherv");
    all_gatherv(std::ranges::data(send), std::ranges::data(recv), recv_counts,
                elem_type_of<buffer_elem_t<R>>());
  }
  template <InBuffer S, OutBuffer R>
  requires SameElement<S, R> && LastingBuffer<S> && LastingBuffer<R> Request
  iall_gatherv(S&& send, R&& recv, std::span<const size_t> recv_counts) {
    check_gatherv(std::ranges::size(send), std::ranges::size(recv), recv_counts, "iall_gatherv");
    return iall_gatherv(std::ranges::data(send), std::ranges::data(recv), recv_counts,
                        elem_type_of<buffer_elem_t<R>>());
  }

  // send[size() * n] -> recv[size() * n].
  template <InBuffer S, OutBuffer R>
  requires SameElement<S, R>
  void all_to_all(const S& send, R&& recv) {
    all_to_all(std::ranges::data(send), std::ranges::data(recv),
               check_all_to_all(std::ranges::size(send), std::ranges::size(recv), "all_to_all"),
               elem_type_of<buffer_elem_t<R>>());
  }
  template <InBuffer S, OutBuffer R>
  requires SameElement<S, R> && LastingBuffer<S> && LastingBuffer<R> Request iall_to_all(S&& send,
                                                                                         R&& recv) {
    return iall_to_all(
        std::ranges::data(send), std::ranges::data(recv),
        check_all_to_all(std::ranges::size(send), std::ranges::size(recv), "iall_to_all"),
        elem_type_of<buffer_elem_t<R>>());
  }

  // Every count/displacement pair must lie inside its buffer.
  template <InBuffer S, OutBuffer R>
  requires SameElement<S, R>
  void all_to_allv(const S& send, std::span<const size_t> send_counts,
                   std::span<const size_t> send_displs, R&& recv,
                   std::span<const size_t> recv_counts, std::span<const size_t> recv_displs) {
    check_all_to_allv(std::ranges::size(send), send_counts, send_displs, std::ranges::size(recv),
                      recv_counts, recv_displs, "all_to_allv");
    all_to_allv(std::ranges::data(send), send_counts, send_displs, std::ranges::data(recv),
                recv_counts, recv_displs, elem_type_of<buffer_elem_t<R>>());
  }
  template <InBuffer S, OutBuffer R>
  requires SameElement<S, R> && LastingBuffer<S> && LastingBuffer<R> Request
  iall_to_allv(S&& send, std::span<const size_t> send_counts, std::span<const size_t> send_displs,
               R&& recv, std::span<const size_t> recv_counts, std::span<const size_t> recv_displs) {
    check_all_to_allv(std::ranges::size(send), send_counts, send_displs, std::ranges::size(recv),
                      recv_counts, recv_displs, "iall_to_allv");
    return iall_to_allv(std::ranges::data(send), send_counts, send_displs, std::ranges::data(recv),
                        recv_counts, recv_displs, elem_type_of<buffer_elem_t<R>>());
  }

  template <OutBuffer R>
  void broadcast(R&& data, int root) {
    broadcast(std::ranges::data(data), std::ranges::size(data), elem_type_of<buffer_elem_t<R>>(),
              root);
  }
  template <OutBuffer R>
  requires LastingBuffer<R> Request ibroadcast(R&& data, int root) {
    return ibroadcast(std::ranges::data(data), std::ranges::size(data),
                      elem_type_of<buffer_elem_t<R>>(), root);
  }

  template <InBuffer S>
  void send(const S& data, int dest, int tag) {
    send(std::ranges::data(data), std::ranges::size(data), elem_type_of<buffer_elem_t<S>>(), dest,
         tag);
  }
  template <InBuffer S>
  requires LastingBuffer<S> Request isend(S&& data, int dest, int tag) {
    return isend(std::ranges::data(data), std::ranges::size(data), elem_type_of<buffer_elem_t<S>>(),
                 dest, tag);
  }
  template <OutBuffer R>
  void recv(R&& data, int source, int tag) {
    recv(std::ranges::data(data), std::ranges::size(data), elem_type_of<buffer_elem_t<R>>(), source,
         tag);
  }
  template <OutBuffer R>
  requires LastingBuffer<R> Request irecv(R&& data, int source, int tag) {
    return irecv(std::ranges::data(data), std::ranges::size(data), elem_type_of<buffer_elem_t<R>>(),
                 source, tag);
  }

 protected:
  Communicator() = default;

  // Whether a backend call must complete before returning (kBlocking; the returned
  // Request is then complete) or may return a pending Request.
  enum class Mode : uint8_t { kBlocking, kNonBlocking };

  // Backend hooks. Arguments are validated before these run (spans have size() entries);
  // traffic is counted once they return, as a backend may still reject a call.
  virtual std::unique_ptr<Communicator> do_split(int color, int key) = 0;
  virtual Request do_all_reduce(void* data, size_t count, ElemType type, ReduceOp op,
                                Mode mode) = 0;
  virtual Request do_reduce_scatter(const void* send, void* recv, size_t block_count, ElemType type,
                                    ReduceOp op, Mode mode) = 0;
  virtual Request do_all_gather(const void* send, void* recv, size_t block_count, ElemType type,
                                Mode mode) = 0;
  virtual Request do_all_gatherv(const void* send, void* recv, std::span<const size_t> recv_counts,
                                 ElemType type, Mode mode) = 0;
  virtual Request do_all_to_all(const void* send, void* recv, size_t block_count, ElemType type,
                                Mode mode) = 0;
  virtual Request do_all_to_allv(const void* send, std::span<const size_t> send_counts,
                                 std::span<const size_t> send_displs, void* recv,
                                 std::span<const size_t> recv_counts,
                                 std::span<const size_t> recv_displs, ElemType type, Mode mode) = 0;
  virtual Request do_broadcast(void* data, size_t count, ElemType type, int root, Mode mode) = 0;
  virtual Request do_send(const void* data, size_t count, ElemType type, int dest, int tag,
                          Mode mode) = 0;
  virtual Request do_recv(void* data, size_t count, ElemType type, int source, int tag,
                          Mode mode) = 0;
  virtual Request do_barrier(Mode mode) = 0;

 private:
  // Shared front ends of the blocking and non-blocking forms: validate, dispatch, count.
  Request start_all_reduce(void* data, size_t count, ElemType type, ReduceOp op, Mode mode);
  Request start_reduce_scatter(const void* send, void* recv, size_t block_count, ElemType type,
                               ReduceOp op, Mode mode);
  Request start_all_gather(const void* send, void* recv, size_t block_count, ElemType type,
                           Mode mode);
  Request start_all_gatherv(const void* send, void* recv, std::span<const size_t> recv_counts,
                            ElemType type, Mode mode);
  Request start_all_to_all(const void* send, void* recv, size_t block_count, ElemType type,
                           Mode mode);
  Request start_all_to_allv(const void* send, std::span<const size_t> send_counts,
                            std::span<const size_t> send_displs, void* recv,
                            std::span<const size_t> recv_counts,
                            std::span<const size_t> recv_displs, ElemType type, Mode mode);
  Request start_broadcast(void* data, size_t count, ElemType type, int root, Mode mode);
  Request start_send(const void* data, size_t count, ElemType type, int dest, int tag, Mode mode);
  Request start_recv(void* data, size_t count, ElemType type, int source, int tag, Mode mode);
  // Counts a call of `kind` sending `bytes` that the backend has `started`; returns it.
  Request counted(uint64_t TrafficCounts::*kind, uint64_t bytes, Request started);

  // Size checks of the typed forms; each throws tessel::Error naming `call`.
  void check_blocks(size_t whole, size_t block, const char* call) const;
  size_t check_all_to_all(size_t send, size_t recv, const char* call) const;
  void check_gatherv(size_t send, size_t recv, std::span<const size_t> recv_counts,
                     const char* call) const;
  void check_all_to_allv_spans(std::span<const size_t> send_counts,
                               std::span<const size_t> send_displs,
                               std::span<const size_t> recv_counts,
                               std::span<const size_t> recv_displs, const char* call) const;
  void check_all_to_allv(size_t send, std::span<const size_t> send_counts,
                         std::span<const size_t> send_displs, size_t recv,
                         std::span<const size_t> recv_counts, std::span<const size_t> recv_displs,
                         const char* call) const;

  Traffic traffic_;
};

}  // namespace tessel::comm
