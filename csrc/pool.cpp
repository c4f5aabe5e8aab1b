// The persistent worker pool of parallel_for (pool.h; docs/native.md, Threads).
//
// Job hand-off: ``generation`` is even while a job is open and odd while the
// calling thread writes the next one. A pool thread joins the job it saw
// open by counting itself in ``active`` and checking the generation again;
// the caller closes the generation (odd) and waits for ``active`` to reach 0
// before it rewrites the job, so a joined thread always reads a whole job.
// A pool thread that joins after the caller returned finds the task counter
// past the end and never calls the finished job's function.
#include "pool.h"

#include <pthread.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <new>
#include <thread>
#include <vector>

#include "kvemb_native.h"
#include "parallel.h"

namespace kvemb {
namespace {

using Clock = std::chrono::steady_clock;

// Pool threads beyond this many are not started (a call asking for more
// workers gets the caller and the ones there are).
constexpr int64_t kMaxPoolThreads = 256;
// Idle spin before sleeping, in microseconds (TORCHREC_KVEMB_POOL_SPIN_US).
constexpr int64_t kDefaultSpinUs = 50;

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Waits until ready(): spins for ``spin``, then gives the core away at each
// check (what it waits for may be a thread that needs this core).
template <class Ready>
void wait_until(Clock::duration spin, Ready&& ready) {
  const auto deadline = Clock::now() + spin;
  bool spinning = true;
  for (int64_t i = 0; !ready(); ++i) {
    if (spinning && (i & 63) == 63) spinning = Clock::now() < deadline;
    if (spinning) {
      relax();
    } else {
      std::this_thread::yield();
    }
  }
}

int64_t spin_us_from_env() {
  const char* text = std::getenv("TORCHREC_KVEMB_POOL_SPIN_US");
  if (text == nullptr || *text == '\0') return kDefaultSpinUs;
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  if (end == text || *end != '\0' || value < 0) return kDefaultSpinUs;
  return std::min<long long>(value, 1000000);
}

struct Pool {
  std::atomic<bool> busy{false};  // a call's job is on the pool

  std::atomic<uint64_t> generation{0};
  std::atomic<int64_t> active{0};  // pool threads inside the current job
  std::atomic<int64_t> next{0};    // next task to take
  std::atomic<int64_t> done{0};    // tasks finished
  std::atomic<bool> failed{false};
  int64_t tasks = 0;
  int64_t workers = 0;
  TaskFn fn = nullptr;
  void* context = nullptr;

  std::mutex sleep_mutex;
  std::condition_variable wake;
  std::atomic<int64_t> sleepers{0};

  std::vector<std::thread> threads;  // only grows; never joined (see pool())
  std::atomic<int64_t> thread_count{0};
  std::atomic<int64_t> pooled_jobs{0};
  std::atomic<int64_t> spawned_jobs{0};
  const Clock::duration spin = std::chrono::microseconds(spin_us_from_env());
  const int64_t spin_us = spin_us_from_env();

  // Takes tasks of the open job as ``worker`` until none is left.
  void take_tasks(int64_t worker) {
    for (int64_t task; (task = next.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
      if (!fn(context, task, worker)) failed.store(true, std::memory_order_relaxed);
      done.fetch_add(1, std::memory_order_release);
    }
  }

  static bool open_after(uint64_t g, uint64_t seen) { return g != seen && (g & 1) == 0; }

  // The generation of the next open job after ``seen``: spins, then sleeps.
  uint64_t wait_for_job(uint64_t seen) {
    const auto deadline = Clock::now() + spin;
    for (int64_t i = 0;; ++i) {
      const uint64_t g = generation.load(std::memory_order_acquire);
      if (open_after(g, seen)) return g;
      if ((i & 63) == 63 && Clock::now() >= deadline) break;
      relax();
    }
    std::unique_lock<std::mutex> lock(sleep_mutex);
    sleepers.fetch_add(1);
    uint64_t g;
    while (!open_after(g = generation.load(), seen)) wake.wait(lock);
    sleepers.fetch_sub(1);
    return g;
  }

  void serve(int64_t worker, uint64_t seen) {
    for (;;) {
      const uint64_t g = wait_for_job(seen);
      seen = g;
      active.fetch_add(1);
      if (generation.load() == g && worker < workers) take_tasks(worker);
      active.fetch_sub(1, std::memory_order_release);
    }
  }

  // Starts pool threads up to ``wanted`` (called by the call holding ``busy``),
  // with every signal blocked: signals go to the process's own threads.
  void grow(int64_t wanted) {
    wanted = std::min(wanted, kMaxPoolThreads);
    if (static_cast<int64_t>(threads.size()) >= wanted) return;
    sigset_t all, previous;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &previous);
    start_threads(wanted);
    pthread_sigmask(SIG_SETMASK, &previous, nullptr);
  }

  void start_threads(int64_t wanted) {
    while (static_cast<int64_t>(threads.size()) < wanted) {
      const int64_t worker = static_cast<int64_t>(threads.size()) + 1;
      const uint64_t seen = generation.load();
      try {
        threads.emplace_back([this, worker, seen] { serve(worker, seen); });
      } catch (...) {
        return;  // no more threads: the started ones and the caller take the tasks
      }
      thread_count.store(static_cast<int64_t>(threads.size()));
    }
  }

  bool run(int64_t job_tasks, int64_t job_workers, TaskFn job_fn, void* job_context) {
    grow(job_workers - 1);
    const uint64_t g = generation.load();
    generation.store(g + 1);  // closed: no thread joins while the job is written
    wait_until(spin, [&] { return active.load(std::memory_order_acquire) == 0; });
    tasks = job_tasks;
    workers = job_workers;
    fn = job_fn;
    context = job_context;
    failed.store(false, std::memory_order_relaxed);
    done.store(0, std::memory_order_relaxed);
    next.store(0, std::memory_order_relaxed);
    generation.store(g + 2);  // open
    if (sleepers.load() > 0) {
      std::lock_guard<std::mutex> lock(sleep_mutex);
      wake.notify_all();
    }
    pooled_jobs.fetch_add(1, std::memory_order_relaxed);
    take_tasks(0);
    // Tasks still running are on pool threads that took them.
    wait_until(spin, [&] { return done.load(std::memory_order_acquire) >= job_tasks; });
    return !failed.load(std::memory_order_relaxed);
  }
};

std::atomic<Pool*> g_pool{nullptr};

void forget_pool_in_child() {
  // The pool's threads do not exist in a forked child and its mutexes may be
  // held by them: the child leaks the parent's pool and starts its own.
  g_pool.store(nullptr);
}

Pool* pool() {
  Pool* current = g_pool.load(std::memory_order_acquire);
  if (current != nullptr) return current;
  static const int registered = pthread_atfork(nullptr, nullptr, forget_pool_in_child);
  (void)registered;
  // Never deleted: its threads live as long as the process (or until a fork).
  Pool* created = new Pool();
  if (g_pool.compare_exchange_strong(current, created)) return created;
  delete created;  // another thread installed one first (no threads started yet)
  return current;
}

// Threads started for one call: the pool is busy (another Python thread's
// call, or a parallel_for inside a task).
bool run_spawned(int64_t tasks, int64_t workers, TaskFn fn, void* context) {
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  auto work = [&](int64_t worker) {
    for (int64_t task; (task = next.fetch_add(1, std::memory_order_relaxed)) < tasks;) {
      if (!fn(context, task, worker)) failed.store(true);
    }
  };
  std::vector<std::thread> started;
  for (int64_t w = 1; w < workers; ++w) {
    try {
      started.emplace_back(work, w);
    } catch (...) {
      break;  // no more threads: the started workers take the remaining tasks
    }
  }
  work(0);
  for (auto& thread : started) thread.join();
  return !failed.load();
}

}  // namespace

bool run_tasks(int64_t tasks, int64_t workers, TaskFn fn, void* context) {
  workers = worker_count(tasks, workers);
  if (workers == 1) {
    bool ok = true;
    for (int64_t task = 0; task < tasks; ++task) ok = fn(context, task, 0) && ok;
    return ok;
  }
  Pool* p = pool();
  // why a flag, not a mutex: a task of the pool's own job may call parallel_for
  // on the thread that holds it (try_lock there is undefined for std::mutex).
  if (p->busy.exchange(true, std::memory_order_acquire)) {
    p->spawned_jobs.fetch_add(1, std::memory_order_relaxed);
    return run_spawned(tasks, workers, fn, context);
  }
  const bool ok = p->run(tasks, workers, fn, context);
  p->busy.store(false, std::memory_order_release);
  return ok;
}

PoolStats pool_stats() {
  Pool* p = pool();
  return {p->thread_count.load(), p->pooled_jobs.load(), p->spawned_jobs.load(), p->spin_us};
}

}  // namespace kvemb

extern "C" int kv_pool_stats(int64_t* out) {
  const kvemb::PoolStats s = kvemb::pool_stats();
  out[0] = s.threads;
  out[1] = s.pooled_jobs;
  out[2] = s.spawned_jobs;
  out[3] = s.spin_us;
  return KV_OK;
}

extern "C" int kv_pool_selftest(int64_t tasks, int64_t num_threads, int64_t failing_task,
                                int64_t sleep_us, int64_t* worker_of_task,
                                int64_t* thread_of_task) {
  if (tasks < 0 || num_threads < 1) return KV_BAD_ARGUMENT;
  const bool ok = kvemb::parallel_for(tasks, num_threads, [&](int64_t task, int64_t worker) {
    if (sleep_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(sleep_us));
    if (task == failing_task) throw std::bad_alloc();
    worker_of_task[task] = worker;
    thread_of_task[task] = static_cast<int64_t>(syscall(SYS_gettid));
  });
  return ok ? KV_OK : KV_OUT_OF_MEMORY;
}
