#pragma once
// The denominator of MFU: the f32 GEMM throughput this process reaches with the current
// thread count (tessel::set_num_threads).
#include <cstdint>

namespace tessel::kernels {

// Times square gemm of `size` (after a warm-up call) repeatedly for at least `min_seconds`
// and returns the best repetition's GFLOP/s (2 size^3 flops per call).
double measure_gemm_peak_gflops(int64_t size, double min_seconds);

}  // namespace tessel::kernels
