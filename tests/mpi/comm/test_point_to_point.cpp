// send/recv and isend/irecv between MPI ranks; exact integer payloads.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "tessel/comm/world.hpp"

using namespace tessel;
using namespace tessel::comm;

TEST(PointToPoint, RingWithIsendIrecv) {
  Communicator& comm = world();
  const int n = comm.size(), r = comm.rank();
  const int next = (r + 1) % n, prev = (r + n - 1) % n;
  std::vector<int64_t> out(6), in(6, -1);
  for (int i = 0; i < 6; ++i) out[size_t(i)] = 100 * r + i;
  std::vector<Request> requests;
  requests.push_back(comm.irecv(in, prev, 3));
  requests.push_back(comm.isend(out, next, 3));
  wait_all(requests);
  for (int i = 0; i < 6; ++i) EXPECT_EQ(in[size_t(i)], 100 * prev + i);
}

TEST(PointToPoint, BlockingPairs) {
  Communicator& comm = world();
  const int r = comm.rank(), partner = r ^ 1;  // world sizes are even
  std::vector<double> out{double(r) + 0.5, double(r) * 2}, in(2, -1.0);
  if (r % 2 == 0) {
    comm.send(out, partner, 0);
    comm.recv(in, partner, 0);
  } else {
    comm.recv(in, partner, 0);
    comm.send(out, partner, 0);
  }
  EXPECT_EQ(in, (std::vector<double>{partner + 0.5, partner * 2.0}));
}

// Rank 0 sends tags 1 then 2; rank 1 receives tag 2 first.
TEST(PointToPoint, MatchesByTag) {
  Communicator& comm = world();
  if (comm.rank() == 0) {
    std::vector<int32_t> a{1, 1}, b{2, 2, 2};
    Request ra = comm.isend(a, 1, 1);
    Request rb = comm.isend(b, 1, 2);
    ra.wait();
    rb.wait();
  } else if (comm.rank() == 1) {
    std::vector<int32_t> a(2), b(3);
    comm.recv(b, 0, 2);
    comm.recv(a, 0, 1);
    EXPECT_EQ(a, (std::vector<int32_t>{1, 1}));
    EXPECT_EQ(b, (std::vector<int32_t>{2, 2, 2}));
  }
  comm.barrier();
}

// Errors on a split copy of the world so the world stays clean.
TEST(PointToPoint, CountMismatchAndMpiErrorsBecomeErrors) {
  auto comm = world().split(0, world().rank());
  ASSERT_NE(comm, nullptr);
  if (comm->rank() == 0) {
    comm->send(std::vector<uint8_t>{1, 2, 3}, 1, 5);
    comm->send(std::vector<uint8_t>{4, 5, 6}, 1, 6);
  } else if (comm->rank() == 1) {
    std::vector<uint8_t> larger(4), smaller(2);
    try {
      comm->recv(larger, 0, 5);
      ADD_FAILURE() << "receiving 3 elements into 4 must throw";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("expected 4 elements but the message has 3"),
                std::string::npos)
          << e.what();
    }
    try {
      comm->recv(smaller, 0, 6);
      ADD_FAILURE() << "receiving 3 elements into 2 must throw";
    } catch (const Error& e) {
      // MPI_ERR_TRUNCATE, with MPI's own error string.
      EXPECT_NE(std::string(e.what()).find("MPI_Recv failed: "), std::string::npos) << e.what();
      EXPECT_NE(std::string(e.what()).find("truncat"), std::string::npos) << e.what();
    }
  }
  comm->barrier();
}
