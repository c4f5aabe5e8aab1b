// The read-only probe of a group index, software-pipelined: the bucket of id
// j + kProbeAhead is hashed and prefetched while id j is compared, so about
// kProbeAhead bucket reads are in flight at once instead of one.
//
// Shared by kv_lookup_eval_group (lookup_eval.cpp) and the fused eval lookups
// (pooled_forward.cpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "bucket.h"
#include "hashing.h"
#include "kvemb_native.h"

namespace kvemb {

// Ids between a bucket's prefetch and its compare. Why 32: one thread probing
// 327k ids in 4 x 65k buckets (32 MB of keys) took 9.5 / 5.2 / 3.7 / 2.9 ms
// with a distance of 0 / 8 / 16 / 32-48.
constexpr int64_t kProbeAhead = 32;
constexpr int64_t kProbeRing = 64;  // a power of two > kProbeAhead

// Each table's bucket range in a group index, with its remainder.
struct GroupIndex {
  const int64_t* keys = nullptr;
  const int64_t* bucket_offset = nullptr;
  int64_t num_tables = 0;
  std::vector<FastMod> mods;

  // KV_OK, or KV_BAD_ARGUMENT when a range leaves the index.
  int init(const int64_t* keys_, int64_t num_buckets_total, const int64_t* bucket_offset_,
           const int64_t* num_buckets, int64_t num_tables_) {
    keys = keys_;
    bucket_offset = bucket_offset_;
    num_tables = num_tables_;
    mods.clear();
    for (int64_t t = 0; t < num_tables; ++t) {
      if (num_buckets[t] < 1 || bucket_offset[t] < 0 ||
          bucket_offset[t] + num_buckets[t] > num_buckets_total) {
        return KV_BAD_ARGUMENT;
      }
      mods.emplace_back(static_cast<uint64_t>(num_buckets[t]));
    }
    return KV_OK;
  }
};

// The probe of ids [m] whose tables are table[m] (-1: not the group's id,
// slot -1) as a pipeline: start(j) hashes id j and prefetches its bucket,
// finish(j) (at most kProbeRing - 1 ids after start(j), in order) compares it
// and gives its slot, counting a hit in hits[t]. A bad table or a negative id
// gets slot -1 and raises *status to its KvStatus (the largest code wins).
class ProbePipeline {
 public:
  ProbePipeline(const GroupIndex& index, const int64_t* ids, const int64_t* table, int64_t* hits,
                int* status)
      : index_(index), ids_(ids), table_(table), hits_(hits), status_(status) {}

  void start(int64_t j) {
    const int64_t t = table_[j], id = ids_[j];
    int64_t b = -1;
    if (t >= 0 && t < index_.num_tables && id >= 0) {
      b = index_.bucket_offset[t] + index_bucket(id, index_.mods[t]);
      prefetch_bucket(index_.keys + b * kWays);
    } else if (t != -1) {
      const bool bad_table = t < -1 || t >= index_.num_tables;
      *status_ = std::max<int>(*status_, bad_table ? KV_BAD_TABLE : KV_NEGATIVE_ID);
    }
    bucket_[j & (kProbeRing - 1)] = b;
  }

  int64_t finish(int64_t j) {
    const int64_t b = bucket_[j & (kProbeRing - 1)];
    if (b < 0) return -1;
    const uint32_t found = match(index_.keys + b * kWays, ids_[j]);
    if (!found) return -1;
    ++hits_[table_[j]];
    return b * kWays + lowest_way(found);
  }

 private:
  const GroupIndex& index_;
  const int64_t* ids_;
  const int64_t* table_;
  int64_t* hits_;
  int* status_;
  int64_t bucket_[kProbeRing];
};

// Global slots [m] of ids [m] (ProbePipeline's rules), kProbeAhead ids in flight.
inline void probe_pipelined(const GroupIndex& index, const int64_t* ids, const int64_t* table,
                            int64_t m, int64_t* slots, int64_t* hits, int* status) {
  ProbePipeline probe(index, ids, table, hits, status);
  const int64_t lead = std::min(m, kProbeAhead);
  for (int64_t j = 0; j < lead; ++j) probe.start(j);
  for (int64_t j = 0; j < m; ++j) {
    if (j + kProbeAhead < m) probe.start(j + kProbeAhead);
    slots[j] = probe.finish(j);
  }
}

}  // namespace kvemb
