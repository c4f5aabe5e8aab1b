"""The lower-tier contract (``torchrec_kvemb.tier.LowerTier``) and its SSD tier.

``SSDStore`` implements every method of the contract; a tier that lacks one
cannot be built. A ``TieredKVTable`` whose tier is wrapped in a tier that
forwards the contract's methods and nothing else (no ``counters``, ``slab``,
...) trains, inserts, finds, exports, flushes and reopens exactly as one over a
bare ``SSDStore``, on the native lookup and on the torch path: the table uses
its tier through the contract only.
"""

from collections import Counter
from typing import Any

import pytest
import torch

from torchrec_kvemb import EvictionPolicy, KVTableOptions, SSDOptions
from torchrec_kvemb.backend import ENV_VAR
from torchrec_kvemb.ops import native
from torchrec_kvemb.ssd import SSDStore
from torchrec_kvemb.tier import TIER_COUNTERS, LowerTier, RestoredRows
from torchrec_kvemb.tiered import TieredKVTable

DIM = 4
STATE_DIM = 1


class ContractOnly(LowerTier):
    """A tier that forwards the contract's methods to another and counts the calls."""

    def __init__(self, inner: LowerTier) -> None:
        self.inner = inner
        self.calls: Counter[str] = Counter()

    def _call(self, name: str, *args: Any) -> Any:
        self.calls[name] += 1
        return getattr(self.inner, name)(*args)

    @property
    def size(self) -> int:
        return self.inner.size

    @property
    def capacity(self) -> int:
        return self.inner.capacity

    @property
    def closed(self) -> bool:
        return self.inner.closed

    def memory_bytes(self) -> int:
        return self._call("memory_bytes")

    def metrics(self) -> dict[str, int]:
        return self._call("metrics")

    def lookup(self, ids):
        return self._call("lookup", ids)

    def fetch(self, ids, slots, use_staged=True):
        return self._call("fetch", ids, slots, use_staged)

    def prefetch(self, ids):
        return self._call("prefetch", ids)

    def export(self):
        return self._call("export")

    def reserve(self, n):
        return self._call("reserve", n)

    def needs_flush(self, n):
        return self._call("needs_flush", n)

    def put(self, ids, memory_scores, tier_scores, rows):
        return self._call("put", ids, memory_scores, tier_scores, rows)

    def remove(self, slots):
        return self._call("remove", slots)

    def expire(self, cutoff, part, parts):
        return self._call("expire", cutoff, part, parts)

    def read_restored(self):
        return self._call("read_restored")

    def adopt(self, ids, tier_scores, records):
        return self._call("adopt", ids, tier_scores, records)

    def flush(self, ids, memory_scores, rows, meta):
        return self._call("flush", ids, memory_scores, rows, meta)

    def close(self):
        return self._call("close")


class OverContract(TieredKVTable):
    """A tiered table whose tier answers the contract's methods only."""

    def _open_tier(self, rank: int) -> LowerTier:
        return ContractOnly(super()._open_tier(rank))


def _store(path, capacity=None) -> SSDStore:
    return SSDStore("t", DIM, STATE_DIM, SSDOptions(path=str(path), capacity=capacity), rank=0)


def test_the_ssd_store_implements_the_whole_contract(tmp_path):
    store = _store(tmp_path)
    assert isinstance(store, LowerTier)
    for name in LowerTier.__abstractmethods__:
        assert name not in SSDStore.__abstractmethods__, name
    assert tuple(store.metrics()) == TIER_COUNTERS
    store.close()


def test_a_tier_missing_a_method_cannot_be_built():
    class Partial(LowerTier):
        def lookup(self, ids):
            return ids

    with pytest.raises(TypeError, match="abstract method"):
        Partial()


def test_rows_go_down_come_back_and_survive_a_reopen(tmp_path):
    """The module docstring's example of ``torchrec_kvemb.tier``: rows put into the
    tier come back bit for bit with their memory scores; removed ones are gone; a
    flush's memory rows and meta come back from ``read_restored``."""
    tier = _store(tmp_path)
    ids = torch.tensor([3, 2**40, 17])
    rows = torch.arange(15, dtype=torch.float32).reshape(3, 5) / 7
    memory_scores = torch.tensor([5, 6, 7])
    tier.reserve(ids.numel())
    tier.put(ids, memory_scores, memory_scores, rows)
    assert tier.size == 3
    slots = tier.lookup(torch.tensor([17, 4, 3]))
    assert slots[1] == -1 and bool((slots[[0, 2]] >= 0).all())
    got_scores, got_rows, ok = tier.fetch(torch.tensor([17, 3]), slots[[0, 2]])
    assert ok.all() and torch.equal(got_scores, torch.tensor([7, 5]))
    assert torch.equal(got_rows, rows[[2, 0]])
    tier.remove(slots[[0]])
    assert tier.size == 2 and tier.lookup(torch.tensor([17])).item() == -1
    exported = tier.export()
    assert torch.equal(exported[0].sort().values, torch.tensor([3, 2**40]))
    memory_ids, memory_rows = torch.tensor([100, 101]), torch.ones(2, 5)
    tier.flush(memory_ids, torch.tensor([1, 2]), memory_rows, {"step": 4})
    assert tier.metrics()["ssd_flushes"] == 1
    tier.close()
    assert tier.closed

    again = _store(tmp_path)
    restored = again.read_restored()
    assert isinstance(restored, RestoredRows) and restored.meta["step"] == 4
    assert torch.equal(restored.ids, memory_ids) and torch.equal(restored.rows, memory_rows)
    assert torch.equal(restored.memory_scores, torch.tensor([1, 2]))
    again.adopt(restored.ids[1:], restored.memory_scores[1:], restored.records[1:])
    assert again.size == 3 and again.lookup(torch.tensor([101])).item() >= 0
    again.close()


def _batches(steps=12):
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, 600, (40,), generator=gen) * 7_919 for _ in range(steps)]


def _train(table, batches) -> None:
    for ids in batches:
        slots = table.lookup_train(ids)
        stored = slots >= 0
        weights, state = table.batch_rows()
        weights[slots[stored]] += (ids[stored] % 13).to(torch.float32).unsqueeze(1) / 32
        state[slots[stored]] += 1.0


def _assert_same_export(got, want) -> None:
    got, want = got.export(), want.export()
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert torch.equal(got[key], value), key


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("policy", [EvictionPolicy.LRU, EvictionPolicy.LFU])
def test_a_table_uses_its_tier_through_the_contract_only(backend, policy, tmp_path, monkeypatch):
    if backend == "native":
        assert native.available(), native.unavailable_reason()  # make test builds it
    monkeypatch.setenv(ENV_VAR, "auto" if backend == "native" else backend)

    def options(path):
        return KVTableOptions(capacity=64, eviction=policy, ssd=SSDOptions(path=str(path)))

    bare = TieredKVTable("t", DIM, options(tmp_path / "bare"))
    wrapped = OverContract("t", DIM, options(tmp_path / "wrapped"))
    assert isinstance(wrapped.tier, ContractOnly)
    assert wrapped.lookup_backend(torch.device("cpu")) == backend
    batches = _batches()
    for table in (bare, wrapped):
        _train(table, batches[:8])
        table.insert(torch.tensor([5, 9]), torch.full((2, DIM), 0.5))
        _train(table, batches[8:])
    _assert_same_export(wrapped, bare)
    assert wrapped.metrics() == bare.metrics()
    probe = torch.cat([batches[0], torch.tensor([5, 9, 123456789])])
    assert all(torch.equal(a, b) for a, b in zip(wrapped.find(probe), bare.find(probe)))
    calls = wrapped.tier.calls
    assert calls["put"] and calls["fetch"] and calls["remove"] and calls["reserve"], calls

    for table in (bare, wrapped):
        table.close()
    bare = TieredKVTable("t", DIM, options(tmp_path / "bare"))
    wrapped = OverContract("t", DIM, options(tmp_path / "wrapped"))
    assert wrapped.tier.calls["read_restored"] == 1
    _assert_same_export(wrapped, bare)
    assert (wrapped.step, wrapped.optim_step) == (bare.step, bare.optim_step) == (12, 0)
    bare.close()
    wrapped.close()
