// Scatter of rows into a row array at given slots (torch's index_copy_ on
// dim 0 for float32 rows), with the destination rows prefetched a few ahead
// (why: each row lands at a random slot, and the writes' cache misses then
// overlap instead of queueing; a checkpoint load scatters 1 GB this way), and
// its gather (index_select on dim 0), source rows prefetched the same way
// (why on the native pool, not torch's: a torch parallel op leaves its OpenMP
// thread spinning for milliseconds on the core the pool's next call needs;
// docs/tiers.md, Measured).
#include <algorithm>
#include <cstring>

#include "kvemb_native.h"
#include "parallel.h"

namespace {
// Rows a task copies (why this few: a step's few thousand rows made 2 tasks, and
// the call waited for whichever thread held the other half, descheduled or
// not; a task is a shared counter's increment, nothing to amortize).
constexpr int64_t kRowsPerTask = 512;
}  // namespace

extern "C" int kv_scatter_rows(float* dest, int64_t dest_rows, int64_t dest_stride, int64_t width,
                               const int64_t* slots, int64_t k, const float* rows,
                               int64_t rows_stride, int64_t num_threads) {
  if (k < 0 || width < 0 || dest_stride < width || rows_stride < width) return KV_BAD_ARGUMENT;
  for (int64_t r = 0; r < k; ++r) {
    if (slots[r] < 0 || slots[r] >= dest_rows) return KV_BAD_ARGUMENT;
  }
  constexpr int64_t kAhead = 8;
  const int64_t tasks = (k + kRowsPerTask - 1) / kRowsPerTask;
  const bool ok = kvemb::parallel_for(tasks, num_threads, [&](int64_t task, int64_t) {
    const int64_t begin = task * kRowsPerTask, end = std::min(k, begin + kRowsPerTask);
    for (int64_t r = begin; r < end; ++r) {
      if (r + kAhead < end) {
        const char* ahead = reinterpret_cast<const char*>(dest + slots[r + kAhead] * dest_stride);
        for (int64_t b = 0; b < width * 4; b += 64) __builtin_prefetch(ahead + b, 1);
      }
      std::memcpy(dest + slots[r] * dest_stride, rows + r * rows_stride, sizeof(float) * width);
    }
  });
  return ok ? KV_OK : KV_OUT_OF_MEMORY;
}

extern "C" int kv_gather_rows(const float* src, int64_t src_rows, int64_t src_stride, int64_t width,
                              const int64_t* slots, int64_t k, float* dest, int64_t dest_stride,
                              int64_t num_threads) {
  if (k < 0 || width < 0 || src_stride < width || dest_stride < width) return KV_BAD_ARGUMENT;
  for (int64_t r = 0; r < k; ++r) {
    if (slots[r] < 0 || slots[r] >= src_rows) return KV_BAD_ARGUMENT;
  }
  constexpr int64_t kAhead = 8;
  const int64_t tasks = (k + kRowsPerTask - 1) / kRowsPerTask;
  const bool ok = kvemb::parallel_for(tasks, num_threads, [&](int64_t task, int64_t) {
    const int64_t begin = task * kRowsPerTask, end = std::min(k, begin + kRowsPerTask);
    for (int64_t r = begin; r < end; ++r) {
      if (r + kAhead < end) {
        const char* ahead = reinterpret_cast<const char*>(src + slots[r + kAhead] * src_stride);
        for (int64_t b = 0; b < width * 4; b += 64) __builtin_prefetch(ahead + b);
      }
      std::memcpy(dest + r * dest_stride, src + slots[r] * src_stride, sizeof(float) * width);
    }
  });
  return ok ? KV_OK : KV_OUT_OF_MEMORY;
}
