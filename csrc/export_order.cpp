// An index's stored ids in checkpoint order: by routing bucket, then by id
// (KVTable.checkpoint_order; the torch path, ops/export_order.py, is the reference).
//
// One counting sort by routing bucket (a histogram of the buckets, their
// starts, then each (id, slot) placed at its bucket's next position, slots
// ascending) and a sort of each bucket's few ids (why: the torch path sorts
// one int64 key per id with a radix sort over all of them, 70 ms per 1M ids
// here, and a checkpoint orders every table it saves).
#include <algorithm>
#include <new>
#include <utility>
#include <vector>

#include "hashing.h"
#include "kvemb_native.h"

namespace {

// Sorts the pairs (ids[k], slots[k]) of [0, n) by id (distinct): insertion sort
// for the few ids of a routing bucket, std::sort past that.
void sort_by_id(int64_t* ids, int64_t* slots, int64_t n,
                std::vector<std::pair<int64_t, int64_t>>& scratch) {
  if (n <= 32) {
    for (int64_t k = 1; k < n; ++k) {
      const int64_t id = ids[k], slot = slots[k];
      int64_t j = k;
      for (; j > 0 && ids[j - 1] > id; --j) {
        ids[j] = ids[j - 1];
        slots[j] = slots[j - 1];
      }
      ids[j] = id;
      slots[j] = slot;
    }
    return;
  }
  scratch.clear();
  for (int64_t k = 0; k < n; ++k) scratch.emplace_back(ids[k], slots[k]);
  std::sort(scratch.begin(), scratch.end());
  for (int64_t k = 0; k < n; ++k) {
    ids[k] = scratch[k].first;
    slots[k] = scratch[k].second;
  }
}

}  // namespace

extern "C" int kv_export_order(const int64_t* keys, int64_t num_slots, uint64_t salt,
                               int64_t num_route_buckets, int64_t n, int64_t* out_ids,
                               int64_t* out_slots, int64_t* counts) {
  using namespace kvemb;
  if (num_slots < 0 || n < 0 || num_route_buckets < 1) return KV_BAD_ARGUMENT;
  const FastMod mod(static_cast<uint64_t>(num_route_buckets));
  try {
    // The live slots and their routing buckets, slots ascending.
    std::vector<int64_t> live;
    std::vector<int64_t> route;
    live.reserve(static_cast<size_t>(n));
    route.reserve(static_cast<size_t>(n));
    std::fill(counts, counts + num_route_buckets, int64_t{0});
    for (int64_t s = 0; s < num_slots; ++s) {
      const int64_t id = keys[s];
      if (id < 0) continue;
      const auto b = static_cast<int64_t>(mod(fmix64(static_cast<uint64_t>(id) ^ salt) & kInt64Max));
      live.push_back(s);
      route.push_back(b);
      ++counts[b];
    }
    const auto found = static_cast<int64_t>(live.size());
    if (found != n) return KV_BAD_ARGUMENT;  // the caller's count is stale
    std::vector<int64_t> next(static_cast<size_t>(num_route_buckets));
    int64_t start = 0;
    for (int64_t b = 0; b < num_route_buckets; ++b) {
      next[b] = start;
      start += counts[b];
    }
    for (int64_t k = 0; k < n; ++k) {
      const int64_t at = next[route[k]]++;
      out_ids[at] = keys[live[k]];
      out_slots[at] = live[k];
    }
    std::vector<std::pair<int64_t, int64_t>> scratch;
    start = 0;
    for (int64_t b = 0; b < num_route_buckets; ++b) {
      sort_by_id(out_ids + start, out_slots + start, counts[b], scratch);
      start += counts[b];
    }
  } catch (const std::bad_alloc&) {
    return KV_OUT_OF_MEMORY;
  }
  return KV_OK;
}
