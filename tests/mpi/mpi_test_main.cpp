// Main of every MPI test binary (run under mpirun with 2 and 4 ranks; comm and parallel also 3).
//
// Rank 0 prints the normal gtest output; every other rank prints only its failed
// assertions, each line prefixed with "[rank r]". After each test the ranks
// exchange its outcome, and rank 0 names the ranks where it failed. Every rank
// exits non-zero if any rank failed.
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

using tessel::comm::Communicator;

// " 1 3": the ranks whose flag is set.
std::string flagged_ranks(Communicator& world, bool flag) {
  const int32_t mine = flag ? 1 : 0;
  std::vector<int32_t> flags(size_t(world.size()));
  world.all_gather(std::span(&mine, 1), flags);
  std::string ranks;
  for (int r = 0; r < world.size(); ++r)
    if (flags[size_t(r)]) ranks.append(" ").append(std::to_string(r));
  return ranks;
}

// On ranks other than 0: prints failed assertions, prefixed with the rank.
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

// On every rank: after each test, collects on which ranks it failed; rank 0 reports.
class CrossRankResults : public ::testing::EmptyTestEventListener {
 public:
  explicit CrossRankResults(Communicator& world) : world_(world) {}

  void OnTestEnd(const ::testing::TestInfo& info) override {
    const std::string ranks = flagged_ranks(world_, info.result()->Failed());
    if (ranks.empty()) return;
    const std::string name = std::string(info.test_suite_name()) + "." + info.name();
    failed_.push_back(name + " (rank" + ranks + ")");
    if (world_.rank() == 0) {
      std::fflush(stdout);
      std::printf("[mpi_test_main] %s failed on rank(s)%s\n", name.c_str(), ranks.c_str());
      std::fflush(stdout);
    }
  }

  const std::vector<std::string>& failed() const { return failed_; }

 private:
  Communicator& world_;
  std::vector<std::string> failed_;
};

}  // namespace

int main(int argc, char** argv) {
  tessel::comm::CommGuard guard = tessel::comm::init_communication(&argc, &argv);
  Communicator& world = guard.world();
  ::testing::InitGoogleTest(&argc, argv);

  ::testing::TestEventListeners& listeners = ::testing::UnitTest::GetInstance()->listeners();
  if (world.rank() != 0) {
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new RankFailurePrinter(world.rank()));
  }
  auto* results = new CrossRankResults(world);  // owned by gtest
  listeners.Append(results);

  const bool failed_here = RUN_ALL_TESTS() != 0;
  const std::string failed_ranks = flagged_ranks(world, failed_here);
  if (failed_ranks.empty()) return 0;
  if (world.rank() == 0) {
    std::fflush(stdout);
    std::printf("[mpi_test_main] FAILED on rank(s)%s of %d\n", failed_ranks.c_str(), world.size());
    for (const std::string& test : results->failed())
      std::printf("[mpi_test_main]   %s\n", test.c_str());
    std::fflush(stdout);
  }
  return 1;
}
