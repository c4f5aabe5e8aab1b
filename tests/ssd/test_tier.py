"""The SSD tier under a KVTable: demotion/promotion, capacity, durability, corruption,
unwritable paths, full disks, prefetch, files per rank, storage estimates."""

import errno
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

import torchrec_kvemb.ssd.slab as slab_module
from torchrec_kvemb import EvictionPolicy, KVTable, KVTableOptions, SSDOptions
from torchrec_kvemb.dispatch import insert
from torchrec_kvemb.index import BucketIndex
from torchrec_kvemb.ops.hashing import index_bucket
from torchrec_kvemb.optimizer import FusedOptimConfig, OptimKind
from torchrec_kvemb.options import WAYS
from torchrec_kvemb.slot_index import INITIAL_BUCKETS, SlotIndex
from torchrec_kvemb.ssd import KVStorageError, storage_estimate
from torchrec_kvemb.ssd.slab import HEADER_BYTES
from torchrec_kvemb.state_dict import restore_table, rows_from_entries, table_state

DIM = 6
#: Memory rows of the cached tables: 8 buckets, so a batch of 24 ids (3 a bucket)
#: always finds room, as in the all-in-memory reference.
CACHE = 128
ADAM = FusedOptimConfig(kind=OptimKind.ADAM)


def _ssd_table(path, name="t", capacity=CACHE, ssd=None, optim=None, **options) -> KVTable:
    ssd = ssd or {}
    opts = KVTableOptions(capacity=capacity, ssd=SSDOptions(path=str(path), **ssd), **options)
    return KVTable(name, DIM, opts, optim)


def _memory_table(capacity=4096, optim=None, **options) -> KVTable:
    return KVTable("ref", DIM, KVTableOptions(capacity=capacity, **options), optim)


def _batches(n_steps, n_ids=24, id_range=1500, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, id_range, (n_ids,), generator=gen) * 1_000_003 for _ in range(n_steps)]


def _touch(table: KVTable, slots: torch.Tensor, ids: torch.Tensor) -> None:
    """A stand-in for an optimizer step: rows and state change as a function of the id."""
    stored = slots >= 0
    slots, ids = slots[stored], ids[stored]
    weights, state = table.batch_rows()  # slots >= capacity: the batch's scratch rows
    weights[slots] += (ids % 97).to(torch.float32).unsqueeze(1) / 64 + 0.125
    state[slots] += 1.0


def _train(table: KVTable, batches) -> None:
    for ids in batches:
        _touch(table, table.lookup_train(ids), ids)


def _assert_same_rows(got: dict, want: dict, scores: bool = True) -> None:
    assert got.keys() == want.keys()
    assert torch.equal(got["ids"], want["ids"]), "ids differ"
    assert torch.unique(got["ids"]).numel() == got["ids"].numel()
    for key in got.keys() - {"ids"}:
        if key != "scores" or scores:
            assert torch.equal(got[key], want[key]), f"{key} differs"


def _snapshot(table: KVTable) -> list:
    return [t.clone() for t in (table.keys, table.scores, table.weights, table.state)] + [
        table.step,
        table.optim_step,
        table.size,
    ]


def _same(a: list, b: list) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


# ------------------------------------------------------------ demotion / promotion
def test_rows_and_state_move_between_tiers_exactly(tmp_path):
    table = _ssd_table(tmp_path, optim=ADAM)
    reference = _memory_table(optim=ADAM)
    batches = _batches(25)
    _train(table, batches)
    _train(reference, batches)
    m = table.metrics()
    assert m["demotions"] == m["evictions"] > 0 and m["promotions"] > 0
    assert m["ssd_writes"] == m["demotions"] and m["ssd_size"] > 0
    _assert_same_rows(table.export(), reference.export())
    assert table.size + m["ssd_size"] == reference.size
    # the tiers never hold the same id
    ssd_ids = table.ssd.export()[0]
    assert not torch.isin(ssd_ids, table.keys[table.keys >= 0]).any()
    # find sees both tiers, read-only
    probe = torch.cat([reference.export()["ids"][::3], torch.tensor([5, 2**62])])
    before = table.metrics()["ssd_size"]
    rows, found = table.find(probe)
    want_rows, want_found = reference.find(probe)
    assert torch.equal(found, want_found) and torch.equal(rows, want_rows)
    assert table.metrics()["ssd_size"] == before
    m = table.metrics()
    assert m["hits"] + m["ssd_hits"] + m["ssd_misses"] == sum(b.numel() for b in batches)
    assert m["ssd_bytes_written"] == m["ssd_writes"] * table.ssd.slab.record_bytes


def test_eval_promotes_without_changing_rows(tmp_path):
    table, reference = _ssd_table(tmp_path), _memory_table()
    batches = _batches(12)
    _train(table, batches)
    _train(reference, batches)
    held = table.ssd.export()[0][:20]
    ids = torch.cat([held, table.keys[table.keys >= 0][:5], torch.tensor([3])])
    slots = table.lookup_eval(ids)
    want = reference.lookup_eval(ids)
    assert torch.equal(slots >= 0, want >= 0)
    stored = slots >= 0
    assert torch.equal(table.weights[slots[stored]], reference.weights[want[stored]])
    assert table.metrics()["promotions"] > 0
    assert table.step == reference.step
    _assert_same_rows(table.export(), reference.export())


def test_insert_overwrites_rows_in_either_tier(tmp_path):
    table, reference = _ssd_table(tmp_path), _memory_table()
    batches = _batches(10)
    _train(table, batches)
    _train(reference, batches)
    ids = torch.cat([table.ssd.export()[0][:10], table.keys[table.keys >= 0][:3]])
    ids = torch.cat([ids, torch.arange(10**12, 10**12 + 300)])  # more than memory holds
    rows = torch.randn(ids.numel(), DIM)
    table.insert(ids, rows)
    reference.insert(ids, rows)
    got, found = table.find(ids)
    assert found.all() and torch.equal(got, rows)
    _assert_same_rows(table.export(), reference.export(), scores=False)


@pytest.mark.parametrize(
    "policy, ssd_policy",
    [
        (EvictionPolicy.LRU, EvictionPolicy.LRU),
        (EvictionPolicy.LFU, EvictionPolicy.LFU),
        (EvictionPolicy.LFU, EvictionPolicy.LRU),
        (EvictionPolicy.CUSTOM_SCORE, EvictionPolicy.CUSTOM_SCORE),
    ],
    ids=["lru", "lfu", "lfu-ssd_lru", "custom_score"],
)
def test_insert_with_exact_scores_keeps_them_in_either_tier(tmp_path, policy, ssd_policy):
    table = _ssd_table(tmp_path, capacity=48, eviction=policy, ssd={"eviction": ssd_policy})
    _train(table, _batches(9, id_range=200))
    held = table.ssd.export()[0][:5]  # overwritten: they move to memory
    ids = torch.cat([held, torch.arange(10**9, 10**9 + 101) * 3])  # more than memory holds
    scores = torch.randperm(ids.numel()) * 3 + 1000
    slots = table.insert(ids, torch.randn(ids.numel(), DIM), scores=scores, exact_scores=True)
    assert bool((slots[:5] >= 0).all()) and bool((slots < 0).any())
    exported = table.export()
    at = torch.searchsorted(exported["ids"], ids)
    assert torch.equal(exported["scores"][at], scores), "a tier lost the given scores"
    ssd_ids, _, _ = table.ssd.export()
    on_ssd = torch.isin(ids, ssd_ids)
    ssd_scores = table.ssd.scores_of(table.ssd.lookup(ids[on_ssd]))
    want = scores[on_ssd] if ssd_policy == policy else torch.full_like(ssd_scores, table.step)
    assert torch.equal(ssd_scores, want), "the SSD tier ranks them by other scores"


def test_full_disk_in_a_checkpoint_load_leaves_the_table_unchanged(tmp_path, monkeypatch):
    saved = _ssd_table(tmp_path / "saved", optim=ADAM)
    _train(saved, _batches(50, n_ids=48, id_range=10**5))  # more rows than the slab has
    rows = rows_from_entries("t", table_state(saved))
    table = _ssd_table(tmp_path / "loaded", optim=ADAM)
    _train(table, _batches(3, seed=5))
    before, exported = _snapshot(table), table.export()
    monkeypatch.setattr(slab_module, "_fallocate", _no_space)
    with pytest.raises(KVStorageError, match="no space left on device"):
        restore_table(table, rows)
    assert _same(_snapshot(table), before)
    _assert_same_rows(table.export(), exported)
    monkeypatch.undo()
    restore_table(table, rows)
    _assert_same_rows(table.export(), saved.export())


def test_custom_scores_carry_across_tiers(tmp_path):
    policy = EvictionPolicy.CUSTOM_SCORE
    table = _ssd_table(tmp_path, eviction=policy, ssd={"eviction": policy})
    reference = _memory_table(eviction=policy)
    for step, ids in enumerate(_batches(20)):
        custom = step * 100 + ids % 7  # later batches outrank: every id finds a row
        _touch(table, table.lookup_train(ids, custom), ids)
        _touch(reference, reference.lookup_train(ids, custom), ids)
    assert table.metrics()["promotions"] > 0
    assert table.metrics()["insert_failures"] == 0
    _assert_same_rows(table.export(), reference.export())


def test_lfu_counts_survive_demotion(tmp_path):
    lfu = EvictionPolicy.LFU
    table = _ssd_table(tmp_path, capacity=16, eviction=lfu, ssd={"eviction": lfu})  # one bucket
    table.lookup_train(torch.arange(16).repeat(3))  # counts 3
    table.lookup_train(torch.arange(100, 116).repeat(5))  # counts 5: all of 0..15 demoted
    assert table.metrics()["demotions"] == 16
    table.lookup_train(torch.zeros(4, dtype=torch.int64))  # promoted: 3 + 4, evicts 115
    scores = dict(zip(*(table.export()[k].tolist() for k in ("ids", "scores"))))
    assert scores == {0: 7, **dict.fromkeys(range(1, 16), 3), **dict.fromkeys(range(100, 116), 5)}
    assert 115 in table.ssd.export()[0].tolist()


def test_admission_counts_demoted_ids_as_stored(tmp_path):
    counter = {"admission_threshold": 2, "admission_counter_capacity": 8192}
    table, reference = _ssd_table(tmp_path, **counter), _memory_table(**counter)
    batches = _batches(20, id_range=200)
    _train(table, batches)
    _train(reference, batches)
    assert table.metrics()["promotions"] > 0
    assert table.metrics()["admission_rejects"] == reference.metrics()["admission_rejects"]
    _assert_same_rows(table.export(), reference.export())


def test_bounded_ssd_drops_and_counts(tmp_path):
    table = _ssd_table(tmp_path, ssd={"capacity": 64})
    batches = _batches(40, id_range=2000)
    _train(table, batches)
    m = table.metrics()
    assert m["ssd_size"] <= 64 and table.ssd.capacity == 64
    assert m["ssd_evictions"] > 0
    distinct = torch.unique(torch.cat(batches)).numel()
    assert len(table.export()["ids"]) == table.size + m["ssd_size"]
    assert m["insert_failures"] == 0
    assert m["ssd_evictions"] >= distinct - table.size - m["ssd_size"]
    # the last batch's ids were used last: none of them was dropped
    assert table.find(batches[-1])[1].all()


def test_unbounded_ssd_grows_and_drops_nothing(tmp_path):
    table = _ssd_table(tmp_path)
    batches = [torch.arange(i * 24, (i + 1) * 24) * 3 for i in range(200)]
    _train(table, batches)
    m = table.metrics()
    assert m["insert_failures"] == 0
    assert m["ssd_evictions"] == 0 and m["ssd_size"] == 4800 - table.size
    assert m["ssd_size"] <= 0.75 * table.ssd.capacity


def test_unbounded_index_keeps_every_id_at_a_high_load():
    index = SlotIndex(INITIAL_BUCKETS, stash=True)
    ids = torch.unique(torch.randint(0, 2**62, (200_000,), generator=torch.Generator()))
    for part in ids.split(5000):
        index.add(part, part % 1000)
    slots = index.probe(ids)
    assert (slots >= 0).all()
    assert torch.equal(index.ids_at(slots), ids) and torch.equal(index.scores_at(slots), ids % 1000)
    assert index.size == ids.numel() and index.size > 0.35 * index.slots
    assert index.records_at(slots).eq(-1).all()
    assert (slots >= index.main_slots).any(), "some ids should overflow into the stash"
    index.remove(slots[::3])
    assert index.size == ids.numel() - slots[::3].numel()
    again = index.probe(ids)
    assert (again[::3] < 0).all() and torch.equal(again[1::3], slots[1::3])


def test_place_takes_the_ways_insert_would():
    keys = torch.full((8, WAYS), -1, dtype=torch.int64)
    keys[:, :5] = torch.arange(40).view(8, 5) + 10**6
    ids = torch.randperm(500, generator=torch.Generator().manual_seed(0))[:60] * 7
    reference_keys = keys.clone()
    want = insert(reference_keys, torch.zeros_like(keys), ids, torch.zeros_like(ids), False, True)
    got = BucketIndex(keys, torch.zeros_like(keys)).place(ids)
    placed = got >= 0
    assert placed.any() and not placed.all(), "the test wants buckets with and without room"
    # ids of a bucket without room for all of them are left out, whole
    buckets = index_bucket(ids, 8)
    assert not torch.isin(buckets[placed], buckets[~placed]).any()
    assert torch.equal(got[placed] // WAYS, buckets[placed])
    # in the others, the same ways as insert (the first free ones)
    kept = torch.isin(buckets, buckets[placed])
    assert torch.equal(got[kept].sort().values, want.slots[kept].sort().values)
    assert torch.equal(keys.view(-1)[got[placed]], ids[placed])


def test_bad_ssd_options(tmp_path):
    with pytest.raises(ValueError, match=r"'t'.*NONE never demotes"):
        _ssd_table(tmp_path, eviction=EvictionPolicy.NONE)
    with pytest.raises(ValueError, match=r"'t'.*SSD eviction LFU"):
        _ssd_table(tmp_path, ssd={"eviction": EvictionPolicy.LFU})
    with pytest.raises(ValueError, match="capacity must be > 0"):
        SSDOptions(path=str(tmp_path), capacity=0)


# ------------------------------------------------------------------ durability
def test_flush_close_reopen_restores_and_training_continues(tmp_path):
    batches = _batches(30)
    table = _ssd_table(tmp_path / "a", optim=ADAM)
    _train(table, batches[:15])
    table.optim_step = 15
    table.flush()
    _train(table, batches[15:20])
    table.optim_step = 20
    flushed = table.export()
    table.close()
    with pytest.raises(KVStorageError, match="closed"):
        table.lookup_train(batches[0])

    reopened = _ssd_table(tmp_path / "a", optim=ADAM)
    assert (reopened.step, reopened.optim_step) == (20, 20)
    _assert_same_rows(reopened.export(), flushed)
    # the memory tier comes back as it was: further training matches an unbroken run
    unbroken = _ssd_table(tmp_path / "b", optim=ADAM)
    _train(unbroken, batches[:20])
    assert torch.equal(reopened.export()["ids"], unbroken.export()["ids"])
    assert sorted(reopened.keys[reopened.keys >= 0].tolist()) == sorted(
        unbroken.keys[unbroken.keys >= 0].tolist()
    )
    _train(reopened, batches[20:])
    _train(unbroken, batches[20:])
    _assert_same_rows(reopened.export(), unbroken.export())
    reopened.close()
    unbroken.close()
    fresh = _ssd_table(tmp_path / "a", ssd={"resume": False}, optim=ADAM)
    assert fresh.step == 0 and len(fresh.export()["ids"]) == 0


def test_writes_after_flush_never_touch_durable_records(tmp_path):
    table = _ssd_table(tmp_path)
    batches = _batches(40)
    _train(table, batches[:15])
    table.flush()
    tier = table.ssd
    saved = np.load(tier.index_path)
    durable = np.concatenate([saved["ssd_records"], saved["mem_records"]])
    image = tier.slab_path.read_bytes()
    _train(table, batches[15:])  # promotions free durable records, demotions write
    assert table.metrics()["ssd_flushes"] == 1
    now = tier.slab_path.read_bytes()
    size = tier.slab.record_bytes
    for record in durable.tolist():
        start = HEADER_BYTES + record * size
        assert now[start : start + size] == image[start : start + size], f"record {record}"
    assert now != image[: len(now)]


def test_full_slab_flushes_by_itself(tmp_path):
    table = _ssd_table(tmp_path)
    _train(table, _batches(100))
    table.flush()
    # the same ids again: promotions free durable records, demotions need free ones
    _train(table, _batches(80, seed=1))
    m = table.metrics()
    assert m["ssd_flushes"] > 1
    records = table.ssd.slab.records
    assert records <= 1.6 * (m["ssd_size"] + 2 * table.capacity) + 2048


CHILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import torch
    from tests.ssd.test_tier import _batches, _ssd_table, _train

    out = Path(sys.argv[1])
    table = _ssd_table(out / "ssd")
    batches = _batches(40)
    _train(table, batches[:20])
    table.flush()
    torch.save(table.export(), out / "flushed.pt")
    (out / "flushed").touch()
    _train(table, batches[20:])  # written after the flush, never flushed
    assert table.metrics()["ssd_flushes"] == 1
    (out / "trained").touch()
    time.sleep(120)
    """
)


def test_sigkill_after_flush_keeps_every_flushed_row(tmp_path):
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path)],
        cwd=root,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "trained").exists():
            assert child.poll() is None, child.stderr.read().decode()
            assert time.monotonic() < deadline, "child did not finish training"
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    flushed = torch.load(tmp_path / "flushed.pt")
    table = _ssd_table(tmp_path / "ssd")
    assert table.step == 20
    _assert_same_rows(table.export(), flushed)
    assert table.metrics()["ssd_corrupt"] == 0


def test_corrupted_records_are_detected_never_served(tmp_path):
    table = _ssd_table(tmp_path)
    _train(table, _batches(15))
    table.close()
    table = _ssd_table(tmp_path)
    ids, _, _ = table.ssd.export()
    victims = ids[:4]
    records = table.ssd.records_of(table.ssd.lookup(victims)).tolist()
    size = table.ssd.slab.record_bytes
    table.ssd.close()
    with open(table.ssd.slab_path, "r+b") as f:
        for record, offset in zip(records, (0, 8, 16 + 3, 24 + 5)):  # id, score, sum, floats
            f.seek(HEADER_BYTES + record * size + offset)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x10]))
    table = _ssd_table(tmp_path)
    everything = table.export()
    assert not torch.isin(victims, everything["ids"]).any()
    assert table.metrics()["ssd_corrupt"] == 4
    rows, found = table.find(victims)
    assert not found.any() and not rows.any()
    # treated as missing: training gives them fresh initial rows
    slots = table.lookup_train(victims)
    assert torch.equal(table.weights[slots], table.initial_rows(victims))
    assert table.metrics()["ssd_corrupt"] == 4  # counted once: the bad entries are dropped


def test_unreadable_index_is_a_clear_error(tmp_path):
    table = _ssd_table(tmp_path)
    _train(table, _batches(5))
    table.close()
    index = table.ssd.index_path
    index.write_bytes(index.read_bytes()[:100])
    with pytest.raises(KVStorageError, match=r"table 't'.*index .*t\.rank0\.index.*unreadable"):
        _ssd_table(tmp_path)
    with pytest.raises(KVStorageError, match=r"table 't'.*'dim': 6.*'dim': 7"):
        KVTable("t", 7, KVTableOptions(capacity=32, ssd=SSDOptions(str(tmp_path))))


# --------------------------------------------------------------- paths and disks
def test_unwritable_paths_are_clear_errors(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(KVStorageError, match=r"table 't'.*file.*not a directory"):
        _ssd_table(a_file)
    with pytest.raises(KVStorageError, match=r"table 't'.*create the directory.*file/sub"):
        _ssd_table(a_file / "sub")


def _no_space(*args):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_full_disk_in_training_leaves_memory_unchanged(tmp_path, monkeypatch):
    table, reference = _ssd_table(tmp_path / "a"), _ssd_table(tmp_path / "b")
    batches = _batches(12) + [torch.arange(2000) * 7 + 1]  # the last needs a bigger slab
    _train(table, batches[:12])
    _train(reference, batches[:12])
    before, metrics = _snapshot(table), table.metrics()
    exported = table.export()
    monkeypatch.setattr(slab_module, "_fallocate", _no_space)
    with pytest.raises(KVStorageError, match=rf"table 't'.*{tmp_path}/a.*no space left on device"):
        table.lookup_train(batches[12])
    assert _same(_snapshot(table), before)
    after = table.metrics()
    for key in metrics.keys() - {"ssd_reads", "ssd_bytes_read"}:
        assert after[key] == metrics[key], key
    _assert_same_rows(table.export(), exported)
    monkeypatch.undo()  # space again: the same batch goes through as if nothing happened
    _train(table, batches[12:])
    _train(reference, batches[12:])
    _assert_same_rows(table.export(), reference.export())


def test_full_disk_in_flush_keeps_the_previous_flush(tmp_path, monkeypatch):
    table = _ssd_table(tmp_path)
    batches = _batches(20)
    _train(table, batches[:10])
    table.flush()
    flushed = table.export()
    _train(table, batches[10:])
    monkeypatch.setattr(slab_module, "_fsync", _no_space)
    with pytest.raises(KVStorageError, match=r"table 't'.*no space left on device"):
        table.flush()
    monkeypatch.undo()
    assert not list(tmp_path.glob("*.tmp"))
    table.ssd.close()  # a crash: no flush at close
    _assert_same_rows(_ssd_table(tmp_path).export(), flushed)


def test_files_per_table_and_rank(tmp_path):
    a0 = KVTable("a/b", DIM, KVTableOptions(capacity=16, ssd=SSDOptions(str(tmp_path))), rank=0)
    a1 = KVTable("a/b", DIM, KVTableOptions(capacity=16, ssd=SSDOptions(str(tmp_path))), rank=1)
    _train(a0, _batches(5, seed=1))
    _train(a1, _batches(5, seed=2))
    assert a0.ssd.slab_path.name == "a_b.rank0.slab" and a1.ssd.slab_path.name == "a_b.rank1.slab"
    assert not torch.equal(a0.export()["ids"], a1.export()["ids"])
    with pytest.raises(KVStorageError, match="open in another table or process"):
        KVTable("a/b", DIM, KVTableOptions(capacity=16, ssd=SSDOptions(str(tmp_path))), rank=1)
    a0.close()
    a1.close()


# ------------------------------------------------------------------------ prefetch
def test_prefetch_gives_the_same_rows_even_when_stale(tmp_path):
    table, reference = _ssd_table(tmp_path), _memory_table()
    batches = _batches(30)
    _train(table, batches[:10])
    _train(reference, batches[:10])
    staged_total = 0
    for step in range(10, 29):
        # stage step+1's rows, then run step, which promotes/demotes some of them
        table.prefetch(batches[step + 1])
        staged_total += table.metrics()["ssd_reads"]
        _train(table, [batches[step]])
        _train(reference, [batches[step]])
    m = table.metrics()
    assert 0 < m["ssd_prefetch_hits"]
    _assert_same_rows(table.export(), reference.export())


def test_prefetch_of_rewritten_records_reads_again(tmp_path):
    table = _ssd_table(tmp_path)
    _train(table, [torch.arange(i * 20, i * 20 + 20) for i in range(20)])
    held = table.ssd.export()[0][:10]
    table.prefetch(held)
    table.lookup_train(held)  # promotes the staged rows: their records are freed
    _train(table, [torch.arange(1000 + 20 * i, 1020 + 20 * i) for i in range(10)])  # rewrites
    before = table.metrics()["ssd_prefetch_hits"]
    table.lookup_train(held)  # nothing staged is still valid
    assert table.metrics()["ssd_prefetch_hits"] == before


# ---------------------------------------------------------------- estimate
def test_storage_estimate(tmp_path):
    plain = KVTableOptions(capacity=1000)
    est = storage_estimate(plain, DIM, ADAM)
    assert est["disk_bytes"] == 0
    assert est["memory_bytes"] == _memory_table(1000, optim=ADAM).memory_bytes()

    table = _ssd_table(tmp_path, ssd={"capacity": 4096}, optim=ADAM)
    _train(table, _batches(40))
    table.flush()
    _train(table, _batches(10, seed=5))
    table.flush()
    est = storage_estimate(table.options, DIM, ADAM)
    assert est["memory_rows"] == table.capacity and est["ssd_rows"] == 4096
    assert est["record_bytes"] == table.ssd.slab.record_bytes == 8 * (3 + 3 * DIM // 2)
    assert est["memory_bytes"] >= table.memory_bytes() + table.ssd.memory_bytes()
    assert est["disk_bytes"] >= table.ssd.disk_bytes()
    with pytest.raises(ValueError, match="ssd_rows"):
        storage_estimate(KVTableOptions(capacity=8, ssd=SSDOptions(str(tmp_path))), DIM)
    unbounded = storage_estimate(
        KVTableOptions(capacity=8, ssd=SSDOptions(str(tmp_path))), DIM, ssd_rows=10**6
    )
    assert unbounded["disk_bytes"] > 10**6 * unbounded["record_bytes"]
