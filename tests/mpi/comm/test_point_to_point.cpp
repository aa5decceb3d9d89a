// send/recv and isend/irecv between MPI ranks; exact integer payloads.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>
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
  const int r = comm.rank(), partner = r ^ 1;
  if (partner >= comm.size()) return;  // an odd world's last rank has no partner
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

// An abandoned receive is cancelled at once, though no message has come: it returns without
// waiting, and the message sent afterwards goes to the next matching receive, never into the
// abandoned buffer.
TEST(PointToPoint, AbandonedReceiveIsCancelled) {
  auto comm = world().split(0, world().rank());
  ASSERT_NE(comm, nullptr);
  std::vector<int32_t> abandoned(2, -1), got(2, -1);
  if (comm->rank() == 0) {
    Request r = comm->irecv(abandoned, 1, 9);
    r.abandon();
    EXPECT_TRUE(r.done());
  }
  comm->barrier();
  if (comm->rank() == 1) comm->send(std::vector<int32_t>{7, 8}, 0, 9);
  if (comm->rank() == 0) {
    // Polled, not waited for: were the abandoned receive still posted, it would take the
    // message and this one would never complete.
    Request next = comm->irecv(got, 1, 9);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
    while (!next.test() && abandoned[0] == -1 && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    EXPECT_EQ(abandoned, (std::vector<int32_t>{-1, -1}));
    EXPECT_TRUE(next.done());
    if (next.done()) {
      EXPECT_EQ(got, (std::vector<int32_t>{7, 8}));
    }
    next.abandon();
  }
  // A completed request abandons as a no-op.
  Request done;
  done.abandon();
  EXPECT_TRUE(done.done());
}
