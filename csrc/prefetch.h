// Software prefetch of a byte range, a cache line at a time: how the kernels
// start the misses of rows they will read or write a few rows later.
#pragma once

#include <stdint.h>

namespace kvemb {

inline void prefetch_bytes(const void* p, int64_t bytes, bool write) {
  const char* c = static_cast<const char*>(p);
  for (int64_t b = 0; b < bytes; b += 64) {
    if (write) {
      __builtin_prefetch(c + b, 1);
    } else {
      __builtin_prefetch(c + b, 0);
    }
  }
}

}  // namespace kvemb
