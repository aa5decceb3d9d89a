#include <gtest/gtest.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <thread>

#include "tessel/train/ett.hpp"
#include "tessel/train/fault.hpp"

using namespace tessel::train;

namespace {

// Builds rank 0's injector for attempt 0 with `kill_seconds`, gives its timer 100 ms, and
// exits 0 unless it fired (SIGKILL); a resumed attempt is told its step first.
[[noreturn]] void arm_and_wait(const char* kill_seconds, int64_t resumed_from = -1,
                               int wait_ms = 100) {
  FaultConfig c;
  c.kill_seconds = kill_seconds;
  FaultInjector injector(c, /*attempt=*/0, /*rank=*/0, /*ledger_path=*/"", monotonic_ns());
  if (resumed_from >= 0) injector.starts_from(resumed_from);
  std::this_thread::sleep_for(std::chrono::milliseconds(wait_ms));
  std::_Exit(0);
}

}  // namespace

// A deadline longer than the attempt never fires, however long: 1e10 s is 1e19 ns, past int64,
// which once wrapped to a deadline already passed and killed the attempt at once.
TEST(FaultInjector, AKillDeadlineBeyondTheClockNeverFires) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");  // the injector's timer is a thread
  for (const char* seconds : {"1e10", "9.3e9", "1e300", "1e9"})
    EXPECT_EXIT(arm_and_wait(seconds), testing::ExitedWithCode(0), "") << seconds;
  // The control: a deadline inside the wait fires.
  EXPECT_EXIT(arm_and_wait("0.001"), testing::KilledBySignal(SIGKILL), "kill_after_seconds");
}

// A kill before a resumed attempt's first update reports the step it resumed from as done
// (the ETT report's failure_step), not 0.
TEST(FaultInjector, AKillBeforeAResumedAttemptsFirstStepNamesTheResumedStep) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(arm_and_wait("1", /*resumed_from=*/7, /*wait_ms=*/4000),
              testing::KilledBySignal(SIGKILL), "kill_after_seconds, 7 steps done");
}
