#pragma once
// The world communicator and the lifetime of MPI.
//
//   int main(int argc, char** argv) {
//     auto guard = tessel::comm::init_communication(&argc, &argv);
//     tessel::comm::Communicator& world = guard.world();  // or tessel::comm::world()
//     ...
//   }  // ~CommGuard: the world communicator goes, then MPI_Finalize
//
// Under a launcher (mpirun/mpiexec/srun: one of OMPI_COMM_WORLD_SIZE, PMIX_RANK,
// PMI_RANK, PMI_SIZE is set) or when MPI is already initialized, the world is an
// MpiCommunicator (MPI initialized requesting MPI_THREAD_SERIALIZED, so that any
// thread may communicate, one at a time; a granted level below it, also of an MPI
// initialized before, is an Error). Otherwise it is a SingleCommunicator and MPI is not
// touched. MPI_Finalize runs only if init_communication initialized MPI.
//
// Destroy every communicator split from the world (meshes included) before the
// guard: MPI cannot free communicators after MPI_Finalize.
#include "tessel/comm/communicator.hpp"

namespace tessel::comm {

class CommGuard {
 public:
  CommGuard(CommGuard&& other) noexcept : active_(other.active_) { other.active_ = false; }
  CommGuard& operator=(CommGuard&&) = delete;
  ~CommGuard();

  Communicator& world() const;

 private:
  friend CommGuard init_communication(int* argc, char*** argv);
  CommGuard() = default;
  bool active_ = true;
};

// Creates the world communicator; throws tessel::Error if it already exists.
// argc/argv may be null; MPI_Init may strip its own arguments from them.
[[nodiscard]] CommGuard init_communication(int* argc, char*** argv);

// The world communicator; throws tessel::Error outside the lifetime of a CommGuard.
Communicator& world();

// Whether this process was started by an MPI launcher (one of the variables above is set),
// even as a job of one rank.
bool launched_by_mpi();

}  // namespace tessel::comm
