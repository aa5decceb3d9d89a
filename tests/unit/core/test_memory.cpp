#include <gtest/gtest.h>
#include <malloc.h>

#include <cstdlib>
#include <cstring>

#include "tessel/core/memory.hpp"
#include "tessel/core/tensor.hpp"

namespace tessel {
namespace {

// 64 MiB: far above glibc's default mmap threshold (128 KiB, at most 32 MiB when it adapts),
// so without the policy the block is mmap'd and unmapped on free, or, from the heap, trimmed.
constexpr size_t kBytes = size_t(64) << 20;

TEST(RetainFreedMemory, TheFirstTensorKeepsLargeBlocksInTheHeapAfterFree) {
  ASSERT_EQ(std::getenv("TESSEL_RETAIN_FREED_MEMORY"), nullptr) << "the test needs the policy on";
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

}  // namespace
}  // namespace tessel
