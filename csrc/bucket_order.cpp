// Two counting sorts: items into parts (per slice of items, so that threads
// can count and scatter without sharing counters), then by bucket inside a part.
#include "bucket_order.h"

#include <algorithm>
#include <new>
#include <vector>

namespace kvemb {

namespace {

// Items a slice counts and scatters at least (why: a thread start costs
// ~20 us, more than sorting a few thousand items).
constexpr int64_t kMinSlice = 16384;

void ensure(bool ok) {
  if (!ok) throw std::bad_alloc();
}

}  // namespace

void order_by_bucket(const int64_t* bucket, const int64_t* key, int64_t n, int64_t num_buckets,
                     int64_t threads, Arena& arena, BucketOrder* out, int shift) {
  const int64_t parts = part_count(num_buckets, shift);
  const int64_t slices = worker_count(n / kMinSlice + 1, threads);
  int64_t* cursor = arena.take<int64_t>(slices * parts);  // [slice][part]
  ensure(parallel_for(slices, threads, [&](int64_t s, int64_t) {
    int64_t* count = cursor + s * parts;
    std::fill(count, count + parts, 0);
    for (int64_t i = slice_begin(n, slices, s), e = slice_begin(n, slices, s + 1); i < e; ++i) {
      if (bucket[i] >= 0) ++count[bucket[i] >> shift];
    }
  }));

  // Exclusive prefix in (part, slice) order: slice s of part p starts after
  // every earlier part and after the earlier slices of p (a stable scatter).
  out->parts = parts;
  out->shift = shift;
  out->part_start = arena.take<int64_t>(parts + 1);
  int64_t total = 0;
  for (int64_t p = 0; p < parts; ++p) {
    out->part_start[p] = total;
    for (int64_t s = 0; s < slices; ++s) {
      const int64_t count = cursor[s * parts + p];
      cursor[s * parts + p] = total;
      total += count;
    }
  }
  out->part_start[parts] = total;

  Item* staged = arena.take<Item>(total);
  ensure(parallel_for(slices, threads, [&](int64_t s, int64_t) {
    int64_t* next = cursor + s * parts;
    for (int64_t i = slice_begin(n, slices, s), e = slice_begin(n, slices, s + 1); i < e; ++i) {
      if (bucket[i] >= 0) staged[next[bucket[i] >> shift]++] = Item{bucket[i], key[i], i};
    }
  }));

  out->items = arena.take<Item>(total);
  ensure(parallel_for(parts, threads, [&](int64_t p, int64_t) {
    const int64_t begin = out->part_start[p], end = out->part_start[p + 1];
    if (begin == end) return;
    const int64_t first = p << shift;
    const int64_t width = std::min(int64_t{1} << shift, num_buckets - first);
    std::vector<int64_t> next(static_cast<size_t>(width) + 1, 0);
    for (int64_t k = begin; k < end; ++k) ++next[staged[k].bucket - first + 1];
    next[0] = begin;
    for (int64_t b = 1; b <= width; ++b) next[b] += next[b - 1];
    for (int64_t k = begin; k < end; ++k) out->items[next[staged[k].bucket - first]++] = staged[k];
  }));
}

}  // namespace kvemb
