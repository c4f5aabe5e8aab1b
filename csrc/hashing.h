// Integer hashing and initial rows, bit for bit as torchrec_kvemb/ops/hashing.py.
//
// The torch path works on int64 and masks after arithmetic shifts; here the
// same bits come from uint64 arithmetic (wrapping, logical shifts).
#pragma once

#include <cstdint>

namespace kvemb {

constexpr uint64_t kMix1 = 0xFF51AFD7ED558CCDull;
constexpr uint64_t kMix2 = 0xC4CEB9FE1A85EC53ull;
constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ull;
constexpr uint64_t kIndexSalt = 0x1B873593A5A5A5A5ull;
constexpr uint64_t kInt64Max = 0x7FFFFFFFFFFFFFFFull;

// MurmurHash3's 64-bit finalizer.
inline uint64_t fmix64(uint64_t x) {
  x ^= x >> 33;
  x *= kMix1;
  x ^= x >> 33;
  x *= kMix2;
  x ^= x >> 33;
  return x;
}

// x mod d for x < 2**63 by one multiply-high, exact (why: a 64-bit division
// per probe cost ~5 ms per 327k ids).
//
// With l = ceil(log2 d) and m = ceil(2**(63+l) / d), m * d = 2**(63+l) + e
// with 0 <= e < d <= 2**l, so x * e < 2**(63+l) for x < 2**63 and
// floor(x * m / 2**(63+l)) = floor(x / d). m < 2**64 for any d >= 2.
class FastMod {
 public:
  FastMod() = default;
  explicit FastMod(uint64_t d) : d_(d) {
    if (d_ < 2) return;  // d == 1: every remainder is 0
    const int l = 64 - __builtin_clzll(d_ - 1);
    const unsigned __int128 numerator = static_cast<unsigned __int128>(1) << (63 + l);
    magic_ = static_cast<uint64_t>((numerator + d_ - 1) / d_);
    shift_ = l - 1;
  }

  uint64_t operator()(uint64_t x) const {
    if (d_ < 2) return 0;
    const uint64_t high = static_cast<uint64_t>((static_cast<unsigned __int128>(x) * magic_) >> 64);
    return x - (high >> shift_) * d_;
  }

 private:
  uint64_t d_ = 1;
  uint64_t magic_ = 0;
  int shift_ = 0;
};

// The index bucket of an id in a table whose bucket count ``mod`` divides by.
inline int64_t index_bucket(int64_t id, const FastMod& mod) {
  return static_cast<int64_t>(mod(fmix64(static_cast<uint64_t>(id) ^ kIndexSalt) & kInt64Max));
}

// Uniform initial values on [low, high): u * float(high - low) + float(low)
// with u a 24-bit uniform, rounded as torch rounds ``u.mul_(b - a).add_(a)``
// on a float32 tensor (the Python scalars become float32 first). Built with
// -ffp-contract=off, so the two float operations are not fused.
struct UniformInit {
  uint64_t seed_mix = 0;
  float scale = 0.0f;
  float shift = 0.0f;

  UniformInit() = default;
  UniformInit(int64_t seed, double low, double high)
      : seed_mix(static_cast<uint64_t>(seed)),
        scale(static_cast<float>(high - low)),
        shift(static_cast<float>(low)) {}

  void fill(float* row, int64_t dim, int64_t id) const {
    const uint64_t base = fmix64(static_cast<uint64_t>(id) ^ seed_mix);
    for (int64_t j = 0; j < dim; ++j) {
      const uint64_t bits = fmix64(base + static_cast<uint64_t>(j + 1) * kGolden);
      // 24 bits: exact through int32 (why: int32 -> float vectorizes, uint64 -> float does not).
      const int32_t u24 = static_cast<int32_t>((bits >> 40) & 0xFFFFFF);
      const float u = static_cast<float>(u24) * (1.0f / 16777216.0f);
      row[j] = u * scale + shift;
    }
  }
};

}  // namespace kvemb
