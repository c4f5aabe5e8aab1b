"""``checkpoint.load`` streams the KV rows in blocks and places each as it is read
(``row_stream.py``, ``placement.py``): the tables end bit-identical to a load through
``load_state_dict`` (``restore_table``, which places everything after the read), for
odd block sizes, every optimizer, rows that find no room, into fresh and into trained
tables; a failure in the middle of the stream (reading or placing) leaves every
table as it was."""

import errno
import os
import threading

import pytest
import torch

from tests.checkpoint.test_state_dict import ADAGRAD, ADAM, OPTIONS, SGD, build, train
from torchrec_kvemb import KVTableOptions, checkpoint
from torchrec_kvemb.checkpoint import CheckpointError, placement, row_stream
from torchrec_kvemb.ops.hashing import index_bucket
from torchrec_kvemb.state_dict import admission_state

FUSED = {"sgd": SGD, "adagrad": ADAGRAD, "adam": ADAM}


def arrays(ebc) -> dict:
    """Every table's whole arrays (index, rows, state, admission counter) and counters."""
    out = {}
    for name, t in ebc.kv_tables().items():
        out[name] = {
            "keys": t.keys.clone(),
            "scores": t.scores.clone(),
            "weights": t.weights.clone(),
            "state": t.state.clone(),
            "steps": torch.tensor([t.step, t.optim_step]),
            **{f"admission{i}": a.clone() for i, a in enumerate(admission_state(t))},
            **{f"export.{k}": v.clone() for k, v in t.export().items()},
        }
    return out


def assert_equal(a: dict, b: dict, keys=None) -> None:
    assert a.keys() == b.keys()
    for name in a:
        for key in keys or a[name]:
            assert torch.equal(a[name][key], b[name][key]), f"table {name!r}: {key} differs"


@pytest.fixture
def small_blocks(monkeypatch):
    """Blocks of a few odd-sized rows, two buffers: many blocks, readers waiting."""
    monkeypatch.setattr(row_stream, "BLOCK_BYTES", 100)
    monkeypatch.setattr(row_stream, "BUFFERS", 2)


@pytest.mark.parametrize("fused", FUSED.values(), ids=FUSED.keys())
@pytest.mark.parametrize("trained_target", [False, True], ids=["fresh", "trained"])
def test_streamed_load_equals_restore_table(tmp_path, small_blocks, fused, trained_target):
    source = build(fused)
    train(source, range(5))
    checkpoint.save(source, tmp_path / "ckpt")
    streamed, reference = build(fused), build(fused)
    if trained_target:
        train(streamed, range(20, 23))
        train(reference, range(20, 23))
    checkpoint.load(streamed, tmp_path / "ckpt")
    reference.load_state_dict(source.state_dict())
    assert_equal(arrays(streamed), arrays(reference))
    assert streamed.table("user").size > 0 and streamed.table("item").size > 0


def test_rows_without_room_are_dropped_as_restore_table_drops_them(tmp_path, small_blocks):
    ids = torch.arange(4000)
    ids = ids[index_bucket(ids, 2) == 0][:21]  # one bucket of a 2-bucket (32-row) index
    options = {"user": OPTIONS["user"], "item": KVTableOptions(capacity=1024)}
    big = build(options=options)
    slots = big.table("item").insert(ids, torch.randn(21, 3), torch.rand(21, 1))
    big.table("item").scores.view(-1)[slots] = torch.randperm(21) * 3
    checkpoint.save(big, tmp_path / "ckpt")
    small_options = {"user": OPTIONS["user"], "item": KVTableOptions(capacity=32)}
    streamed, reference = build(options=small_options), build(options=small_options)
    with pytest.warns(UserWarning, match="'item': 5 of 21 rows found no room"):
        checkpoint.load(streamed, tmp_path / "ckpt")
    with pytest.warns(UserWarning, match="'item': 5 of 21 rows found no room"):
        reference.load_state_dict(big.state_dict())
    assert_equal(arrays(streamed), arrays(reference))


def _unchanged_keys() -> list[str]:
    """What a failed load must leave: the index, counters, admission and every stored
    row (rows of slots holding no id may differ; no id reads them)."""
    keys = ["keys", "scores", "steps", "admission0", "admission1", "admission2"]
    return keys + [f"export.{k}" for k in ("ids", "weights", "scores", "momentum1")]


def assert_loaded(target, source) -> None:
    """``target`` holds what a load of ``source`` through ``load_state_dict`` gives."""
    reference = build()
    reference.load_state_dict(source.state_dict())
    assert_equal(arrays(target), arrays(reference), _unchanged_keys())


def saved_and_trained_target(tmp_path):
    """A trained model saved to ``tmp_path / "ckpt"``, another trained model to load
    it into, and that model's arrays before the load."""
    source = build()
    train(source, range(5))
    checkpoint.save(source, tmp_path / "ckpt")
    target = build()
    train(target, range(20, 24))
    return source, target, arrays(target)


@pytest.mark.parametrize("fail_at", [1, 4, 9])
def test_read_error_mid_stream_changes_nothing(tmp_path, small_blocks, monkeypatch, fail_at):
    source, target, before = saved_and_trained_target(tmp_path)
    placed = {"n": 0}
    real_place = placement.TablePlacement.place

    def counting_place(self, *args):
        placed["n"] += 1
        real_place(self, *args)

    real_read = row_stream.read_bytes_into
    calls = {"n": 0}

    def failing_read(*args):
        calls["n"] += 1
        if calls["n"] == fail_at:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real_read(*args)

    monkeypatch.setattr(placement.TablePlacement, "place", counting_place)
    monkeypatch.setattr(row_stream, "read_bytes_into", failing_read)
    with pytest.raises(CheckpointError, match="reading failed.*Input/output error.*nothing"):
        checkpoint.load(target, tmp_path / "ckpt")
    assert calls["n"] >= fail_at
    if fail_at > 4:
        assert placed["n"] > 0, "no block was placed before the failure"
    assert_equal(arrays(target), before, _unchanged_keys())
    monkeypatch.undo()
    checkpoint.load(target, tmp_path / "ckpt")  # the fault is gone: it loads
    assert_loaded(target, source)


def test_placing_error_changes_nothing(tmp_path, small_blocks, monkeypatch):
    _, target, before = saved_and_trained_target(tmp_path)
    real_place = placement.TablePlacement.place
    calls = {"n": 0}

    def failing_place(self, *args):
        calls["n"] += 1
        if calls["n"] == 6:
            raise MemoryError("no memory for a block")
        real_place(self, *args)

    monkeypatch.setattr(placement.TablePlacement, "place", failing_place)
    with pytest.raises(CheckpointError, match="MemoryError: no memory for a block"):
        checkpoint.load(target, tmp_path / "ckpt")
    assert calls["n"] >= 6
    assert_equal(arrays(target), before, _unchanged_keys())


def test_tables_are_planned_once_on_the_reading_threads(tmp_path, small_blocks, monkeypatch):
    """Each table is planned exactly once, by a reading thread (not the placing one),
    and the load equals one through ``load_state_dict``."""
    source, target, _ = saved_and_trained_target(tmp_path)
    planners: list[tuple[str, str]] = []
    real_plan = placement.TablePlacement.plan

    def recording_plan(self):
        planners.append((self.table.name, threading.current_thread().name))
        real_plan(self)

    monkeypatch.setattr(placement.TablePlacement, "plan", recording_plan)
    checkpoint.load(target, tmp_path / "ckpt")
    assert sorted(name for name, _ in planners) == ["item", "user"]
    assert all(thread.startswith("kvemb-rows") for _, thread in planners), planners
    assert_loaded(target, source)


def test_a_plan_that_fails_on_a_reading_thread_changes_nothing(tmp_path, small_blocks, monkeypatch):
    _, target, before = saved_and_trained_target(tmp_path)
    real_plan = placement.TablePlacement.plan

    def failing_plan(self):
        if self.table.name == "item":
            raise MemoryError("no memory for the staged index")
        real_plan(self)

    monkeypatch.setattr(placement.TablePlacement, "plan", failing_plan)
    with pytest.raises(CheckpointError, match="MemoryError: no memory for the staged index"):
        checkpoint.load(target, tmp_path / "ckpt")
    assert_equal(arrays(target), before, _unchanged_keys())
