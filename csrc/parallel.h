// Threads for one call: tasks taken one at a time from a shared counter.
//
// The threads are a pool started once per process (pool.h, pool.cpp): a call
// wakes it, and an idle pool thread sleeps. What a task computes must not
// depend on which worker runs it: every kernel writes each task's results to
// places fixed by the task, and sums integers per worker (order-free).
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <new>

#include "pool.h"

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

// Runs fn(task, worker) for task in [0, tasks) on worker_count() workers
// (worker in [0, worker_count())); false if a task ran out of memory (the
// other tasks still ran).
template <class F>
bool parallel_for(int64_t tasks, int64_t threads, F&& fn) {
  auto* body = &fn;
  TaskFn run_one = [](void* context, int64_t task, int64_t worker) -> bool {
    try {
      (*static_cast<decltype(body)>(context))(task, worker);
      return true;
    } catch (const std::bad_alloc&) {
      return false;
    }
  };
  return run_tasks(tasks, worker_count(tasks, threads), run_one,
                   const_cast<void*>(static_cast<const void*>(body)));
}

// [begin, end) of slice s when n items are cut into ``slices`` equal slices.
inline int64_t slice_begin(int64_t n, int64_t slices, int64_t s) {
  return static_cast<int64_t>((static_cast<unsigned __int128>(n) * s) / slices);
}

}  // namespace kvemb
