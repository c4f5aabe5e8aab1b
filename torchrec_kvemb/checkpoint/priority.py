"""The CPU priority of an asynchronous save's threads: idle beside training, raised if starved.

An asynchronous save writes while training runs on every core. Its threads run
at Linux's ``SCHED_IDLE`` policy, which gives a core to them only when nothing
else wants it: a training thread that wakes takes the core back at once. At nice
19 (the lowest ordinary priority) the scheduler may let a running writer finish
its slice first. Measured beside 2-thread training steps on 2 cores (0.91x-0.94x
of the steps without a save in two quiet ``make bench`` runs): docs/benchmarks.md,
"Asynchronous checkpoints".

An idle thread can starve while training keeps every core busy. A watchdog (a
thread at the caller's priority) reads the save threads' run-queue wait
(``/proc/self/task/<tid>/schedstat``) every :data:`POLL_S` s; once some thread
has been runnable but waiting for :data:`STALL_S` s in a row (more than
:data:`STARVED` of each poll), every thread of the save is raised to nice 19 for
the rest of the save. Leaving ``SCHED_IDLE`` needs privilege (root,
``CAP_SYS_NICE`` or ``RLIMIT_NICE`` >= 1); where it would be refused
(:func:`idle_reversible`), or off Linux, the threads run at nice 19 from the
start, as they would after the raise.

Example::

    priority = SavePriority()
    priority.watch()                  # on the training thread
    with priority.lowered():          # on each thread of the save
        write()
    priority.close()
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections.abc import Iterator

__all__ = ["POLL_S", "STALL_S", "STARVED", "SavePriority", "idle_reversible", "set_nice_19"]

#: Seconds between the watchdog's looks at the save's threads.
POLL_S = 0.25
#: Seconds in a row a thread of the save may wait runnable before all are raised.
STALL_S = 5.0
#: A poll counts as starved when a thread waited runnable for more than this
#: fraction of it.
STARVED = 0.9
#: Use ``SCHED_IDLE`` where it can be left again (False: nice 19 throughout).
USE_IDLE = True

_IDLE = getattr(os, "SCHED_IDLE", None)


def set_nice_19(tid: int = 0) -> None:
    """Thread ``tid`` (0: the calling one) at ``SCHED_OTHER``, nice 19, where the
    system allows it (a refusal leaves its priority as it was)."""
    tid = tid or threading.get_native_id()
    with contextlib.suppress(AttributeError, OSError):
        if _IDLE is not None and os.sched_getscheduler(tid) == _IDLE:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, tid, 19)


def _set_idle() -> bool:
    """The calling thread at ``SCHED_IDLE``; False where refused."""
    try:
        os.sched_setscheduler(0, _IDLE, os.sched_param(0))  # type: ignore[arg-type]
    except (AttributeError, OSError, TypeError):
        return False
    return True


@functools.cache
def idle_reversible() -> bool:
    """Whether a thread of this process may enter ``SCHED_IDLE`` and leave it again
    (tried once, on a thread of its own that ends after)."""
    if _IDLE is None or not hasattr(os, "sched_setscheduler"):
        return False
    result = [False]

    def probe() -> None:
        if not _set_idle():
            return
        try:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        except OSError:
            return
        result[0] = os.sched_getscheduler(0) == os.SCHED_OTHER

    thread = threading.Thread(target=probe, name="kvemb-priority-probe")
    thread.start()
    thread.join()
    return result[0]


def _waited_ns(tid: int) -> int | None:
    """Nanoseconds thread ``tid`` has spent runnable waiting for a CPU (None when
    the thread is gone or the system does not say)."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            return int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None


class SavePriority:
    """The priority of one save's threads: ``SCHED_IDLE`` (see the module docstring)
    until :meth:`raise_all` (by the watchdog of :meth:`watch`, or a caller), nice 19
    after. ``idle``: whether the threads start idle (default: where reversible).

    Example::

        priority = SavePriority()
        priority.watch()
        with priority.lowered():
            ...                        # the save's work on this thread
        priority.close()
    """

    def __init__(self, idle: bool | None = None, stall_s: float | None = None) -> None:
        self.idle = (USE_IDLE and idle_reversible()) if idle is None else idle
        self.stall_s = STALL_S if stall_s is None else stall_s
        self.raised = False  # set once the threads were raised to nice 19
        self._lock = threading.Lock()
        self._tids: set[int] = set()
        self._stop = threading.Event()
        self._watchdog: threading.Thread | None = None

    @contextlib.contextmanager
    def lowered(self) -> Iterator[None]:
        """Run the calling thread (and the threads it starts) at the save's priority
        for the ``with`` block."""
        tid = threading.get_native_id()
        with self._lock:
            idle = self.idle and not self.raised and _set_idle()
            self._tids.add(tid)
        if not idle:
            set_nice_19(tid)
        try:
            yield
        finally:
            with self._lock:
                self._tids.discard(tid)

    def raise_all(self) -> None:
        """Every thread of the save (now and later) at nice 19 instead of idle."""
        with self._lock:
            self.raised = True
            for tid in self._tids:
                set_nice_19(tid)

    def watch(self) -> None:
        """Start the watchdog (call on a thread of ordinary priority: its threads
        inherit it). Nothing to watch when the threads are not idle."""
        if not self.idle:
            return
        self._watchdog = threading.Thread(target=self._watch, name="kvemb-save-watch", daemon=True)
        self._watchdog.start()

    def close(self) -> None:
        """Stop the watchdog."""
        self._stop.set()

    def _watch(self) -> None:
        last: dict[int, int] = {}
        starved_since: float | None = None
        before = time.monotonic()
        while not self._stop.wait(POLL_S):
            now = time.monotonic()
            with self._lock:
                tids = list(self._tids)
            waits = {tid: w for tid in tids if (w := _waited_ns(tid)) is not None}
            window = (now - before) * 1e9
            starved = any(w - last[t] > STARVED * window for t, w in waits.items() if t in last)
            last, before = waits, now
            starved_since = (starved_since or now) if starved else None
            if starved_since is not None and now - starved_since >= self.stall_s - POLL_S:
                self.raise_all()
                return
