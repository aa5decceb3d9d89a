#pragma once
// Process-wide memory policy: keep freed heap memory for reuse instead of handing it back to
// the kernel.
//
// A training step allocates and frees the same activation, gradient and workspace buffers
// every step. With glibc's defaults, large ones are mmap'd and unmapped each time and the
// top of the heap is trimmed, so the next step takes a page fault on every 4 KiB page it
// touches again: on the README demo that cost about a fifth of the step (docs/benchmarks.md,
// "Allocator policy"). The policy serves every allocation from the heap and never trims it,
// so the resident size stays at the run's high-water mark, which it reaches anyway.
// Numerics do not depend on it. TESSEL_RETAIN_FREED_MEMORY=0 in the environment keeps
// glibc's defaults (the benchmark's baseline).
namespace tessel {

// Applies the policy once per process (later calls do nothing). Storage (tensor.cpp) calls
// it before the first tensor allocation, so every binary that allocates tensors has it.
void retain_freed_memory();

}  // namespace tessel
