// kv_host_exchange: a table's demoted rows go into its host tier's records and
// its promoted rows come back, in one call (kvemb_native.h says what it
// writes, in which order). Why one call: the host tier's bookkeeping as torch
// ops was some 40 small ops a step beside the two row copies through a buffer
// each way (docs/tiers.md, Measured); here each row is copied once, between
// its random table slot and its random record, the next rows prefetched.
#include <algorithm>
#include <cstring>

#include <vector>

#include "bucket.h"
#include "hashing.h"
#include "kvemb_native.h"
#include "parallel.h"
#include "prefetch.h"

namespace {

using kvemb::prefetch_bytes;

// Rows a task copies (as rows.cpp: a step's few thousand rows in small tasks).
constexpr int64_t kRowsPerTask = 512;
// Rows between a row's prefetch and its copy.
constexpr int64_t kAhead = 8;


// The index columns of a global slot: the main part's below main_slots, else
// the stash's.
struct HostIndex {
  const KvHostExchangeArgs& a;
  int64_t* record(int64_t slot) const {
    return slot < a.main_slots ? a.main_record + slot : a.stash_record + (slot - a.main_slots);
  }
  int64_t* score(int64_t slot) const {
    return slot < a.main_slots ? a.main_scores + slot : a.stash_scores + (slot - a.main_slots);
  }
  void clear(int64_t slot) const {
    if (slot < a.main_slots) {
      a.main_keys[slot] = -1;
      a.main_scores[slot] = 0;
      a.main_record[slot] = -1;
    } else {
      const int64_t s = slot - a.main_slots;
      a.stash_keys[s] = -1;
      a.stash_scores[s] = 0;
      a.stash_record[s] = -1;
    }
  }
};

int check(const KvHostExchangeArgs& a) {
  if (a.dim < 0 || a.state_dim < 0 || a.table_rows < 0 || a.num_records < 0 || a.num_down < 0 ||
      a.num_up < 0 || a.main_slots < 0 || a.stash_slots < 0) {
    return KV_BAD_ARGUMENT;
  }
  if ((a.state_dim > 0 && a.state == nullptr) ||
      (a.stash_slots > 0 && (!a.stash_keys || !a.stash_scores || !a.stash_record))) {
    return KV_BAD_ARGUMENT;
  }
  const int64_t free_count = *a.free_count;
  if (free_count < a.num_down || free_count > a.num_records) return KV_BAD_ARGUMENT;
  const int64_t slots = a.main_slots + a.stash_slots;
  HostIndex index{a};
  if (a.main_slots % kvemb::kWays || a.stash_slots % kvemb::kWays || a.main_slots < 1) {
    return KV_BAD_ARGUMENT;
  }
  for (int64_t k = 0; k < a.num_down; ++k) {
    const int64_t slot = a.down_host_slots[k];
    if (a.down_slots[k] < 0 || a.down_slots[k] >= a.table_rows || a.down_ids[k] < 0) {
      return KV_BAD_ARGUMENT;
    }
    if (slot < -1 || slot >= slots || (slot >= 0 && *index.record(slot) != -1)) {
      return KV_BAD_ARGUMENT;
    }
    const int64_t record = a.free_list[free_count - 1 - k];
    if (record < 0 || record >= a.num_records || a.record_ids[record] != -1) {
      return KV_BAD_ARGUMENT;
    }
  }
  for (int64_t p = 0; p < a.num_up; ++p) {
    const int64_t slot = a.up_host_slots[p];
    if (slot < 0 || slot >= slots || a.up_slots[p] < -1 || a.up_slots[p] >= a.table_rows) {
      return KV_BAD_ARGUMENT;
    }
    const int64_t record = *index.record(slot);
    if (record < 0 || record >= a.num_records) return KV_BAD_ARGUMENT;
  }
  return KV_OK;
}

// Step 0: the down ids without a slot take the lowest empty way of their main
// bucket, else of their stash bucket; false (each placed id taken out again,
// its slot -1 again) when one finds neither.
bool place(const KvHostExchangeArgs& a) {
  using kvemb::kWays;
  const kvemb::FastMod main_mod(static_cast<uint64_t>(a.main_slots / kWays));
  const kvemb::FastMod stash_mod(static_cast<uint64_t>(a.stash_slots ? a.stash_slots / kWays : 1));
  std::vector<int64_t> placed;
  placed.reserve(static_cast<size_t>(a.num_down));  // (throws, if it does, before any write)
  for (int64_t k = 0; k < a.num_down; ++k) {
    if (a.down_host_slots[k] != -1) continue;
    const int64_t id = a.down_ids[k];
    int64_t* keys = a.main_keys + kvemb::index_bucket(id, main_mod) * kWays;
    int64_t base = 0;
    uint32_t empty = kvemb::match(keys, kvemb::kEmpty);
    if (!empty && a.stash_slots) {
      keys = a.stash_keys + kvemb::index_bucket(id, stash_mod) * kWays;
      base = a.main_slots;
      empty = kvemb::match(keys, kvemb::kEmpty);
    }
    if (!empty) {
      for (const int64_t j : placed) {
        const int64_t slot = a.down_host_slots[j];
        if (slot < a.main_slots) {
          a.main_keys[slot] = kvemb::kEmpty;
        } else {
          a.stash_keys[slot - a.main_slots] = kvemb::kEmpty;
        }
        a.down_host_slots[j] = -1;
      }
      return false;
    }
    const int way = __builtin_ctz(empty);
    keys[way] = id;
    const int64_t bucket_start = base + (keys - (base ? a.stash_keys : a.main_keys));
    a.down_host_slots[k] = bucket_start + way;
    placed.push_back(k);
  }
  return true;
}

}  // namespace

extern "C" int kv_host_exchange(const KvHostExchangeArgs* args) {
  const KvHostExchangeArgs& a = *args;
  if (const int status = check(a); status != KV_OK) return status;
  try {
    if (!place(a)) return KV_NO_ROOM;
  } catch (const std::bad_alloc&) {
    return KV_OUT_OF_MEMORY;
  }
  const HostIndex index{a};
  const int64_t width = a.dim + a.state_dim;
  const int64_t free_top = *a.free_count;
  const int64_t* popped = a.free_list + free_top - a.num_down;  // record of down k: popped[n-1-k]
  auto down_record = [&](int64_t k) { return popped[a.num_down - 1 - k]; };

  // 1. down: records, ids, memory scores, then the rows.
  for (int64_t k = 0; k < a.num_down; ++k) {
    const int64_t record = down_record(k);
    *index.record(a.down_host_slots[k]) = record;
    *index.score(a.down_host_slots[k]) = a.down_scores[k];
    a.record_ids[record] = a.down_ids[k];
    a.record_scores[record] = a.down_scores[k];
  }
  const int64_t down_tasks = (a.num_down + kRowsPerTask - 1) / kRowsPerTask;
  bool ok = kvemb::parallel_for(down_tasks, a.num_threads, [&](int64_t task, int64_t) {
    const int64_t begin = task * kRowsPerTask, end = std::min(a.num_down, begin + kRowsPerTask);
    for (int64_t k = begin; k < end; ++k) {
      if (k + kAhead < end) {
        const int64_t slot = a.down_slots[k + kAhead];
        prefetch_bytes(a.weights + slot * a.dim, 4 * a.dim, false);
        if (a.state_dim) prefetch_bytes(a.state + slot * a.state_dim, 4 * a.state_dim, false);
        prefetch_bytes(a.rows + down_record(k + kAhead) * width, 4 * width, true);
      }
      const int64_t slot = a.down_slots[k];
      float* out = a.rows + down_record(k) * width;
      std::memcpy(out, a.weights + slot * a.dim, sizeof(float) * a.dim);
      if (a.state_dim) {
        std::memcpy(out + a.dim, a.state + slot * a.state_dim, sizeof(float) * a.state_dim);
      }
    }
  });

  // 2. up: the promoted records' rows to their table slots.
  const int64_t up_tasks = (a.num_up + kRowsPerTask - 1) / kRowsPerTask;
  const bool up_ok = kvemb::parallel_for(up_tasks, a.num_threads, [&](int64_t task, int64_t) {
    const int64_t begin = task * kRowsPerTask, end = std::min(a.num_up, begin + kRowsPerTask);
    for (int64_t p = begin; p < end; ++p) {
      if (p + kAhead < end && a.up_slots[p + kAhead] >= 0) {
        const int64_t slot = a.up_slots[p + kAhead];
        prefetch_bytes(a.rows + *index.record(a.up_host_slots[p + kAhead]) * width, 4 * width, false);
        prefetch_bytes(a.weights + slot * a.dim, 4 * a.dim, true);
        if (a.state_dim) prefetch_bytes(a.state + slot * a.state_dim, 4 * a.state_dim, true);
      }
      const int64_t slot = a.up_slots[p];
      if (slot < 0) continue;
      const float* row = a.rows + *index.record(a.up_host_slots[p]) * width;
      std::memcpy(a.weights + slot * a.dim, row, sizeof(float) * a.dim);
      if (a.state_dim) {
        std::memcpy(a.state + slot * a.state_dim, row + a.dim, sizeof(float) * a.state_dim);
      }
    }
  });
  ok = ok && up_ok;
  if (!ok) return KV_OUT_OF_MEMORY;

  // 3. the promoted ids leave the index; their records go back on the free list.
  int64_t free_count = free_top - a.num_down;
  for (int64_t p = 0; p < a.num_up; ++p) {
    const int64_t slot = a.up_host_slots[p];
    const int64_t record = *index.record(slot);
    a.record_ids[record] = -1;
    a.free_list[free_count++] = record;
    index.clear(slot);
  }
  *a.free_count = free_count;
  return KV_OK;
}
