// Rows stored in float16 or bfloat16: read to float32 (exact), written back
// rounded to nearest, ties to even, bit for bit what torch's tensor
// `.to(torch.float16)` / `.to(torch.bfloat16)` give on x86-64:
//
// * float16: subnormals rounded at 2**-24, values from 65520 up become inf,
//   NaN keeps its sign and the top 9 payload bits with the quiet bit set.
// * bfloat16: every NaN becomes 0xFFFF (torch's vectorized conversion, the
//   one its CPU kernels take wherever AVX2 runs; its scalar one gives 0x7FC0).
//
// Branch-free integer and float code (every case computed, one picked by
// masks), so the row loops vectorize in both builds (SSE2 or AVX2).
// The float additions below rely on the default rounding mode (to nearest),
// which the library never changes.
//
// Float16 rows on x86-64 CPUs with F16C (every AVX2 CPU has it): whole rows
// are converted by the F16C instructions in functions compiled for them
// (target attributes, chosen at run time, in both builds: -mavx2 does not
// imply -mf16c). Why: the integer code costs about twelve vector operations per
// eight values, F16C one; a float16 pooled forward of 327k ids x 64 (2 threads)
// took 0.61x a float32 one's time with the integer code. The same bits: VCVTPS2PH
// with round-to-nearest-even rounds as float_to_half_bits (subnormals,
// overflow to inf, NaN quieted with its top payload bits); VCVTPH2PS is exact
// except that it quiets a signaling NaN, so it serves only where float
// arithmetic follows the read (sums, optimizer updates), which quiets it anyway.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstring>

#include "kvemb_native.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kvemb {

inline uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// All ones where cond holds, else 0. Why selects by masks, not `?:`: GCC kept
// branches around the float addition below and vectorized no row loop; a
// float16 backward of 259k rows x 64 (row-wise Adagrad, 1 thread, AVX2 build)
// took 67-77 ms, 45-51 ms with masks (float32 rows: 39-46 ms).
inline uint32_t mask_if(bool cond) { return 0u - static_cast<uint32_t>(cond); }

// float32 -> float16 bits, round to nearest even.
inline uint16_t float_to_half_bits(float f) {
  const uint32_t x = float_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7FFFFFFFu;
  // Normal results: rebias the exponent (-112 << 23, modulo 2**32) and round
  // the 13 dropped bits to even; a carry moves into the exponent, and 65520
  // and up reach 0x7C00 (inf).
  const uint32_t normal = (ax + 0xC8000FFFu + ((ax >> 13) & 1u)) >> 13;
  // Below 2**-14: adding 0.5 puts units of 2**-24 (float16's subnormal step)
  // in the last place, and the float addition rounds to even; the bits above
  // 0.5's are the result (0x400 when it rounds up to 2**-14).
  const uint32_t subnormal = float_bits(bits_float(ax) + 0.5f) - 0x3F000000u;
  // From 2**16: inf, or NaN with its top 9 payload bits and the quiet bit.
  const uint32_t nan = mask_if(ax > 0x7F800000u);
  const uint32_t special = 0x7C00u | (nan & (0x200u | ((ax >> 13) & 0x3FFu)));
  const uint32_t is_subnormal = mask_if(ax < 0x38800000u);
  const uint32_t is_special = mask_if(ax >= 0x47800000u);
  const uint32_t h = (is_subnormal & subnormal) | (is_special & special) |
                     (~(is_subnormal | is_special) & normal);
  return static_cast<uint16_t>(sign | h);
}

// float16 bits -> float32, exact (NaN keeps its payload).
inline float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t shifted = static_cast<uint32_t>(h & 0x7FFFu) << 13;
  const uint32_t exponent = shifted & 0x0F800000u;
  const uint32_t rebiased = shifted + (112u << 23);  // normal numbers
  // inf and NaN: exponent 255, another 112 up
  const uint32_t special = mask_if(exponent == 0x0F800000u);
  // Subnormals (exponent 0): m * 2**-24, exact as (2**-14 + m * 2**-24) - 2**-14.
  const uint32_t subnormal = float_bits(bits_float(rebiased + (1u << 23)) - 0x1p-14f);
  const uint32_t is_subnormal = mask_if(exponent == 0);
  const uint32_t value =
      (is_subnormal & subnormal) | (~is_subnormal & (rebiased + (special & (112u << 23))));
  return bits_float(sign | value);
}

// float32 -> bfloat16 bits, round to nearest even.
inline uint16_t float_to_bfloat16_bits(float f) {
  const uint32_t x = float_bits(f);
  const uint32_t rounded = (x + 0x7FFFu + ((x >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(rounded | mask_if((x & 0x7FFFFFFFu) > 0x7F800000u));
}

inline float bfloat16_bits_to_float(uint16_t b) {
  return bits_float(static_cast<uint32_t>(b) << 16);
}

// Whole rows, by the functions above (vectorized loops).
inline void half_row_to_float(const uint16_t* row, float* out, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) out[d] = half_bits_to_float(row[d]);
}
inline void bfloat16_row_to_float(const uint16_t* row, float* out, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) out[d] = bfloat16_bits_to_float(row[d]);
}
inline void float_row_to_half(const float* values, uint16_t* row, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) row[d] = float_to_half_bits(values[d]);
}
inline void float_row_to_bfloat16(const float* values, uint16_t* row, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) row[d] = float_to_bfloat16_bits(values[d]);
}

#if defined(__x86_64__)
#define KV_F16C_CLONES 1
#define KV_TARGET_F16C __attribute__((target("avx,f16c")))

// Whether this CPU (and OS: AVX state saved) runs F16C code.
inline bool cpu_has_f16c() {
  static const bool has = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  return has;
}

// kv_set_f16c: 0 turns the F16C conversions off (tests run both paths).
inline std::atomic<int> f16c_allowed{1};

// Whether float16 rows take the F16C conversions now.
inline bool use_f16c() { return f16c_allowed.load(std::memory_order_relaxed) && cpu_has_f16c(); }

// A float16 row to float32 by VCVTPH2PS: exact, signaling NaN quieted (see above).
KV_TARGET_F16C inline __attribute__((always_inline)) void half_row_to_float_f16c(
    const uint16_t* row, float* out, int64_t dim) {
  int64_t d = 0;
  for (; d + 8 <= dim; d += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d));
    _mm256_storeu_ps(out + d, _mm256_cvtph_ps(h));
  }
  for (; d < dim; ++d) out[d] = _cvtsh_ss(row[d]);
}

// float32 to a float16 row by VCVTPS2PH, rounded to nearest even.
KV_TARGET_F16C inline __attribute__((always_inline)) void float_row_to_half_f16c(
    const float* values, uint16_t* row, int64_t dim) {
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  int64_t d = 0;
  for (; d + 8 <= dim; d += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(values + d), kNearest);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(row + d), h);
  }
  for (; d < dim; ++d) row[d] = _cvtss_sh(values[d], kNearest);
}

// Out-of-line versions (for the function pointers below).
KV_TARGET_F16C inline void half_row_to_float_f16c_call(const uint16_t* row, float* out,
                                                       int64_t dim) {
  half_row_to_float_f16c(row, out, dim);
}
KV_TARGET_F16C inline void float_row_to_half_f16c_call(const float* values, uint16_t* row,
                                                       int64_t dim) {
  float_row_to_half_f16c(values, row, dim);
}
#endif

using ReadHalfRow = void (*)(const uint16_t* row, float* out, int64_t dim);
using WriteHalfRow = void (*)(const float* values, uint16_t* row, int64_t dim);

// The conversions of a half-precision row dtype (KvRowDtype), the F16C ones where
// the CPU has them; null for float32.
inline ReadHalfRow half_row_reader(int64_t dtype) {
  if (dtype == KV_ROWS_BFLOAT16) return bfloat16_row_to_float;
  if (dtype != KV_ROWS_FLOAT16) return nullptr;
#if defined(KV_F16C_CLONES)
  if (use_f16c()) return half_row_to_float_f16c_call;
#endif
  return half_row_to_float;
}

inline WriteHalfRow half_row_writer(int64_t dtype) {
  if (dtype == KV_ROWS_BFLOAT16) return float_row_to_bfloat16;
  if (dtype != KV_ROWS_FLOAT16) return nullptr;
#if defined(KV_F16C_CLONES)
  if (use_f16c()) return float_row_to_half_f16c_call;
#endif
  return float_row_to_half;
}

}  // namespace kvemb
