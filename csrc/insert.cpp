// Find-or-insert of unique ids with eviction over one bucketed index: the
// ranking rule of torchrec_kvemb/ops/insert.py (insert_torch) in one pass.
//
// Ids are ordered by bucket (bucket_order.h) and each part of buckets is
// settled by one thread: hits take their new score, then the bucket's new
// ids compete with its stored entries (bucket.h place_new). Results do not
// depend on the number of threads. Evictions come out ascending by slot.
#include <algorithm>
#include <new>
#include <vector>

#include "bucket.h"
#include "bucket_order.h"
#include "hashing.h"
#include "kvemb_native.h"
#include "parallel.h"
#include "workspace.h"

namespace kvemb {
namespace {

inline int64_t wrapping_add(int64_t a, int64_t b) {
  return static_cast<int64_t>(static_cast<uint64_t>(a) + static_cast<uint64_t>(b));
}

class Insert {
 public:
  Insert(const KvInsertArgs& args, Arena& arena) : a_(args), arena_(arena) {}

  int run() {
    threads_ = std::max<int64_t>(1, a_.num_threads);
    if (const int status = hash_ids(); status != KV_OK) return status;
    order_by_bucket(bucket_, a_.ids, a_.n, a_.num_buckets, threads_, arena_, &order_);
    e_id_ = arena_.take<int64_t>(a_.n);
    e_slot_ = arena_.take<int64_t>(a_.n);
    n_evicted_.assign(static_cast<size_t>(order_.parts), 0);
    std::vector<Scratch> scratch(static_cast<size_t>(threads_));
    const bool ok = parallel_for(order_.parts, threads_, [&](int64_t p, int64_t w) {
      settle_part(p, scratch[static_cast<size_t>(w)]);
    });
    if (!ok) throw std::bad_alloc();
    gather_evictions();
    return KV_OK;
  }

 private:
  struct Scratch {
    std::vector<NewId> new_ids;
    Placement placement;
  };

  int hash_ids() {
    const int64_t n = a_.n;
    const FastMod mod(static_cast<uint64_t>(a_.num_buckets));
    bucket_ = arena_.take<int64_t>(n);
    constexpr int64_t kPerTask = 1 << 14;
    std::vector<int> status(static_cast<size_t>(threads_), KV_OK);
    const bool ok = parallel_for((n + kPerTask - 1) / kPerTask, threads_, [&](int64_t task,
                                                                               int64_t w) {
      for (int64_t i = task * kPerTask, end = std::min(n, i + kPerTask); i < end; ++i) {
        if (a_.ids[i] < 0) {
          status[static_cast<size_t>(w)] = KV_NEGATIVE_ID;
          bucket_[i] = -1;
        } else {
          bucket_[i] = index_bucket(a_.ids[i], mod);
        }
      }
    });
    if (!ok) throw std::bad_alloc();
    return *std::max_element(status.begin(), status.end());
  }

  void settle_part(int64_t p, Scratch& s) {
    for_each_bucket(order_, p, a_.keys, a_.scores, [&](int64_t bucket, int64_t k0, int64_t k1) {
      settle_bucket(p, bucket, k0, k1, s);
    });
  }

  // Items [k0, k1) of the order, all in ``bucket``.
  void settle_bucket(int64_t p, int64_t bucket, int64_t k0, int64_t k1, Scratch& s) {
    int64_t* keys = a_.keys + bucket * kWays;
    int64_t* scores = a_.scores + bucket * kWays;
    uint32_t hit_mask = 0;
    s.new_ids.clear();
    for (int64_t k = k0; k < k1; ++k) {
      const int64_t i = order_.items[k].index;
      const uint32_t found = match(keys, order_.items[k].key);
      a_.inserted[i] = 0;
      if (!found) {
        a_.hit[i] = 0;
        s.new_ids.push_back({order_.items[k].key, a_.values[i], i});
        continue;
      }
      const int way = lowest_way(found);
      hit_mask |= 1u << way;
      scores[way] = a_.accumulate ? wrapping_add(scores[way], a_.values[i]) : a_.values[i];
      a_.slots[i] = bucket * kWays + way;
      a_.hit[i] = 1;
    }
    if (s.new_ids.empty()) return;
    Placement& placed = s.placement;
    place_new(keys, scores, hit_mask, a_.keep_existing != 0, s.new_ids.data(),
              static_cast<int64_t>(s.new_ids.size()), &placed);
    for (size_t r = 0; r < s.new_ids.size(); ++r) {
      const int64_t i = s.new_ids[r].ref;
      const int way = placed.way[r];
      a_.slots[i] = way < 0 ? -1 : bucket * kWays + way;
      a_.inserted[i] = way >= 0;
    }
    const int64_t at = order_.part_start[p] + n_evicted_[static_cast<size_t>(p)];
    for (int e = 0; e < placed.n_evicted; ++e) {
      e_id_[at + e] = placed.evicted_id[e];
      e_slot_[at + e] = bucket * kWays + placed.evicted_way[e];
    }
    n_evicted_[static_cast<size_t>(p)] += placed.n_evicted;
  }

  // Parts are ascending bucket ranges and each part's evictions ascend by
  // slot: concatenated in part order, they ascend by slot.
  void gather_evictions() {
    int64_t out = 0;
    for (int64_t p = 0; p < order_.parts; ++p) {
      const int64_t base = order_.part_start[p], count = n_evicted_[static_cast<size_t>(p)];
      std::copy(e_id_ + base, e_id_ + base + count, a_.evicted_ids + out);
      std::copy(e_slot_ + base, e_slot_ + base + count, a_.evicted_slots + out);
      out += count;
    }
    a_.num_evicted[0] = out;
  }

  const KvInsertArgs& a_;
  Arena& arena_;
  int64_t threads_ = 1;
  int64_t* bucket_ = nullptr;
  BucketOrder order_;
  int64_t *e_id_ = nullptr, *e_slot_ = nullptr;  // per part at its part_start
  std::vector<int64_t> n_evicted_;
};

}  // namespace
}  // namespace kvemb

extern "C" int kv_insert(const KvInsertArgs* args) {
  if (!args || args->n < 0 || args->num_buckets < 1) return KV_BAD_ARGUMENT;
  try {
    kvemb::ArenaLease lease(args->workspace ? &args->workspace->arena : nullptr,
                            args->workspace ? &args->workspace->busy : nullptr);
    return kvemb::Insert(*args, lease.arena()).run();
  } catch (const std::bad_alloc&) {
    return KV_OUT_OF_MEMORY;
  }
}
