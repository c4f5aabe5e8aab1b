// Training lookup of a group of KV tables: KVTable.lookup_train for T
// memory-only tables at once, on raw ids with duplicates.
//
// Phases, each parallel over parts of buckets (bucket_order.h), so results
// do not depend on the number of threads:
//  1. collect: occurrences ordered by bucket; per bucket, a stored id's way
//     is its de-duplication key, new ids are de-duplicated by sorting. Tables
//     without admission settle the bucket at once (insert rule, new rows).
//  2. admit: ids of admission tables not stored are counted in the counter
//     index, bucket by counter bucket (KVTable._admit).
//  3. settle the buckets of admission tables: stored and admitted ids compete.
//  4. gather: uniques and evictions of each part into the outputs; every
//     occurrence gets its slot and unique index.
#include <algorithm>
#include <cstring>
#include <limits>
#include <new>
#include <utility>
#include <vector>

#include "bucket.h"
#include "bucket_order.h"
#include "hashing.h"
#include "kvemb_native.h"
#include "parallel.h"
#include "row_dtype.h"
#include "workspace.h"

namespace kvemb {
namespace {

// Occurrences between a tier bucket's prefetch and the probe that may read it
// (why 32: the training kernel of benchmarks.host_tier in its step took
// 1.70-1.76 ms with 32, 1.75-1.81 with 64, 1.87-1.90 with 128 and 2.03-2.29
// without; 16, prefetching the keys alone, changed nothing).
constexpr int64_t kTierAhead = 32;

enum : uint8_t {
  kInserted = KV_UNIQUE_INSERTED,
  kPromoted = KV_UNIQUE_PROMOTED,
  kNoRoom = KV_UNIQUE_NO_ROOM,
  kAdmitted = 8,
};

// Which table owns a bucket: tables own disjoint bucket ranges of an index
// (why not the occurrence's table_idx: a random read per bucket cost more
// than half of the per-bucket work).
class BucketOwner {
 public:
  void add(int64_t begin, int64_t end, int64_t table) { ranges_.push_back({begin, end, table}); }

  // Sorts the ranges; false if two overlap.
  bool finish() {
    std::sort(ranges_.begin(), ranges_.end(),
              [](const Range& a, const Range& b) { return a.begin < b.begin; });
    for (size_t r = 1; r < ranges_.size(); ++r) {
      if (ranges_[r].begin < ranges_[r - 1].end) return false;
    }
    return true;
  }

  int64_t operator()(int64_t bucket) const {
    const auto after = std::upper_bound(ranges_.begin(), ranges_.end(), bucket,
                                        [](int64_t b, const Range& r) { return b < r.begin; });
    return (after - 1)->table;
  }

 private:
  struct Range {
    int64_t begin, end, table;
  };
  std::vector<Range> ranges_;
};

struct TableInfo {
  FastMod mod;
  FastMod counter_mod;
  int64_t bucket_offset = 0;
  int64_t counter_offset = 0;
  int64_t step = 0;
  int64_t threshold = 1;
  bool accumulate = false;     // LFU: a hit adds its count to the score
  bool keep_existing = false;  // NONE: stored entries never lose
  bool custom = false;         // CUSTOM_SCORE given scores: the max per id
  bool admission = false;
  bool init_native = true;
  UniformInit init;
  // The table's host tier index (KvTrainArgs.tier_index), probed for its new ids.
  const int64_t* tier_main_keys = nullptr;  // null: no tier index
  const int64_t* tier_main_scores = nullptr;
  const int64_t* tier_stash_keys = nullptr;
  const int64_t* tier_stash_scores = nullptr;
  FastMod tier_main_mod, tier_stash_mod;
  int64_t tier_main_slots = 0;

  // The tier's global slot of ``id`` (main part, then stash), -1: not held;
  // ``score``: the memory score the index keeps there.
  int64_t tier_find(int64_t id, int64_t* score) const {
    const int64_t b = index_bucket(id, tier_main_mod);
    if (const uint32_t m = match(tier_main_keys + b * kWays, id)) {
      const int64_t slot = b * kWays + __builtin_ctz(m);
      *score = tier_main_scores[slot];
      return slot;
    }
    if (!tier_stash_keys) return -1;
    const int64_t s = index_bucket(id, tier_stash_mod);
    if (const uint32_t m = match(tier_stash_keys + s * kWays, id)) {
      const int64_t slot = s * kWays + __builtin_ctz(m);
      *score = tier_stash_scores[slot];
      return tier_main_slots + slot;
    }
    return -1;
  }

  // The score value of a unique id seen ``count`` times with custom max ``top``.
  int64_t value(int64_t count, int64_t top) const {
    if (accumulate) return count;
    return custom ? top : step;
  }
};

// A part's counts, a cache line of their own (why: two threads settling
// neighbouring parts bumped counters of one line at every bucket).
struct alignas(64) PartCounts {
  int64_t unique = 0;
  int64_t evicted = 0;
  int64_t evicted_collect = 0;
};

// One worker's scratch, reused bucket after bucket.
struct alignas(64) Worker {  // a cache line of its own, as PartCounts
  std::vector<std::pair<int64_t, int64_t>> misses;  // (id, position in the order)
  std::vector<NewId> new_ids;
  std::vector<int> way_of;  // counter phase: per waiting id, see count_bucket
  std::vector<float> row;   // a new row as drawn (float32)
  std::vector<uint16_t> half_row;  // ... in a half-precision row dtype, before it is streamed out
  Placement placement;
  std::vector<int64_t> metrics;  // [T, KV_NUM_METRICS]
};

#if defined(__SSE2__)
constexpr bool kStreamRows = true;
// dst (16-byte aligned) = src, bytes a multiple of 16, by non-temporal stores.
inline void stream_row(void* dst, const void* src, int64_t bytes) {
  auto* d = static_cast<__m128i*>(dst);
  const auto* s = static_cast<const __m128i*>(src);
  for (int64_t j = 0; j < bytes / 16; ++j) _mm_stream_si128(d + j, _mm_loadu_si128(s + j));
}
// Orders the non-temporal stores before whatever the caller does next.
inline void stream_fence() { _mm_sfence(); }
#else
constexpr bool kStreamRows = false;
inline void stream_row(void*, const void*, int64_t) {}
inline void stream_fence() {}
#endif

// A new row drawn in float32 (row), stored in the rows' dtype at dst: float32
// as drawn, float16 / bfloat16 rounded to nearest even (row_dtype.h).
inline void store_row(int64_t dtype, const float* row, void* dst, int64_t dim) {
  if (dtype == KV_ROWS_FLOAT32) {
    std::memcpy(dst, row, sizeof(float) * static_cast<size_t>(dim));
  } else {
    half_row_writer(dtype)(row, static_cast<uint16_t*>(dst), dim);
  }
}

// Wrapping add, as torch's int64 index_add_ (LFU counts never get there).
inline int64_t wrap_add(int64_t a, int64_t b) {
  return static_cast<int64_t>(static_cast<uint64_t>(a) + static_cast<uint64_t>(b));
}

void ensure(bool ok) {
  if (!ok) throw std::bad_alloc();
}

class TrainLookup {
 public:
  TrainLookup(const KvTrainArgs& args, Arena& arena) : a_(args), arena_(arena) {}

  int run() {
    std::fill(a_.metrics, a_.metrics + a_.num_tables * KV_NUM_METRICS, 0);
    a_.sizes[0] = a_.sizes[1] = 0;
    try {
      if (const int status = read_tables(); status != KV_OK) return status;
      if (const int status = hash_occurrences(); status != KV_OK) return status;
      order_by_bucket(bucket_, a_.ids, a_.n, a_.num_buckets_total, threads_, arena_, &occ_,
                      fine_part_shift(a_.num_buckets_total));
      allocate();
      const int64_t parts = occ_.parts;
      ensure(parallel_for(parts, threads_, [&](int64_t p, int64_t w) { collect_part(p, w); }));
      if (any_admission_) {
        admit();
        ensure(parallel_for(parts, threads_, [&](int64_t p, int64_t w) { settle_admission(p, w); }));
      }
      gather();
    } catch (const std::bad_alloc&) {
      return KV_OUT_OF_MEMORY;
    }
    return KV_OK;
  }

 private:
  int read_tables() {
    const int64_t T = a_.num_tables;
    threads_ = std::max<int64_t>(1, a_.num_threads);
    for (int64_t t = 0; t < T; ++t) {
      TableInfo tab;
      if (a_.num_buckets[t] < 1 || a_.bucket_offset[t] < 0 ||
          a_.bucket_offset[t] + a_.num_buckets[t] > a_.num_buckets_total ||
          a_.policy[t] < KV_LRU || a_.policy[t] > KV_NONE || a_.admission_threshold[t] < 1) {
        return KV_BAD_ARGUMENT;
      }
      tab.mod = FastMod(static_cast<uint64_t>(a_.num_buckets[t]));
      tab.bucket_offset = a_.bucket_offset[t];
      tab.step = a_.step[t];
      tab.threshold = a_.admission_threshold[t];
      tab.accumulate = a_.policy[t] == KV_LFU;
      tab.keep_existing = a_.policy[t] == KV_NONE;
      tab.custom = a_.policy[t] == KV_CUSTOM_SCORE && a_.use_custom[t] && a_.custom_scores;
      tab.admission = tab.threshold > 1;
      if (tab.admission) {
        const int64_t offset = a_.counter_bucket_offset[t], count = a_.counter_num_buckets[t];
        if (!a_.counter_keys || !a_.counter_scores || !a_.counter_counts || count < 1 ||
            offset < 0 || offset + count > a_.counter_num_buckets_total) {
          return KV_BAD_ARGUMENT;
        }
        tab.counter_mod = FastMod(static_cast<uint64_t>(count));
        tab.counter_offset = offset;
        any_admission_ = true;
      }
      tab.init_native = a_.init_native[t] != 0;
      tab.init = UniformInit(a_.seed_mix[t], a_.init_low[t], a_.init_high[t]);
      if (a_.tier_index && a_.tier_index[t * KV_TIER_INDEX_COLUMNS] != 0) {
        const int64_t* row = a_.tier_index + t * KV_TIER_INDEX_COLUMNS;
        if (row[1] < 1 || !row[4] || (row[2] != 0 && (row[3] < 1 || !row[5])) || a_.num_promote) {
          return KV_BAD_ARGUMENT;
        }
        tab.tier_main_keys = reinterpret_cast<const int64_t*>(row[0]);
        tab.tier_main_mod = FastMod(static_cast<uint64_t>(row[1]));
        tab.tier_main_slots = row[1] * kWays;
        tab.tier_stash_keys = reinterpret_cast<const int64_t*>(row[2]);
        tab.tier_stash_mod = FastMod(static_cast<uint64_t>(row[2] ? row[3] : 1));
        tab.tier_main_scores = reinterpret_cast<const int64_t*>(row[4]);
        tab.tier_stash_scores = reinterpret_cast<const int64_t*>(row[5]);
      }
      tables_.push_back(tab);
      owner_.add(tab.bucket_offset, tab.bucket_offset + a_.num_buckets[t], t);
      if (tab.admission) {
        counter_owner_.add(tab.counter_offset, tab.counter_offset + a_.counter_num_buckets[t], t);
      }
    }
    if (!owner_.finish() || !counter_owner_.finish()) return KV_BAD_ARGUMENT;
    if (!check_promotions()) return KV_BAD_ARGUMENT;
    workers_.resize(static_cast<size_t>(threads_));
    for (Worker& w : workers_) w.metrics.assign(static_cast<size_t>(T * KV_NUM_METRICS), 0);
    return KV_OK;
  }

  // The lower tier's ids: per table (promote_offsets, or all of table 0 of
  // a one-table group), strictly ascending. Sets promote_begin_.
  bool check_promotions() {
    const int64_t T = a_.num_tables, P = a_.num_promote;
    if (P < 0) return false;
    promote_begin_.assign(static_cast<size_t>(T + 1), 0);
    promote_begin_[static_cast<size_t>(T)] = P;
    if (P == 0) return true;
    if (!a_.promote_ids || !a_.promote_scores) return false;
    if (a_.promote_offsets) {
      for (int64_t t = 0; t <= T; ++t) promote_begin_[t] = a_.promote_offsets[t];
    } else if (T != 1) {
      return false;
    }
    if (promote_begin_[0] != 0 || promote_begin_[T] != P) return false;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t lo = promote_begin_[t], hi = promote_begin_[t + 1];
      if (hi < lo) return false;
      for (int64_t p = lo + 1; p < hi; ++p) {
        if (a_.promote_ids[p] <= a_.promote_ids[p - 1]) return false;
      }
    }
    return true;
  }

  // The global bucket of every occurrence (-1: another group's); checks
  // table indices and ids before anything is modified.
  int hash_occurrences() {
    const int64_t n = a_.n, T = a_.num_tables;
    bucket_ = arena_.take<int64_t>(n);
    constexpr int64_t kPerTask = 1 << 14;
    std::vector<int> status(static_cast<size_t>(threads_), KV_OK);
    ensure(parallel_for((n + kPerTask - 1) / kPerTask, threads_, [&](int64_t task, int64_t w) {
      for (int64_t i = task * kPerTask, end = std::min(n, i + kPerTask); i < end; ++i) {
        const int64_t t = a_.table_idx[i], id = a_.ids[i];
        bucket_[i] = -1;
        if (t == -1) {
          a_.slots[i] = -1;
          a_.unique_index[i] = -1;
        } else if (t < -1 || t >= T) {
          status[w] = std::max<int>(status[w], KV_BAD_TABLE);
        } else if (id < 0) {
          status[w] = std::max<int>(status[w], KV_NEGATIVE_ID);
        } else {
          bucket_[i] = tables_[t].bucket_offset + index_bucket(id, tables_[t].mod);
        }
      }
    }));
    return *std::max_element(status.begin(), status.end());
  }

  void allocate() {
    const int64_t total = occ_.size(), parts = occ_.parts;
    tag_ = arena_.take<int64_t>(total);
    u_id_ = arena_.take<int64_t>(total);
    u_bucket_ = arena_.take<int64_t>(total);
    u_table_ = arena_.take<int64_t>(total);
    u_count_ = arena_.take<int64_t>(total);
    u_value_ = arena_.take<int64_t>(total);
    u_final_ = arena_.take<int64_t>(total);
    u_slot_ = arena_.take<int64_t>(total);
    u_way_ = arena_.take<int8_t>(total);
    u_flags_ = arena_.take<uint8_t>(total);
    if (a_.tier_index) u_tier_slot_ = arena_.take<int64_t>(total);
    e_id_ = arena_.take<int64_t>(total);
    e_slot_ = arena_.take<int64_t>(total);
    e_score_ = arena_.take<int64_t>(total);
    counts_.assign(static_cast<size_t>(parts), PartCounts{});
  }

  // ------------------------------------------------------------ 1. collect
  void collect_part(int64_t p, int64_t worker) {
    Worker& w = workers_[static_cast<size_t>(worker)];
    for_each_bucket(occ_, p, a_.keys, a_.scores, [&](int64_t bucket, int64_t k0, int64_t k1) {
      collect_bucket(p, bucket, k0, k1, w);
    });
    counts_[p].evicted_collect = counts_[p].evicted;
    if (!any_admission_) write_new_rows(occ_.part_start[p], occ_.part_start[p] + counts_[p].unique, w);
  }

  void add_unique(int64_t pos, int64_t id, int64_t bucket, int64_t t, int64_t count, int64_t top,
                  int way) {
    u_id_[pos] = id;
    u_bucket_[pos] = bucket;
    u_table_[pos] = t;
    u_count_[pos] = count;
    u_value_[pos] = tables_[t].value(count, top);
    u_final_[pos] = u_value_[pos];
    u_way_[pos] = static_cast<int8_t>(way);
    u_flags_[pos] = 0;
    if (u_tier_slot_) u_tier_slot_[pos] = -1;
  }

  // A new unique at ``pos`` the lower tier holds: it competes as a stored id
  // that outranks every unprotected entry, and keeps its tier score.
  void mark_promoted(int64_t pos) {
    const int64_t t = u_table_[pos];
    const TableInfo& tab = tables_[t];
    int64_t tier_score;
    if (u_tier_slot_) {  // the table's tier index, probed here
      if (!tab.tier_main_keys) return;
      const int64_t slot = tab.tier_find(u_id_[pos], &tier_score);
      if (slot < 0) return;
      u_tier_slot_[pos] = slot;
    } else {
      const int64_t* end = a_.promote_ids + promote_begin_[t + 1];
      const int64_t* at = std::lower_bound(a_.promote_ids + promote_begin_[t], end, u_id_[pos]);
      if (at == end || *at != u_id_[pos]) return;
      tier_score = a_.promote_scores[at - a_.promote_ids];
    }
    u_final_[pos] = tab.accumulate ? wrap_add(u_count_[pos], tier_score) : u_value_[pos];
    u_value_[pos] = std::numeric_limits<int64_t>::max();
    u_flags_[pos] = kPromoted | kAdmitted;
  }

  // The tier bucket an occurrence kTierAhead ahead would probe if it missed
  // memory: its keys and scores (why: a random read of the tier's index each).
  void prefetch_tier(const Item& item) const {
    const TableInfo& tab = tables_[owner_(item.bucket)];
    if (!tab.tier_main_keys) return;
    const int64_t at = index_bucket(item.key, tab.tier_main_mod) * kWays;
    __builtin_prefetch(tab.tier_main_keys + at);
    __builtin_prefetch(tab.tier_main_keys + at + 8);
    __builtin_prefetch(tab.tier_main_scores + at);
    __builtin_prefetch(tab.tier_main_scores + at + 8);
  }

  // Occurrences at positions [k0, k1) of the order, all in ``bucket``.
  // Uniques: the stored ids in way order, then the new ids by id.
  void collect_bucket(int64_t p, int64_t bucket, int64_t k0, int64_t k1, Worker& w) {
    const Item* items = occ_.items;
    const int64_t t = owner_(bucket);
    const TableInfo& tab = tables_[t];
    const int64_t* keys = a_.keys + bucket * kWays;
    int64_t count[kWays], top[kWays];
    uint32_t seen = 0;
    w.misses.clear();
    const int64_t part_end = occ_.part_start[p + 1];
    for (int64_t k = k0; k < k1; ++k) {
      if (u_tier_slot_ && k + kTierAhead < part_end) prefetch_tier(items[k + kTierAhead]);
      const int64_t id = items[k].key;
      const uint32_t found = match(keys, id);
      if (!found) {
        tag_[k] = -1;
        w.misses.emplace_back(id, k);
        continue;
      }
      const int way = lowest_way(found);
      if (!(seen >> way & 1u)) {
        seen |= 1u << way;
        count[way] = 0;
        top[way] = std::numeric_limits<int64_t>::min();
      }
      ++count[way];
      if (tab.custom) top[way] = std::max(top[way], a_.custom_scores[items[k].index]);
      tag_[k] = way;
    }

    const int64_t base = occ_.part_start[p];
    int64_t& n_unique = counts_[p].unique;
    const int64_t first_unique = n_unique;
    int64_t local_of_way[kWays];
    for (uint32_t m = seen; m; m &= m - 1) {
      const int way = lowest_way(m);
      local_of_way[way] = n_unique;
      add_unique(base + n_unique++, keys[way], bucket, t, count[way], top[way], way);
    }
    if (seen) {
      for (int64_t k = k0; k < k1; ++k) {
        if (tag_[k] >= 0) tag_[k] = local_of_way[tag_[k]];
      }
    }

    if (!w.misses.empty()) {
      auto& misses = w.misses;
      std::sort(misses.begin(), misses.end());
      for (size_t g = 0; g < misses.size();) {
        size_t g1 = g + 1;
        while (g1 < misses.size() && misses[g1].first == misses[g].first) ++g1;
        int64_t top_score = std::numeric_limits<int64_t>::min();
        for (size_t j = g; j < g1; ++j) {
          if (tab.custom) {
            top_score = std::max(top_score, a_.custom_scores[items[misses[j].second].index]);
          }
          tag_[misses[j].second] = n_unique;
        }
        add_unique(base + n_unique, misses[g].first, bucket, t, static_cast<int64_t>(g1 - g),
                   top_score, -1);
        if (a_.num_promote || u_tier_slot_) mark_promoted(base + n_unique);
        ++n_unique;
        g = g1;
      }
    }
    if (!tab.admission) settle_bucket(p, bucket, base + first_unique, base + n_unique, w);
  }

  // ------------------------------------------------------------- 2. admit
  // Every waiting id (admission table, not stored) is counted in its
  // counter bucket; ids seen often enough are admitted and leave the counter.
  void admit() {
    const int64_t total = occ_.size();
    int64_t* counter_bucket = arena_.take<int64_t>(total);
    ensure(parallel_for(occ_.parts, threads_, [&](int64_t p, int64_t) {
      const int64_t base = occ_.part_start[p], used = base + counts_[p].unique;
      for (int64_t pos = base; pos < occ_.part_start[p + 1]; ++pos) {
        counter_bucket[pos] = -1;
        if (pos >= used || u_way_[pos] >= 0 || (u_flags_[pos] & kPromoted)) continue;
        const TableInfo& tab = tables_[u_table_[pos]];
        if (tab.admission) {
          counter_bucket[pos] = tab.counter_offset + index_bucket(u_id_[pos], tab.counter_mod);
        }
      }
    }));
    BucketOrder waiting;
    order_by_bucket(counter_bucket, u_id_, total, a_.counter_num_buckets_total, threads_, arena_,
                    &waiting);
    ensure(parallel_for(waiting.parts, threads_, [&](int64_t p, int64_t worker) {
      const Item* items = waiting.items;
      const int64_t end = waiting.part_start[p + 1];
      for (int64_t k = waiting.part_start[p]; k < end;) {
        int64_t k1 = k + 1;
        while (k1 < end && items[k1].bucket == items[k].bucket) ++k1;
        count_bucket(items + k, k1 - k, workers_[static_cast<size_t>(worker)]);
        k = k1;
      }
    }));
  }

  // The counter insert of KVTable._admit for the waiting uniques ``u[0..m)``
  // (items: counter bucket, id, unique position) of one counter bucket:
  // value = step, no accumulation, no keep_existing.
  void count_bucket(const Item* u, int64_t m, Worker& w) {
    const int64_t bucket = u[0].bucket;
    const TableInfo& tab = tables_[counter_owner_(bucket)];
    int64_t* keys = a_.counter_keys + bucket * kWays;
    int64_t* scores = a_.counter_scores + bucket * kWays;
    int64_t* counts = a_.counter_counts + bucket * kWays;
    // way_of[j]: the way of a counted id (+ kWays when the slot is new to it), or -1.
    w.way_of.assign(static_cast<size_t>(m), -1);
    w.new_ids.clear();
    uint32_t hit_mask = 0;
    for (int64_t j = 0; j < m; ++j) {
      const uint32_t found = match(keys, u[j].key);
      if (found) {
        const int way = lowest_way(found);
        hit_mask |= 1u << way;
        scores[way] = tab.step;
        w.way_of[static_cast<size_t>(j)] = way;
      } else {
        w.new_ids.push_back({u[j].key, tab.step, j});
      }
    }
    if (!w.new_ids.empty()) {
      place_new(keys, scores, hit_mask, false, w.new_ids.data(),
                static_cast<int64_t>(w.new_ids.size()), &w.placement);
      for (size_t r = 0; r < w.new_ids.size(); ++r) {
        const int way = w.placement.way[r];
        if (way >= 0) w.way_of[static_cast<size_t>(w.new_ids[r].ref)] = way + kWays;
      }
    }
    for (int64_t j = 0; j < m; ++j) {
      const int code = w.way_of[static_cast<size_t>(j)];
      int64_t seen = u_count_[u[j].index];
      const int way = code & (kWays - 1);
      if (code >= 0) {
        if (code < kWays) seen += counts[way];  // a slot new to the id starts at 0
        counts[way] = seen;
      }
      if (seen >= tab.threshold) {
        u_flags_[u[j].index] |= kAdmitted;
        if (code >= 0) {
          keys[way] = kEmpty;
          scores[way] = 0;
          counts[way] = 0;
        }
      }
    }
  }

  // ------------------------------------------------------------ 3. settle
  void settle_admission(int64_t p, int64_t worker) {
    Worker& w = workers_[static_cast<size_t>(worker)];
    const int64_t base = occ_.part_start[p], end = base + counts_[p].unique;
    for (int64_t pos = base; pos < end;) {
      int64_t e = pos + 1;
      while (e < end && u_bucket_[e] == u_bucket_[pos]) ++e;
      if (tables_[u_table_[pos]].admission) settle_bucket(p, u_bucket_[pos], pos, e, w);
      pos = e;
    }
    write_new_rows(base, end, w);  // every table's: the collect phase left them
  }

  // The main insert for the uniques [u0, u1) of one bucket: hits are scored,
  // then the candidates (every new id, or the admitted ones) are placed.
  void settle_bucket(int64_t p, int64_t bucket, int64_t u0, int64_t u1, Worker& w) {
    const int64_t t = u_table_[u0];
    const TableInfo& tab = tables_[t];
    int64_t* keys = a_.keys + bucket * kWays;
    int64_t* scores = a_.scores + bucket * kWays;
    int64_t* metrics = w.metrics.data() + t * KV_NUM_METRICS;
    uint32_t hit_mask = 0;
    w.new_ids.clear();
    for (int64_t u = u0; u < u1; ++u) {
      const int way = u_way_[u];
      if (way >= 0) {
        hit_mask |= 1u << way;
        scores[way] = tab.accumulate ? wrap_add(scores[way], u_value_[u]) : u_value_[u];
        u_final_[u] = scores[way];
        u_slot_[u] = bucket * kWays + way;
        metrics[KV_HITS] += u_count_[u];
        continue;
      }
      metrics[KV_MISSES] += u_count_[u];
      if (tab.admission && !(u_flags_[u] & kAdmitted)) {
        u_slot_[u] = -1;
        ++metrics[KV_ADMISSION_REJECTS];
        continue;
      }
      w.new_ids.push_back({u_id_[u], u_value_[u], u});
    }
    if (w.new_ids.empty()) return;

    Placement& placed = w.placement;
    place_new(keys, scores, hit_mask, tab.keep_existing, w.new_ids.data(),
              static_cast<int64_t>(w.new_ids.size()), &placed);
    for (size_t r = 0; r < w.new_ids.size(); ++r) {
      const int64_t u = w.new_ids[r].ref;
      const int way = placed.way[r];
      if (way < 0) {
        u_slot_[u] = -1;
        u_flags_[u] |= kNoRoom;
        ++metrics[KV_INSERT_FAILURES];
        continue;
      }
      u_slot_[u] = bucket * kWays + way;
      if (u_flags_[u] & kPromoted) {
        scores[way] = u_final_[u];
        continue;
      }
      u_flags_[u] |= kInserted;
      ++metrics[KV_INSERTS];
    }
    const int64_t at = occ_.part_start[p] + counts_[p].evicted;
    for (int e = 0; e < placed.n_evicted; ++e) {
      e_id_[at + e] = placed.evicted_id[e];
      e_slot_[at + e] = bucket * kWays + placed.evicted_way[e];
      e_score_[at + e] = placed.evicted_score[e];
    }
    counts_[p].evicted += placed.n_evicted;
    metrics[KV_EVICTIONS] += placed.n_evicted;
  }

  // New rows of the uniques [u0, u1) inserted in this call: initial weights
  // (uniform tables; none without a weights array, whose caller writes them),
  // drawn in float32 and stored in the rows' dtype, and zero state. A pass of
  // its own, after the part's buckets are settled (why: written right at
  // insert time, each row's cache misses stalled the insert; here rows are
  // prefetched a few ahead).
  void write_new_rows(int64_t u0, int64_t u1, Worker& w) {
    const int64_t dim = a_.dim, state_dim = a_.state_dim, dtype = a_.weights_dtype;
    if (!a_.weights && !a_.state) return;  // the caller writes every row
    char* const weights = static_cast<char*>(a_.weights);
    const int64_t row_bytes = dim * (dtype == KV_ROWS_FLOAT32 ? 4 : 2);
    // Rows of whole 16-byte blocks are computed in a scratch row and stored
    // around the cache (why: each row's lines were read for ownership only to
    // be overwritten; 327k ids uniform over 100M, nearly all new, took 15-23 %
    // less time streamed, one thread, 4 tables of 1M rows x 64).
    const bool stream = kStreamRows && weights && row_bytes % 16 == 0 &&
                        reinterpret_cast<uintptr_t>(weights) % 16 == 0;
    if (weights) w.row.resize(static_cast<size_t>(dim));
    if (weights && dtype != KV_ROWS_FLOAT32) w.half_row.resize(static_cast<size_t>(dim));
    constexpr int64_t kAhead = 4;
    for (int64_t u = u0; u < u1; ++u) {
      if (u + kAhead < u1 && (u_flags_[u + kAhead] & kInserted)) {
        const int64_t ahead = u_slot_[u + kAhead];
        if (weights && !stream) {
          for (int64_t b = 0; b < row_bytes; b += 64) {
            __builtin_prefetch(weights + ahead * row_bytes + b, 1);
          }
        }
        if (state_dim && a_.state) __builtin_prefetch(a_.state + ahead * state_dim, 1);
      }
      if (!(u_flags_[u] & kInserted)) continue;
      const int64_t slot = u_slot_[u];
      const TableInfo& tab = tables_[u_table_[u]];
      if (tab.init_native && weights) {
        char* const dst = weights + slot * row_bytes;
        if (dtype == KV_ROWS_FLOAT32 && !stream) {
          tab.init.fill(reinterpret_cast<float*>(dst), dim, u_id_[u]);
        } else {
          tab.init.fill(w.row.data(), dim, u_id_[u]);
          if (!stream) {
            store_row(dtype, w.row.data(), dst, dim);
          } else if (dtype == KV_ROWS_FLOAT32) {
            stream_row(dst, w.row.data(), row_bytes);
          } else {
            store_row(dtype, w.row.data(), w.half_row.data(), dim);
            stream_row(dst, w.half_row.data(), row_bytes);
          }
        }
      }
      if (state_dim && a_.state) {
        std::memset(a_.state + slot * state_dim, 0, sizeof(float) * state_dim);
      }
    }
    if (stream) stream_fence();
  }

  // ------------------------------------------------------------ 4. gather
  void gather() {
    const int64_t parts = occ_.parts;
    std::vector<int64_t> unique_base(static_cast<size_t>(parts) + 1, 0);
    std::vector<int64_t> evicted_base(static_cast<size_t>(parts) + 1, 0);
    for (int64_t p = 0; p < parts; ++p) {
      unique_base[p + 1] = unique_base[p] + counts_[p].unique;
      evicted_base[p + 1] = evicted_base[p] + counts_[p].evicted;
    }
    ensure(parallel_for(parts, threads_, [&](int64_t p, int64_t) {
      const int64_t base = occ_.part_start[p];
      for (int64_t j = 0, out = unique_base[p]; j < counts_[p].unique; ++j, ++out) {
        a_.unique_ids[out] = u_id_[base + j];
        a_.unique_slots[out] = u_slot_[base + j];
        a_.unique_table[out] = u_table_[base + j];
        a_.unique_inserted[out] = u_flags_[base + j] & kInserted;
        if (a_.unique_flags) a_.unique_flags[out] = u_flags_[base + j] & ~kAdmitted;
        if (a_.unique_scores) a_.unique_scores[out] = u_final_[base + j];
        if (a_.unique_tier_slots) a_.unique_tier_slots[out] = u_tier_slot_[base + j];
      }
      // Both phases' evictions are ascending by slot: merge them.
      int64_t i = base, i_end = base + counts_[p].evicted_collect;
      int64_t j = i_end, j_end = base + counts_[p].evicted;
      for (int64_t out = evicted_base[p]; i < i_end || j < j_end; ++out) {
        const bool first = j >= j_end || (i < i_end && e_slot_[i] < e_slot_[j]);
        const int64_t from = first ? i++ : j++;
        a_.evicted_ids[out] = e_id_[from];
        a_.evicted_slots[out] = e_slot_[from];
        if (a_.evicted_scores) a_.evicted_scores[out] = e_score_[from];
      }
      for (int64_t k = base; k < occ_.part_start[p + 1]; ++k) {
        const int64_t i_occ = occ_.items[k].index, local = tag_[k];
        a_.slots[i_occ] = u_slot_[base + local];
        a_.unique_index[i_occ] = unique_base[p] + local;
      }
    }));
    for (const Worker& w : workers_) {
      for (size_t m = 0; m < w.metrics.size(); ++m) a_.metrics[m] += w.metrics[m];
    }
    a_.sizes[0] = unique_base[parts];
    a_.sizes[1] = evicted_base[parts];
  }

  const KvTrainArgs& a_;
  Arena& arena_;  // every array below is taken from it
  std::vector<TableInfo> tables_;
  std::vector<int64_t> promote_begin_;  // [T + 1] where each table's promotions start
  BucketOwner owner_, counter_owner_;
  bool any_admission_ = false;
  int64_t threads_ = 1;
  int64_t* bucket_ = nullptr;  // [n] global bucket of each occurrence, -1: another group's
  BucketOrder occ_;            // occurrences by bucket
  int64_t* tag_ = nullptr;     // per position of occ_.items: the part-local unique index
  // Uniques of part p at [occ_.part_start[p], + counts_[p].unique).
  int64_t *u_id_ = nullptr, *u_bucket_ = nullptr, *u_table_ = nullptr;
  int64_t *u_count_ = nullptr, *u_value_ = nullptr, *u_slot_ = nullptr;
  int64_t* u_final_ = nullptr;  // the score the unique's slot ends with (or would)
  int8_t* u_way_ = nullptr;  // the stored way before the call, -1: new
  uint8_t* u_flags_ = nullptr;
  int64_t* u_tier_slot_ = nullptr;  // with a tier index: the promoted id's tier slot, else -1
  // Evictions of part p at [occ_.part_start[p], + counts_[p].evicted): the
  // collect phase's first (evicted_collect), then the settle phase's.
  int64_t *e_id_ = nullptr, *e_slot_ = nullptr, *e_score_ = nullptr;
  std::vector<PartCounts> counts_;
  std::vector<Worker> workers_;
};

}  // namespace
}  // namespace kvemb

extern "C" int kv_lookup_train_group(const KvTrainArgs* args) {
  if (!args || args->n < 0 || args->num_tables < 0 || args->dim < 1 || args->state_dim < 0 ||
      args->weights_dtype < KV_ROWS_FLOAT32 || args->weights_dtype > KV_ROWS_BFLOAT16) {
    return KV_BAD_ARGUMENT;
  }
  try {
    kvemb::ArenaLease lease(args->workspace ? &args->workspace->arena : nullptr,
                            args->workspace ? &args->workspace->busy : nullptr);
    return kvemb::TrainLookup(*args, lease.arena()).run();
  } catch (const std::bad_alloc&) {
    return KV_OUT_OF_MEMORY;
  }
}
