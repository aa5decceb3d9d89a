#include "tessel/core/memory.hpp"

#include <malloc.h>
#include <sys/resource.h>

#include <cstdio>
#include <cstdlib>
#include <string_view>

namespace tessel {

void retain_freed_memory() {
  [[maybe_unused]] static const bool applied = [] {
    const char* env = std::getenv("TESSEL_RETAIN_FREED_MEMORY");
    if (env) {
      for (std::string_view off : {"0", "false", "off", "no"})
        if (off == env) return false;
      // A typo ("fasle") must not pass for a choice; every process says so, before any rank
      // is known.
      bool on = false;
      for (std::string_view word : {"", "1", "true", "on", "yes"}) on = on || word == env;
      if (!on)
        std::fprintf(stderr,
                     "tessel: warning: TESSEL_RETAIN_FREED_MEMORY=%s is none of 0, false, off, "
                     "no (glibc's defaults) or 1, true, on, yes; keeping freed memory\n",
                     env);
    }
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
