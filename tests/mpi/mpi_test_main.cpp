// Main of every MPI test binary (run under mpirun with 2 and 4 ranks).
//
// Rank 0 prints the normal gtest output; every other rank prints only its failed
// assertions, each line prefixed with "[rank r]". After the tests the ranks
// exchange their results and every rank exits non-zero if any rank failed.
//
// Tests run in the same order on every rank. A test must make the same
// collective calls on every rank even when its checks fail: prefer EXPECT_* to
// ASSERT_* before a collective, or one rank leaves while the others wait.
#include <gtest/gtest.h>

#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "tessel/comm/world.hpp"

namespace {

class RankFailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit RankFailurePrinter(int rank) : rank_(rank) {}

  void OnTestStart(const ::testing::TestInfo& info) override {
    test_ = std::string(info.test_suite_name()) + "." + info.name();
  }

  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::ostringstream out;
    out << "[rank " << rank_ << "] " << test_ << ": "
        << (result.file_name() ? result.file_name() : "unknown file") << ":" << result.line_number()
        << ": Failure\n";
    std::istringstream message(result.message());
    for (std::string line; std::getline(message, line);)
      out << "[rank " << rank_ << "] " << line << "\n";
    std::fputs(out.str().c_str(), stderr);
    std::fflush(stderr);
  }

 private:
  int rank_;
  std::string test_;
};

}  // namespace

int main(int argc, char** argv) {
  tessel::comm::CommGuard guard = tessel::comm::init_communication(&argc, &argv);
  tessel::comm::Communicator& world = guard.world();
  ::testing::InitGoogleTest(&argc, argv);

  ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (world.rank() != 0) {
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(world.rank()));
  }

  const int32_t failed = RUN_ALL_TESTS() != 0 ? 1 : 0;
  std::vector<int32_t> failed_by_rank(size_t(world.size()));
  world.all_gather(std::span(&failed, 1), failed_by_rank);

  std::string failed_ranks;
  for (int r = 0; r < world.size(); ++r)
    if (failed_by_rank[size_t(r)]) failed_ranks += " " + std::to_string(r);
  if (failed_ranks.empty()) return 0;
  if (world.rank() == 0)
    std::fprintf(stderr, "[mpi_test_main] tests failed on rank(s)%s of %d\n", failed_ranks.c_str(),
                 world.size());
  return 1;
}
