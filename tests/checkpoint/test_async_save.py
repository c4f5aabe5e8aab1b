"""Asynchronous saves (``checkpoint.async_save`` / ``save(..., blocking=False)``).

A save started before further training steps, whose files are written only after
those steps, loads to exactly the state at the call, as a blocking save taken at
the same point does: KV tables in memory and over an SSD tier (whose files the
later steps rewrite), unsharded here and sharded on 2 gloo ranks
(``async_worker.py``). Two saves in a row each hold the state at their own
call. A failing save raises ``CheckpointError`` from ``result()`` (or at the next
save) and leaves the checkpoint before it in place. A process SIGKILLed while an
asynchronous save writes leaves the complete checkpoint loadable and the partial
one refused.
"""

import errno
import math
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import replace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from tests.checkpoint import ckpt_worker, test_ssd_scores
from tests.checkpoint.async_worker import MORE
from tests.checkpoint.test_state_dict import assert_same
from tests.checkpoint.test_state_dict import snapshot as table_snapshot
from tests.torchrun_jobs import ROOT, read_result, run_job, torchrun_command
from torchrec_kvemb import (
    EvictionPolicy,
    HostTierOptions,
    KVEmbeddingBagCollection,
    checkpoint,
)
from torchrec_kvemb.checkpoint import writer


# ------------------------------------------------------------------ models
class InMemory:
    """The models of ``ckpt_worker.py``: two KV collections (LFU with admission,
    Adagrad; Adam), a dense layer and its Adam optimizer."""

    def __init__(self, _directory) -> None:
        self.model = ckpt_worker.unsharded_model()
        self.optimizer = ckpt_worker.dense_optimizer(self.model)

    def train(self, steps: range) -> None:
        for step in steps:
            ckpt_worker.train_step(self.model, self.optimizer, step, 0, 1, 1)

    def state(self) -> dict:
        return {
            "tables": ckpt_worker.snapshot(self.model),
            "optimizer": ckpt_worker.optimizer_state(self.optimizer),
            "lr": ckpt_worker.kv_lr(self.model),
        }

    def assert_state(self, want: dict) -> None:
        tally = ckpt_worker.Tally(0.0)
        got = self.state()
        ckpt_worker.compare_snapshots(tally, got["tables"], want["tables"], True, "loaded")
        ckpt_worker.compare_optimizer(tally, got["optimizer"], want["optimizer"], "loaded")
        tally.check("learning rates", got["lr"] == want["lr"])
        failed = [name for name, ok in tally.checks.items() if not ok]
        assert not failed, failed


class OverSSD:
    """Two KV tables of 64 memory rows over SSD tiers (LRU): the steps demote and
    promote rows, rewriting the tiers' files."""

    def __init__(self, directory) -> None:
        self.model = test_ssd_scores.build(directory, EvictionPolicy.LRU)
        self.optimizer = None

    def train(self, steps: range) -> None:
        test_ssd_scores.train(self.model, self.model, steps)

    def state(self) -> dict:
        return table_snapshot(self.model)

    def assert_state(self, want: dict) -> None:
        assert_same(self.state(), want)


class OverHostTier(OverSSD):
    """The same tables of 64 memory rows over host-memory tiers (LRU), the steps
    moving rows between the tiers."""

    def __init__(self, directory) -> None:
        options = {
            name: replace(
                option,
                ssd=None,
                host_tier=HostTierOptions(capacity=512, eviction=EvictionPolicy.LRU),
            )
            for name, option in test_ssd_scores.options(
                directory, EvictionPolicy.LRU, test_ssd_scores.SAVED_MEMORY
            ).items()
        }
        self.model = KVEmbeddingBagCollection(
            test_ssd_scores.configs(), options, fused_params=test_ssd_scores.ADAGRAD
        )
        self.optimizer = None


MODELS = {"in-memory": InMemory, "over-ssd": OverSSD, "over-host-tier": OverHostTier}


@pytest.fixture
def gated(monkeypatch):
    """Checkpoint writers wait until the returned event is set (the test's steps
    run before any file of the save is written)."""
    release = threading.Event()
    write_data = writer.RowStreamWriter.write_data

    def wait_then_write(self, plan, planner):
        assert release.wait(60), "the test never released the writer"
        return write_data(self, plan, planner)

    monkeypatch.setattr(writer.RowStreamWriter, "write_data", wait_then_write)
    yield release
    release.set()


# ------------------------------------------------------------------- tests
@pytest.mark.parametrize("kind", MODELS)
def test_a_save_holds_the_state_at_the_call(kind, tmp_path, gated):
    job = MODELS[kind](tmp_path / "run")
    job.train(range(3))
    want = job.state()
    gated.set()
    checkpoint.save(job.model, tmp_path / "blocking", optimizer=job.optimizer)
    gated.clear()

    pending = checkpoint.save(
        job.model, tmp_path / "async", optimizer=job.optimizer, blocking=False
    )
    assert isinstance(pending, checkpoint.AsyncCheckpoint)
    job.train(range(3, 3 + MORE))  # training goes on; nothing is written yet
    assert not pending.done()
    assert not (tmp_path / "async").exists()
    with pytest.raises(AssertionError):
        job.assert_state(want)  # the steps changed the model
    gated.set()
    pending.result()
    assert pending.done()

    for name in ("async", "blocking"):
        fresh = MODELS[kind](tmp_path / f"load-{name}")
        checkpoint.load(fresh.model, tmp_path / name, optimizer=fresh.optimizer)
        fresh.assert_state(want)


def test_two_saves_in_a_row_hold_their_own_states(tmp_path, gated):
    job = InMemory(tmp_path)
    job.train(range(2))
    first_state = job.state()
    first = checkpoint.async_save(job.model, tmp_path / "first", optimizer=job.optimizer)
    job.train(range(2, 4))
    second_state = job.state()
    assert not first.done()
    threading.Timer(0.2, gated.set).start()  # the first writes while the second waits
    second = checkpoint.save(job.model, tmp_path / "second", job.optimizer, blocking=False)
    assert first.done()  # the second save waited for the first, then took its snapshot
    job.train(range(4, 5))
    second.result()
    first.result()
    for name, want in (("first", first_state), ("second", second_state)):
        fresh = InMemory(tmp_path)
        checkpoint.load(fresh.model, tmp_path / name, optimizer=fresh.optimizer)
        fresh.assert_state(want)
    checkpoint.asynchronous.release_buffers()


def test_a_failing_save_raises_from_result_and_keeps_the_checkpoint_before(tmp_path, monkeypatch):
    job = InMemory(tmp_path)
    job.train(range(2))
    want = job.state()
    path = tmp_path / "ckpt"
    checkpoint.save(job.model, path, optimizer=job.optimizer)
    job.train(range(2, 4))

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(writer, "write_tensor", disk_full)
    pending = checkpoint.async_save(job.model, path, optimizer=job.optimizer)
    with pytest.raises(checkpoint.CheckpointError, match="No space left on device") as err:
        pending.result()
    assert str(path) in str(err.value) and "unchanged" in str(err.value)
    assert pending.done()

    # A failure nobody asked about fails the next save, once.
    unasked = checkpoint.async_save(job.model, path, optimizer=job.optimizer)
    deadline = time.monotonic() + 60
    while not unasked.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    monkeypatch.undo()
    with pytest.raises(checkpoint.CheckpointError, match="previous asynchronous save"):
        checkpoint.save(job.model, tmp_path / "next")
    assert not (tmp_path / "next").exists()
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt")) == ["ckpt"]
    fresh = InMemory(tmp_path)
    checkpoint.load(fresh.model, path, optimizer=fresh.optimizer)
    fresh.assert_state(want)
    checkpoint.async_save(job.model, tmp_path / "next").result()  # saving works again
    checkpoint.read_marker(tmp_path / "next")


def test_a_path_that_cannot_be_written_raises_from_result(tmp_path):
    job = InMemory(tmp_path)
    (tmp_path / "file").write_text("not a directory")
    pending = checkpoint.save(job.model, tmp_path / "file" / "ckpt", blocking=False)
    with pytest.raises(checkpoint.CheckpointError, match="Not a directory"):
        pending.result()


def test_a_process_killed_during_a_save_keeps_the_complete_checkpoint(tmp_path):
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.checkpoint.async_worker", "crash", str(tmp_path)],
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "writing").exists():
            assert child.poll() is None, child.stderr.read().decode()[-4000:]
            assert time.monotonic() < deadline, "the save never started writing"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL

    partial = list(tmp_path.glob("ckpt.tmp-*"))
    assert len(partial) == 1 and list(partial[0].glob("*.distcp"))
    with pytest.raises(checkpoint.CheckpointError, match="incomplete"):
        checkpoint.load(ckpt_worker.unsharded_model(), partial[0])
    expected = torch.load(tmp_path / "expected.pt")
    fresh = InMemory(tmp_path)
    checkpoint.load(fresh.model, tmp_path / "ckpt", optimizer=fresh.optimizer)
    fresh.assert_state({**expected, "lr": ckpt_worker.CHANGED_LR})


def test_a_write_rate_spreads_the_writes(tmp_path):
    job = InMemory(tmp_path)
    job.train(range(2))
    want = job.state()
    checkpoint.save(job.model, tmp_path / "unpaced")
    saved = dcp.FileSystemReader(tmp_path / "unpaced").read_metadata().state_dict_metadata
    nbytes = sum(
        md.properties.dtype.itemsize * math.prod(md.size)
        for md in saved.values()
        if isinstance(md, TensorStorageMetadata)
    )  # the tensors' bytes: what the rate counts
    start = time.monotonic()
    pending = checkpoint.async_save(job.model, tmp_path / "paced", max_write_bytes_per_s=nbytes)
    job.train(range(2, 3))
    pending.result()
    # Each block waits for the end of its slot: a second or more at this rate.
    assert time.monotonic() - start >= 0.9
    fresh = InMemory(tmp_path)
    checkpoint.load(fresh.model, tmp_path / "paced")
    fresh.assert_state({**want, "optimizer": fresh.state()["optimizer"]})
    with pytest.raises(ValueError, match="max_write_bytes_per_s must be > 0"):
        checkpoint.save(job.model, tmp_path / "x", blocking=False, max_write_bytes_per_s=0)


def test_sharded_two_ranks(tmp_path):
    job = run_job(
        torchrun_command(2, "-m", "tests.checkpoint.async_worker", "sharded", str(tmp_path))
    )
    result = read_result(tmp_path / "sharded.json", job)
    assert "error" not in result, result["error"]
    failed = [name for name, ok in result["checks"].items() if not ok]
    assert not failed, failed
    assert result["passed"]
