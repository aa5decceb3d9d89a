#pragma once
// The process mesh pp x dp x cp, with expert parallelism ep folded inside dp (as
// in Megatron-Core). Process groups are split from the world once, in
// Mesh::build; code asks the mesh for the group of an axis.
//
// Rank order: pp outermost, then dp, then cp innermost:
//   world rank = (p * dp + d) * cp + c
// Inside the dp axis, d = b * ep + e: the ep group is a contiguous block of ep
// data-parallel ranks (same p, c, b; varying e) and the edp group ("expert data
// parallel", the ep-complement that reduces expert weights) joins the dp / ep ranks
// with the same ep index (same p, c, e; varying b).
//
// Two replica groups join the cp axis to those: dp_cp, every rank of a pipeline stage
// (same p; the ranks whose gradients of the stage's dense weights sum), and edp_cp, every
// rank holding the same experts (same p, e; the ranks whose expert gradients sum). Without
// context parallelism they have the members of dp and edp.
//
// Each group's rank equals this process's coordinate on that axis. The mesh keeps a
// reference to the world communicator, which must outlive it.
#include <array>
#include <cstdint>
#include <memory>

#include "tessel/comm/communicator.hpp"

namespace tessel::comm {

enum class Axis : uint8_t { pp, dp, cp, ep, edp, dp_cp, edp_cp };
inline constexpr int kNumAxes = 7;
const char* axis_name(Axis axis);  // "pp", "dp", "cp", "ep", "edp", "dp_cp", "edp_cp"

struct MeshShape {
  int pp = 1, dp = 1, cp = 1, ep = 1;
  int64_t world_size() const { return int64_t(pp) * dp * cp; }  // 64 bits: never overflows
  // Throws tessel::InputError (one line naming the parallel.* setting) unless every
  // degree is >= 1, ep divides dp and pp * dp * cp == world_size.
  void validate(int world_size) const;
};

class Mesh {
 public:
  // Validates the shape against world.size() and splits the seven axis groups
  // (collective over `world`).
  static Mesh build(Communicator& world, MeshShape shape);

  const MeshShape& shape() const { return shape_; }
  Communicator& world() const { return *world_; }
  Communicator& group(Axis axis) const { return *groups_[size_t(axis)]; }
  // This process's index on `axis`, in [0, size(axis)) (dp_cp: d cp + c; edp_cp: b cp + c).
  int coordinate(Axis axis) const { return coords_[size_t(axis)]; }
  // The degree of `axis` (edp: dp / ep; dp_cp: dp cp; edp_cp: dp / ep cp).
  int size(Axis axis) const;

 private:
  Mesh(Communicator& world, MeshShape shape) : world_(&world), shape_(shape) {}
  Communicator* world_;
  MeshShape shape_;
  std::array<std::unique_ptr<Communicator>, kNumAxes> groups_;
  std::array<int, kNumAxes> coords_{};
};

}  // namespace tessel::comm
