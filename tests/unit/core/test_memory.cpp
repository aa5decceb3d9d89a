#include <gtest/gtest.h>
#include <malloc.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <fstream>

#include "tessel/core/memory.hpp"
#include "tessel/core/tensor.hpp"

namespace tessel {
namespace {

// 64 MiB: far above glibc's default mmap threshold (128 KiB, at most 32 MiB when it adapts),
// so without the policy the block is mmap'd and unmapped on free, or, from the heap, trimmed.
constexpr size_t kBytes = size_t(64) << 20;

TEST(RetainFreedMemory, TheFirstTensorKeepsLargeBlocksInTheHeapAfterFree) {
  if (std::getenv("TESSEL_RETAIN_FREED_MEMORY")) GTEST_SKIP() << "the policy may be off";
  Tensor first(Shape{1});  // applies the policy
  // Nothing else allocates between the block's malloc and its free, so when freed it is the
  // top of the heap: what glibc's default trims.
  const struct mallinfo2 before = mallinfo2();
  void* block = std::malloc(kBytes);
  ASSERT_NE(block, nullptr);
  std::memset(block, 1, kBytes);
  const struct mallinfo2 held = mallinfo2();
  std::free(block);
  const struct mallinfo2 after = mallinfo2();
  EXPECT_EQ(held.hblkhd, before.hblkhd) << "the 64 MiB block was mmap'd";
  EXPECT_GE(held.arena, before.arena + kBytes);
  EXPECT_EQ(after.arena, held.arena) << "the heap was trimmed after the free";
  EXPECT_GE(after.fordblks, kBytes);
}

// Resident bytes of this process (/proc/self/statm).
size_t resident_bytes() {
  size_t pages = 0, resident = 0;
  std::ifstream("/proc/self/statm") >> pages >> resident;
  return resident * size_t(sysconf(_SC_PAGESIZE));
}

TEST(RetainFreedMemory, ReleaseHandsAFreedPeakBack) {
  if (std::getenv("TESSEL_RETAIN_FREED_MEMORY")) GTEST_SKIP() << "the policy may be off";
  Tensor first(Shape{1});  // applies the policy: the freed block stays resident until released
  void* block = std::malloc(kBytes);
  void* after = std::malloc(64);  // so the block is not the heap's top when freed
  ASSERT_NE(block, nullptr);
  std::memset(block, 1, kBytes);
  std::free(block);
  const size_t held = resident_bytes();
  release_free_memory();
  EXPECT_LE(resident_bytes() + kBytes / 2, held) << "the freed 64 MiB stayed resident";
  std::free(after);
}

}  // namespace
}  // namespace tessel
