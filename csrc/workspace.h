// Scratch memory reused across calls.
//
// A training lookup of 327k ids needs ~40 MB of scratch; fresh pages on every
// call cost ~15% of it in page faults (the allocator returns them to the OS
// between calls). A KvWorkspace keeps its blocks: a call takes them in the
// same order each time, so after the first call nothing is allocated.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

namespace kvemb {

class Arena {
 public:
  // The next block, of at least n items of T (uninitialized; 16-byte aligned).
  template <class T>
  T* take(int64_t n) {
    const size_t bytes = sizeof(T) * static_cast<size_t>(n > 0 ? n : 1);
    if (next_ == blocks_.size()) blocks_.emplace_back();
    Block& block = blocks_[next_++];
    if (block.bytes < bytes) {
      const size_t grown = bytes + bytes / 4;  // why: batch sizes vary a little from call to call
      block.data.reset(new char[grown]);
      block.bytes = grown;
    }
    return reinterpret_cast<T*>(block.data.get());
  }

  void rewind() { next_ = 0; }

  int64_t bytes() const {
    int64_t total = 0;
    for (const Block& block : blocks_) total += static_cast<int64_t>(block.bytes);
    return total;
  }

 private:
  struct Block {
    std::unique_ptr<char[]> data;
    size_t bytes = 0;
  };
  std::vector<Block> blocks_;
  size_t next_ = 0;
};

// The arena a call uses: its workspace's when given and not in use by
// another call at the same moment, else one of its own.
class ArenaLease {
 public:
  ArenaLease(Arena* shared, std::atomic<bool>* busy) {
    if (shared && busy && !busy->exchange(true)) {
      arena_ = shared;
      busy_ = busy;
    } else {
      own_ = std::make_unique<Arena>();
      arena_ = own_.get();
    }
    arena_->rewind();
  }
  ~ArenaLease() {
    if (busy_) busy_->store(false);
  }
  ArenaLease(const ArenaLease&) = delete;
  ArenaLease& operator=(const ArenaLease&) = delete;

  Arena& arena() { return *arena_; }

 private:
  std::unique_ptr<Arena> own_;
  Arena* arena_ = nullptr;
  std::atomic<bool>* busy_ = nullptr;
};

}  // namespace kvemb

// The opaque workspace of the C ABI.
struct KvWorkspace {
  kvemb::Arena arena;
  std::atomic<bool> busy{false};
};
