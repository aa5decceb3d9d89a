#pragma once
// Process-wide memory policy: keep freed heap memory for reuse instead of handing it back to
// the kernel.
//
// A training step allocates and frees the same activation, gradient and workspace buffers
// every step. With glibc's defaults, large ones are mmap'd and unmapped each time and the
// top of the heap is trimmed, so the next step takes a page fault on every 4 KiB page it
// touches again: on the README demo that cost about a fifth of the step (docs/benchmarks.md,
// "Allocator policy"). The policy serves every allocation from the heap and never trims it,
// so the resident size stays at the run's high-water mark: what the steps reach anyway, once
// a one-off peak (a resume's loaded checkpoint) is handed back with release_free_memory().
// Large blocks of threads other than the main one may still be mmap'd (their arenas hold
// at most 64 MiB each). Numerics do not depend on the policy. TESSEL_RETAIN_FREED_MEMORY=0
// (or false, off, no) in the environment keeps glibc's defaults (the benchmark's baseline).
#include <cstdint>

namespace tessel {

// Applies the policy once per process (later calls do nothing). Storage (tensor.cpp) calls
// it before the first tensor allocation, so every binary that allocates tensors has it.
void retain_freed_memory();

// Hands the free heap memory back to the kernel now (malloc_trim): after a one-off peak
// that later steps will not reach again, such as loading a checkpoint to resume.
void release_free_memory();

// The process's peak resident set size so far, in bytes (getrusage's high-water mark): under
// the policy above, the most memory the process held at any time.
int64_t peak_resident_bytes();

}  // namespace tessel
