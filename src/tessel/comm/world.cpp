#include "tessel/comm/world.hpp"

#include <cstdlib>
#include <memory>

#include "tessel/comm/mpi_communicator.hpp"
#include "tessel/comm/single_communicator.hpp"

namespace tessel::comm {

namespace {

std::unique_ptr<Communicator> g_world;
bool g_finalize_mpi = false;  // init_communication called MPI_Init_thread

}  // namespace

bool launched_by_mpi() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE"})
    if (std::getenv(var) != nullptr) return true;
  return false;
}

CommGuard init_communication(int* argc, char*** argv) {
  TESSEL_CHECK(g_world == nullptr, "init_communication: the world communicator already exists");
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (initialized || launched_by_mpi()) {
    TESSEL_CHECK(!finalized, "init_communication: MPI was already finalized in this process");
    int provided = 0;
    if (!initialized) {
      mpi_check(MPI_Init_thread(argc, argv, MPI_THREAD_SERIALIZED, &provided), "MPI_Init_thread");
      g_finalize_mpi = true;
    } else {
      mpi_check(MPI_Query_thread(&provided), "MPI_Query_thread");
    }
    // world.hpp promises that any thread may communicate (one at a time); below this level
    // a call from a second thread would be undefined behaviour, not an error.
    if (provided < MPI_THREAD_SERIALIZED) {
      if (g_finalize_mpi) MPI_Finalize();
      g_finalize_mpi = false;
      throw Error(tessel::detail::concat(
          "init_communication: MPI grants thread level ", provided,
          " but tessel needs MPI_THREAD_SERIALIZED (", MPI_THREAD_SERIALIZED,
          ": any thread may communicate, one at a time); use an MPI library built with thread "
          "support, or initialize MPI with MPI_Init_thread requesting it"));
    }
    g_world = MpiCommunicator::dup_world();
  } else {
    g_world = std::make_unique<SingleCommunicator>();
  }
  return CommGuard();
}

CommGuard::~CommGuard() {
  if (!active_) return;
  g_world.reset();
  if (g_finalize_mpi) {
    MPI_Finalize();
    g_finalize_mpi = false;
  }
}

Communicator& CommGuard::world() const {
  return comm::world();
}

Communicator& world() {
  TESSEL_CHECK(g_world != nullptr, "world(): call init_communication first");
  return *g_world;
}

}  // namespace tessel::comm
