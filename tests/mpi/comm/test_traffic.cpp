// Traffic counters on the MPI world: exact bytes of this rank's send buffer per kind.
#include <gtest/gtest.h>

#include <climits>
#include <vector>

#include "tessel/comm/world.hpp"

using namespace tessel;
using namespace tessel::comm;

TEST(Traffic, CountsEveryKindExactly) {
  Communicator& comm = world();
  const int n = comm.size(), r = comm.rank();
  const uint64_t un = uint64_t(n);
  comm.reset_traffic();

  std::vector<float> ar(10, 1.0f);
  comm.all_reduce(ar);  // 40 bytes
  comm.iall_reduce(ar).wait();

  std::vector<double> rs_send(3 * un), rs_recv(3);
  comm.reduce_scatter(rs_send, rs_recv);  // 3 N x 8 bytes

  std::vector<int32_t> ag_send(2), ag_recv(2 * un);
  comm.all_gather(ag_send, ag_recv);  // 8 bytes
  std::vector<size_t> counts(un);
  for (int s = 0; s < n; ++s) counts[size_t(s)] = size_t(s + 1);
  std::vector<int32_t> agv_send(size_t(r + 1)), agv_recv(un * (un + 1) / 2);
  comm.iall_gatherv(agv_send, agv_recv, counts).wait();  // (r + 1) x 4 bytes

  std::vector<int64_t> a2a_send(2 * un), a2a_recv(2 * un);
  comm.all_to_all(a2a_send, a2a_recv);  // 2 N x 8 bytes
  // Equal counts of 3 elements each way; displacements packed.
  const std::vector<size_t> three(un, 3), displs = packed_displacements(three);
  std::vector<uint8_t> a2av_send(3 * un), a2av_recv(3 * un);
  comm.all_to_allv(a2av_send, three, displs, a2av_recv, three, displs);  // 3 N bytes

  std::vector<float> bc(5);
  comm.broadcast(bc, 0);  // 20 bytes on the root only

  std::vector<uint16_t> msg(7), in(7);
  std::vector<Request> ring;
  ring.push_back(comm.irecv(in, (r + n - 1) % n, 0));
  ring.push_back(comm.isend(msg, (r + 1) % n, 0));  // 14 bytes
  wait_all(ring);
  comm.barrier();

  const Traffic t = comm.traffic();
  EXPECT_EQ(t.bytes, (TrafficCounts{.all_reduce = 80,
                                    .reduce_scatter = 24 * un,
                                    .all_gather = 8 + 4 * uint64_t(r + 1),
                                    .all_to_all = 16 * un + 3 * un,
                                    .broadcast = r == 0 ? 20u : 0u,
                                    .send = 14}));
  EXPECT_EQ(t.calls, (TrafficCounts{.all_reduce = 2,
                                    .reduce_scatter = 1,
                                    .all_gather = 2,
                                    .all_to_all = 2,
                                    .broadcast = 1,
                                    .send = 1}));

  // Split communicators count on their own; the parent is unchanged by them.
  auto sub = comm.split(0, r);
  sub->all_reduce(ar);
  EXPECT_EQ(sub->traffic().bytes.all_reduce, 40u);
  EXPECT_EQ(comm.traffic().bytes, t.bytes);

  comm.reset_traffic();
  EXPECT_EQ(comm.traffic().bytes, TrafficCounts{});
  EXPECT_EQ(comm.traffic().calls, TrafficCounts{});
}

// The backend refuses counts past MPI's int before touching a buffer; a refused call counts
// nothing.
TEST(Traffic, ARefusedCallCountsNothing) {
  Communicator& comm = world();
  comm.reset_traffic();
  uint8_t byte = 0;
  const size_t too_many = size_t(INT_MAX) + 1;
  EXPECT_THROW(comm.all_reduce(&byte, too_many, ElemType::u8, ReduceOp::max), Error);
  EXPECT_THROW(comm.broadcast(&byte, too_many, ElemType::u8, 0), Error);
  EXPECT_THROW(comm.isend(&byte, too_many, ElemType::u8, 0, 0), Error);
  EXPECT_EQ(comm.traffic().bytes, TrafficCounts{});
  EXPECT_EQ(comm.traffic().calls, TrafficCounts{});
}
