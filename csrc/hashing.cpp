// Entry points of the hashing primitives (tests compare them with the torch
// path), the ABI version and workspaces.
#include "hashing.h"

#include "kvemb_native.h"
#include "parallel.h"
#include "workspace.h"

using namespace kvemb;

extern "C" int kv_abi_version(void) { return KV_ABI_VERSION; }

extern "C" int kv_cpu_has_avx2(void) {
#if defined(__x86_64__) || defined(__i386__)
  return __builtin_cpu_supports("avx2") ? 1 : 0;  // cpuid and the OS's saved AVX state
#else
  return 0;
#endif
}

extern "C" int kv_build_has_avx2(void) {
#if defined(__AVX2__)
  return 1;
#else
  return 0;
#endif
}

extern "C" KvWorkspace* kv_workspace_create(void) { return new (std::nothrow) KvWorkspace(); }

extern "C" void kv_workspace_destroy(KvWorkspace* workspace) { delete workspace; }

extern "C" int64_t kv_workspace_bytes(const KvWorkspace* workspace) {
  return workspace ? workspace->arena.bytes() : 0;
}

extern "C" int kv_index_bucket(const int64_t* ids, int64_t n, int64_t num_buckets, int64_t* out) {
  if (num_buckets < 1) return KV_BAD_ARGUMENT;
  const FastMod mod(static_cast<uint64_t>(num_buckets));
  for (int64_t i = 0; i < n; ++i) out[i] = index_bucket(ids[i], mod);
  return KV_OK;
}

extern "C" int kv_init_uniform(const int64_t* ids, int64_t n, int64_t dim, int64_t seed_mix,
                               double low, double high, int64_t num_threads, float* out) {
  if (dim < 1) return KV_BAD_ARGUMENT;
  const UniformInit init(seed_mix, low, high);
  constexpr int64_t kRowsPerTask = 4096;
  const bool ok = parallel_for((n + kRowsPerTask - 1) / kRowsPerTask, num_threads,
                               [&](int64_t task, int64_t) {
                                 const int64_t end = std::min(n, (task + 1) * kRowsPerTask);
                                 for (int64_t i = task * kRowsPerTask; i < end; ++i) {
                                   init.fill(out + i * dim, dim, ids[i]);
                                 }
                               });
  return ok ? KV_OK : KV_OUT_OF_MEMORY;
}
