// Threads for one call: tasks taken one at a time from a shared counter.
//
// Threads live for one parallel_for (no pool, no global state), so two groups
// can run in one process, from any Python thread. What a task computes must
// not depend on which worker runs it: every kernel writes each task's results
// to places fixed by the task, and sums integers per worker (order-free).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <new>
#include <thread>
#include <vector>

namespace kvemb {

// An uninitialized array (why: value-initializing n-sized scratch costs a pass).
template <class T>
using Buffer = std::unique_ptr<T[]>;

template <class T>
Buffer<T> make_buffer(int64_t n) {
  return Buffer<T>(new T[static_cast<size_t>(std::max<int64_t>(n, 1))]);
}

// Workers a call of ``tasks`` tasks uses with ``threads`` allowed.
inline int64_t worker_count(int64_t tasks, int64_t threads) {
  return std::max<int64_t>(1, std::min(threads, tasks));
}

// Runs fn(task, worker) for task in [0, tasks) on worker_count() workers;
// false if a task ran out of memory (the other tasks still ran).
template <class F>
bool parallel_for(int64_t tasks, int64_t threads, F&& fn) {
  const int64_t workers = worker_count(tasks, threads);
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  auto work = [&](int64_t worker) {
    for (int64_t task; (task = next.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
      try {
        fn(task, worker);
      } catch (const std::bad_alloc&) {
        failed.store(true);
      }
    }
  };
  std::vector<std::thread> pool;
  for (int64_t w = 1; w < workers; ++w) {
    try {
      pool.emplace_back(work, w);
    } catch (...) {
      break;  // no more threads: the started workers take the remaining tasks
    }
  }
  work(0);
  for (auto& thread : pool) thread.join();
  return !failed.load();
}

// [begin, end) of slice s when n items are cut into ``slices`` equal slices.
inline int64_t slice_begin(int64_t n, int64_t slices, int64_t s) {
  return static_cast<int64_t>((static_cast<unsigned __int128>(n) * s) / slices);
}

}  // namespace kvemb
