// C ABI of the native CPU kernels of torchrec_kvemb.
//
// Loaded with ctypes by torchrec_kvemb/ops/native.py, which checks every
// tensor (dtype, device, contiguity, shape) before a call: the kernels trust
// their pointers and sizes. All sizes and offsets are int64. Every entry
// point returns a KvStatus; on an error nothing was modified unless said.
//
// Argument structs hold only 8-byte members (int64, double, pointers), so
// their ctypes mirrors in native.py lay out the same on every 64-bit ABI.
#pragma once

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Bump on any change of a signature or struct below; native.py refuses a
// library whose version differs (a stale build).
#define KV_ABI_VERSION 17

enum KvStatus {
  KV_OK = 0,
  KV_BAD_TABLE = 1,      // a table index outside [-1, num_tables)
  KV_NEGATIVE_ID = 2,    // an id < 0 in a table of the group
  KV_OUT_OF_MEMORY = 3,  // scratch allocation failed (nothing was modified)
  KV_BAD_ARGUMENT = 4,   // inconsistent sizes, offsets or indices
  KV_NO_ROOM = 5,        // kv_host_exchange: an id to place found no empty way
};

// Policy codes of KvTrainArgs.policy (EvictionPolicy in options.py).
enum KvPolicy { KV_LRU = 0, KV_LFU = 1, KV_CUSTOM_SCORE = 2, KV_NONE = 3 };

// Optimizer codes of KvBackwardArgs.kind (OptimKind.code in optimizer.py).
enum KvOptim { KV_SGD = 0, KV_ROWWISE_ADAGRAD = 1, KV_ADAM = 2 };

// A row's optimizer state: its blocks in this order (OptimKind.state_names),
// each one float (momentum1) or dim floats (exp_avg, exp_avg_sq; STATE_PER_COLUMN).
enum KvStateBlock { KV_MOMENTUM1 = 0, KV_EXP_AVG = 0, KV_EXP_AVG_SQ = 1 };

// Metric columns of KvTrainArgs.metrics ([T, 6] deltas).
enum KvMetric {
  KV_HITS = 0,
  KV_MISSES = 1,
  KV_INSERTS = 2,
  KV_EVICTIONS = 3,
  KV_ADMISSION_REJECTS = 4,
  KV_INSERT_FAILURES = 5,
  KV_NUM_METRICS = 6,
};

int kv_abi_version(void);

// The worker pool of every parallel call (pool.h): out[0] pool threads
// started in this process, out[1] calls it ran, out[2] calls that found it
// busy and started threads of their own, out[3] its idle spin in us.
int kv_pool_stats(int64_t* out);

// A check of the pool alone (tests): ``tasks`` tasks on ``num_threads``
// threads, each sleeping ``sleep_us`` and writing its worker and its OS
// thread id; task ``failing_task`` throws std::bad_alloc instead (KV_OUT_OF_MEMORY).
int kv_pool_selftest(int64_t tasks, int64_t num_threads, int64_t failing_task, int64_t sleep_us,
                     int64_t* worker_of_task, int64_t* thread_of_task);

// Whether this CPU runs AVX2 code, and whether this build is the AVX2 one.
int kv_cpu_has_avx2(void);
int kv_build_has_avx2(void);

// Float16 rows are converted by F16C instructions where the CPU has them
// (row_dtype.h), by integer code elsewhere: the same bits. enable 0 turns F16C
// off for the whole process, 1 back on; returns 1 if F16C is used after the call.
int kv_set_f16c(int64_t enable);

// Scratch memory an op may reuse across calls (see workspace.h); optional
// (null: the call allocates its own). One call at a time uses it; a call
// that finds it in use allocates its own.
typedef struct KvWorkspace KvWorkspace;
KvWorkspace* kv_workspace_create(void);
void kv_workspace_destroy(KvWorkspace* workspace);
int64_t kv_workspace_bytes(const KvWorkspace* workspace);

// Index bucket of each id (ops/hashing.py index_bucket) in a table of
// num_buckets buckets; exposed for tests of the multiply-high remainder.
int kv_index_bucket(const int64_t* ids, int64_t n, int64_t num_buckets, int64_t* out);

// Uniform initial rows [n, dim] (ops/hashing.py init_rows, normal=False).
int kv_init_uniform(const int64_t* ids, int64_t n, int64_t dim, int64_t seed_mix, double low,
                    double high, int64_t num_threads, float* out);

// Read-only probe of a group index: global slot of each id (-1: absent, or
// table_idx -1), and hits per table. keys: [num_buckets_total, 16].
int kv_lookup_eval_group(const int64_t* keys, int64_t num_buckets_total,
                         const int64_t* bucket_offset, const int64_t* num_buckets,
                         int64_t num_tables, const int64_t* ids, const int64_t* table_idx,
                         int64_t n, int64_t num_threads, int64_t* slots, int64_t* hits);

// Row dtypes (KvTrainArgs, KvBackwardArgs, KvPooledArgs .weights_dtype).
enum KvRowDtype { KV_ROWS_FLOAT32 = 0, KV_ROWS_FLOAT16 = 1, KV_ROWS_BFLOAT16 = 2 };

// Training lookup of a group (KVTable.lookup_train for T memory-only tables).
typedef struct KvTrainArgs {
  // Group index and rows, updated in place.
  int64_t* keys;    // [NB, 16], -1: empty way
  int64_t* scores;  // [NB, 16]
  int64_t num_buckets_total;
  // [NB * 16, dim] of weights_dtype (KvRowDtype), or null: new rows' weights are the
  // caller's to write. New uniform rows of half-precision tables are drawn in
  // float32 and stored rounded to nearest even (row_dtype.h), as torch's `.to()`.
  void* weights;
  int64_t weights_dtype;
  int64_t dim;
  float* state;  // [NB * 16, state_dim]
  int64_t state_dim;
  // Admission counter group index (tables with threshold > 1 own a range).
  int64_t* counter_keys;    // [NCB, 16] (may be null when no table admits)
  int64_t* counter_scores;  // [NCB, 16]
  int64_t* counter_counts;  // [NCB * 16]
  int64_t counter_num_buckets_total;
  // Per table, [T] each.
  int64_t num_tables;
  const int64_t* bucket_offset;
  const int64_t* num_buckets;
  const int64_t* policy;     // KvPolicy
  const int64_t* step;       // the table's clock value for this batch
  const int64_t* use_custom; // 1: scores are the custom scores (max per id)
  const int64_t* admission_threshold;
  const int64_t* counter_bucket_offset;
  const int64_t* counter_num_buckets;
  const int64_t* init_native;  // 1: write uniform initial rows; 0: the caller fills them
  const int64_t* seed_mix;
  const double* init_low;
  const double* init_high;
  // The batch: raw ids with duplicates.
  const int64_t* ids;            // [n]
  const int64_t* table_idx;      // [n], -1: not this group's id
  const int64_t* custom_scores;  // [n] or null
  int64_t n;
  int64_t num_threads;
  KvWorkspace* workspace;  // or null
  // Outputs. Unique and evicted arrays hold n entries (an upper bound);
  // sizes[0] / sizes[1] say how many are used.
  int64_t* slots;           // [n] global slot per occurrence, -1: no row
  int64_t* unique_index;    // [n] unique of each occurrence, -1: table_idx -1
  int64_t* unique_ids;      // [U]
  int64_t* unique_slots;    // [U]
  int64_t* unique_table;    // [U]
  uint8_t* unique_inserted; // [U] 1: got a new row in this call
  int64_t* evicted_ids;     // [E], by slot
  int64_t* evicted_slots;   // [E]
  int64_t* metrics;         // [T, KV_NUM_METRICS] deltas (overwritten)
  int64_t* sizes;           // [2]: U, E
  // A lower tier under the group's tables (TieredKVTable.lookup_train, a group
  // of tiered tables); all optional. promote_ids: the batch's ids the tier
  // holds (not in memory), table by table (promote_offsets [T + 1]; null: all
  // of table 0 of a one-table group), ascending within a table, with their
  // memory scores. Such an id competes as a stored one
  // (never counted for admission) that outranks every unprotected entry, is
  // not counted as an insert, and its slot takes the score it would have kept
  // (LFU: batch count + promote score). With a null state (and weights), the
  // call writes no rows: the caller moves evicted rows out, then writes the
  // promoted and new rows.
  const int64_t* promote_ids;      // [P] ascending within each table
  const int64_t* promote_scores;   // [P]
  const int64_t* promote_offsets;  // [T + 1] or null (T == 1)
  int64_t num_promote;
  uint8_t* unique_flags;    // [U] KvUniqueFlag bits, or null
  int64_t* unique_scores;   // [U] the score the id holds (or would: no row), or null
  int64_t* evicted_scores;  // [E] the evicted entries' scores, or null
  // Instead of promote_ids (num_promote 0), optional: each table's host tier
  // index, probed for the table's ids not in memory ([T, KV_TIER_INDEX_COLUMNS]
  // int64: main keys address, main buckets, stash keys address (0: none),
  // stash buckets, main scores address, stash scores address; the index's
  // score of an id is its memory score; a row whose first entry is 0: no
  // tier). A held id is promoted as above, with that score; unique_tier_slots
  // [U] (with tier_index) gets its global tier slot (stash slots after the
  // main ones), -1 where not promoted. The tier is only read.
  const int64_t* tier_index;
  int64_t* unique_tier_slots;
} KvTrainArgs;

#define KV_TIER_INDEX_COLUMNS 6

// Bits of KvTrainArgs.unique_flags.
enum KvUniqueFlag {
  KV_UNIQUE_INSERTED = 1,  // a new row in this call
  KV_UNIQUE_PROMOTED = 2,  // one of promote_ids
  KV_UNIQUE_NO_ROOM = 4,   // a candidate (stored, promoted or admitted) without a memory row
};

int kv_lookup_train_group(const KvTrainArgs* args);

// Gradient reduction over a training lookup's unique rows, then one
// optimizer step per row, in place. Half-precision rows are read to float32,
// updated in float32 as float32 rows are, and stored rounded to nearest even
// (row_dtype.h); the optimizer state is float32 whatever the rows.
typedef struct KvBackwardArgs {
  void* weights;          // [rows, dim] of weights_dtype
  int64_t weights_dtype;  // KvRowDtype
  float* state;           // [rows, state_dim]
  int64_t num_rows;
  int64_t dim;
  int64_t state_dim;
  // Gradient of bag b: grad + (b / bags_per_group) * group_stride
  //                         + (b % bags_per_group) * bag_stride (floats).
  const float* grad;
  int64_t bags_per_group;
  int64_t group_stride;
  int64_t bag_stride;
  const int64_t* offsets;  // [num_bags + 1] into the occurrences
  int64_t num_bags;
  const float* per_sample_weights;  // [n] or null
  int64_t mean;
  const int64_t* unique_index;  // [n], -1: no unique
  int64_t n;
  const int64_t* unique_slots;  // [U], -1: no row (skipped)
  const int64_t* unique_table;  // [U]
  int64_t num_unique;
  int64_t num_tables;
  const double* learning_rate;  // [T]
  const int64_t* optim_step;    // [T], from 1
  int64_t kind;                 // KvOptim
  double eps;
  double beta1;
  double beta2;
  double weight_decay;
  int64_t weight_decay_mode;  // 0 none, 1 L2, 2 decoupled
  int64_t gradient_clipping;
  double max_gradient;
  int64_t num_threads;
  KvWorkspace* workspace;  // or null
} KvBackwardArgs;

int kv_fused_backward_group(const KvBackwardArgs* args);

// Pooled forward of a group by slot (kv_pooled_forward), or, given keys, the
// fused eval lookup: the group index probed and the found rows pooled in one
// pass. Rows of weights_dtype are read to
// float32. Bag b (ids [offsets[b], offsets[b + 1])) is the sum in id order of
// its ids' rows times their multiplier: scale[i]; else per_sample_weights[i]
// (1 without) divided by the bag's length (at least 1) where mean_of_bag[b];
// with a multiplier the sum is acc = fma(s, row, acc), without it acc + row
// (what torch's embedding_bag gives through fbgemm). Ids with slot -1 (not
// stored, or not the group's) pool nothing; an empty bag is zeros. Each bag is
// summed by one thread: the bytes do not depend on num_threads.
typedef struct KvPooledArgs {
  const void* weights;    // [num_rows, dim] of weights_dtype
  int64_t weights_dtype;  // KvRowDtype
  int64_t num_rows;
  int64_t dim;
  const int64_t* offsets;  // [num_bags + 1], 0 ... n; null: id b is bag b (num_bags == n)
  int64_t num_bags;
  int64_t n;
  const float* scale;               // [n] or null
  const float* per_sample_weights;  // [n] or null (read when scale is null)
  const uint8_t* mean_of_bag;       // [num_bags] or null (read when scale is null)
  // The table of each id, per bag or per id (at most one given; neither: all -1).
  const int64_t* table_of_bag;  // [num_bags], -1: not the group's bag
  const int64_t* table_idx;     // [n], -1: not the group's id
  int64_t num_tables;
  // Slots of the ids [n] (-1: no row), read without keys; with keys, the
  // index below is probed instead (eval).
  const int64_t* slots;
  const int64_t* keys;  // [num_buckets_total, 16] or null
  int64_t num_buckets_total;
  const int64_t* bucket_offset;  // [T]
  const int64_t* num_buckets;    // [T]
  const int64_t* ids;            // [n]
  // Output: bag b's dim floats at out + out_offset[b] (-1: bag b not written;
  // null: b * dim); every written row inside out [out_numel].
  float* out;
  int64_t out_numel;
  const int64_t* out_offset;  // [num_bags] or null
  // Counters (overwritten; each optional): ids of each table found and seen
  // ([T] each, eval), and ids of a table with slot -1 ([1]).
  int64_t* hits;
  int64_t* seen;
  int64_t* missing;
  int64_t num_threads;
  // 1: no pooling, every id its row (row i of out [n, dim]; the bags give
  // only each id's table; no multiplier, no out_offset).
  int64_t unpooled;
} KvPooledArgs;

int kv_pooled_forward(const KvPooledArgs* args);

// Find-or-insert of unique ids in one index (ops/insert.py insert_torch):
// keys and scores updated in place; every id must be >= 0 (checked before
// anything changes) and appear once.
typedef struct KvInsertArgs {
  int64_t* keys;    // [num_buckets, 16], -1: empty way
  int64_t* scores;  // [num_buckets, 16]
  int64_t num_buckets;
  const int64_t* ids;     // [n] unique
  const int64_t* values;  // [n] score values
  int64_t n;
  int64_t accumulate;     // 1: a hit adds its value to its score (LFU)
  int64_t keep_existing;  // 1: stored entries never lose (NONE)
  int64_t num_threads;
  KvWorkspace* workspace;  // or null
  // Outputs.
  int64_t* slots;          // [n] slot after the call, -1: no row
  uint8_t* hit;            // [n] 1: stored before the call
  uint8_t* inserted;       // [n] 1: got a new row in this call
  int64_t* evicted_ids;    // [n] (an upper bound), ascending by slot
  int64_t* evicted_slots;  // [n]
  int64_t* num_evicted;    // [1]
} KvInsertArgs;

int kv_insert(const KvInsertArgs* args);

// Puts absent ids [n] into the first empty ways of their buckets, in the
// given order (index.py BucketIndex.place): slots [n], -1 for every id of a
// bucket without room for all of them. Keys are written, scores untouched.
int kv_place(int64_t* keys, int64_t num_buckets, const int64_t* ids, int64_t n,
             int64_t num_threads, int64_t* slots);

// Stores unique ids [n] with score values in an EMPTY index (index.py
// BucketIndex.bulk_load): the ids of a bucket take ways 0, 1, ... in input
// order; when any bucket is given more than 16, every bucket's ids go in rank
// order (score desc, id asc) and those past 16 get slot -1. slots [n].
int kv_bulk_load(int64_t* keys, int64_t* scores, int64_t num_buckets, const int64_t* ids,
                 const int64_t* values, int64_t n, int64_t num_threads, int64_t* slots);

// Copies records[k] of slab [slab_records, words] into out [k, words]; ok[k]:
// the record holds ids[r] and its checksum matches (ssd/slab.py verify).
int kv_read_records(const int64_t* slab, int64_t slab_records, int64_t words,
                    const int64_t* records, int64_t k, const int64_t* ids, int64_t num_threads,
                    int64_t* out, uint8_t* ok);

// dest[slots[r], :width] = rows[r, :width] for r in [0, k) (float32; row
// strides in floats); refuses a slot outside [0, dest_rows) before writing.
int kv_scatter_rows(float* dest, int64_t dest_rows, int64_t dest_stride, int64_t width,
                    const int64_t* slots, int64_t k, const float* rows, int64_t rows_stride,
                    int64_t num_threads);

// dest[r, :width] = src[slots[r], :width] for r in [0, k) (float32; row
// strides in floats); refuses a slot outside [0, src_rows) before reading.
int kv_gather_rows(const float* src, int64_t src_rows, int64_t src_stride, int64_t width,
                   const int64_t* slots, int64_t k, float* dest, int64_t dest_stride,
                   int64_t num_threads);

// Checksums [k] of slab records block [k, words] (ssd/slab.py checksum).
int kv_record_checksum(const int64_t* block, int64_t k, int64_t words, int64_t num_threads,
                       int64_t* out);

// Encodes k records (ids, scores, float32 rows [k, width], checksums) into
// slab [slab_records, words] at the distinct indices records[k]; refuses
// (nothing written) an index outside the slab.
int kv_write_records(int64_t* slab, int64_t slab_records, int64_t words, const int64_t* records,
                     int64_t k, const int64_t* ids, const int64_t* scores, const float* rows,
                     int64_t width, int64_t num_threads);

// The n ids stored in keys [num_slots] (-1: empty) and their slots, ordered by
// routing bucket fmix64(id ^ salt) % num_route_buckets (top bit cleared), then
// by id, into out_ids / out_slots [n]; counts [num_route_buckets]: ids per
// routing bucket. Refuses (KV_BAD_ARGUMENT, outputs undefined) when keys does
// not hold exactly n ids.
int kv_export_order(const int64_t* keys, int64_t num_slots, uint64_t salt,
                    int64_t num_route_buckets, int64_t n, int64_t* out_ids, int64_t* out_slots,
                    int64_t* counts);

// CRC-32 of data[0, n) continuing crc: zlib's crc32(crc, data, n), into *out.
int kv_crc32(const uint8_t* data, int64_t n, uint32_t crc, uint32_t* out);
// 1 where kv_crc32 folds with carry-less multiplies (x86-64 with PCLMULQDQ),
// else 0 (a byte-wise table, slower than zlib).
int kv_crc32_folds(void);
// kv_crc32 of src[0, n) while copying it to dst[0, n) (not overlapping), in one
// pass; where kv_crc32_folds(), the bulk is stored non-temporally.
int kv_crc32_copy(uint8_t* dst, const uint8_t* src, int64_t n, uint32_t crc, uint32_t* out);

// One table's rows trade places with its host tier's records after a training
// lookup (host_tier.py HostTier.exchange; ops/host_exchange.py is the torch
// path it equals). The host tier's index is a main part and an optional stash
// ([main_slots] and [stash_slots] keys, scores, record numbers; a global slot
// below main_slots is the main part's). In this order:
// 0. a down id whose down_host_slots[k] is -1 is placed: it takes the lowest
//    empty way of its main bucket, else of its stash bucket (in k order), and
//    its slot is written to down_host_slots[k]; if one finds neither, every id
//    this call placed is taken out again and the call returns KV_NO_ROOM,
//    nothing else written;
// 1. down: the table's rows at down_slots[k] (weights [table_rows, dim], state
//    [table_rows, state_dim]) go to records popped from free_list (the last of
//    its *free_count entries first) at the index slots down_host_slots[k]
//    (record -1 there), with their ids and memory scores (in the records and
//    as the index slots' scores);
// 2. up: the records at the index slots up_host_slots[p] are copied to the
//    table's rows at up_slots[p] (-1: not copied);
// 3. the up ids leave the index (key -1, score 0, record -1) and their records
//    are pushed on the free list (their ids -1).
// Host rows are [records, dim + state_dim] float32 (weights, then state). The
// down records and the up records are distinct (step 1 pops before step 3
// pushes). Refuses (KV_BAD_ARGUMENT, nothing written) a slot or record out of
// range, a down slot that holds a record, an up slot that holds none, fewer
// free records than down rows, or a free record that holds an id.
typedef struct KvHostExchangeArgs {
  float* weights;
  float* state;  // null when state_dim is 0
  int64_t table_rows;
  int64_t dim;
  int64_t state_dim;
  float* rows;
  int64_t* record_ids;
  int64_t* record_scores;
  int64_t num_records;
  int64_t* free_list;
  int64_t* free_count;  // [1], updated
  int64_t* main_keys;
  int64_t* main_scores;
  int64_t* main_record;
  int64_t main_slots;
  int64_t* stash_keys;  // null when stash_slots is 0
  int64_t* stash_scores;
  int64_t* stash_record;
  int64_t stash_slots;
  const int64_t* down_slots;
  const int64_t* down_ids;
  const int64_t* down_scores;
  int64_t* down_host_slots;  // -1: placed by the call (written)
  int64_t num_down;
  const int64_t* up_host_slots;
  const int64_t* up_slots;
  int64_t num_up;
  int64_t num_threads;
} KvHostExchangeArgs;
int kv_host_exchange(const KvHostExchangeArgs* args);

#ifdef __cplusplus
}
#endif
