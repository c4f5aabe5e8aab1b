// Read-only probe of a group index (KVTable.lookup_eval for T tables at once):
// tasks of consecutive ids, each probed by probe_pipelined (probe.h).
#include <algorithm>
#include <vector>

#include "kvemb_native.h"
#include "parallel.h"
#include "probe.h"

using namespace kvemb;

namespace {

constexpr int64_t kIdsPerTask = 1 << 14;  // a thread's unit of work

}  // namespace

extern "C" int kv_lookup_eval_group(const int64_t* keys, int64_t num_buckets_total,
                                    const int64_t* bucket_offset, const int64_t* num_buckets,
                                    int64_t num_tables, const int64_t* ids,
                                    const int64_t* table_idx, int64_t n, int64_t num_threads,
                                    int64_t* slots, int64_t* hits) {
  std::fill(hits, hits + num_tables, 0);
  GroupIndex index;
  if (index.init(keys, num_buckets_total, bucket_offset, num_buckets, num_tables) != KV_OK) {
    return KV_BAD_ARGUMENT;
  }
  const int64_t tasks = (n + kIdsPerTask - 1) / kIdsPerTask;
  const int64_t workers = worker_count(tasks, num_threads);
  std::vector<int64_t> worker_hits(static_cast<size_t>(workers * num_tables), 0);
  std::vector<int> worker_status(static_cast<size_t>(workers), KV_OK);

  const bool ok = parallel_for(tasks, num_threads, [&](int64_t task, int64_t worker) {
    const int64_t begin = task * kIdsPerTask;
    const int64_t m = std::min(n, begin + kIdsPerTask) - begin;
    probe_pipelined(index, ids + begin, table_idx + begin, m, slots + begin,
                    worker_hits.data() + worker * num_tables, &worker_status[worker]);
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
