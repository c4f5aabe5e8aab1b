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
// masks), so the row loops vectorize in both builds (SSE2 or AVX2). Why no
// F16C: the AVX2 build does not assume it (a run-time check and a third code
// path), and these loops already vectorize.
// The float additions below rely on the default rounding mode (to nearest),
// which the library never changes.
#pragma once

#include <cstdint>
#include <cstring>

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

}  // namespace kvemb
