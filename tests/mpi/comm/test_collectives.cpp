// Every collective, blocking and non-blocking, on the MPI world against closed
// forms computed locally. Inputs are small integers in every element type, so all
// results are exact (tolerance 0, in floating point too).
#include <gtest/gtest.h>

#include <bit>
#include <cstring>
#include <vector>

#include "tessel/comm/world.hpp"
#include "tessel/core/rng.hpp"

using namespace tessel;
using namespace tessel::comm;

namespace {

template <class T>
class Reducible : public ::testing::Test {};
using ReducibleTypes = ::testing::Types<float, double, int32_t, int64_t, uint8_t>;
TYPED_TEST_SUITE(Reducible, ReducibleTypes);

template <class T>
class Movable : public ::testing::Test {};
using MovableTypes = ::testing::Types<float, double, int32_t, int64_t, uint8_t, uint16_t>;
TYPED_TEST_SUITE(Movable, MovableTypes);

// Rank r contributes x_r[i] = r + 2 i; over N ranks:
//   sum = N (N - 1) / 2 + 2 i N,  max = N - 1 + 2 i,  min = 2 i.
int reduced(ReduceOp op, int n, int i) {
  switch (op) {
    case ReduceOp::sum:
      return n * (n - 1) / 2 + 2 * i * n;
    case ReduceOp::max:
      return n - 1 + 2 * i;
    case ReduceOp::min:
      return 2 * i;
  }
  return -1;
}

constexpr ReduceOp kOps[] = {ReduceOp::sum, ReduceOp::max, ReduceOp::min};

// all_gatherv counts with a zero: 1, 0, 2, 1, ...
size_t gatherv_count(int r) {
  return size_t((2 * r + 1) % 3);
}
// all_to_allv count from rank s to rank d (zeros included).
size_t a2av_count(int s, int d) {
  return size_t((s + d) % 3);
}

}  // namespace

TYPED_TEST(Reducible, AllReduce) {
  using T = TypeParam;
  Communicator& comm = world();
  const int n = comm.size(), r = comm.rank();
  for (ReduceOp op : kOps) {
    for (bool blocking : {true, false}) {
      std::vector<T> x(7);
      for (int i = 0; i < 7; ++i) x[size_t(i)] = T(r + 2 * i);
      if (blocking)
        comm.all_reduce(x, op);
      else
        comm.iall_reduce(x, op).wait();
      for (int i = 0; i < 7; ++i)
        EXPECT_EQ(x[size_t(i)], T(reduced(op, n, i))) << reduce_op_name(op) << " i=" << i;
    }
  }
}

// Rank r sends s[j] = r + j for j < N B; rank q receives block q of the reduction:
//   sum = N (N - 1) / 2 + N (q B + k),  max = N - 1 + q B + k,  min = q B + k.
TYPED_TEST(Reducible, ReduceScatter) {
  using T = TypeParam;
  Communicator& comm = world();
  const int n = comm.size(), r = comm.rank(), b = 3;
  std::vector<T> send(size_t(n * b));
  for (int j = 0; j < n * b; ++j) send[size_t(j)] = T(r + j);
  for (ReduceOp op : kOps) {
    for (bool blocking : {true, false}) {
      std::vector<T> recv(static_cast<size_t>(b));
      if (blocking)
        comm.reduce_scatter(send, recv, op);
      else
        comm.ireduce_scatter(send, recv, op).wait();
      for (int k = 0; k < b; ++k) {
        const int j = r * b + k;
        const int expect = op == ReduceOp::sum   ? n * (n - 1) / 2 + n * j
                           : op == ReduceOp::max ? n - 1 + j
                                                 : j;
        EXPECT_EQ(recv[size_t(k)], T(expect)) << reduce_op_name(op) << " k=" << k;
      }
    }
  }
}

// Block k of rank s is 10 s + k.
TYPED_TEST(Movable, AllGatherAndInPlace) {
  using T = TypeParam;
  Communicator& comm = world();
  const int n = comm.size(), r = comm.rank(), b = 3;
  std::vector<T> send(static_cast<size_t>(b));
  for (int k = 0; k < b; ++k) send[size_t(k)] = T(10 * r + k);
  for (int form = 0; form < 3; ++form) {  // blocking, non-blocking, in place
    std::vector<T> recv(size_t(n * b), T(0));
    if (form == 0) comm.all_gather(send, recv);
    if (form == 1) comm.iall_gather(send, recv).wait();
    if (form == 2) {
      std::copy(send.begin(), send.end(), recv.begin() + r * b);
      comm.all_gather(std::span(recv).subspan(size_t(r * b), size_t(b)), recv);
    }
    for (int s = 0; s < n; ++s)
      for (int k = 0; k < b; ++k)
        EXPECT_EQ(recv[size_t(s * b + k)], T(10 * s + k)) << "form " << form;
  }
}

TYPED_TEST(Movable, AllGathervUnevenCounts) {
  using T = TypeParam;
  Communicator& comm = world();
  const int n = comm.size(), r = comm.rank();
  std::vector<size_t> counts(static_cast<size_t>(n));
  for (int s = 0; s < n; ++s) counts[size_t(s)] = gatherv_count(s);
  const std::vector<size_t> displs = packed_displacements(counts);
  const size_t total = displs.back() + counts.back();
  std::vector<T> send(counts[size_t(r)]);
  for (size_t k = 0; k < send.size(); ++k) send[k] = T(10 * r + int(k));
  for (int form = 0; form < 3; ++form) {  // blocking, non-blocking, in place
    std::vector<T> recv(total, T(0));
    if (form == 0) comm.all_gatherv(send, recv, counts);
    if (form == 1) comm.iall_gatherv(send, recv, counts).wait();
    if (form == 2) {
      std::copy(send.begin(), send.end(), recv.begin() + ptrdiff_t(displs[size_t(r)]));
      comm.all_gatherv(std::span(recv).subspan(displs[size_t(r)], send.size()), recv, counts);
    }
    for (int s = 0; s < n; ++s)
      for (size_t k = 0; k < counts[size_t(s)]; ++k)
        EXPECT_EQ(recv[displs[size_t(s)] + k], T(10 * s + int(k))) << "form " << form;
  }
}

// Rank s sends block d, element k = 20 s + 5 d + k; rank r receives block s = 20 s + 5 r + k.
TYPED_TEST(Movable, AllToAll) {
  using T = TypeParam;
  Communicator& comm = world();
  const int n = comm.size(), r = comm.rank(), b = 2;
  std::vector<T> send(size_t(n * b));
  for (int d = 0; d < n; ++d)
    for (int k = 0; k < b; ++k) send[size_t(d * b + k)] = T(20 * r + 5 * d + k);
  for (bool blocking : {true, false}) {
    std::vector<T> recv(size_t(n * b), T(0));
    if (blocking)
      comm.all_to_all(send, recv);
    else
      comm.iall_to_all(send, recv).wait();
    for (int s = 0; s < n; ++s)
      for (int k = 0; k < b; ++k) EXPECT_EQ(recv[size_t(s * b + k)], T(20 * s + 5 * r + k));
  }
}

// Uneven counts (zeros included), packed sends, receives with one-element gaps that
// must stay untouched (sentinel 200).
TYPED_TEST(Movable, AllToAllvUnevenWithGaps) {
  using T = TypeParam;
  Communicator& comm = world();
  const int n = comm.size(), r = comm.rank();
  std::vector<size_t> send_counts(static_cast<size_t>(n)), recv_counts(static_cast<size_t>(n)),
      recv_displs(static_cast<size_t>(n));
  size_t recv_total = 0;
  for (int p = 0; p < n; ++p) {
    send_counts[size_t(p)] = a2av_count(r, p);
    recv_counts[size_t(p)] = a2av_count(p, r);
    recv_displs[size_t(p)] = recv_total + 1;  // a gap before every block
    recv_total += recv_counts[size_t(p)] + 1;
  }
  const std::vector<size_t> send_displs = packed_displacements(send_counts);
  std::vector<T> send(send_displs.back() + send_counts.back());
  for (int d = 0; d < n; ++d)
    for (size_t k = 0; k < send_counts[size_t(d)]; ++k)
      send[send_displs[size_t(d)] + k] = T(20 * r + 5 * d + int(k));
  for (bool blocking : {true, false}) {
    std::vector<T> recv(recv_total, T(200));
    if (blocking)
      comm.all_to_allv(send, send_counts, send_displs, recv, recv_counts, recv_displs);
    else
      comm.iall_to_allv(send, send_counts, send_displs, recv, recv_counts, recv_displs).wait();
    std::vector<T> expect(recv_total, T(200));
    for (int s = 0; s < n; ++s)
      for (size_t k = 0; k < recv_counts[size_t(s)]; ++k)
        expect[recv_displs[size_t(s)] + k] = T(20 * s + 5 * r + int(k));
    EXPECT_EQ(recv, expect);
  }
}

TYPED_TEST(Movable, BroadcastFromEveryRoot) {
  using T = TypeParam;
  Communicator& comm = world();
  for (int root = 0; root < comm.size(); ++root) {
    for (bool blocking : {true, false}) {
      std::vector<T> data(5, T(0));
      if (comm.rank() == root)
        for (int i = 0; i < 5; ++i) data[size_t(i)] = T(10 * root + i + 1);
      if (blocking)
        comm.broadcast(data, root);
      else
        comm.ibroadcast(data, root).wait();
      for (int i = 0; i < 5; ++i) EXPECT_EQ(data[size_t(i)], T(10 * root + i + 1));
    }
  }
}

// Several non-blocking collectives in flight at once, polled with test(), then wait_all.
TEST(NonBlocking, ManyInFlightThenWaitAll) {
  Communicator& comm = world();
  const int n = comm.size(), r = comm.rank();
  std::vector<int32_t> summed(4, r), rs_send(size_t(2 * n), r + 1), rs_recv(2);
  std::vector<int64_t> gathered(static_cast<size_t>(n)), mine{int64_t(r) * 3};
  std::vector<double> bcast(3, r == 0 ? 2.5 : 0.0);
  std::vector<Request> requests;
  requests.push_back(comm.iall_reduce(summed));
  requests.push_back(comm.ireduce_scatter(rs_send, rs_recv));
  requests.push_back(comm.iall_gather(mine, gathered));
  requests.push_back(comm.ibroadcast(bcast, 0));
  requests.push_back(comm.ibarrier());
  // Progress by polling one request; the others complete in wait_all.
  while (!requests[0].test()) {
  }
  EXPECT_TRUE(requests[0].done());
  wait_all(requests);
  for (const Request& q : requests) EXPECT_TRUE(q.done());
  for (int32_t v : summed) EXPECT_EQ(v, n * (n - 1) / 2);
  for (int32_t v : rs_recv) EXPECT_EQ(v, n * (n + 1) / 2);
  for (int s = 0; s < n; ++s) EXPECT_EQ(gathered[size_t(s)], 3 * s);
  EXPECT_EQ(bcast, (std::vector<double>{2.5, 2.5, 2.5}));
}

TEST(NonBlocking, DestroyingAPendingRequestWaits) {
  Communicator& comm = world();
  std::vector<float> x(1000, 1.0f);
  { Request pending = comm.iall_reduce(x); }  // waits here
  for (float v : x) EXPECT_EQ(v, float(comm.size()));
  // Assigning over a pending request completes it first.
  std::vector<int32_t> a(8, 1), b(8, 2);
  Request q = comm.iall_reduce(a);
  q = comm.iall_reduce(b);
  for (int32_t v : a) EXPECT_EQ(v, comm.size());
  q.wait();
  for (int32_t v : b) EXPECT_EQ(v, 2 * comm.size());
}

// Determinism: a float sum of random values repeats bitwise and is the same bits on
// every rank, for each call form.
TEST(Determinism, FloatAllReduceRepeatsBitwiseOnEveryRank) {
  Communicator& comm = world();
  const size_t len = 4097;  // odd, not a multiple of the world size
  std::vector<float> input(len);
  Rng rng(1234 + uint64_t(comm.rank()));
  rng.fill_normal(input.data(), int64_t(len), 0.0f, 1.0f);
  for (bool blocking : {true, false}) {
    std::vector<float> first = input, second = input;
    if (blocking) {
      comm.all_reduce(first);
      comm.all_reduce(second);
    } else {
      comm.iall_reduce(first).wait();
      comm.iall_reduce(second).wait();
    }
    EXPECT_EQ(std::memcmp(first.data(), second.data(), len * sizeof(float)), 0);
    std::vector<float> everyone(len * size_t(comm.size()));
    comm.all_gather(first, everyone);
    for (int s = 0; s < comm.size(); ++s)
      EXPECT_EQ(std::memcmp(everyone.data() + size_t(s) * len, first.data(), len * sizeof(float)),
                0)
          << "rank " << s << " differs";
  }
}

TEST(Barrier, BlockingAndNonBlocking) {
  Communicator& comm = world();
  comm.barrier();
  comm.ibarrier().wait();
  SUCCEED();
}
