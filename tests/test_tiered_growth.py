"""Growing tables over lower tiers (``initial_capacity`` with ``host_tier`` / ``ssd``).

The twins: the same batches through a ``KVEmbeddingBagCollection`` whose tables
start at one index bucket of memory rows and grow to four, over a host tier
(unbounded; or bounded, over an SSD tier), and through one whose tables are
built at four buckets over the same kind of tiers. The growing table grows
before it demotes anything, so at every step both give the same outputs and
hold, tier by tier, the same ids with the same rows, optimizer state and
scores, and count the same (but for ``size``, ``capacity``, ``load_factor``
and ``growths``); no row leaves memory while the table is below its maximum.
Tables alone in their group and two tables sharing a group's arrays (and its
scratch pad); the native kernels and the torch path; a checkpoint load into a
small table over tiers.
"""

from __future__ import annotations

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.device_support import ATOL, RTOL, assert_tables_equal, backend, kjt_to
from tests.test_host_tier import _assert_rows_equal
from torchrec_kvemb import (
    EvictionPolicy,
    HostTierOptions,
    KVEmbeddingBagCollection,
    KVTable,
    KVTableOptions,
    SSDOptions,
    checkpoint,
)
from torchrec_kvemb.backend import ENV_VAR
from torchrec_kvemb.ops.hashing import index_bucket
from torchrec_kvemb.options import WAYS

MAX_BUCKETS = 4
#: Batch sizes per table: small first (the tables grow), then past the maximum.
SIZES = [5, 9, 17, 28, 40, 52, 64, 64]
FUSED = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.2}
#: Metrics a grown table and its fixed twin may differ in.
SHAPE_METRICS = {"size", "capacity", "load_factor", "growths"}
#: layout -> dims of the two tables (one dim: one group sharing arrays and a pad)
LAYOUTS = {"alone": {"a": 3, "b": 5}, "grouped": {"a": 4, "b": 4}}
#: case -> (policy, host tier capacity or None for unbounded, SSD tier under it,
#: admission threshold)
CASES = {
    "lru-host-unbounded": (EvictionPolicy.LRU, None, False, 1),
    "lru-host-bounded-over-ssd": (EvictionPolicy.LRU, 3 * WAYS, True, 1),
    "lfu-admission-host-bounded-over-ssd": (EvictionPolicy.LFU, 3 * WAYS, True, 2),
}


def _batches(dims: dict) -> list[KeyedJaggedTensor]:
    gen = torch.Generator().manual_seed(31)
    pool = torch.randperm(40_000, generator=gen)[:131] * 7_919 + 2**41
    crowded = pool[index_bucket(pool, MAX_BUCKETS) == 2][:26]  # > 16 of a batch at the max
    keys = [f"f{name}" for name in dims]
    out = []
    for n in SIZES:
        values, lengths = [], []
        for _ in dims:
            ids = pool[torch.randint(0, pool.numel(), (n,), generator=gen)]
            if n >= 40:
                ids = torch.cat([ids, crowded[torch.randperm(crowded.numel(), generator=gen)]])
            values.append(ids)
            lengths.append(torch.tensor([2, 0, 1, ids.numel() - 3]))
        out.append(KeyedJaggedTensor.from_lengths_sync(keys, torch.cat(values), torch.cat(lengths)))
    return out


def _options(case: str, path, grows: bool) -> KVTableOptions:
    policy, host_rows, over_ssd, threshold = CASES[case]
    return KVTableOptions(
        capacity=MAX_BUCKETS * WAYS,
        initial_capacity=WAYS if grows else None,
        eviction=policy,
        admission_threshold=threshold,
        admission_counter_capacity=8 * WAYS,
        host_tier=HostTierOptions(capacity=host_rows, eviction=policy),
        ssd=SSDOptions(str(path)) if over_ssd else None,
        init_low=-0.1,
        init_high=0.1,
        seed=5,
    )


def _ebc(case: str, dims: dict, path, grows: bool, device=None) -> KVEmbeddingBagCollection:
    configs = [
        EmbeddingBagConfig(
            name=name, embedding_dim=dim, num_embeddings=2**50, feature_names=[f"f{name}"]
        )
        for name, dim in dims.items()
    ]
    options = {name: _options(case, path / name, grows) for name in dims}
    return KVEmbeddingBagCollection(configs, options, device=device, fused_params=FUSED)


def _by_id(ids: torch.Tensor, *values: torch.Tensor) -> list[torch.Tensor]:
    order = torch.argsort(ids)
    return [ids[order], *(v[order] for v in values)]


def _assert_same_tiers(grown: KVTable, fixed: KVTable, what: str) -> None:
    """Memory rows, each lower tier's rows, and the counters, tier by tier."""
    _assert_rows_equal(KVTable.export(grown), KVTable.export(fixed), f"{what} memory")
    for got, want in zip(_by_id(*grown.tier.export()), _by_id(*fixed.tier.export()), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=f"{what} lower tiers")
    got = {k: v for k, v in grown.metrics().items() if k not in SHAPE_METRICS}
    want = {k: v for k, v in fixed.metrics().items() if k not in SHAPE_METRICS}
    assert got == want, what


def _train_twins(grown, fixed, dims, batches) -> None:
    gen = torch.Generator().manual_seed(7)
    for step, kjt in enumerate(batches):
        got, want = grown(kjt).values(), fixed(kjt).values()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=f"step {step} outputs")
        grad = torch.randn(want.shape, generator=gen)
        (got * grad).sum().backward()
        (want * grad).sum().backward()
        for name in dims:
            a, b = grown.table(name), fixed.table(name)
            _assert_same_tiers(a, b, f"step {step} table {name}")
            if a.capacity < a.max_capacity:  # below its maximum nothing left memory
                assert a.metrics()["demotions"] == 0, f"step {step} table {name}"


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("case", list(CASES))
def test_a_growing_table_over_tiers_equals_one_built_at_its_maximum(
    case, layout, tmp_path, monkeypatch
):
    monkeypatch.setenv(ENV_VAR, "auto")
    dims = LAYOUTS[layout]
    grown, fixed = _ebc(case, dims, tmp_path / "g", True), _ebc(case, dims, tmp_path / "f", False)
    assert all(grown.table(n).capacity == WAYS for n in dims)
    _train_twins(grown, fixed, dims, _batches(dims))
    for name in dims:
        m = grown.table(name).metrics()
        assert m["growths"] > 0 and m["capacity"] == MAX_BUCKETS * WAYS, m
        assert m["demotions"] > 0 and m["promotions"] > 0 and m["scratch_rows"] > 0, m
        grown.table(name).close()
        fixed.table(name).close()


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_on_the_torch_path(layout, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "torch")
    dims, case = LAYOUTS[layout], "lru-host-bounded-over-ssd"
    grown, fixed = _ebc(case, dims, tmp_path / "g", True), _ebc(case, dims, tmp_path / "f", False)
    _train_twins(grown, fixed, dims, _batches(dims))
    assert all(grown.table(n).metrics()["growths"] > 0 for n in dims)


def test_a_checkpoint_loads_into_a_small_table_as_into_one_at_its_maximum(tmp_path, monkeypatch):
    # the load grows the table to hold the saved rows, up to its maximum, and the
    # rows past it go down to the tiers as they do in the table built at the maximum
    monkeypatch.setenv(ENV_VAR, "auto")
    dims, case = LAYOUTS["alone"], "lru-host-bounded-over-ssd"
    source = _ebc(case, dims, tmp_path / "s", False)
    batches = _batches(dims)
    for kjt in batches[:5]:
        source(kjt).values().sum().backward()
    checkpoint.save(source, tmp_path / "ckpt")
    grown, fixed = _ebc(case, dims, tmp_path / "g", True), _ebc(case, dims, tmp_path / "f", False)
    for model in (grown, fixed):
        checkpoint.load(model, tmp_path / "ckpt")
    for name in dims:
        _assert_same_tiers(grown.table(name), fixed.table(name), f"loaded {name}")
        assert grown.table(name).capacity == MAX_BUCKETS * WAYS
    _train_twins(grown, fixed, dims, batches[5:])


def test_a_restart_over_the_ssd_tier_grows_as_the_table_at_its_maximum(tmp_path, monkeypatch):
    # the reopened table grows to hold the memory rows the last flush left, then
    # trains on as the reopened table built at its maximum
    monkeypatch.setenv(ENV_VAR, "auto")
    case = "lfu-admission-host-bounded-over-ssd"
    batches = [b.values() for b in _batches({"a": 4})]
    tables = {}
    for kind, grows in (("g", True), ("f", False)):
        table = KVTable("t", 4, _options(case, tmp_path / kind, grows))
        for ids in batches[:6]:
            table.lookup_train(ids)
        table.close()
        tables[kind] = KVTable("t", 4, _options(case, tmp_path / kind, grows))
    grown, fixed = tables["g"], tables["f"]
    _assert_same_tiers(grown, fixed, "reopened")
    for step, ids in enumerate(batches[6:] + batches[:3], start=6):
        grown.lookup_train(ids)
        fixed.lookup_train(ids)
        _assert_same_tiers(grown, fixed, f"step {step}")
    assert grown.metrics()["promotions"] > 0
    grown.close()
    fixed.close()


def test_ids_the_tiers_hold_count_as_admitted_when_the_table_grows(monkeypatch):
    # a table below its maximum whose host tier holds rows (as after a restart that
    # left few rows in memory): a batch of those ids, each seen once, promotes them
    # all (admission does not apply to stored rows), so the table grows for them
    # first, as the table at its maximum takes them without a demotion
    monkeypatch.setenv(ENV_VAR, "auto")
    ids = torch.arange(3 * WAYS) * 4 + 3  # more than a bucket of 16
    tables = []
    for grows in (True, False):
        options = KVTableOptions(
            capacity=MAX_BUCKETS * WAYS,
            initial_capacity=WAYS if grows else None,
            admission_threshold=2,
            host_tier=HostTierOptions(),
            seed=5,
        )
        table = KVTable("t", 4, options)
        width = table.dim + table.state_dim
        rows = torch.randn(ids.numel(), width, generator=torch.Generator().manual_seed(2))
        table.tier.reserve(ids.numel())
        table.tier.put(ids, torch.zeros_like(ids), torch.zeros_like(ids), rows)
        table.lookup_train(ids)
        tables.append(table)
    grown, fixed = tables
    assert grown.capacity > WAYS and grown.size == fixed.size == ids.numel()
    assert grown.metrics()["demotions"] == fixed.metrics()["demotions"] == 0
    _assert_same_tiers(grown, fixed, "after the promotions")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_growing_over_tiers_on_the_device(device, layout, tmp_path):
    """The growing collection over tiers on the device under test (its default
    backend), the one built at its maximum on the CPU torch path: the same outputs
    and rows (every tier's) at every step."""
    dims, case = LAYOUTS[layout], "lru-host-bounded-over-ssd"
    with backend("auto"):
        grown = _ebc(case, dims, tmp_path / "g", True, device=device)
    with backend("torch"):
        fixed = _ebc(case, dims, tmp_path / "f", False)
    width = sum(dims.values())
    for step, kjt in enumerate(_batches(dims)):
        grad = torch.randn(4, width, generator=torch.Generator().manual_seed(step))
        with backend("auto"):
            got = grown(kjt_to(kjt, device)).values()
            (got * grad.to(device)).sum().backward()
        with backend("torch"):
            want = fixed(kjt).values()
            (want * grad).sum().backward()
        torch.testing.assert_close(got.cpu(), want, rtol=RTOL, atol=ATOL)
        for name in dims:
            a, b = grown.table(name), fixed.table(name)
            assert_tables_equal(f"step {step} {name}", a.export(), b.export())
            assert a.metrics()["demotions"] == b.metrics()["demotions"], f"step {step} {name}"
    for name in dims:
        m = grown.table(name).metrics()
        assert m["growths"] > 0 and m["demotions"] > 0, m
        grown.table(name).close()
        fixed.table(name).close()


def test_a_budget_holds_for_a_table_that_grows_over_a_tier(tmp_path, monkeypatch):
    # memory_budget_bytes is the maximum's: the table starts below it, and once grown
    # (and its scratch pad in use) it holds exactly what the planner counts, within it
    from tests.test_memory_budget import allocated
    from torchrec_kvemb.sharding.planner import kv_table_bytes

    monkeypatch.setenv(ENV_VAR, "auto")
    budget = 60_013
    options = KVTableOptions(
        memory_budget_bytes=budget, initial_capacity=WAYS, host_tier=HostTierOptions()
    )
    table = KVTable("t", 4, options)
    planned = kv_table_bytes(options, 4, table.optim)
    assert table.capacity < table.max_capacity and allocated(table) < planned
    ids = torch.arange(table.max_capacity + 101) * 1_000_003  # more than the maximum holds
    table.lookup_train(ids)
    assert table.capacity == table.max_capacity and table.metrics()["scratch_rows"] > 0
    assert allocated(table) == table.memory_bytes() == planned <= budget
    assert table.metrics()["host_size"] > 0
