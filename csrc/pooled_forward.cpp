// Pooled forward of a group by slot, and the fused eval lookup (probe + pool).
//
// The bags are cut into tasks of consecutive bags of about kIdsPerTask ids; a
// task probes its ids (eval: probe_pipelined, probe.h, the bucket of the id
// kProbeAhead ahead prefetched), then sums each bag in id order with the row
// of id i + kRowAhead prefetched, and writes the bag's row once. A bag is one
// task's, so the result does not depend on the threads. Why two passes, not
// one pipeline (probe id i + 32, finish id i + 8 and prefetch its row, sum id
// i): one thread, 327k ids in 4 x 65k buckets of a 4M-row group, CPU time:
// 25.7-26.9 ms in two passes against 31.4-32.5 ms in one.
//
// The sums are what the torch path (ops/pooled_lookup.py) gets from
// F.embedding_bag on the CPU, bit for bit: fbgemm's kernel adds rows without
// per-sample weights and accumulates fma(weight, row, acc) with them (so does
// its reference code); an id of weight 0 there is one skipped here. FMA needs
// hardware support to be fast: on x86-64 the weighted sums run in a clone built
// for FMA where the CPU has it (both builds: -mavx2 does not imply -mfma), and
// in std::fma's exact, slower, library code elsewhere.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "kvemb_native.h"
#include "parallel.h"
#include "probe.h"
#include "row_dtype.h"

using namespace kvemb;

namespace {

// A task's ids (why 4096: its ids' tables and slots stay in L2 between the
// probe and the sums; a thread takes ~80 tasks of a 327k-id batch, balanced).
constexpr int64_t kIdsPerTask = 4096;
// Ids between a row's prefetch and its sum (why 8: a row of 64 float32 is four
// cache lines; 8 rows in flight cover a DRAM miss at ~25 ns of sum per row).
constexpr int64_t kRowAhead = 8;

#define KV_ALWAYS_INLINE inline __attribute__((always_inline))

// How a row is read: value by value (at), or, with kBlock, the whole row to
// float32 scratch first (convert).
struct Float32Rows {
  using T = float;
  static constexpr bool kBlock = false;
  static KV_ALWAYS_INLINE float at(const T* row, int64_t j) { return row[j]; }
};
struct Float16Rows {
  using T = uint16_t;
  static constexpr bool kBlock = false;
  static KV_ALWAYS_INLINE float at(const T* row, int64_t j) { return half_bits_to_float(row[j]); }
};
struct BFloat16Rows {
  using T = uint16_t;
  static constexpr bool kBlock = false;
  static KV_ALWAYS_INLINE float at(const T* row, int64_t j) {
    return bfloat16_bits_to_float(row[j]);
  }
};
#if defined(KV_F16C_CLONES)
// Float16 rows by F16C (row_dtype.h): only in the sums (float arithmetic
// follows every read, so VCVTPH2PS's quieting of a signaling NaN changes no
// result); copied rows keep the integer conversion, exact for every pattern.
struct Float16F16CRows {
  using T = uint16_t;
  static constexpr bool kBlock = true;
  static KV_ALWAYS_INLINE float at(const T* row, int64_t j) { return half_bits_to_float(row[j]); }
  // Inlined by the flattened F16C sums below (always_inline would be refused
  // where the generic templates are compiled).
  KV_TARGET_F16C static inline void convert(const T* row, float* out, int64_t dim) {
    half_row_to_float_f16c(row, out, dim);
  }
};
#endif

// What a task's sums read: the arguments, the slots of the task's ids
// [ids_begin, ids_end) (slots[0] is id ids_begin's).
struct Sums {
  const KvPooledArgs* a;
  const int64_t* slots;
  int64_t ids_begin;
  int64_t ids_end;
  float* acc;   // [dim] scratch
  float* row;   // [dim] scratch: a row read to float32 (R::kBlock)
  int* status;  // raised to KV_BAD_ARGUMENT by a slot outside the rows
};

template <class R>
KV_ALWAYS_INLINE void prefetch_row(const KvPooledArgs& a, int64_t slot) {
  if (slot < 0 || slot >= a.num_rows) return;
  const int64_t bytes = a.dim * static_cast<int64_t>(sizeof(typename R::T));
  const char* p = static_cast<const char*>(a.weights) + slot * bytes;
  for (int64_t k = 0; k < bytes; k += 64) __builtin_prefetch(p + k);
}

// The bags [b0, b1) of one task, the row of id i + kRowAhead prefetched while
// id i is summed. kDim: the row width when known at compile time (0: a.dim);
// why: a bag's sum then stays in registers (one thread, 327k ids of 64 floats
// in a 4M-row group, CPU time: 16.3-17.0 against 19.4-20.7 ms).
template <class R, bool kWeighted, int64_t kDim>
KV_ALWAYS_INLINE void sum_bags_body(const Sums& s, int64_t b0, int64_t b1) {
  const KvPooledArgs& a = *s.a;
  const int64_t dim = kDim ? kDim : a.dim;
  const auto* weights = static_cast<const typename R::T*>(a.weights);
  float local[kDim ? kDim : 1];
  float* acc = kDim ? local : s.acc;
  float local_row[kDim && R::kBlock ? kDim : 1];
  float* wide = kDim ? local_row : s.row;
  const int64_t* slots = s.slots - s.ids_begin;  // indexed by the id's position
  for (int64_t b = b0; b < b1; ++b) {
    if (a.out_offset && a.out_offset[b] < 0) continue;
    const int64_t lo = a.offsets ? a.offsets[b] : b;
    const int64_t hi = a.offsets ? a.offsets[b + 1] : b + 1;
    // Bags.build's divisor: the length (at least 1) where the bag pools by MEAN.
    const float divisor = a.mean_of_bag && a.mean_of_bag[b]
                              ? static_cast<float>(std::max<int64_t>(hi - lo, 1))
                              : 1.0f;
    for (int64_t j = 0; j < dim; ++j) acc[j] = 0.0f;
    for (int64_t i = lo; i < hi; ++i) {
      if (i + kRowAhead < s.ids_end) prefetch_row<R>(a, slots[i + kRowAhead]);
      const int64_t slot = slots[i];
      if (slot < 0) continue;
      if (slot >= a.num_rows) {
        *s.status = std::max<int>(*s.status, KV_BAD_ARGUMENT);
        continue;
      }
      const typename R::T* row = weights + slot * dim;
      if constexpr (R::kBlock) R::convert(row, wide, dim);
      if (kWeighted) {
        float w = 1.0f;
        if (a.scale) {
          w = a.scale[i];
        } else {
          w = (a.per_sample_weights ? a.per_sample_weights[i] : 1.0f) / divisor;
        }
        if constexpr (R::kBlock) {
          for (int64_t j = 0; j < dim; ++j) acc[j] = __builtin_fmaf(w, wide[j], acc[j]);
        } else {
          for (int64_t j = 0; j < dim; ++j) acc[j] = __builtin_fmaf(w, R::at(row, j), acc[j]);
        }
      } else if constexpr (R::kBlock) {
        for (int64_t j = 0; j < dim; ++j) acc[j] += wide[j];
      } else {
        for (int64_t j = 0; j < dim; ++j) acc[j] += R::at(row, j);
      }
    }
    float* dst = a.out + (a.out_offset ? a.out_offset[b] : b * dim);
    std::memcpy(dst, acc, static_cast<size_t>(dim) * sizeof(float));
  }
}

// An unpooled float32 output of at least this many bytes is written with
// non-temporal stores, around the caches (why: it does not fit them, and a
// cached write reads each line first; a sequence eval of 163,840 ids of dim 64,
// written in pieces of 10.5 MB, took 17.8 against 20.0 ms of CPU a step on 2
// threads, docs/benchmarks.md). Smaller outputs stay in cache for their reader.
constexpr int64_t kStreamBytes = 8 << 20;

#if defined(__x86_64__)
// dim float32 (a multiple of 4) from row to dst (16-byte aligned), around the caches.
template <int64_t kDim>
KV_ALWAYS_INLINE void stream_row(float* dst, const float* row, int64_t dim) {
  const int64_t d = kDim ? kDim : dim;
  for (int64_t j = 0; j < d; j += 4) _mm_stream_ps(dst + j, _mm_loadu_ps(row + j));
}
template <int64_t kDim>
KV_ALWAYS_INLINE void stream_zeros(float* dst, int64_t dim) {
  const int64_t d = kDim ? kDim : dim;
  const __m128 z = _mm_setzero_ps();
  for (int64_t j = 0; j < d; j += 4) _mm_stream_ps(dst + j, z);
}

// copy_rows_body's float32 rows by non-temporal stores: true where it wrote them
// (an output of at least kStreamBytes, rows of a multiple of 4 floats, aligned).
template <class R, int64_t kDim>
KV_ALWAYS_INLINE bool stream_rows(const Sums& s, int64_t b0, int64_t b1) {
  const KvPooledArgs& a = *s.a;
  if constexpr (!std::is_same_v<R, Float32Rows>) {
    return false;
  } else {
    const int64_t dim = kDim ? kDim : a.dim;
    if (a.out_offset || a.out_numel * 4 < kStreamBytes || dim % 4 != 0 ||
        (reinterpret_cast<uintptr_t>(a.out) & 15) != 0) {
      return false;
    }
    const float* weights = static_cast<const float*>(a.weights);
    const int64_t* slots = s.slots - s.ids_begin;
    for (int64_t i = b0; i < b1; ++i) {
      if (i + kRowAhead < s.ids_end) prefetch_row<R>(a, slots[i + kRowAhead]);
      float* dst = a.out + i * dim;
      const int64_t slot = slots[i];
      if (slot >= a.num_rows) *s.status = std::max<int>(*s.status, KV_BAD_ARGUMENT);
      if (slot < 0 || slot >= a.num_rows) {
        stream_zeros<kDim>(dst, dim);
      } else {
        stream_row<kDim>(dst, weights + slot * dim, dim);
      }
    }
    _mm_sfence();  // the stores are seen before the task is counted done
    return true;
  }
}
#endif

// Every id a bag of its own (no offsets), or unpooled: the rows of ids
// [b0, b1), read to float32, or zeros, straight into their output rows.
template <class R, int64_t kDim>
KV_ALWAYS_INLINE void copy_rows_body(const Sums& s, int64_t b0, int64_t b1) {
#if defined(__x86_64__)
  if (stream_rows<R, kDim>(s, b0, b1)) return;
#endif
  const KvPooledArgs& a = *s.a;
  const int64_t dim = kDim ? kDim : a.dim;
  const auto* weights = static_cast<const typename R::T*>(a.weights);
  const int64_t* slots = s.slots - s.ids_begin;
  for (int64_t i = b0; i < b1; ++i) {
    if (i + kRowAhead < s.ids_end) prefetch_row<R>(a, slots[i + kRowAhead]);
    if (a.out_offset && a.out_offset[i] < 0) continue;
    float* dst = a.out + (a.out_offset ? a.out_offset[i] : i * dim);
    const int64_t slot = slots[i];
    if (slot >= a.num_rows) *s.status = std::max<int>(*s.status, KV_BAD_ARGUMENT);
    if (slot < 0 || slot >= a.num_rows) {
      for (int64_t j = 0; j < dim; ++j) dst[j] = 0.0f;
      continue;
    }
    const typename R::T* row = weights + slot * dim;
    for (int64_t j = 0; j < dim; ++j) dst[j] = R::at(row, j);
  }
}

// One row width's sums, compiled for the dims kDims list (then any dim).
template <class R, bool kWeighted>
KV_ALWAYS_INLINE void sum_bags_any(const Sums& s, int64_t b0, int64_t b1) {
  if (!kWeighted && (!s.a->offsets || s.a->unpooled)) {
    switch (s.a->dim) {  // the ids of the bags
      case 64:
        return copy_rows_body<R, 64>(s, s.ids_begin, s.ids_end);
      default:
        return copy_rows_body<R, 0>(s, s.ids_begin, s.ids_end);
    }
  }
  switch (s.a->dim) {
    case 32:
      return sum_bags_body<R, kWeighted, 32>(s, b0, b1);
    case 64:
      return sum_bags_body<R, kWeighted, 64>(s, b0, b1);
    case 128:
      return sum_bags_body<R, kWeighted, 128>(s, b0, b1);
    default:
      return sum_bags_body<R, kWeighted, 0>(s, b0, b1);
  }
}

template <class R, bool kWeighted>
void sum_bags_plain(const Sums& s, int64_t b0, int64_t b1) {
  sum_bags_any<R, kWeighted>(s, b0, b1);
}

#if defined(__x86_64__)
template <class R>
__attribute__((target("fma"))) void sum_bags_fma(const Sums& s, int64_t b0, int64_t b1) {
  sum_bags_any<R, true>(s, b0, b1);
}

bool cpu_has_fma() {
  static const bool has = __builtin_cpu_supports("fma");
  return has;
}

// Float16 sums by F16C; weighted ones with FMA too.
__attribute__((target("avx,f16c"), flatten)) void sum_bags_f16c(const Sums& s, int64_t b0,
                                                               int64_t b1) {
  sum_bags_any<Float16F16CRows, false>(s, b0, b1);
}
__attribute__((target("avx,f16c,fma"), flatten)) void sum_bags_f16c_fma(const Sums& s, int64_t b0,
                                                                        int64_t b1) {
  sum_bags_any<Float16F16CRows, true>(s, b0, b1);
}
#endif

using SumBags = void (*)(const Sums&, int64_t, int64_t);

template <class R>
SumBags sum_bags_for(bool weighted) {
  if (!weighted) return sum_bags_plain<R, false>;
#if defined(__x86_64__)
  if (cpu_has_fma()) return sum_bags_fma<R>;
#endif
  return sum_bags_plain<R, true>;
}

SumBags sum_bags_of(int64_t dtype, bool weighted) {
  switch (dtype) {
    case KV_ROWS_FLOAT32:
      return sum_bags_for<Float32Rows>(weighted);
    case KV_ROWS_FLOAT16:
#if defined(KV_F16C_CLONES)
      if (use_f16c() && !weighted) return sum_bags_f16c;
      if (use_f16c() && cpu_has_fma()) return sum_bags_f16c_fma;
#endif
      return sum_bags_for<Float16Rows>(weighted);
    case KV_ROWS_BFLOAT16:
      return sum_bags_for<BFloat16Rows>(weighted);
    default:
      return nullptr;
  }
}

// A worker's scratch and counters.
struct Worker {
  std::vector<int64_t> table, slots, hits, seen;
  std::vector<float> acc, row;
  int64_t missing = 0;
  int status = KV_OK;
};

int check_args(const KvPooledArgs& a) {
  const int64_t B = a.num_bags, n = a.n, dim = a.dim;
  if (B < 0 || n < 0 || dim < 0 || a.num_rows < 0 || a.num_tables < 0) {
    return KV_BAD_ARGUMENT;
  }
  if (a.offsets) {
    if (a.offsets[0] != 0 || a.offsets[B] != n) return KV_BAD_ARGUMENT;
    for (int64_t b = 0; b < B; ++b) {
      if (a.offsets[b + 1] < a.offsets[b]) return KV_BAD_ARGUMENT;
    }
  } else if (B != n) {
    return KV_BAD_ARGUMENT;
  }
  if (a.unpooled && (a.out_offset || a.scale || a.per_sample_weights || a.mean_of_bag)) {
    return KV_BAD_ARGUMENT;
  }
  if (a.unpooled && n * dim > a.out_numel) return KV_BAD_ARGUMENT;
  if (a.out_offset) {
    for (int64_t b = 0; b < B; ++b) {
      const int64_t o = a.out_offset[b];
      if (o < -1 || (o >= 0 && o + dim > a.out_numel)) return KV_BAD_ARGUMENT;
    }
  } else if (!a.unpooled && B * dim > a.out_numel) {
    return KV_BAD_ARGUMENT;
  }
  // (An empty tensor's pointer may be null: only what n ids need is required.)
  if (n > 0 && (a.keys ? !a.ids : !a.slots)) return KV_BAD_ARGUMENT;
  return KV_OK;
}

}  // namespace

extern "C" int kv_pooled_forward(const KvPooledArgs* args) {
  const KvPooledArgs& a = *args;
  const int64_t T = a.num_tables;
  if (a.hits) std::fill(a.hits, a.hits + T, 0);
  if (a.seen) std::fill(a.seen, a.seen + T, 0);
  if (a.missing) *a.missing = 0;
  if (int status = check_args(a); status != KV_OK) return status;
  const bool weighted = a.scale || a.per_sample_weights || a.mean_of_bag;
  const SumBags sum_bags = sum_bags_of(a.weights_dtype, weighted);
  if (!sum_bags) return KV_BAD_ARGUMENT;
  const bool probe = a.keys != nullptr;
  GroupIndex index;
  if (probe &&
      index.init(a.keys, a.num_buckets_total, a.bucket_offset, a.num_buckets, T) != KV_OK) {
    return KV_BAD_ARGUMENT;
  }
  const int64_t B = a.num_bags, n = a.n;
  const bool tables = a.table_of_bag || a.table_idx;
  const bool count = a.seen || a.missing || probe;  // per-id tables needed

  // Tasks: consecutive bags, about n / tasks ids each.
  const int64_t tasks = std::max<int64_t>(1, (n + kIdsPerTask - 1) / kIdsPerTask);
  std::vector<int64_t> first_bag(static_cast<size_t>(tasks + 1));
  for (int64_t k = 0; k <= tasks; ++k) {
    const int64_t target = slice_begin(n, tasks, k);
    first_bag[k] =
        k == tasks ? B
        : a.offsets ? std::lower_bound(a.offsets, a.offsets + B + 1, target) - a.offsets
                    : target;
    first_bag[k] = std::min(first_bag[k], B);
  }
  const int64_t workers = worker_count(tasks, a.num_threads);
  std::vector<Worker> scratch(static_cast<size_t>(workers));
  for (Worker& w : scratch) {
    w.hits.assign(static_cast<size_t>(T), 0);
    w.seen.assign(static_cast<size_t>(T), 0);
    w.acc.resize(static_cast<size_t>(std::max<int64_t>(a.dim, 1)));
    w.row.resize(static_cast<size_t>(std::max<int64_t>(a.dim, 1)));
  }

  const bool ok = parallel_for(tasks, a.num_threads, [&](int64_t task, int64_t worker) {
    Worker& w = scratch[worker];
    const int64_t b0 = first_bag[task], b1 = first_bag[task + 1];
    if (b0 >= b1) return;
    const int64_t i0 = a.offsets ? a.offsets[b0] : b0;
    const int64_t i1 = a.offsets ? a.offsets[b1] : b1;
    const int64_t m = i1 - i0;
    const int64_t* table = nullptr;
    if (count && m > 0) {
      if (static_cast<int64_t>(w.table.size()) < m) w.table.resize(static_cast<size_t>(m));
      int64_t* tab = w.table.data();
      if (a.table_idx) {
        std::copy(a.table_idx + i0, a.table_idx + i1, tab);
      } else if (a.table_of_bag) {
        for (int64_t b = b0; b < b1; ++b) {
          const int64_t lo = a.offsets ? a.offsets[b] : b;
          const int64_t hi = a.offsets ? a.offsets[b + 1] : b + 1;
          std::fill(tab + (lo - i0), tab + (hi - i0), a.table_of_bag[b]);
        }
      } else {
        std::fill(tab, tab + m, -1);
      }
      table = tab;
      if (a.seen) {
        for (int64_t j = 0; j < m; ++j) {
          if (tab[j] >= 0 && tab[j] < T) ++w.seen[tab[j]];
        }
      }
    }
    const int64_t* slots = probe ? nullptr : a.slots + i0;
    if (probe && m > 0) {
      if (static_cast<int64_t>(w.slots.size()) < m) w.slots.resize(static_cast<size_t>(m));
      probe_pipelined(index, a.ids + i0, table, m, w.slots.data(), w.hits.data(), &w.status);
      slots = w.slots.data();
    }
    if (a.missing && tables) {
      for (int64_t j = 0; j < m; ++j) w.missing += table[j] >= 0 && slots[j] < 0;
    }
    sum_bags(Sums{&a, slots, i0, i1, w.acc.data(), w.row.data(), &w.status}, b0, b1);
  });
  if (!ok) return KV_OUT_OF_MEMORY;
  int status = KV_OK;
  for (const Worker& w : scratch) status = std::max(status, w.status);
  if (status != KV_OK) return status;
  for (const Worker& w : scratch) {
    for (int64_t t = 0; t < T; ++t) {
      if (a.hits) a.hits[t] += w.hits[t];
      if (a.seen) a.seen[t] += w.seen[t];
    }
    if (a.missing) *a.missing += w.missing;
  }
  return KV_OK;
}
