// Placement of ids into empty ways without ranking (torchrec_kvemb/ops/place.py):
// kv_place puts absent ids into the empty ways of their buckets (per bucket, in
// the given order, ascending ways, or, when they do not all fit, none of them:
// slot -1; scores untouched); kv_bulk_load fills an empty index at once.
#include <algorithm>
#include <new>
#include <vector>

#include "bucket.h"
#include "bucket_order.h"
#include "hashing.h"
#include "kvemb_native.h"
#include "parallel.h"
#include "workspace.h"

namespace {

int check_ids(const int64_t* ids, int64_t n, int64_t num_buckets) {
  if (n < 0 || num_buckets < 1) return KV_BAD_ARGUMENT;
  for (int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0) return KV_NEGATIVE_ID;
  }
  return KV_OK;
}

// Checks the ids, orders them by index bucket (then input order) and calls
// fn(order, threads), which returns whether its parallel work had memory; a
// KvStatus.
template <class F>
int with_ids_by_bucket(const int64_t* ids, int64_t n, int64_t num_buckets, int64_t num_threads,
                       F&& fn) {
  if (const int status = check_ids(ids, n, num_buckets); status != KV_OK) return status;
  try {
    kvemb::Arena arena;
    const kvemb::FastMod mod(static_cast<uint64_t>(num_buckets));
    int64_t* bucket = arena.take<int64_t>(n);
    for (int64_t i = 0; i < n; ++i) bucket[i] = kvemb::index_bucket(ids[i], mod);
    const int64_t threads = std::max<int64_t>(1, num_threads);
    kvemb::BucketOrder order;
    kvemb::order_by_bucket(bucket, ids, n, num_buckets, threads, arena, &order);
    return fn(order, threads) ? KV_OK : KV_OUT_OF_MEMORY;
  } catch (const std::bad_alloc&) {
    return KV_OUT_OF_MEMORY;
  }
}

// An item of a bucket with the value it is ranked by.
struct Ranked {
  int64_t value;
  int64_t key;
  int64_t index;
};

}  // namespace

extern "C" int kv_place(int64_t* keys, int64_t num_buckets, const int64_t* ids, int64_t n,
                        int64_t num_threads, int64_t* slots) {
  using namespace kvemb;
  return with_ids_by_bucket(ids, n, num_buckets, num_threads, [&](BucketOrder& order,
                                                                  int64_t threads) {
    return parallel_for(order.parts, threads, [&](int64_t p, int64_t) {
      for_each_bucket(order, p, keys, nullptr, [&](int64_t bucket, int64_t k0, int64_t k1) {
        int64_t* bucket_keys = keys + bucket * kWays;
        uint32_t empty = match(bucket_keys, kEmpty);
        const bool fits = k1 - k0 <= __builtin_popcount(empty);
        for (int64_t j = k0; j < k1; ++j) {
          const Item& item = order.items[j];
          if (!fits) {
            slots[item.index] = -1;
            continue;
          }
          const int way = lowest_way(empty);
          empty &= empty - 1;
          bucket_keys[way] = item.key;
          slots[item.index] = bucket * kWays + way;
        }
      });
    });
  });
}

extern "C" int kv_bulk_load(int64_t* keys, int64_t* scores, int64_t num_buckets, const int64_t* ids,
                            const int64_t* values, int64_t n, int64_t num_threads,
                            int64_t* slots) {
  using namespace kvemb;
  return with_ids_by_bucket(ids, n, num_buckets, num_threads, [&](BucketOrder& order,
                                                                  int64_t threads) {
    // Any bucket given more than its ways: every bucket's ids go in rank order
    // (score desc, id asc), as the torch path's global sort puts them.
    bool overflow = false;
    for (int64_t k = 0; k + kWays < order.size() && !overflow; ++k) {
      overflow = order.items[k].bucket == order.items[k + kWays].bucket;
    }
    return parallel_for(order.parts, threads, [&](int64_t p, int64_t) {
      // A bucket's items with their values beside them (why: the sort compares
      // each item several times; reading values[index] each time cost a random
      // read per comparison).
      std::vector<Ranked> ranked;
      for_each_bucket(order, p, keys, scores, [&](int64_t b, int64_t k0, int64_t k1) {
        ranked.clear();
        for (int64_t k = k0; k < k1; ++k) {
          const Item& item = order.items[k];
          ranked.push_back(Ranked{values[item.index], item.key, item.index});
        }
        if (overflow) {
          std::sort(ranked.begin(), ranked.end(), [](const Ranked& x, const Ranked& y) {
            return x.value != y.value ? x.value > y.value : x.key < y.key;
          });
        }
        for (size_t way = 0; way < ranked.size(); ++way) {
          const Ranked& r = ranked[way];
          if (way >= static_cast<size_t>(kWays)) {
            slots[r.index] = -1;
            continue;
          }
          keys[b * kWays + static_cast<int64_t>(way)] = r.key;
          scores[b * kWays + static_cast<int64_t>(way)] = r.value;
          slots[r.index] = b * kWays + static_cast<int64_t>(way);
        }
      });
    });
  });
}
