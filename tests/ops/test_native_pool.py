"""The worker pool behind every parallel native call (csrc/pool.cpp).

Threads are started once per process and kept: a call hands them its tasks
and returns when every task has finished. Checked here, on each build: every
task runs exactly once on a worker below the call's count, whatever the
number of tasks and threads; the same OS threads serve call after call; a
task running out of memory fails its call (the others still run) and leaves
the pool working; calls from several Python threads at once give the bytes of
one call alone (the busy pool's fallback threads included); a forked child
gets a pool of its own. Kernel results (``native.pooled_forward``, uneven
bags) are compared bit for bit with their single-thread run, which is held
to ``F.embedding_bag``.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from torchrec_kvemb import native_lib
from torchrec_kvemb.ops import native

NO_FAILURE = -1


@pytest.fixture(autouse=True)
def build(native_build: str) -> str:
    """Every test runs on each build of the library (tests/ops/conftest.py)."""
    return native_build


def selftest(tasks: int, threads: int, failing: int = NO_FAILURE, sleep_us: int = 0):
    """``kv_pool_selftest``: (status, worker of each task, OS thread of each task)."""
    worker = torch.full((max(tasks, 1),), -1, dtype=torch.int64)
    thread = torch.full((max(tasks, 1),), -1, dtype=torch.int64)
    status = native_lib.library().kv_pool_selftest(
        tasks, threads, failing, sleep_us, worker.data_ptr(), thread.data_ptr()
    )
    return status, worker[:tasks], thread[:tasks]


def blocked_signals(tid: int) -> int:
    with open(f"/proc/self/task/{tid}/status") as f:
        return next(int(line.split()[1], 16) for line in f if line.startswith("SigBlk:"))


def os_threads() -> set[int]:
    return {int(t) for t in os.listdir("/proc/self/task")}


def bags(seed: int, rows: int = 1009, dim: int = 13, num_bags: int = 2003):
    """Weights, slots (some -1) and offsets of uneven bags (some empty)."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.randn(rows, dim, generator=g)
    lengths = torch.randint(0, 41, (num_bags,), generator=g)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    slots = torch.randint(-1, rows, (int(offsets[-1]),), generator=g)
    return weights, slots, offsets


def oracle(weights: torch.Tensor, slots: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Stock ``embedding_bag`` sums, slot -1 pooling nothing (a zero row)."""
    padded = torch.cat([weights, torch.zeros(1, weights.shape[1])])
    return F.embedding_bag(torch.where(slots < 0, weights.shape[0], slots), padded, offsets[:-1],
                           mode="sum", include_last_offset=False)  # fmt: skip


@pytest.mark.parametrize(
    "tasks,threads",
    [
        pytest.param(tasks, threads, id=f"{tasks}-tasks-{threads}-threads")
        for tasks, threads in [(1, 3), (2, 5), (7, 2), (7, 3), (97, 3), (1000, 2), (1000, 7)]
    ],
)
def test_every_task_runs_once_on_a_worker_of_the_call(tasks: int, threads: int) -> None:
    workers = min(tasks, threads)
    for sleep_us in (0, 300):
        status, worker, thread = selftest(tasks, threads, sleep_us=sleep_us if tasks < 100 else 0)
        assert status == 0
        assert bool(((worker >= 0) & (worker < workers)).all()), worker
        # One OS thread per worker id within a call, the caller's for worker 0.
        pairs = set(zip(worker.tolist(), thread.tolist()))
        assert len({w for w, _ in pairs}) == len(pairs)
        caller = threading.get_native_id()
        assert {t for w, t in pairs if w == 0} <= {caller}
        assert all(t != caller for w, t in pairs if w != 0)
    assert native_lib.pool_stats()["threads"] >= workers - 1


def test_the_same_threads_serve_call_after_call() -> None:
    selftest(40, 4, sleep_us=500)  # the pool has its 3 threads from here on
    before = native_lib.pool_stats()
    known = os_threads()
    seen: set[int] = set()
    for _ in range(20):
        status, worker, thread = selftest(40, 4, sleep_us=200)
        assert status == 0
        seen |= {t for w, t in zip(worker.tolist(), thread.tolist()) if w != 0}
    after = native_lib.pool_stats()
    assert seen and seen <= known  # no thread started for a call
    # Pool threads block signals (they go to the process's own threads).
    assert all(blocked_signals(t) != 0 for t in seen)
    assert blocked_signals(threading.get_native_id()) == 0
    assert os_threads() == known
    assert after["threads"] == before["threads"] >= 3
    assert after["pooled_calls"] == before["pooled_calls"] + 20
    assert after["spawned_calls"] == before["spawned_calls"]


@pytest.mark.parametrize("threads", [1, 3], ids=["serial", "pool"])
def test_a_task_out_of_memory_fails_the_call_and_the_pool_keeps_working(threads: int) -> None:
    status, worker, _ = selftest(101, threads, failing=37, sleep_us=50)
    assert status == 3  # KV_OUT_OF_MEMORY
    ran = torch.ones(101, dtype=torch.bool)
    ran[37] = False
    assert bool((worker[ran] >= 0).all()) and int(worker[37]) == -1  # every other task ran
    status, worker, _ = selftest(101, threads, sleep_us=50)
    assert status == 0 and bool((worker >= 0).all())
    with pytest.raises(native_lib.NativeOpError, match="out of memory"):
        native_lib.check_status(3, "pool")


def test_python_threads_calling_at_once_get_the_bytes_of_one_call() -> None:
    cases = [bags(seed) for seed in range(4)]
    expected = [native.pooled_forward(w, s, o, num_threads=1)[0] for w, s, o in cases]
    for (w, s, o), out in zip(cases, expected):
        torch.testing.assert_close(out, oracle(w, s, o), rtol=1e-5, atol=1e-5)
    before = native_lib.pool_stats()
    errors: list[str] = []

    def hammer(k: int) -> None:
        w, s, o = cases[k]
        for i in range(30):
            out, _ = native.pooled_forward(w, s, o, num_threads=2 + (i + k) % 3)
            if not torch.equal(out, expected[k]):
                errors.append(f"thread {k} call {i}: pooled rows differ")
            status, worker, _ = selftest(53, 3)
            if status != 0 or not bool(((worker >= 0) & (worker < 3)).all()):
                errors.append(f"thread {k} call {i}: selftest {status}, {worker.tolist()}")

    # One long call holds the pool (>= 400 ms: 60 tasks of 20 ms on 3 workers)
    # while the others call: they must take the busy pool's fallback.
    long_call: list[int] = []
    holder = threading.Thread(target=lambda: long_call.append(selftest(60, 3, sleep_us=20_000)[0]))
    holder.start()
    time.sleep(0.05)
    callers = [threading.Thread(target=hammer, args=(k,)) for k in range(4)]
    for t in callers:
        t.start()
    for t in callers + [holder]:
        t.join(timeout=120)
        assert not t.is_alive(), "a call never returned"
    assert errors == [] and long_call == [0]
    after = native_lib.pool_stats()
    assert after["spawned_calls"] > before["spawned_calls"]
    assert after["pooled_calls"] > before["pooled_calls"]


def _child_run(write_fd: int, weights, slots, offsets, expected) -> None:
    """In the forked child: the kernels and the pool work, on a pool of its own."""
    ok = False
    try:
        start = native_lib.pool_stats()
        out, _ = native.pooled_forward(weights, slots, offsets, num_threads=3)
        status, worker, thread = selftest(30, 3, sleep_us=1000)
        mine = os_threads()
        ok = (
            torch.equal(out, expected)
            and status == 0
            and set(thread.tolist()) <= mine
            and start["threads"] == 0
            and native_lib.pool_stats()["threads"] == 2
        )
    finally:
        os.write(write_fd, b"ok" if ok else b"no")
        os._exit(0)


def test_a_forked_child_starts_a_pool_of_its_own() -> None:
    weights, slots, offsets = bags(7)
    expected = native.pooled_forward(weights, slots, offsets, num_threads=1)[0]
    assert torch.equal(native.pooled_forward(weights, slots, offsets, num_threads=3)[0], expected)
    selftest(30, 3, sleep_us=1000)
    assert native_lib.pool_stats()["threads"] >= 2  # the parent's pool is running
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read_fd)
        _child_run(write_fd, weights, slots, offsets, expected)
    os.close(write_fd)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.02)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        pytest.fail("the forked child's native call never returned (a dead pool inherited)")
    answer = os.read(read_fd, 2)
    os.close(read_fd)
    assert answer == b"ok"
    # The parent's pool is untouched by the child.
    assert selftest(30, 3, sleep_us=100)[0] == 0


@pytest.mark.parametrize("threads", [1, 2, 3, 5], ids=lambda t: f"{t}-threads")
def test_kernels_on_the_pool_equal_one_thread(threads: int) -> None:
    weights, slots, offsets = bags(11, rows=4099, dim=33, num_bags=5001)
    one = native.pooled_forward(weights, slots, offsets, num_threads=1)[0]
    torch.testing.assert_close(one, oracle(weights, slots, offsets), rtol=1e-5, atol=1e-5)
    for _ in range(3):
        out, _ = native.pooled_forward(weights, slots, offsets, num_threads=threads)
        assert torch.equal(out, one)
