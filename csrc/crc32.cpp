// CRC-32 of the zip and zlib formats (polynomial 0x04C11DB7, bit-reflected:
// 0xEDB88320), bit for bit zlib's crc32(crc, data, n). A checkpoint checksums
// every byte it writes (torch.save records are zip archives).
//
// On x86-64 CPUs with PCLMULQDQ the bulk is folded with carry-less multiplies:
// four 128-bit lanes, each advanced 512 bits per 64-byte step (a lane times
// x^(512+32) and x^(512-32) mod P, halves apart, plus the next input block),
// then the lanes folded into one (x^(128+32), x^(128-32) mod P), the leftover
// 16-byte blocks folded in the same way, and the 128-bit remainder reduced to
// 64 bits, to 32, and by a Barrett reduction to the CRC (Gopal et al., "Fast
// CRC Computation for Generic Polynomials Using PCLMULQDQ", Intel, 2009).
// Bytes before and after the 16-byte multiples go through a 256-entry table.
// Elsewhere only the table runs, slower than zlib's own code: callers ask
// kv_crc32_folds() and keep zlib where it says 0 (ops/checksum.py).
//
// kv_crc32_copy does the same while copying the bytes to another buffer, in one
// pass over them (a checkpoint's writer fills its O_DIRECT buffer so: the rows
// are read from memory once, not once for the copy and once for the CRC).
#include <cstdint>
#include <cstring>

#include "kvemb_native.h"

#if defined(__x86_64__)
#include <immintrin.h>
#define KV_CRC_FOLD 1
#endif

namespace {

struct Table {
  uint32_t v[256];
  constexpr Table() : v() {
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0xEDB88320u : c >> 1;
      v[i] = c;
    }
  }
};
constexpr Table kTable{};

// ``state`` is the CRC register (zlib's value, inverted).
uint32_t crc_table(uint32_t state, const uint8_t* p, int64_t n) {
  for (int64_t i = 0; i < n; ++i) state = kTable.v[(state ^ p[i]) & 0xFF] ^ (state >> 8);
  return state;
}

#ifdef KV_CRC_FOLD
// Powers of x modulo P, bit-reflected (each 33 bits): the fold distances.
constexpr int64_t kX544 = 0x154442bd4;  // x^(4*128+32) mod P: a lane's low half
constexpr int64_t kX480 = 0x1c6e41596;  // x^(4*128-32) mod P: its high half
constexpr int64_t kX160 = 0x1751997d0;  // x^(128+32) mod P
constexpr int64_t kX96 = 0x0ccaa009e;   // x^(128-32) mod P
constexpr int64_t kX64 = 0x163cd6124;   // x^64 mod P
constexpr int64_t kPoly = 0x1db710641;  // P, reflected
constexpr int64_t kMu = 0x1f7011641;    // floor(x^64 / P), reflected

__attribute__((target("pclmul,sse4.1"))) inline __m128i fold(__m128i lane, __m128i k,
                                                               __m128i next) {
  const __m128i low = _mm_clmulepi64_si128(lane, k, 0x00);
  const __m128i high = _mm_clmulepi64_si128(lane, k, 0x11);
  return _mm_xor_si128(_mm_xor_si128(low, high), next);
}

__attribute__((target("pclmul,sse4.1"))) inline __m128i load(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

// Where the bytes go besides the CRC: nowhere, or a copy with non-temporal
// stores (16-byte aligned destination): a checkpoint's write buffer is read
// next by the disk, not the CPU, so its lines need not push the training's out
// of the caches.
enum class Store { kNone, kStream };

template <Store kStore>
__attribute__((target("pclmul,sse4.1"))) inline __m128i put(uint8_t* dst, __m128i v) {
  if constexpr (kStore == Store::kStream) {
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst), v);
  }
  return v;
}

// The register after n bytes (n >= 64, a multiple of 16), stored to dst as read.
template <Store kStore>
__attribute__((target("pclmul,sse4.1"))) uint32_t crc_fold(uint32_t state, const uint8_t* p,
                                                             int64_t n, uint8_t* dst) {
  const __m128i by4 = _mm_set_epi64x(kX480, kX544);
  const __m128i by1 = _mm_set_epi64x(kX96, kX160);
  __m128i x0 = _mm_xor_si128(put<kStore>(dst, load(p)),
                             _mm_cvtsi32_si128(static_cast<int>(state)));
  __m128i x1 = put<kStore>(dst + 16, load(p + 16));
  __m128i x2 = put<kStore>(dst + 32, load(p + 32));
  __m128i x3 = put<kStore>(dst + 48, load(p + 48));
  p += 64;
  dst += 64;
  n -= 64;
  for (; n >= 64; p += 64, dst += 64, n -= 64) {
    x0 = fold(x0, by4, put<kStore>(dst, load(p)));
    x1 = fold(x1, by4, put<kStore>(dst + 16, load(p + 16)));
    x2 = fold(x2, by4, put<kStore>(dst + 32, load(p + 32)));
    x3 = fold(x3, by4, put<kStore>(dst + 48, load(p + 48)));
  }
  x0 = fold(x0, by1, x1);
  x0 = fold(x0, by1, x2);
  x0 = fold(x0, by1, x3);
  for (; n >= 16; p += 16, dst += 16, n -= 16) x0 = fold(x0, by1, put<kStore>(dst, load(p)));
  if constexpr (kStore == Store::kStream) _mm_sfence();
  // 128 -> 64 bits: the low half times x^96 onto the high half.
  x0 = _mm_xor_si128(_mm_srli_si128(x0, 8), _mm_clmulepi64_si128(x0, by1, 0x10));
  // 64 -> 32 bits (plus 32 zero bits appended): the low 32 times x^64.
  const __m128i low32 = _mm_set_epi32(0, 0, 0, -1);
  const __m128i shifted = _mm_srli_si128(x0, 4);
  x0 = _mm_clmulepi64_si128(_mm_and_si128(x0, low32), _mm_set_epi64x(0, kX64), 0x00);
  x0 = _mm_xor_si128(x0, shifted);
  // Barrett reduction: q = (low 32 * mu) mod x^32, crc = x0 + q * P.
  const __m128i barrett = _mm_set_epi64x(kMu, kPoly);
  __m128i q = _mm_clmulepi64_si128(_mm_and_si128(x0, low32), barrett, 0x10);
  q = _mm_clmulepi64_si128(_mm_and_si128(q, low32), barrett, 0x00);
  return static_cast<uint32_t>(_mm_extract_epi32(_mm_xor_si128(x0, q), 1));
}

bool cpu_folds() { return __builtin_cpu_supports("pclmul") && __builtin_cpu_supports("sse4.1"); }
#endif

}  // namespace

extern "C" int kv_crc32_folds(void) {
#ifdef KV_CRC_FOLD
  return cpu_folds() ? 1 : 0;
#else
  return 0;
#endif
}

extern "C" int kv_crc32(const uint8_t* data, int64_t n, uint32_t crc, uint32_t* out) {
  if (n < 0 || (n > 0 && data == nullptr) || out == nullptr) return KV_BAD_ARGUMENT;
  uint32_t state = ~crc;
#ifdef KV_CRC_FOLD
  static const bool folds = cpu_folds();
  if (folds && n >= 64) {
    const int64_t bulk = n & ~int64_t{15};
    state = crc_fold<Store::kNone>(state, data, bulk, nullptr);
    data += bulk;
    n -= bulk;
  }
#endif
  *out = ~crc_table(state, data, n);
  return KV_OK;
}

extern "C" int kv_crc32_copy(uint8_t* dst, const uint8_t* src, int64_t n, uint32_t crc,
                             uint32_t* out) {
  if (n < 0 || (n > 0 && (dst == nullptr || src == nullptr)) || out == nullptr) {
    return KV_BAD_ARGUMENT;
  }
  if (n > 0 && dst < src + n && src < dst + n) return KV_BAD_ARGUMENT;  // overlapping
  uint32_t state = ~crc;
#ifdef KV_CRC_FOLD
  static const bool folds = cpu_folds();
  // The bytes before dst's next 16-byte boundary go through the table, so that
  // the bulk can be stored non-temporally.
  const int64_t head = static_cast<int64_t>(-reinterpret_cast<uintptr_t>(dst) & 15);
  if (folds && n >= 64 + head) {
    std::memcpy(dst, src, static_cast<size_t>(head));
    state = crc_table(state, src, head);
    dst += head;
    src += head;
    n -= head;
    const int64_t bulk = n & ~int64_t{15};
    state = crc_fold<Store::kStream>(state, src, bulk, dst);
    dst += bulk;
    src += bulk;
    n -= bulk;
  }
#endif
  if (n > 0) std::memcpy(dst, src, static_cast<size_t>(n));
  *out = ~crc_table(state, src, n);
  return KV_OK;
}
