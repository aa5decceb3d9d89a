#include "tessel/core/memory.hpp"

#include <malloc.h>
#include <sys/resource.h>

#include <cstdlib>
#include <string_view>

namespace tessel {

void retain_freed_memory() {
  [[maybe_unused]] static const bool applied = [] {
    const char* env = std::getenv("TESSEL_RETAIN_FREED_MEMORY");
    for (std::string_view off : {"0", "false", "off", "no"})
      if (env && off == env) return false;
    // No mmap'd chunks: freeing one returns its pages to the kernel.
    mallopt(M_MMAP_MAX, 0);
    // Never shrink the heap (-1: no threshold at all; man mallopt).
    mallopt(M_TRIM_THRESHOLD, -1);
    return true;
  }();
}

void release_free_memory() {
  malloc_trim(0);
}

int64_t peak_resident_bytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return int64_t(usage.ru_maxrss) * 1024;  // Linux reports KiB
}

}  // namespace tessel
