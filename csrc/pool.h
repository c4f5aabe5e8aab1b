// The worker pool behind parallel_for (pool.cpp): threads started once per
// process, on first need, that wait for work between calls.
//
// A call hands the pool a job of ``tasks`` tasks for ``workers`` workers: the
// calling thread is worker 0, pool thread k (k >= 1) works as worker k when
// k < workers. Tasks are taken one at a time from a shared counter, so which
// worker runs a task never matters to a kernel that writes each task's
// results to places fixed by the task. The call returns once every task has
// finished; a pool thread that wakes late finds no task left and does not
// hold the call up.
//
// One job at a time: a call that finds the pool busy (another Python thread's
// call, or a parallel_for inside a task) starts threads of its own for that
// call. A forked child does not inherit the pool (its threads do not exist
// there): its first call starts a fresh one.
#pragma once

#include <cstdint>

namespace kvemb {

// Runs one task; false if it ran out of memory (std::bad_alloc).
using TaskFn = bool (*)(void* context, int64_t task, int64_t worker);

// Runs fn(context, task, worker) for task in [0, tasks) on at most ``workers``
// workers; false if any task ran out of memory (the other tasks still ran).
bool run_tasks(int64_t tasks, int64_t workers, TaskFn fn, void* context);

// What the pool did in this process (tests, docs/native.md).
struct PoolStats {
  int64_t threads;      // pool threads started (the caller not counted)
  int64_t pooled_jobs;  // jobs run by the pool
  int64_t spawned_jobs; // jobs that found the pool busy and started their own threads
  int64_t spin_us;      // how long an idle pool thread spins before it sleeps
};
PoolStats pool_stats();

}  // namespace kvemb
