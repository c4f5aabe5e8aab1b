"""Incremental dumps: changed rows and evicted ids per dump, rebuilt exactly, into
tables with or without an SSD tier."""

import errno
import json
import os
import shutil

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import torchrec_kvemb.ssd.slab as slab_module
from tests.checkpoint.test_ssd_scores import assert_memory_keeps_the_highest_scores
from torchrec_kvemb import KVEmbeddingBagCollection, KVTableOptions, SSDOptions
from torchrec_kvemb.checkpoint.incremental import (
    IncrementalDumper,
    RowTracker,
    apply_dumps,
    dump_incremental,
    list_dumps,
    load_dumps_into,
)
from torchrec_kvemb.options import EvictionPolicy
from torchrec_kvemb.ssd import KVStorageError


def _ebc(optimizer="EXACT_ROWWISE_ADAGRAD", opts=None):
    configs = [
        EmbeddingBagConfig(
            name="user", embedding_dim=4, num_embeddings=2**63 - 1, feature_names=["u"]
        ),
        EmbeddingBagConfig(name="item", embedding_dim=3, num_embeddings=2**40, feature_names=["i"]),
    ]
    opts = opts or {
        "user": KVTableOptions(capacity=32, eviction=EvictionPolicy.LRU),
        "item": KVTableOptions(capacity=64, eviction=EvictionPolicy.LRU),
    }
    return KVEmbeddingBagCollection(
        configs,
        opts,
        fused_params={"optimizer": getattr(EmbOptimType, optimizer), "learning_rate": 0.1},
    )


def _step(ebc, gen):
    users = torch.randint(0, 400, (12,), generator=gen)
    items = torch.randint(0, 40, (6,), generator=gen)
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["u", "i"],
        values=torch.cat([users, items]),
        lengths=torch.tensor([3, 3, 3, 3, 2, 2, 1, 1]),
    )
    ebc(kjt).values().square().sum().backward()


def _assert_same(rebuilt, ebc):
    assert set(rebuilt) == set(ebc.kv_tables())
    for name, table in ebc.kv_tables().items():
        live = table.export()
        assert set(rebuilt[name]) == set(live), name
        for key in live:
            assert torch.equal(rebuilt[name][key], live[key]), (name, key)


@pytest.mark.parametrize("optimizer", ["EXACT_ROWWISE_ADAGRAD", "ADAM"])
def test_dumps_rebuild_live_tables_exactly(tmp_path, optimizer):
    ebc = _ebc(optimizer)
    gen = torch.Generator().manual_seed(0)
    dumper = IncrementalDumper(ebc, tmp_path)
    evicted_total = 0
    for step in range(8):
        _step(ebc, gen)
        manifest = dumper.dump()
        assert manifest["seq"] == step and manifest["full"] == (step == 0)
        evicted_total += sum(t["evicted"] for t in manifest["tables"].values())
        _assert_same(apply_dumps(tmp_path), ebc)
    assert ebc.table("user").metrics()["evictions"] > 0
    assert evicted_total > 0  # capacity forced evictions between dumps
    assert list_dumps(tmp_path) == list(range(8))
    with open(tmp_path / "000003" / "manifest.json") as f:
        info = json.load(f)
    assert info["tables"]["user"]["dim"] == 4 and not info["full"]

    fresh = _ebc(optimizer)
    load_dumps_into(fresh, tmp_path)
    for name, table in ebc.kv_tables().items():
        live, loaded = table.export(), fresh.table(name).export()
        for key in live:
            assert torch.equal(live[key], loaded[key]), (name, key)


def test_dump_without_changes_is_empty_and_increments_are_small(tmp_path):
    ebc = _ebc()
    gen = torch.Generator().manual_seed(1)
    dumper = IncrementalDumper(ebc, tmp_path)
    _step(ebc, gen)
    full = dumper.dump()
    assert full["tables"]["user"]["changed"] == ebc.table("user").size
    empty = dumper.dump()
    assert all(t["changed"] == 0 and t["evicted"] == 0 for t in empty["tables"].values())
    saved = torch.load(tmp_path / "000001" / empty["tables"]["user"]["file"])
    assert saved["ids"].numel() == 0 and saved["weights"].shape == (0, 4)
    _assert_same(apply_dumps(tmp_path), ebc)


def test_torn_dump_is_ignored_and_new_dumper_starts_full(tmp_path):
    ebc = _ebc()
    gen = torch.Generator().manual_seed(2)
    dumper = IncrementalDumper(ebc, tmp_path)
    _step(ebc, gen)
    dumper.dump()
    _step(ebc, gen)
    dumper.dump()
    # An interrupted dump: its temporary directory, and a numbered one without manifest.
    os.makedirs(tmp_path / ".tmp-000002-dead")
    torch.save({"ids": torch.tensor([1])}, tmp_path / ".tmp-000002-dead" / "table_0000.pt")
    os.makedirs(tmp_path / "000002")
    assert list_dumps(tmp_path) == [0, 1]
    _assert_same(apply_dumps(tmp_path), ebc)

    os.rmdir(tmp_path / "000002")
    _step(ebc, gen)
    again = IncrementalDumper(ebc, tmp_path).dump()
    assert again["seq"] == 2 and again["full"]
    _assert_same(apply_dumps(tmp_path), ebc)


def test_missing_increment_and_no_full_dump_raise(tmp_path):
    with pytest.raises(FileNotFoundError):
        apply_dumps(tmp_path)
    ebc = _ebc()
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        _step(ebc, gen)
        dump_incremental(ebc, tmp_path)
    assert list_dumps(tmp_path) == [0, 1, 2]
    _assert_same(apply_dumps(tmp_path), ebc)
    shutil.rmtree(tmp_path / "000001")
    with pytest.raises(ValueError, match="not consecutive"):
        apply_dumps(tmp_path)


def test_load_into_non_empty_table_raises(tmp_path):
    ebc = _ebc()
    _step(ebc, torch.Generator().manual_seed(4))
    IncrementalDumper(ebc, tmp_path).dump()
    with pytest.raises(ValueError, match="not empty"):
        load_dumps_into(ebc, tmp_path)


def test_tracker_invalidate_resends_rows_and_evictions():
    ebc = _ebc()
    gen = torch.Generator().manual_seed(5)
    _step(ebc, gen)
    tracker = RowTracker()
    tables = ebc.kv_tables()
    first = tracker.diff(tables)["user"]
    some = first.rows["ids"][:3]
    assert tracker.diff(tables)["user"].empty
    tracker.invalidate("user", torch.cat([some, torch.tensor([10**12])]))
    again = tracker.diff(tables)["user"]
    assert torch.equal(again.rows["ids"], some)
    assert again.evicted.tolist() == [10**12]


# ------------------------------------------------------------ tables with an SSD tier
#: (table policy, SSD tier policy): the SSD tier ranks by the table's scores, or LRU
#: (by demotion time) over an LFU table.
SSD_POLICIES = {
    "lru": (EvictionPolicy.LRU, EvictionPolicy.LRU),
    "lfu": (EvictionPolicy.LFU, EvictionPolicy.LFU),
    "lfu-ssd_lru": (EvictionPolicy.LFU, EvictionPolicy.LRU),
}
#: Memory rows of the dumped tables (user: 2 index buckets for ~110 ids; item: 2 for
#: the 40 ids), and of the tables the dumps load into: as dumped, more (rows dumped
#: from SSD land in memory), less (rows dumped from memory land on SSD).
SSD_MEMORY = {
    "same-memory": {"user": 32, "item": 32},
    "more-memory": {"user": 80, "item": 64},
    "less-memory": {"user": 16, "item": 16},
}
#: The dumped user table's SSD tier drops rows (ids evicted between dumps).
DUMPED_SSD_CAPACITY = {"user": 48, "item": None}


def _ssd_opts(path, policy, memory, ssd_capacity=None, ssd_policy=None):
    return {
        name: KVTableOptions(
            capacity=memory[name],
            eviction=policy,
            ssd=SSDOptions(
                path=str(path / name),
                capacity=(ssd_capacity or {}).get(name),
                eviction=ssd_policy or policy,
            ),
        )
        for name in ("user", "item")
    }


def _dumped_ssd_ebc(tmp_path, policy):
    """An SSD-tier module trained and dumped step by step; returns it."""
    table_policy, ssd_policy = SSD_POLICIES[policy]
    opts = _ssd_opts(
        tmp_path / "ssd", table_policy, SSD_MEMORY["same-memory"], DUMPED_SSD_CAPACITY, ssd_policy
    )
    ebc = _ebc("ADAM", opts)
    gen = torch.Generator().manual_seed(6)
    dumper = IncrementalDumper(ebc, tmp_path / "dumps")
    evicted_total = 0
    for _ in range(11):
        _step(ebc, gen)
        manifest = dumper.dump()
        evicted_total += manifest["tables"]["user"]["evicted"]
    assert evicted_total > 0  # the SSD tier dropped rows between dumps
    for name, table in ebc.kv_tables().items():
        m = table.metrics()
        assert m["demotions"] > 0 and m["promotions"] > 0 and m["ssd_size"] > 0, name
    return ebc


def _tiers(table):
    """The ids in memory and the ids on SSD, sorted."""
    return table.keys[table.keys >= 0].sort().values, table.ssd.export()[0].sort().values


def _exports(ebc):
    return {name: table.export() for name, table in ebc.kv_tables().items()}


@pytest.mark.parametrize("memory", list(SSD_MEMORY))
@pytest.mark.parametrize("policy", list(SSD_POLICIES))
def test_dumps_load_into_ssd_tables_exactly(tmp_path, policy, memory):
    ebc = _dumped_ssd_ebc(tmp_path, policy)
    _assert_same(apply_dumps(tmp_path / "dumps"), ebc)

    table_policy, ssd_policy = SSD_POLICIES[policy]
    opts = _ssd_opts(tmp_path / "fresh", table_policy, SSD_MEMORY[memory], None, ssd_policy)
    fresh = _ebc("ADAM", opts)
    load_dumps_into(fresh, tmp_path / "dumps")
    _assert_same(_exports(fresh), ebc)  # ids, rows, Adam state and scores of both tiers
    for name, table in fresh.kv_tables().items():
        memory_ids, ssd_ids = _tiers(table)
        if memory != "more-memory":
            assert memory_ids.numel() > 0 and ssd_ids.numel() > 0, name
        assert_memory_keeps_the_highest_scores(table)
        ids, memory_scores, _ = table.ssd.export()
        ssd_scores = table.ssd.scores_of(table.ssd.lookup(ids))
        if ssd_policy == table_policy:
            assert torch.equal(ssd_scores, memory_scores), f"{name}: SSD ranks by other scores"
        else:  # LRU over LFU: the time rows reached the SSD tier (dumps hold no step)
            assert bool((ssd_scores == table.step).all()), name
        if policy == "lru" and memory == "same-memory":
            for got, want in zip(_tiers(table), _tiers(ebc.table(name)), strict=True):
                assert torch.equal(got, want), f"table {name!r}: the tiers hold other ids"


#: errno of a failing slab growth, and the reason the error gives.
SSD_WRITE_ERRORS = {
    "no-space-left": (errno.ENOSPC, "no space left on device"),
    "read-only-file-system": (errno.EROFS, os.strerror(errno.EROFS)),
}


@pytest.mark.parametrize("err", list(SSD_WRITE_ERRORS))
@pytest.mark.parametrize("failing", ["user", "item"])
def test_ssd_write_failure_in_load_leaves_every_table_empty(tmp_path, monkeypatch, failing, err):
    ebc = _dumped_ssd_ebc(tmp_path, "lru")
    fresh = _ebc(
        "ADAM", _ssd_opts(tmp_path / "fresh", EvictionPolicy.LRU, SSD_MEMORY["less-memory"])
    )
    fd = fresh.table(failing).ssd.slab._files.fd
    fallocate = slab_module._fallocate
    code, reason = SSD_WRITE_ERRORS[err]

    def fail_on_one_table(at, offset, length):
        if at == fd:
            raise OSError(code, os.strerror(code))
        fallocate(at, offset, length)

    monkeypatch.setattr(slab_module, "_fallocate", fail_on_one_table)
    with pytest.raises(KVStorageError, match=rf"table '{failing}'.*{reason}"):
        load_dumps_into(fresh, tmp_path / "dumps")
    for name, table in fresh.kv_tables().items():
        assert table.size == 0 and table.ssd.size == 0, f"table {name!r} changed"
        assert table.export()["ids"].numel() == 0, name
    monkeypatch.undo()  # room again: the same load goes through
    load_dumps_into(fresh, tmp_path / "dumps")
    _assert_same(_exports(fresh), ebc)


def test_load_into_ssd_tables_checks_room_and_emptiness_first(tmp_path):
    ebc = _dumped_ssd_ebc(tmp_path, "lfu")
    small = {"user": 16, "item": 16}
    fresh = _ebc(
        "ADAM", _ssd_opts(tmp_path / "small", EvictionPolicy.LFU, small, {"user": 17, "item": None})
    )
    with pytest.raises(RuntimeError, match=r"table 'user': \d+ dumped rows do not fit"):
        load_dumps_into(fresh, tmp_path / "dumps")
    assert all(t.size == 0 and t.ssd.size == 0 for t in fresh.kv_tables().values())

    # Rows on SSD only (memory empty) still make a table non-empty.
    other = _ebc(
        "ADAM", _ssd_opts(tmp_path / "other", EvictionPolicy.LFU, SSD_MEMORY["same-memory"])
    )
    item = other.table("item")
    item.ssd.put(
        torch.tensor([5]), torch.tensor([1]), torch.tensor([1]), torch.zeros(1, item.dim * 3)
    )
    with pytest.raises(ValueError, match=r"table 'item' is not empty \(1 ids\)"):
        load_dumps_into(other, tmp_path / "dumps")
    assert other.table("user").export()["ids"].numel() == 0
    _assert_same(apply_dumps(tmp_path / "dumps"), ebc)
