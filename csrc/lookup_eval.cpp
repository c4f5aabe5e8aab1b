// Read-only probe of a group index (KVTable.lookup_eval for T tables at once).
//
// Ids are probed in blocks: hash a block and prefetch its buckets, then
// compare; the block's cache misses overlap instead of queueing one by one.
#include <algorithm>
#include <vector>

#include "bucket.h"
#include "hashing.h"
#include "kvemb_native.h"
#include "parallel.h"

using namespace kvemb;

namespace {

constexpr int64_t kBlock = 16;            // ids in flight: 32 cache lines prefetched
constexpr int64_t kIdsPerTask = 1 << 14;  // a thread's unit of work

}  // namespace

extern "C" int kv_lookup_eval_group(const int64_t* keys, int64_t num_buckets_total,
                                    const int64_t* bucket_offset, const int64_t* num_buckets,
                                    int64_t num_tables, const int64_t* ids,
                                    const int64_t* table_idx, int64_t n, int64_t num_threads,
                                    int64_t* slots, int64_t* hits) {
  std::fill(hits, hits + num_tables, 0);
  std::vector<FastMod> mods;
  for (int64_t t = 0; t < num_tables; ++t) {
    if (num_buckets[t] < 1 || bucket_offset[t] < 0 ||
        bucket_offset[t] + num_buckets[t] > num_buckets_total) {
      return KV_BAD_ARGUMENT;
    }
    mods.emplace_back(static_cast<uint64_t>(num_buckets[t]));
  }
  const int64_t tasks = (n + kIdsPerTask - 1) / kIdsPerTask;
  const int64_t workers = worker_count(tasks, num_threads);
  std::vector<int64_t> worker_hits(static_cast<size_t>(workers * num_tables), 0);
  std::vector<int> worker_status(static_cast<size_t>(workers), KV_OK);

  const bool ok = parallel_for(tasks, num_threads, [&](int64_t task, int64_t worker) {
    int64_t* my_hits = worker_hits.data() + worker * num_tables;
    const int64_t end = std::min(n, (task + 1) * kIdsPerTask);
    int64_t bucket[kBlock];
    for (int64_t base = task * kIdsPerTask; base < end; base += kBlock) {
      const int64_t m = std::min(kBlock, end - base);
      for (int64_t j = 0; j < m; ++j) {
        const int64_t t = table_idx[base + j], id = ids[base + j];
        bucket[j] = -1;
        if (t == -1) continue;
        if (t < -1 || t >= num_tables) {
          worker_status[worker] = std::max<int>(worker_status[worker], KV_BAD_TABLE);
          continue;
        }
        if (id < 0) {
          worker_status[worker] = std::max<int>(worker_status[worker], KV_NEGATIVE_ID);
          continue;
        }
        bucket[j] = bucket_offset[t] + index_bucket(id, mods[t]);
        prefetch_bucket(keys + bucket[j] * kWays);
      }
      for (int64_t j = 0; j < m; ++j) {
        int64_t slot = -1;
        if (bucket[j] >= 0) {
          const uint32_t found = match(keys + bucket[j] * kWays, ids[base + j]);
          if (found) {
            slot = bucket[j] * kWays + lowest_way(found);
            ++my_hits[table_idx[base + j]];
          }
        }
        slots[base + j] = slot;
      }
    }
  });
  if (!ok) return KV_OUT_OF_MEMORY;
  // The largest code any worker saw: the same error whatever the scheduling.
  const int status = *std::max_element(worker_status.begin(), worker_status.end());
  if (status != KV_OK) return status;
  for (int64_t w = 0; w < workers; ++w) {
    for (int64_t t = 0; t < num_tables; ++t) hits[t] += worker_hits[w * num_tables + t];
  }
  return KV_OK;
}
