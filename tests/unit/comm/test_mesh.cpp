// Mesh shape validation (any world size, no MPI needed) and a mesh on one process.
#include <gtest/gtest.h>

#include "tessel/comm/mesh.hpp"
#include "tessel/comm/single_communicator.hpp"

using namespace tessel;
using namespace tessel::comm;

namespace {
std::string validation_message(MeshShape shape, int world_size) {
  try {
    shape.validate(world_size);
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(MeshShape, AcceptsMatchingWorlds) {
  EXPECT_NO_THROW((MeshShape{}.validate(1)));
  EXPECT_NO_THROW((MeshShape{.dp = 4}.validate(4)));
  EXPECT_NO_THROW((MeshShape{.pp = 2, .dp = 2}.validate(4)));
  EXPECT_NO_THROW((MeshShape{.pp = 2, .dp = 4, .cp = 2, .ep = 4}.validate(16)));
  EXPECT_EQ((MeshShape{.pp = 2, .dp = 3, .cp = 5}.world_size()), 30);
}

TEST(MeshShape, WrongWorldSizeIsOneLineInputError) {
  EXPECT_EQ(validation_message(MeshShape{.dp = 3}, 4),
            "mesh pp=1 x dp=3 x cp=1 needs 3 processes but the world has 4 (set parallel.pp, "
            "parallel.dp and parallel.cp so that their product is 4)");
  EXPECT_EQ(validation_message(MeshShape{.pp = 2, .dp = 2, .cp = 2}, 4),
            "mesh pp=2 x dp=2 x cp=2 needs 8 processes but the world has 4 (set parallel.pp, "
            "parallel.dp and parallel.cp so that their product is 4)");
}

TEST(MeshShape, EpMustDivideDpAndDegreesArePositive) {
  EXPECT_EQ(validation_message(MeshShape{.dp = 4, .ep = 3}, 4),
            "mesh parallel.ep = 3 must divide parallel.dp = 4 (expert parallelism is folded "
            "inside data parallelism)");
  EXPECT_EQ(validation_message(MeshShape{.dp = 0}, 0), "mesh degree parallel.dp = 0 must be >= 1");
  EXPECT_EQ(validation_message(MeshShape{.ep = -2}, 1),
            "mesh degree parallel.ep = -2 must be >= 1");
}

TEST(Mesh, SingleProcessGroupsAreTrivial) {
  SingleCommunicator world;
  Mesh mesh = Mesh::build(world, MeshShape{});
  EXPECT_EQ(&mesh.world(), &world);
  for (int a = 0; a < kNumAxes; ++a) {
    const Axis axis = Axis(a);
    EXPECT_EQ(mesh.group(axis).size(), 1) << axis_name(axis);
    EXPECT_EQ(mesh.coordinate(axis), 0) << axis_name(axis);
    EXPECT_EQ(mesh.size(axis), 1) << axis_name(axis);
  }
  EXPECT_THROW(Mesh::build(world, MeshShape{.dp = 2}), InputError);
}
