#pragma once
// Thread count for OpenMP regions and OpenBLAS. Set once at start (from
// `run.threads` in the config, or OMP_NUM_THREADS); with several ranks on one
// machine choose ranks x threads <= cores.
namespace tessel {

void set_num_threads(int n);
int num_threads();

}  // namespace tessel
