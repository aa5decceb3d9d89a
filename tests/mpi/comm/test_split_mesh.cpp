// split() sub-groups and Mesh axis groups on the MPI world, against membership
// computed from the documented rank layout.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <string>
#include <vector>

#include "tessel/comm/mesh.hpp"
#include "tessel/comm/world.hpp"

using namespace tessel;
using namespace tessel::comm;

namespace {

std::vector<int32_t> gather_world_ranks(Communicator& group) {
  std::vector<int32_t> mine{world().rank()}, all(size_t(group.size()));
  group.all_gather(mine, all);
  return all;
}

// A world rank's coordinates, decoded from rank = (p dp + d) cp + c, d = b ep + e.
struct Coords {
  int p, d, c, e, b;
};
Coords decode(int rank, const MeshShape& s) {
  Coords k;
  k.c = rank % s.cp;
  k.d = (rank / s.cp) % s.dp;
  k.p = rank / (s.cp * s.dp);
  k.e = k.d % s.ep;
  k.b = k.d / s.ep;
  return k;
}

int coordinate(const Coords& k, Axis axis, const MeshShape& s) {
  switch (axis) {
    case Axis::pp:
      return k.p;
    case Axis::dp:
      return k.d;
    case Axis::cp:
      return k.c;
    case Axis::ep:
      return k.e;
    case Axis::edp:
      return k.b;
    case Axis::dp_cp:
      return k.d * s.cp + k.c;
    case Axis::edp_cp:
      return k.b * s.cp + k.c;
  }
  return -1;
}

// Two ranks share a group of `axis` when they agree on every other coordinate.
bool same_group(const Coords& a, const Coords& b, Axis axis) {
  switch (axis) {
    case Axis::pp:
      return a.d == b.d && a.c == b.c;
    case Axis::dp:
      return a.p == b.p && a.c == b.c;
    case Axis::cp:
      return a.p == b.p && a.d == b.d;
    case Axis::ep:
      return a.p == b.p && a.c == b.c && a.b == b.b;
    case Axis::edp:
      return a.p == b.p && a.c == b.c && a.e == b.e;
    case Axis::dp_cp:
      return a.p == b.p;
    case Axis::edp_cp:
      return a.p == b.p && a.e == b.e;
  }
  return false;
}

// Members of this rank's group on `axis`, ordered by their coordinate on it.
std::vector<int32_t> expected_members(const MeshShape& s, int rank, Axis axis) {
  const Coords me = decode(rank, s);
  std::vector<int32_t> members;
  for (int q = 0; q < s.world_size(); ++q)
    if (same_group(decode(q, s), me, axis)) members.push_back(q);
  std::stable_sort(members.begin(), members.end(), [&](int32_t a, int32_t b) {
    return coordinate(decode(a, s), axis, s) < coordinate(decode(b, s), axis, s);
  });
  return members;
}

std::string describe(const MeshShape& s) {
  return "pp=" + std::to_string(s.pp) + " dp=" + std::to_string(s.dp) +
         " cp=" + std::to_string(s.cp) + " ep=" + std::to_string(s.ep);
}

}  // namespace

TEST(Split, ParityGroupsOrderedByKey) {
  Communicator& w = world();
  const int n = w.size(), r = w.rank();
  auto sub = w.split(r % 2, -r);  // reverse order inside each group
  ASSERT_NE(sub, nullptr);
  std::vector<int32_t> expect;
  for (int q = n - 1; q >= 0; --q)
    if (q % 2 == r % 2) expect.push_back(q);
  EXPECT_EQ(sub->size(), int(expect.size()));
  EXPECT_EQ(gather_world_ranks(*sub), expect);
  EXPECT_EQ(expect[size_t(sub->rank())], r);
  std::vector<int64_t> sum{r};
  sub->all_reduce(sum);
  int64_t expect_sum = 0;
  for (int32_t q : expect) expect_sum += q;
  EXPECT_EQ(sum[0], expect_sum);
}

TEST(Split, NegativeColorOptsOut) {
  Communicator& w = world();
  auto sub = w.split(w.rank() == 0 ? -1 : 4, w.rank());
  if (w.rank() == 0) {
    EXPECT_EQ(sub, nullptr);
  } else {
    ASSERT_NE(sub, nullptr);
    EXPECT_EQ(sub->size(), w.size() - 1);
    EXPECT_EQ(sub->rank(), w.rank() - 1);
    sub->barrier();
  }
}

TEST(Mesh, GroupsMatchTheRankLayout) {
  const int n = world().size();
  const std::vector<MeshShape> candidates = {
      {.dp = n},
      {.pp = n},
      {.cp = n},
      {.pp = 2, .dp = n / 2},
      {.dp = n / 2, .cp = 2},
      {.pp = 2, .cp = n / 2},
      {.dp = n, .ep = 2},
      {.dp = n, .ep = n},
      {.pp = 2, .dp = n / 2, .ep = 2},
      {.dp = n / 2, .cp = 2, .ep = n / 2},
  };
  int built = 0;
  for (const MeshShape& shape : candidates) {
    if (shape.world_size() != n || shape.dp % shape.ep != 0) continue;  // not for this world
    ++built;
    Mesh mesh = Mesh::build(world(), shape);
    for (int a = 0; a < kNumAxes; ++a) {
      const Axis axis = Axis(a);
      const std::vector<int32_t> members = expected_members(shape, world().rank(), axis);
      Communicator& group = mesh.group(axis);
      SCOPED_TRACE(describe(shape) + " axis " + axis_name(axis));
      EXPECT_EQ(group.size(), int(members.size()));
      EXPECT_EQ(mesh.size(axis), int(members.size()));
      EXPECT_EQ(group.rank(), mesh.coordinate(axis));
      EXPECT_EQ(members[size_t(mesh.coordinate(axis))], world().rank());
      EXPECT_EQ(gather_world_ranks(group), members);
    }
  }
  // Any even world builds at least six of the shapes; an odd one dp=N, pp=N, cp=N, ep=dp=N.
  EXPECT_GE(built, n % 2 == 0 ? 6 : 4);
}

TEST(Mesh, WrongWorldSizeIsAnInputErrorOnEveryRank) {
  const int n = world().size();
  try {
    Mesh::build(world(), MeshShape{.dp = n + 1});
    ADD_FAILURE() << "a mesh of " << n + 1 << " on " << n << " ranks must throw";
  } catch (const InputError& e) {
    const std::string expect = "mesh pp=1 x dp=" + std::to_string(n + 1) + " x cp=1 needs " +
                               std::to_string(n + 1) + " processes but the world has " +
                               std::to_string(n);
    EXPECT_EQ(std::string(e.what()).substr(0, expect.size()), expect) << e.what();
  }
  EXPECT_THROW(Mesh::build(world(), MeshShape{.dp = n, .ep = n + 1}), InputError);
}
