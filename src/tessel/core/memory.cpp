#include "tessel/core/memory.hpp"

#include <malloc.h>

#include <cstdlib>
#include <cstring>
#include <limits>

namespace tessel {

void retain_freed_memory() {
  [[maybe_unused]] static const bool applied = [] {
    const char* env = std::getenv("TESSEL_RETAIN_FREED_MEMORY");
    if (env && std::strcmp(env, "0") == 0) return false;
    // No mmap'd chunks: freeing one returns its pages to the kernel.
    mallopt(M_MMAP_MAX, 0);
    // Never shrink the heap (the main arena's top, and the threads' arenas).
    mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max());
    return true;
  }();
}

}  // namespace tessel
