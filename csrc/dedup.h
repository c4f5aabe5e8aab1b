// De-duplication of (bucket, id) keys by an open-addressing scratch table.
//
// The table is tagged per call instead of cleared: an entry belongs to this
// call when its tag is the call's generation, so a call touches only the
// entries its keys hash to (why: clearing the 2**19 entries of 16 bytes that
// 327k ids take is a memset of 8 MiB, 0.28 ms at best here, over memory the
// de-duplication itself mostly skips).
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>

namespace kvemb {

// An entry: the id and, in one word, the generation that wrote it (top
// kTagBits) and the key's unique index in its range (the rest).
struct DedupEntry {
  int64_t id;
  uint64_t tag_uid;
};

constexpr int kTagBits = 24;
constexpr int kUidBits = 64 - kTagBits;
constexpr uint64_t kUidMask = (uint64_t{1} << kUidBits) - 1;

// The entries one call uses, kept between calls by a workspace.
class DedupSlots {
 public:
  // At least n entries none of which belongs to the new generation returned
  // in *tag. Throws std::bad_alloc.
  DedupEntry* take(int64_t n, uint64_t* tag) {
    const size_t want = static_cast<size_t>(n > 0 ? n : 1);
    if (size_ < want) {
      entries_.reset(new DedupEntry[want]);
      std::memset(entries_.get(), 0, sizeof(DedupEntry) * want);  // tag 0: no call's
      size_ = want;
      generation_ = 0;
    }
    if (++generation_ == uint64_t{1} << kTagBits) {  // every tag used: start again
      std::memset(entries_.get(), 0, sizeof(DedupEntry) * size_);
      generation_ = 1;
    }
    *tag = generation_ << kUidBits;
    return entries_.get();
  }

 private:
  std::unique_ptr<DedupEntry[]> entries_;
  size_t size_ = 0;
  uint64_t generation_ = 0;
};

// Where a key starts probing in a table of 2**bits entries (multiplicative
// hashing: the top bits of a mixed product).
inline uint64_t dedup_home(int64_t id, int64_t bucket, int bits) {
  uint64_t x = static_cast<uint64_t>(id) ^ (static_cast<uint64_t>(bucket) * 0x9E3779B97F4A7C15ull);
  x *= 0xFF51AFD7ED558CCDull;
  x ^= x >> 29;
  x *= 0xC4CEB9FE1A85EC53ull;
  return x >> (64 - bits);
}

}  // namespace kvemb
