// init_communication outside a launcher gives the single-process world; an MPI without
// MPI_THREAD_SERIALIZED is refused.
#include <gtest/gtest.h>
#include <mpi.h>
#include <sys/wait.h>

#include <cstdio>
#include <cstdlib>

#include "tessel/comm/world.hpp"

using namespace tessel;
using namespace tessel::comm;

TEST(World, SingleProcessWithoutLauncher) {
  EXPECT_THROW(world(), Error);
  {
    CommGuard guard = init_communication(nullptr, nullptr);
    EXPECT_EQ(guard.world().backend(), "single");
    EXPECT_EQ(world().size(), 1);
    EXPECT_EQ(&guard.world(), &world());
    EXPECT_THROW((void)init_communication(nullptr, nullptr), Error);
    CommGuard moved = std::move(guard);  // the moved-from guard finalizes nothing
    EXPECT_EQ(world().rank(), 0);
  }
  EXPECT_THROW(world(), Error);
  CommGuard again = init_communication(nullptr, nullptr);
  EXPECT_EQ(world().size(), 1);
}

// MPI initialized before init_communication with a lower thread level than world.hpp promises
// (in a child process, as MPI can be initialized only once): refused with an Error, not used.
TEST(WorldDeathTest, RefusesMpiWithoutSerializedThreads) {
  EXPECT_EXIT(
      {
        int provided = 0;
        MPI_Init_thread(nullptr, nullptr, MPI_THREAD_SINGLE, &provided);
        if (provided >= MPI_THREAD_SERIALIZED) {  // this MPI cannot show the refusal
          std::fprintf(stderr, "MPI granted more than asked\n");
          std::_Exit(4);
        }
        try {
          CommGuard guard = init_communication(nullptr, nullptr);
        } catch (const Error& e) {
          std::fprintf(stderr, "%s\n", e.what());
          MPI_Finalize();
          std::_Exit(3);
        }
        std::_Exit(1);
      },
      [](int status) {
        return WIFEXITED(status) && (WEXITSTATUS(status) == 3 || WEXITSTATUS(status) == 4);
      },
      "tessel needs MPI_THREAD_SERIALIZED|MPI granted more than asked");
}
