#include "tessel/comm/single_communicator.hpp"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>

namespace tessel::comm {

namespace detail {
struct PostedRecv {
  void* data;
  size_t count;
  ElemType type;
  int tag;
  bool done = false;
  // The communicator's list holding it until matched; null once the communicator is gone.
  std::deque<std::shared_ptr<PostedRecv>>* posted = nullptr;
};
}  // namespace detail

namespace {

// memmove: an in-place all_gather copies a block onto itself.
void copy(void* dst, const void* src, size_t bytes) {
  if (bytes > 0) std::memmove(dst, src, bytes);
}

std::byte* at(void* base, size_t elems, ElemType type) {
  return static_cast<std::byte*>(base) + elems * elem_size(type);
}
const std::byte* at(const void* base, size_t elems, ElemType type) {
  return static_cast<const std::byte*>(base) + elems * elem_size(type);
}

void check_match(int tag, size_t sent_count, ElemType sent_type, size_t recv_count,
                 ElemType recv_type) {
  TESSEL_CHECK(sent_count == recv_count && sent_type == recv_type,
               "single-process communicator: message with tag ", tag, " has ", sent_count, " ",
               elem_type_name(sent_type), " elements but the receive expects ", recv_count, " ",
               elem_type_name(recv_type));
}

[[noreturn]] void no_matching_send(int tag) {
  throw Error(
      tessel::detail::concat("single-process communicator: receive with tag ", tag,
                             " has no matching send; with one process no message can arrive "
                             "later"));
}

class PendingRecv final : public detail::PendingOp {
 public:
  explicit PendingRecv(std::shared_ptr<detail::PostedRecv> posted) : posted_(std::move(posted)) {}
  ~PendingRecv() override { cancel(); }
  void wait() override {
    if (!posted_->done) no_matching_send(posted_->tag);
  }
  bool test() override { return posted_->done; }
  // Unmatched: leaves the communicator's list at once, so no send writes to its buffer.
  bool cancel() noexcept override {
    if (!posted_->done && posted_->posted)
      std::erase(*std::exchange(posted_->posted, nullptr), posted_);
    return true;
  }

 private:
  std::shared_ptr<detail::PostedRecv> posted_;
};

}  // namespace

SingleCommunicator::~SingleCommunicator() {
  for (auto& posted : posted_) posted->posted = nullptr;  // their Requests may outlive it
}

void SingleCommunicator::abort(int exit_code) {
  std::fflush(nullptr);
  std::_Exit(exit_code);
}

std::unique_ptr<Communicator> SingleCommunicator::do_split(int color, int key) {
  if (color < 0) return nullptr;
  return std::make_unique<SingleCommunicator>();
}

Request SingleCommunicator::do_all_reduce(void* data, size_t count, ElemType type, ReduceOp op,
                                          Mode mode) {
  return {};  // the reduction over one rank is the data itself
}

Request SingleCommunicator::do_reduce_scatter(const void* send, void* recv, size_t block_count,
                                              ElemType type, ReduceOp op, Mode mode) {
  copy(recv, send, block_count * elem_size(type));
  return {};
}

Request SingleCommunicator::do_all_gather(const void* send, void* recv, size_t block_count,
                                          ElemType type, Mode mode) {
  copy(recv, send, block_count * elem_size(type));
  return {};
}

Request SingleCommunicator::do_all_gatherv(const void* send, void* recv,
                                           std::span<const size_t> recv_counts, ElemType type,
                                           Mode mode) {
  copy(recv, send, recv_counts[0] * elem_size(type));
  return {};
}

Request SingleCommunicator::do_all_to_all(const void* send, void* recv, size_t block_count,
                                          ElemType type, Mode mode) {
  copy(recv, send, block_count * elem_size(type));
  return {};
}

Request SingleCommunicator::do_all_to_allv(const void* send, std::span<const size_t> send_counts,
                                           std::span<const size_t> send_displs, void* recv,
                                           std::span<const size_t> recv_counts,
                                           std::span<const size_t> recv_displs, ElemType type,
                                           Mode mode) {
  TESSEL_CHECK(send_counts[0] == recv_counts[0], "all_to_allv: rank 0 sends ", send_counts[0],
               " elements to itself but expects to receive ", recv_counts[0]);
  copy(at(recv, recv_displs[0], type), at(send, send_displs[0], type),
       send_counts[0] * elem_size(type));
  return {};
}

Request SingleCommunicator::do_broadcast(void* data, size_t count, ElemType type, int root,
                                         Mode mode) {
  return {};  // the root's buffer is everyone's
}

Request SingleCommunicator::do_send(const void* data, size_t count, ElemType type, int dest,
                                    int tag, Mode mode) {
  for (auto it = posted_.begin(); it != posted_.end(); ++it) {
    detail::PostedRecv& posted = **it;
    if (posted.tag != tag) continue;
    check_match(tag, count, type, posted.count, posted.type);
    copy(posted.data, data, count * elem_size(type));
    posted.done = true;
    posted.posted = nullptr;
    posted_.erase(it);
    return {};
  }
  const auto* bytes = static_cast<const std::byte*>(data);
  queued_.push_back(Message{{bytes, bytes + count * elem_size(type)}, count, type, tag});
  return {};
}

Request SingleCommunicator::do_recv(void* data, size_t count, ElemType type, int source, int tag,
                                    Mode mode) {
  for (auto it = queued_.begin(); it != queued_.end(); ++it) {
    if (it->tag != tag) continue;
    check_match(tag, it->count, it->type, count, type);
    copy(data, it->bytes.data(), it->bytes.size());
    queued_.erase(it);
    return {};
  }
  if (mode == Mode::kBlocking) no_matching_send(tag);
  auto posted = std::make_shared<detail::PostedRecv>(
      detail::PostedRecv{data, count, type, tag, false, &posted_});
  posted_.push_back(posted);
  return Request(std::make_unique<PendingRecv>(std::move(posted)));
}

Request SingleCommunicator::do_barrier(Mode mode) {
  return {};
}

}  // namespace tessel::comm
