"""Incremental dumps: changed rows and evicted ids per dump, rebuilt exactly."""

import json
import os
import shutil

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb import KVEmbeddingBagCollection, KVTableOptions
from torchrec_kvemb.checkpoint.incremental import (
    IncrementalDumper,
    RowTracker,
    apply_dumps,
    dump_incremental,
    list_dumps,
    load_dumps_into,
)
from torchrec_kvemb.options import EvictionPolicy


def _ebc(optimizer="EXACT_ROWWISE_ADAGRAD"):
    configs = [
        EmbeddingBagConfig(
            name="user", embedding_dim=4, num_embeddings=2**63 - 1, feature_names=["u"]
        ),
        EmbeddingBagConfig(name="item", embedding_dim=3, num_embeddings=2**40, feature_names=["i"]),
    ]
    opts = {
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
