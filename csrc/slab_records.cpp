// Slab records of the SSD tier (torchrec_kvemb/ssd/slab.py): the checksum of
// a record, and records encoded straight into the slab's mapping.
//
// A record is `words` int64 words: id, score, checksum, then the row's
// float32 values zero-padded to a whole word. The checksum mixes every word
// but the checksum word (counted as 0) with its position and sums the mixed
// words modulo 2**64; slab.py's numpy `checksum` is the reference.
#include <algorithm>
#include <cstring>

#include "kvemb_native.h"
#include "parallel.h"

namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
constexpr uint64_t kMix = 0xFF51AFD7ED558CCDull;
constexpr int64_t kChecksumWord = 2;
constexpr int64_t kHeadWords = 3;
constexpr int64_t kRecordsPerTask = 1024;

inline uint64_t mixed(uint64_t word, int64_t position) {
  uint64_t x = (word ^ (static_cast<uint64_t>(position + 1) * kGolden)) * kMix;
  return x ^ (x >> 32);
}

inline int64_t record_checksum(const int64_t* record, int64_t words) {
  uint64_t sum = 0;
  for (int64_t j = 0; j < words; ++j) {
    sum += mixed(j == kChecksumWord ? 0 : static_cast<uint64_t>(record[j]), j);
  }
  return static_cast<int64_t>(sum);
}

// Whether every record index is inside the slab.
bool inside(const int64_t* records, int64_t k, int64_t slab_records) {
  for (int64_t r = 0; r < k; ++r) {
    if (records[r] < 0 || records[r] >= slab_records) return false;
  }
  return true;
}

// Calls fn(r, record) for r in [0, k), record = slab + records[r] * words,
// on up to num_threads threads, prefetching records a few ahead (why: the
// records are spread over the slab, and their cache misses then overlap).
template <class Record, class F>
bool for_each_record(Record* slab, int64_t words, const int64_t* records, int64_t k,
                     int64_t num_threads, F&& fn) {
  constexpr int64_t kAhead = 8;
  const int64_t tasks = (k + kRecordsPerTask - 1) / kRecordsPerTask;
  return kvemb::parallel_for(tasks, num_threads, [&](int64_t task, int64_t) {
    const int64_t begin = task * kRecordsPerTask, end = std::min(k, begin + kRecordsPerTask);
    for (int64_t r = begin; r < end; ++r) {
      if (r + kAhead < end) {
        const char* ahead = reinterpret_cast<const char*>(slab + records[r + kAhead] * words);
        for (int64_t b = 0; b < words * 8; b += 64) __builtin_prefetch(ahead + b);
      }
      fn(r, slab + records[r] * words);
    }
  });
}

}  // namespace

extern "C" int kv_record_checksum(const int64_t* block, int64_t k, int64_t words,
                                  int64_t num_threads, int64_t* out) {
  if (k < 0 || words <= kHeadWords) return KV_BAD_ARGUMENT;
  const int64_t tasks = (k + kRecordsPerTask - 1) / kRecordsPerTask;
  const bool ok = kvemb::parallel_for(tasks, num_threads, [&](int64_t task, int64_t) {
    for (int64_t r = task * kRecordsPerTask, end = std::min(k, r + kRecordsPerTask); r < end; ++r) {
      out[r] = record_checksum(block + r * words, words);
    }
  });
  return ok ? KV_OK : KV_OUT_OF_MEMORY;
}

extern "C" int kv_write_records(int64_t* slab, int64_t slab_records, int64_t words,
                                const int64_t* records, int64_t k, const int64_t* ids,
                                const int64_t* scores, const float* rows, int64_t width,
                                int64_t num_threads) {
  if (k < 0 || words <= kHeadWords || width < 0 || 2 * (words - kHeadWords) < width ||
      !inside(records, k, slab_records)) {
    return KV_BAD_ARGUMENT;
  }
  const bool ok = for_each_record(slab, words, records, k, num_threads,
                                  [&](int64_t r, int64_t* record) {
    record[0] = ids[r];
    record[1] = scores[r];
    record[kChecksumWord] = 0;
    float* values = reinterpret_cast<float*>(record + kHeadWords);
    std::memcpy(values, rows + r * width, sizeof(float) * width);
    std::fill(values + width, values + 2 * (words - kHeadWords), 0.0f);
    record[kChecksumWord] = record_checksum(record, words);
  });
  return ok ? KV_OK : KV_OUT_OF_MEMORY;
}

extern "C" int kv_read_records(const int64_t* slab, int64_t slab_records, int64_t words,
                               const int64_t* records, int64_t k, const int64_t* ids,
                               int64_t num_threads, int64_t* out, uint8_t* ok) {
  if (k < 0 || words <= kHeadWords || !inside(records, k, slab_records)) return KV_BAD_ARGUMENT;
  const bool done = for_each_record(slab, words, records, k, num_threads,
                                    [&](int64_t r, const int64_t* record) {
    int64_t* copy = out + r * words;
    std::memcpy(copy, record, sizeof(int64_t) * words);
    ok[r] = copy[0] == ids[r] && copy[kChecksumWord] == record_checksum(copy, words);
  });
  return done ? KV_OK : KV_OUT_OF_MEMORY;
}
