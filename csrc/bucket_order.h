// Items ordered by index bucket, in parts of contiguous buckets.
//
// Buckets are independent (an id lives only in its own bucket), so a part
// is a unit of work one thread owns entirely. The order is stable (by bucket,
// then item index) and the parts depend only on the bucket count, so every
// result built from it is the same for any number of threads.
#pragma once

#include <cstdint>

#include "bucket.h"
#include "parallel.h"
#include "workspace.h"

namespace kvemb {

// 2**10 buckets a part: the per-part counting sort's histogram (8 KiB) stays
// in L1, and a 1M-row table still gives 64 parts to balance Zipf-hot buckets.
constexpr int kPartShift = 10;

inline int64_t part_count(int64_t num_buckets, int shift = kPartShift) {
  return (num_buckets + (int64_t{1} << shift) - 1) >> shift;
}

// A part width for an index of ``num_buckets`` buckets: 2**kPartShift buckets,
// narrower for a small index so that it still has about kMinParts parts, down to
// 2**kMinPartShift (why: a table of 30k rows had 2 parts, and a call waited for
// whichever thread held the larger one, descheduled or not; docs/tiers.md,
// Measured). Depends on the bucket count only, never on the threads.
constexpr int kMinPartShift = 6;
constexpr int64_t kMinParts = 32;
inline int fine_part_shift(int64_t num_buckets) {
  int shift = kPartShift;
  while (shift > kMinPartShift && (num_buckets >> shift) < kMinParts) --shift;
  return shift;
}

// One sorted item: its bucket and key (an id) travel with its index, so the
// passes over the order read sequentially (why: gathering bucket and id
// through the index cost ~35% of a training lookup on 327k ids).
struct Item {
  int64_t bucket;
  int64_t key;
  int64_t index;
};

struct BucketOrder {
  Item* items = nullptr;          // by bucket, then index
  int64_t* part_start = nullptr;  // [parts + 1] into items
  int64_t parts = 0;
  int shift = kPartShift;  // a part is 2**shift buckets
  int64_t size() const { return part_start[parts]; }
};

// Calls fn(bucket, k0, k1) for the items [k0, k1) of each bucket of part p,
// buckets ascending, prefetching the keys (and scores, when given) of the
// bucket a few items ahead (why: each visit otherwise misses the cache).
template <class F>
void for_each_bucket(const BucketOrder& order, int64_t p, const int64_t* keys,
                     const int64_t* scores, F&& fn) {
  constexpr int64_t kAhead = 32;
  const Item* items = order.items;
  const int64_t end = order.part_start[p + 1];
  for (int64_t k = order.part_start[p]; k < end;) {
    const int64_t bucket = items[k].bucket;
    int64_t k1 = k + 1;
    while (k1 < end && items[k1].bucket == bucket) ++k1;
    if (k + kAhead < end) {
      const int64_t ahead = items[k + kAhead].bucket * kWays;
      __builtin_prefetch(keys + ahead);
      __builtin_prefetch(keys + ahead + 8);
      if (scores) {
        __builtin_prefetch(scores + ahead);
        __builtin_prefetch(scores + ahead + 8);
      }
    }
    fn(bucket, k, k1);
    k = k1;
  }
}

// Orders items [0, n) (bucket[i], key[i]) by bucket in [0, num_buckets), in
// parts of 2**shift buckets; items with bucket -1 are left out. Memory comes
// from ``arena``. Throws std::bad_alloc.
void order_by_bucket(const int64_t* bucket, const int64_t* key, int64_t n, int64_t num_buckets,
                     int64_t threads, Arena& arena, BucketOrder* out, int shift = kPartShift);

}  // namespace kvemb
