// SingleCommunicator: every collective is a copy from send to receive buffer;
// point-to-point to self matches through a queue. All comparisons are exact
// (pure copies, no arithmetic).
#include <gtest/gtest.h>

#include <numeric>
#include <span>
#include <utility>
#include <vector>

#include "tessel/comm/single_communicator.hpp"

using namespace tessel;
using namespace tessel::comm;

namespace {

template <class T>
std::vector<T> iota(size_t n, int start) {
  std::vector<T> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = T(start + int(i));
  return v;
}

template <class T>
class SingleTyped : public ::testing::Test {};
using ElementTypes = ::testing::Types<float, double, int32_t, int64_t, uint8_t, uint16_t>;
TYPED_TEST_SUITE(SingleTyped, ElementTypes);

}  // namespace

TEST(ElemType, SizesNamesAndMapping) {
  EXPECT_EQ(elem_size(ElemType::f32), 4u);
  EXPECT_EQ(elem_size(ElemType::f64), 8u);
  EXPECT_EQ(elem_size(ElemType::i32), 4u);
  EXPECT_EQ(elem_size(ElemType::i64), 8u);
  EXPECT_EQ(elem_size(ElemType::u8), 1u);
  EXPECT_EQ(elem_size(ElemType::bf16), 2u);
  EXPECT_STREQ(elem_type_name(ElemType::i64), "i64");
  static_assert(elem_type_of<float>() == ElemType::f32);
  static_assert(elem_type_of<uint16_t>() == ElemType::bf16);
  EXPECT_EQ(elem_type(DType::f32), ElemType::f32);
  EXPECT_EQ(elem_type(DType::bf16), ElemType::bf16);
  EXPECT_EQ(elem_type(DType::i32), ElemType::i32);
  EXPECT_EQ(packed_displacements(std::vector<size_t>{3, 0, 2, 5}),
            (std::vector<size_t>{0, 3, 3, 5}));
}

TEST(Single, IdentityAndSplit) {
  SingleCommunicator comm;
  EXPECT_EQ(comm.rank(), 0);
  EXPECT_EQ(comm.size(), 1);
  EXPECT_EQ(comm.backend(), "single");
  auto sub = comm.split(3, 7);
  ASSERT_NE(sub, nullptr);
  EXPECT_EQ(sub->size(), 1);
  EXPECT_EQ(comm.split(-1, 0), nullptr);
}

TYPED_TEST(SingleTyped, CollectivesCopy) {
  using T = TypeParam;
  SingleCommunicator comm;
  const std::vector<T> src = iota<T>(5, 3);

  if constexpr (!std::is_same_v<T, uint16_t>) {  // bf16 cannot be reduced
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::max, ReduceOp::min}) {
      std::vector<T> data = src;
      comm.all_reduce(data, op);
      EXPECT_EQ(data, src);
      comm.iall_reduce(data, op).wait();
      EXPECT_EQ(data, src);
      std::vector<T> out(5);
      comm.reduce_scatter(src, out, op);
      EXPECT_EQ(out, src);
      std::vector<T> iout(5);
      comm.ireduce_scatter(src, iout, op).wait();
      EXPECT_EQ(iout, src);
    }
  }

  std::vector<T> gathered(5), igathered(5);
  comm.all_gather(src, gathered);
  comm.iall_gather(src, igathered).wait();
  EXPECT_EQ(gathered, src);
  EXPECT_EQ(igathered, src);

  const std::vector<size_t> counts{5};
  std::vector<T> gatheredv(5), igatheredv(5);
  comm.all_gatherv(src, gatheredv, counts);
  comm.iall_gatherv(src, igatheredv, counts).wait();
  EXPECT_EQ(gatheredv, src);
  EXPECT_EQ(igatheredv, src);

  std::vector<T> exchanged(5), iexchanged(5);
  comm.all_to_all(src, exchanged);
  comm.iall_to_all(src, iexchanged).wait();
  EXPECT_EQ(exchanged, src);
  EXPECT_EQ(iexchanged, src);

  // Three elements from send offset 1 land at recv offset 2; the rest of recv stays.
  const std::vector<size_t> n{3}, send_displ{1}, recv_displ{2};
  for (bool blocking : {true, false}) {
    std::vector<T> recv(6, T(0));
    if (blocking)
      comm.all_to_allv(src, n, send_displ, recv, n, recv_displ);
    else
      comm.iall_to_allv(src, n, send_displ, recv, n, recv_displ).wait();
    EXPECT_EQ(recv, (std::vector<T>{T(0), T(0), src[1], src[2], src[3], T(0)}));
  }

  std::vector<T> data = src;
  comm.broadcast(data, 0);
  comm.ibroadcast(data, 0).wait();
  EXPECT_EQ(data, src);
  comm.barrier();
  comm.ibarrier().wait();
}

TEST(Single, AllGatherInPlace) {
  SingleCommunicator comm;
  std::vector<int32_t> buf = iota<int32_t>(4, 1);
  comm.all_gather(buf.data(), buf.data(), 4, ElemType::i32);
  EXPECT_EQ(buf, iota<int32_t>(4, 1));
  comm.all_gatherv(std::span(buf), buf, std::vector<size_t>{4});
  EXPECT_EQ(buf, iota<int32_t>(4, 1));
}

TEST(Single, RejectsBadArguments) {
  SingleCommunicator comm;
  std::vector<float> a(4), b(4), c(3);
  std::vector<uint16_t> half(4);
  EXPECT_THROW(comm.all_reduce(half), Error);      // bf16 reduction
  EXPECT_THROW(comm.reduce_scatter(a, c), Error);  // 4 != 1 x 3
  EXPECT_THROW(comm.reduce_scatter(a.data(), a.data(), 4, ElemType::f32, ReduceOp::sum),
               Error);                                                             // overlap
  EXPECT_THROW(comm.all_gather(a, c), Error);                                      // 3 != 1 x 4
  EXPECT_THROW(comm.all_gather(a.data(), a.data() + 1, 2, ElemType::f32), Error);  // overlap
  EXPECT_THROW(comm.all_gatherv(a, b, std::vector<size_t>{4, 0}), Error);          // 2 counts
  EXPECT_THROW(comm.all_gatherv(a, b, std::vector<size_t>{3}), Error);             // send != count
  EXPECT_THROW(comm.all_to_all(a, c), Error);                                      // sizes differ
  const std::vector<size_t> four{4}, three{3}, zero{0}, one{1};
  EXPECT_THROW(comm.all_to_allv(a, four, zero, b, three, zero), Error);  // self counts differ
  EXPECT_THROW(comm.all_to_allv(a, four, one, b, four, zero), Error);    // past send end
  // The untyped form checks what it can without buffer sizes too: span sizes, overlap.
  EXPECT_THROW(comm.all_to_allv(a.data(), four, zero, a.data() + 2, four, zero, ElemType::f32),
               Error);
  EXPECT_THROW(comm.all_to_allv(a.data(), std::vector<size_t>{4, 0}, zero, b.data(), four, zero,
                                ElemType::f32),
               Error);
  EXPECT_THROW(comm.broadcast(a, 1), Error);
  EXPECT_THROW(comm.send(a, 1, 0), Error);
  EXPECT_THROW(comm.send(a, 0, -1), Error);
  EXPECT_THROW(comm.recv(a, -1, 0), Error);
}

// The non-blocking typed forms take lvalues and views, whose memory outlives the call, and
// refuse temporaries that own their elements (MPI would go on using freed memory); the
// blocking forms take both. Each kX<B>: whether X takes a buffer of type B (B&& forwarded) in
// one of its buffer positions. A failing static_assert fails the build.
using Counts = std::span<const size_t>;
template <class B>
constexpr bool kIsend = requires(Communicator& c, B&& b) {
  c.isend(std::forward<B>(b), 0, 0);
};
template <class B>
constexpr bool kIrecv = requires(Communicator& c, B&& b) {
  c.irecv(std::forward<B>(b), 0, 0);
};
template <class B>
constexpr bool kIallReduce = requires(Communicator& c, B&& b) {
  c.iall_reduce(std::forward<B>(b));
};
template <class B>
constexpr bool kIbroadcast = requires(Communicator& c, B&& b) {
  c.ibroadcast(std::forward<B>(b), 0);
};
template <class B>
constexpr bool kIallGatherSend = requires(Communicator& c, B&& b, std::vector<float>& v) {
  c.iall_gather(std::forward<B>(b), v);
};
template <class B>
constexpr bool kIallGatherRecv = requires(Communicator& c, B&& b, std::vector<float>& v) {
  c.iall_gather(v, std::forward<B>(b));
};
template <class B>
constexpr bool kIreduceScatter = requires(Communicator& c, B&& b, std::vector<float>& v) {
  c.ireduce_scatter(std::forward<B>(b), v);
};
template <class B>
constexpr bool kIallGathervRecv = requires(Communicator& c, B&& b, std::vector<float>& v,
                                           Counts n) {
  c.iall_gatherv(v, std::forward<B>(b), n);
};
template <class B>
constexpr bool kIallToAllRecv = requires(Communicator& c, B&& b, std::vector<float>& v) {
  c.iall_to_all(v, std::forward<B>(b));
};
template <class B>
constexpr bool kIallToAllvSend = requires(Communicator& c, B&& b, std::vector<float>& v, Counts n) {
  c.iall_to_allv(std::forward<B>(b), n, n, v, n, n);
};
template <class B>
constexpr bool kEveryNonBlockingForm =
    kIsend<B>&& kIrecv<B>&& kIallReduce<B>&& kIbroadcast<B>&& kIallGatherSend<B>&& kIallGatherRecv<
        B>&& kIreduceScatter<B>&& kIallGathervRecv<B>&& kIallToAllRecv<B>&& kIallToAllvSend<B>;
template <class B>
constexpr bool kAnyNonBlockingForm =
    kIsend<B> || kIrecv<B> || kIallReduce<B> || kIbroadcast<B> || kIallGatherSend<B> ||
    kIallGatherRecv<B> || kIreduceScatter<B> || kIallGathervRecv<B> || kIallToAllRecv<B> ||
    kIallToAllvSend<B>;
template <class B>
constexpr bool kBlockingSendAndReduce = requires(Communicator& c, B&& b) {
  c.send(std::forward<B>(b), 0, 0);
  c.all_reduce(std::forward<B>(b));
};
static_assert(kEveryNonBlockingForm<std::vector<float>&>);
static_assert(kEveryNonBlockingForm<std::span<float>>);
static_assert(!kAnyNonBlockingForm<std::vector<float>>);
static_assert(kBlockingSendAndReduce<std::vector<float>>);

TEST(Single, SendRecvToSelfMatchesByTagInOrder) {
  SingleCommunicator comm;
  comm.send(std::vector<int32_t>{1, 2}, 0, 7);
  comm.send(std::vector<int32_t>{3, 4}, 0, 9);
  std::vector<int32_t> five_six{5, 6};
  Request queued = comm.isend(five_six, 0, 7);
  five_six.assign(2, 0);  // a queued copy: the buffer is free once isend returns
  queued.wait();
  std::vector<int32_t> got(2);
  comm.recv(got, 0, 9);
  EXPECT_EQ(got, (std::vector<int32_t>{3, 4}));
  comm.recv(got, 0, 7);
  EXPECT_EQ(got, (std::vector<int32_t>{1, 2}));
  comm.irecv(got, 0, 7).wait();
  EXPECT_EQ(got, (std::vector<int32_t>{5, 6}));
}

TEST(Single, PostedIrecvCompletesOnSend) {
  SingleCommunicator comm;
  std::vector<double> got(3, 0.0);
  Request r = comm.irecv(got, 0, 1);
  EXPECT_FALSE(r.test());
  comm.send(std::vector<double>{1.5, 2.5, 3.5}, 0, 1);
  EXPECT_TRUE(r.test());
  EXPECT_TRUE(r.done());
  EXPECT_EQ(got, (std::vector<double>{1.5, 2.5, 3.5}));
}

TEST(Single, UnmatchedReceivesThrow) {
  SingleCommunicator comm;
  std::vector<float> got(2);
  EXPECT_THROW(comm.recv(got, 0, 4), Error);
  Request r = comm.irecv(got, 0, 4);
  EXPECT_THROW(r.wait(), Error);
  EXPECT_TRUE(r.done());  // a failed request is over
  {
    // Dropped unmatched: its buffer must never be written afterwards.
    std::vector<float> dropped(2, -1.0f);
    Request pending = comm.irecv(dropped, 0, 5);
  }
  comm.send(std::vector<float>{8, 9}, 0, 5);  // queued, not written into `dropped`
  comm.recv(got, 0, 5);
  EXPECT_EQ(got, (std::vector<float>{8, 9}));
  // Abandoned unmatched: the same, without waiting (or complaining).
  std::vector<float> abandoned(2, -1.0f);
  Request given_up = comm.irecv(abandoned, 0, 5);
  given_up.abandon();
  EXPECT_TRUE(given_up.done());
  comm.send(std::vector<float>{6, 7}, 0, 5);
  EXPECT_EQ(abandoned, (std::vector<float>{-1, -1}));
  comm.recv(got, 0, 5);
  EXPECT_EQ(got, (std::vector<float>{6, 7}));
  comm.send(std::vector<float>{1, 2, 3}, 0, 6);
  EXPECT_THROW(comm.recv(got, 0, 6), Error);  // 3 elements into 2
}

// A receive given up leaves the posted list at once, wherever it stands in it, so posting and
// dropping receives does not pile them up.
TEST(Single, DroppedReceivesLeaveAtOnce) {
  SingleCommunicator comm;
  std::vector<int32_t> kept(1, 0), dropped(1, 0);
  Request r = comm.irecv(kept, 0, 7);
  for (int i = 0; i < 3; ++i) {
    Request gone = comm.irecv(dropped, 0, 5);
    EXPECT_FALSE(gone.test());
    gone.abandon();
  }
  EXPECT_EQ(comm.posted_receives(), 1u);
  comm.send(std::vector<int32_t>{3}, 0, 7);  // matches the first posted, in front of the others
  EXPECT_TRUE(r.test());
  EXPECT_EQ(kept[0], 3);
  EXPECT_EQ(comm.posted_receives(), 0u);
  {
    Request destroyed = comm.irecv(dropped, 0, 6);
    EXPECT_EQ(comm.posted_receives(), 1u);
  }  // (prints that no send matched it)
  EXPECT_EQ(comm.posted_receives(), 0u);
  // A Request outliving its communicator is harmless.
  Request orphan;
  {
    SingleCommunicator gone;
    orphan = gone.irecv(dropped, 0, 1);
  }
  orphan.abandon();
  EXPECT_EQ(dropped[0], 0);
}

TEST(Request, MoveWaitAllAndDefault) {
  SingleCommunicator comm;
  Request empty;
  EXPECT_TRUE(empty.done());
  EXPECT_TRUE(empty.test());
  empty.wait();

  std::vector<int64_t> a(1, 0), b(1, 0);
  std::vector<Request> requests;
  requests.push_back(comm.irecv(a, 0, 1));
  requests.push_back(comm.irecv(b, 0, 2));
  Request moved = std::move(requests[0]);
  EXPECT_TRUE(requests[0].done());
  EXPECT_FALSE(moved.done());
  requests[0] = std::move(moved);
  comm.send(std::vector<int64_t>{11}, 0, 2);
  comm.send(std::vector<int64_t>{10}, 0, 1);
  wait_all(requests);
  EXPECT_EQ(a[0], 10);
  EXPECT_EQ(b[0], 11);

  // wait_all waits for every request and rethrows the first failure.
  std::vector<int64_t> c(1, 0);
  std::vector<Request> mixed;
  mixed.push_back(comm.irecv(a, 0, 3));  // never matched
  mixed.push_back(comm.irecv(c, 0, 4));
  comm.send(std::vector<int64_t>{12}, 0, 4);
  EXPECT_THROW(wait_all(mixed), Error);
  EXPECT_TRUE(mixed[0].done() && mixed[1].done());
  EXPECT_EQ(c[0], 12);
}

TEST(Traffic, CountsSendBufferBytesPerKind) {
  SingleCommunicator comm;
  std::vector<float> f(6), g(6);
  std::vector<int64_t> l(3), m(3);
  comm.all_reduce(f);          // 6 x 4 bytes
  comm.iall_reduce(l).wait();  // 3 x 8 bytes
  comm.reduce_scatter(f, g);   // the whole input: 24 bytes
  comm.all_gather(l, m);       // own block: 24 bytes
  comm.all_gatherv(l, m, std::vector<size_t>{3});
  comm.all_to_all(f, g);  // everything sent: 24 bytes
  const std::vector<size_t> two{2}, one{1}, zero{0};
  comm.iall_to_allv(f, two, zero, g, two, zero).wait();  // 8 bytes
  comm.broadcast(l, 0);                                  // the root's buffer: 24 bytes
  comm.send(f, 0, 0);                                    // 24 bytes
  comm.recv(g, 0, 0);                                    // receives count nothing
  comm.barrier();

  const Traffic& t = comm.traffic();
  EXPECT_EQ(t.bytes, (TrafficCounts{.all_reduce = 48,
                                    .reduce_scatter = 24,
                                    .all_gather = 48,
                                    .all_to_all = 32,
                                    .broadcast = 24,
                                    .send = 24}));
  EXPECT_EQ(t.calls, (TrafficCounts{.all_reduce = 2,
                                    .reduce_scatter = 1,
                                    .all_gather = 2,
                                    .all_to_all = 2,
                                    .broadcast = 1,
                                    .send = 1}));
  EXPECT_EQ(t.bytes.total(), 48u + 24 + 48 + 32 + 24 + 24);

  // A split communicator counts on its own.
  auto sub = comm.split(0, 0);
  sub->all_reduce(f);
  EXPECT_EQ(sub->traffic().bytes.all_reduce, 24u);
  EXPECT_EQ(comm.traffic().bytes.all_reduce, 48u);

  comm.reset_traffic();
  EXPECT_EQ(comm.traffic().bytes, TrafficCounts{});
  EXPECT_EQ(comm.traffic().calls, TrafficCounts{});

  // A call the backend refuses counts nothing (here: rank 0 sends itself 2 but expects 1).
  EXPECT_THROW(comm.all_to_allv(f, two, zero, g, one, zero), Error);
  EXPECT_EQ(comm.traffic().bytes, TrafficCounts{});
  EXPECT_EQ(comm.traffic().calls, TrafficCounts{});
}
