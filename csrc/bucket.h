// One index bucket: 16 int64 keys (-1: empty way) beside 16 int64 scores.
//
// match() finds an id among the keys; place_new() runs the ranking rule of
// torchrec_kvemb/ops/insert.py for the new ids of one bucket.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace kvemb {

constexpr int64_t kWays = 16;
constexpr int64_t kEmpty = -1;

// Bit w set where keys[w] == id. Branch-free: a hit sits at any way, and a
// data-dependent exit mispredicts about once per probe.
inline uint32_t match(const int64_t* keys, int64_t id) {
#if defined(__AVX2__)
  const __m256i needle = _mm256_set1_epi64x(id);
  uint32_t mask = 0;
  for (int j = 0; j < 4; ++j) {
    const __m256i k = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(keys + 4 * j));
    const __m256d eq = _mm256_castsi256_pd(_mm256_cmpeq_epi64(k, needle));
    mask |= static_cast<uint32_t>(_mm256_movemask_pd(eq)) << (4 * j);
  }
  return mask;
#elif defined(__SSE2__)
  // SSE2 (every x86-64) has no 64-bit compare: two 32-bit halves must both match.
  const __m128i needle = _mm_set1_epi64x(id);
  uint32_t mask = 0;
  for (int j = 0; j < 8; ++j) {
    const __m128i k = _mm_loadu_si128(reinterpret_cast<const __m128i*>(keys + 2 * j));
    const __m128i eq32 = _mm_cmpeq_epi32(k, needle);
    const __m128i eq64 = _mm_and_si128(eq32, _mm_shuffle_epi32(eq32, _MM_SHUFFLE(2, 3, 0, 1)));
    mask |= static_cast<uint32_t>(_mm_movemask_pd(_mm_castsi128_pd(eq64))) << (2 * j);
  }
  return mask;
#else
  uint32_t mask = 0;
  for (int w = 0; w < kWays; ++w) mask |= static_cast<uint32_t>(keys[w] == id) << w;
  return mask;
#endif
}

inline int lowest_way(uint32_t mask) { return __builtin_ctz(mask); }

inline void prefetch_bucket(const int64_t* keys) {
  __builtin_prefetch(keys);
  __builtin_prefetch(keys + 8);
}

// A new id of one bucket (not stored there), with its score value and the
// caller's reference to it.
struct NewId {
  int64_t id;
  int64_t value;
  int64_t ref;
};

// Where place_new put the new ids and which stored entries it evicted.
struct Placement {
  std::vector<int8_t> way;  // per new id in rank order: its way, or -1
  int n_evicted = 0;
  int64_t evicted_id[kWays];
  int64_t evicted_score[kWays];  // before the call
  int evicted_way[kWays];        // ascending
};

// Rank order of new ids among themselves: score desc, then id asc.
inline bool new_ranks_first(const NewId& a, const NewId& b) {
  return a.value != b.value ? a.value > b.value : a.id < b.id;
}

// The insert rule for one bucket whose hits are already scored
// (``protected_mask``: the ways hit by this batch). Stored entries and the
// new ids compete: protected first (with keep_existing every stored entry),
// then score desc, then new before stored, then id asc; the first 16 stay.
// Winning new ids take the freed and empty ways in ascending way order, in
// rank order. ``ids`` is sorted into rank order; keys and scores are written.
inline void place_new(int64_t* keys, int64_t* scores, uint32_t protected_mask, bool keep_existing,
                      NewId* ids, int64_t n, Placement* out) {
  if (n <= 16) {
    for (int64_t i = 1; i < n; ++i) {  // insertion sort: most buckets see one or two
      const NewId x = ids[i];
      int64_t j = i;
      for (; j > 0 && new_ranks_first(x, ids[j - 1]); --j) ids[j] = ids[j - 1];
      ids[j] = x;
    }
  } else {
    std::sort(ids, ids + n, new_ranks_first);
  }
  const uint32_t empty = match(keys, kEmpty);
  const uint32_t occupied = ~empty & 0xFFFFu;
  if (keep_existing) protected_mask = occupied;

  uint32_t freed = 0;
  int64_t winners = n;
  if (n > __builtin_popcount(empty)) {
    // Stored entries in rank order (at most 16: insertion sort), then a merge
    // with the new ids that stops after 16 candidates.
    int order[kWays];
    int n_stored = 0;
    auto stored_first = [&](int a, int b) {
      const bool pa = (protected_mask >> a) & 1u, pb = (protected_mask >> b) & 1u;
      if (pa != pb) return pa;
      if (scores[a] != scores[b]) return scores[a] > scores[b];
      return keys[a] < keys[b];
    };
    for (uint32_t m = occupied; m; m &= m - 1) {
      const int w = lowest_way(m);
      int j = n_stored++;
      for (; j > 0 && stored_first(w, order[j - 1]); --j) order[j] = order[j - 1];
      order[j] = w;
    }
    uint32_t kept = 0;
    int64_t i = 0, j = 0;
    for (int64_t taken = 0; taken < kWays && (i < n_stored || j < n); ++taken) {
      const bool stored_wins =
          i < n_stored &&
          (j >= n || ((protected_mask >> order[i]) & 1u) || scores[order[i]] > ids[j].value);
      if (stored_wins) {
        kept |= 1u << order[i++];
      } else {
        ++j;
      }
    }
    winners = j;
    freed = occupied & ~kept;
  }

  out->way.assign(static_cast<size_t>(n), -1);
  out->n_evicted = 0;
  for (uint32_t m = freed; m; m &= m - 1) {
    const int w = lowest_way(m);
    out->evicted_id[out->n_evicted] = keys[w];
    out->evicted_score[out->n_evicted] = scores[w];
    out->evicted_way[out->n_evicted++] = w;
  }
  uint32_t free_ways = empty | freed;
  for (int64_t r = 0; r < winners; ++r) {
    const int w = lowest_way(free_ways);
    free_ways &= free_ways - 1;
    keys[w] = ids[r].id;
    scores[w] = ids[r].value;
    out->way[static_cast<size_t>(r)] = static_cast<int8_t>(w);
  }
}

}  // namespace kvemb
