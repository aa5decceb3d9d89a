// init_communication outside a launcher gives the single-process world.
#include <gtest/gtest.h>

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
