#include "tessel/comm/mesh.hpp"

namespace tessel::comm {

const char* axis_name(Axis axis) {
  switch (axis) {
    case Axis::pp:
      return "pp";
    case Axis::dp:
      return "dp";
    case Axis::cp:
      return "cp";
    case Axis::ep:
      return "ep";
    case Axis::edp:
      return "edp";
    case Axis::dp_cp:
      return "dp_cp";
    case Axis::edp_cp:
      return "edp_cp";
  }
  TESSEL_CHECK(false, "unknown Axis ", int(axis));
}

void MeshShape::validate(int world_size) const {
  for (auto [name, degree] : {std::pair{"pp", pp}, {"dp", dp}, {"cp", cp}, {"ep", ep}})
    if (degree < 1) input_error("mesh degree parallel.", name, " = ", degree, " must be >= 1");
  if (dp % ep != 0)
    input_error("mesh parallel.ep = ", ep, " must divide parallel.dp = ", dp,
                " (expert parallelism is folded inside data parallelism)");
  if (this->world_size() != world_size)
    input_error("mesh pp=", pp, " x dp=", dp, " x cp=", cp, " needs ", this->world_size(),
                this->world_size() == 1 ? " process" : " processes", " but the world has ",
                world_size,
                " (set parallel.pp, parallel.dp and parallel.cp so that their product is ",
                world_size, ")");
}

int Mesh::size(Axis axis) const {
  switch (axis) {
    case Axis::pp:
      return shape_.pp;
    case Axis::dp:
      return shape_.dp;
    case Axis::cp:
      return shape_.cp;
    case Axis::ep:
      return shape_.ep;
    case Axis::edp:
      return shape_.dp / shape_.ep;
    case Axis::dp_cp:
      return shape_.dp * shape_.cp;
    case Axis::edp_cp:
      return shape_.dp / shape_.ep * shape_.cp;
  }
  TESSEL_CHECK(false, "unknown Axis ", int(axis));
}

Mesh Mesh::build(Communicator& world, MeshShape shape) {
  shape.validate(world.size());
  Mesh mesh(world, shape);
  const int r = world.rank();
  const int c = r % shape.cp, d = r / shape.cp % shape.dp, p = r / (shape.cp * shape.dp);
  const int e = d % shape.ep, b = d / shape.ep, blocks = shape.dp / shape.ep;
  // Per axis: the group is the set of ranks sharing every other coordinate (the
  // color); the key orders the group by this axis' coordinate.
  struct Split {
    Axis axis;
    int color, coordinate;
  };
  const Split splits[] = {
      {Axis::pp, d * shape.cp + c, p},
      {Axis::dp, p * shape.cp + c, d},
      {Axis::cp, p * shape.dp + d, c},
      {Axis::ep, (p * shape.cp + c) * blocks + b, e},
      {Axis::edp, (p * shape.cp + c) * shape.ep + e, b},
      {Axis::dp_cp, p, d * shape.cp + c},
      {Axis::edp_cp, p * shape.ep + e, b * shape.cp + c},
  };
  for (const Split& s : splits) {
    mesh.groups_[size_t(s.axis)] = world.split(s.color, s.coordinate);
    mesh.coords_[size_t(s.axis)] = s.coordinate;
  }
  return mesh;
}

}  // namespace tessel::comm
