"""The CPU priority of an asynchronous save's threads (``checkpoint/priority.py``).

The save's threads (the one ``async_save`` starts and DCP's writer threads) run
at ``SCHED_IDLE`` where a thread may leave it again, else at nice 19; a thread
starved by busy cores is raised to nice 19 and the save finishes; a process that
may not leave ``SCHED_IDLE`` (no privilege, ``RLIMIT_NICE`` 0) never enters it.
"""

import hashlib
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest

from tests.checkpoint import ckpt_worker
from torchrec_kvemb import checkpoint
from torchrec_kvemb.checkpoint import priority, writer

linux_only = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")


def policy_and_nice() -> tuple[int, int]:
    tid = threading.get_native_id()
    return os.sched_getscheduler(tid), os.getpriority(os.PRIO_PROCESS, tid)


@pytest.fixture
def seen(monkeypatch):
    """The (policy, nice) of every thread that writes a file of a save."""
    out: list[tuple[int, int]] = []
    write_items = writer.RowStreamWriter._write_items

    def record(self, *args):
        out.append(policy_and_nice())
        return write_items(self, *args)

    monkeypatch.setattr(writer.RowStreamWriter, "_write_items", record)
    return out


@linux_only
def test_an_async_save_writes_on_idle_threads(tmp_path, seen):
    assert priority.idle_reversible(), "this test process may leave SCHED_IDLE (root)"
    model = ckpt_worker.unsharded_model()
    pending = checkpoint.async_save(model, tmp_path / "a", thread_count=2)
    pending.result(timeout=60)
    assert len(seen) == 2
    assert all(p == os.SCHED_IDLE for p, _ in seen), seen
    assert not pending._priority.raised
    assert policy_and_nice() == (os.SCHED_OTHER, 0)  # the caller's own is unchanged


@linux_only
def test_without_idle_the_threads_run_at_nice_19(tmp_path, seen, monkeypatch):
    monkeypatch.setattr(priority, "USE_IDLE", False)
    model = ckpt_worker.unsharded_model()
    checkpoint.async_save(model, tmp_path / "a", thread_count=2).result(timeout=60)
    assert seen == [(os.SCHED_OTHER, 19)] * 2
    checkpoint.save(model, tmp_path / "b", thread_count=2)  # a blocking save: the caller's
    assert seen[2:] == [policy_and_nice()] * 2


@linux_only
@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs util-linux's setpriv")
def test_a_process_that_cannot_leave_idle_never_enters_it():
    """Without CAP_SYS_NICE and with RLIMIT_NICE 0 a thread may enter SCHED_IDLE
    but not leave it: the save's threads then stay at nice 19."""
    code = (
        "import os, resource\n"
        "resource.setrlimit(resource.RLIMIT_NICE, (0, 0))\n"
        "from torchrec_kvemb.checkpoint import priority\n"
        "p = priority.SavePriority()\n"
        "with p.lowered():\n"
        "    print(priority.idle_reversible(), p.idle, os.sched_getscheduler(0),"
        " os.getpriority(os.PRIO_PROCESS, 0))\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    without_nice_capability = ["setpriv", "--bounding-set", "-sys_nice", "--inh-caps", "-sys_nice"]
    out = subprocess.run(
        [*without_nice_capability, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": root},
    ).stdout.split()
    assert out == ["False", "False", str(os.SCHED_OTHER), "19"]


@linux_only
def test_a_starved_thread_is_raised_and_finishes(monkeypatch):
    """Busy processes on every core starve an idle thread; after ``STALL_S`` of it
    the watchdog raises it to nice 19 and its work completes."""
    monkeypatch.setattr(priority, "STALL_S", 0.5)
    spin = "import sys; sys.stdout.write('x'); sys.stdout.flush()\nwhile True: pass"
    spinners = [
        subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE)
        for _ in range((os.cpu_count() or 1) + 1)
    ]
    try:
        for p in spinners:  # every core busy before the idle thread starts (why: a
            p.stdout.read(1)  # fixed sleep under load let it run before the spinners)
        save = priority.SavePriority(idle=True)
        save.watch()
        states: list[tuple[int, int]] = []
        done = threading.Event()

        def work() -> None:
            with save.lowered():
                states.append(policy_and_nice())
                block = bytes(1 << 20)
                for _ in range(40):  # about 0.05 s of CPU, the GIL released
                    hashlib.sha256(block).digest()
                states.append(policy_and_nice())
            done.set()

        start = time.monotonic()
        threading.Thread(target=work).start()
        assert done.wait(120), "the starved thread never finished"
        save.close()
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert states[0] == (os.SCHED_IDLE, 0)
    assert save.raised
    assert states[1] == (os.SCHED_OTHER, 19)
    assert time.monotonic() - start >= 0.5


@linux_only
def test_threads_entering_after_the_raise_run_at_nice_19():
    save = priority.SavePriority(idle=True)
    save.raise_all()
    got = []

    def enter() -> None:
        with save.lowered():
            got.append(policy_and_nice())

    thread = threading.Thread(target=enter)
    thread.start()
    thread.join()
    assert got == [(os.SCHED_OTHER, 19)]
