"""TTL over lower tiers: a row past its TTL leaves the whole hierarchy.

The twins: the same batches through a ``KVEmbeddingBagCollection`` whose LRU
tables keep 3 buckets of rows in memory over a host tier (unbounded; or
bounded, over an SSD tier) or an SSD tier alone, with a TTL, and through one whose tables hold every
row in memory with the same TTL. Whole sweeps (``sweep_buckets_per_step`` at or
above the table's buckets) free every row at its TTL, wherever it is: at every
step both hold the same ids, rows, optimizer state and scores (the rows' last
steps), give the same outputs, and count the same ``ttl_evictions``. Then:
a partial sweep covers every tier within its period; a checkpoint round trip
keeps the last steps (the loaded model frees what the saved one frees); the
options that stay refused.
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
from torchrec_kvemb.options import WAYS, TTLOptions

DIMS = {"a": 3, "b": 5}
MEMORY_BUCKETS = 3
ALL_ROWS = 64 * WAYS
STEPS = 9
TTL_STEPS = 2
WHOLE = 1_000  # sweep_buckets_per_step above every table's buckets: whole sweeps
FUSED = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.2}

#: case -> (host tier: its capacity, None for unbounded, False for none; an SSD tier)
CASES = {
    "host-unbounded": (None, False),
    "host-bounded-over-ssd": (4 * WAYS, True),
    "ssd": (False, True),
}


def _batches(steps: int = STEPS) -> list[KeyedJaggedTensor]:
    """Batches with churn: a crowded memory bucket (scratch rows, demotions), ids
    that come back after a few steps (promotions) and many that do not (expire)."""
    gen = torch.Generator().manual_seed(29)
    pool = torch.randperm(50_000, generator=gen)[:211] * 7_919 + 2**40
    crowded = pool[index_bucket(pool, MEMORY_BUCKETS) == 1][:31]
    hot = pool[:9]
    out = []
    for step in range(steps):
        values, lengths = [], []
        for _ in DIMS:
            ids = torch.cat(
                [
                    hot[torch.randint(0, hot.numel(), (5,), generator=gen)],
                    crowded[torch.randperm(crowded.numel(), generator=gen)[:19]],
                    pool[torch.randint(0, pool.numel(), (33 + step,), generator=gen)],
                ]
            )
            values.append(ids)
            lengths.append(torch.tensor([4, 0, 11, ids.numel() - 15]))
        out.append(
            KeyedJaggedTensor.from_lengths_sync(["fa", "fb"], torch.cat(values), torch.cat(lengths))
        )
    return out


def _options(case: str | None, path=None, ttl: TTLOptions | None = None) -> KVTableOptions:
    """``case``'s tiered options, or (None) the all-in-memory twin's."""
    ttl = ttl or TTLOptions(steps=TTL_STEPS, sweep_buckets_per_step=WHOLE)
    common = dict(init_low=-0.1, init_high=0.1, seed=5, ttl=ttl)
    if case is None:
        return KVTableOptions(capacity=ALL_ROWS, **common)
    host_rows, over_ssd = CASES[case]
    return KVTableOptions(
        capacity=MEMORY_BUCKETS * WAYS,
        host_tier=None if host_rows is False else HostTierOptions(capacity=host_rows),
        ssd=SSDOptions(str(path)) if over_ssd else None,
        **common,
    )


def _ebc(
    case: str | None, path=None, ttl: TTLOptions | None = None, device=None
) -> KVEmbeddingBagCollection:
    configs = [
        EmbeddingBagConfig(
            name=name, embedding_dim=dim, num_embeddings=2**50, feature_names=[f"f{name}"]
        )
        for name, dim in DIMS.items()
    ]
    options = {name: _options(case, path and path / name, ttl) for name in DIMS}
    return KVEmbeddingBagCollection(configs, options, device=device, fused_params=FUSED)


def _train_twins(tiered, full, batches, first_step: int = 0) -> None:
    """Train both on ``batches``; at every step the same outputs, rows by id (every
    tier's), and TTL frees."""
    gen = torch.Generator().manual_seed(3 + first_step)
    for step, kjt in enumerate(batches, start=first_step):
        got, want = tiered(kjt).values(), full(kjt).values()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=f"step {step} outputs")
        grad = torch.randn(want.shape, generator=gen)
        (got * grad).sum().backward()
        (want * grad).sum().backward()
        for name in DIMS:
            a, b = tiered.table(name), full.table(name)
            _assert_rows_equal(a.export(), b.export(), f"step {step} table {name}")
            assert a.total_size == b.size, f"step {step} table {name}"
            freed = (a.metrics()["ttl_evictions"], b.metrics()["ttl_evictions"])
            assert freed[0] == freed[1], f"step {step} table {name}: ttl_evictions {freed}"


@pytest.mark.parametrize("backend", ["native", "torch"])
@pytest.mark.parametrize("case", list(CASES))
def test_tiered_ttl_twin_equals_all_in_memory(case, backend, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, {"native": "auto"}.get(backend, backend))
    tiered, full = _ebc(case, tmp_path), _ebc(None)
    _train_twins(tiered, full, _batches())
    for name in DIMS:
        m = tiered.table(name).metrics()
        assert m["ttl_evictions"] > 0 and m["demotions"] > 0 and m["promotions"] > 0, m
        assert m["scratch_rows"] > 0, m
        assert full.table(name).metrics()["evictions"] == 0
        if CASES[case] == CASES["host-bounded-over-ssd"]:
            assert m["host_evictions"] > 0 and m["ssd_evictions"] == 0, m
        tiered.table(name).close()


def test_rows_expire_in_the_lower_tier():
    """Rows demoted to the host tier keep their last steps there and expire there."""
    options = KVTableOptions(
        capacity=WAYS,
        host_tier=HostTierOptions(),
        ttl=TTLOptions(steps=TTL_STEPS, sweep_buckets_per_step=WHOLE),
    )
    table = KVTable("t", 4, options)
    chunks = (torch.arange(3 * WAYS) * 13 + 1).split(WAYS)
    for chunk in chunks:  # each chunk moves the one before into the host tier
        table.lookup_train(chunk)
    # step 3 freed chunk 0 (last seen at step 1) from the host tier
    assert table.metrics()["ttl_evictions"] == WAYS
    assert table.metrics()["host_size"] == WAYS and table.size == WAYS
    rows = table.export()
    assert sorted(rows["ids"].tolist()) == torch.cat(chunks[1:]).tolist()
    assert torch.equal(torch.unique(rows["scores"]), torch.tensor([2, 3]))
    table.lookup_train(torch.tensor([7]))  # step 4: chunk 1 expires in the host tier
    assert sorted(table.export()["ids"].tolist()) == sorted(chunks[2].tolist() + [7])
    assert table.metrics()["ttl_evictions"] == 2 * WAYS
    assert table.metrics()["host_size"] == 1  # the chunk 2 row id 7 moved down
    table.lookup_train(torch.tensor([7]))  # step 5: chunk 2 expires, in either tier
    assert table.export()["ids"].tolist() == [7]
    assert table.metrics()["host_size"] == 0


@pytest.mark.parametrize("case", list(CASES))
def test_a_partial_sweep_covers_every_tier_once_per_ttl(case, tmp_path, monkeypatch):
    # the default sweep: 1/TTL of the memory buckets and of each tier's slots per step,
    # so a row unseen for 2 * TTL steps is gone, wherever it was
    monkeypatch.setenv(ENV_VAR, "auto")
    ttl = TTLOptions(steps=3)
    model = _ebc(case, tmp_path, ttl=ttl)
    for kjt in _batches(5):
        model(kjt).values().sum().backward()
    seen_at = {name: model.table(name).export() for name in DIMS}
    keep = torch.tensor([11, 12])
    quiet = KeyedJaggedTensor.from_lengths_sync(
        ["fa", "fb"], torch.cat([keep, keep]), torch.tensor([1, 1, 1, 1])
    )
    for _ in range(2 * ttl.steps):
        model(quiet)
    for name in DIMS:
        table = model.table(name)
        assert seen_at[name]["ids"].numel() > 0
        assert table.export()["ids"].tolist() == keep.tolist(), name
        m = table.metrics()
        assert m["host_size"] == 0 and m["ssd_size"] == 0, m
        table.close()


@pytest.mark.parametrize("target", ["tiered", "all-in-memory"])
def test_a_checkpoint_round_trip_keeps_the_last_steps(target, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "auto")
    case = "host-bounded-over-ssd"
    batches = _batches()
    saved, twin = _ebc(case, tmp_path / "saved"), _ebc(None)
    _train_twins(saved, twin, batches[:4])
    checkpoint.save(saved, tmp_path / "ckpt")
    loaded = _ebc(case, tmp_path / "loaded") if target == "tiered" else _ebc(None)
    checkpoint.load(loaded, tmp_path / "ckpt")
    for name in DIMS:
        _assert_rows_equal(loaded.table(name).export(), saved.table(name).export(), name)
    before = {name: loaded.table(name).metrics()["ttl_evictions"] for name in DIMS}
    for step, kjt in enumerate(batches[4:], start=4):
        torch.testing.assert_close(
            loaded(kjt).values(), saved(kjt).values(), rtol=1e-6, atol=1e-7, msg=f"step {step}"
        )
        for name in DIMS:
            got, want = loaded.table(name).export(), saved.table(name).export()
            assert torch.equal(got["ids"], want["ids"]), f"step {step} table {name}"
            assert torch.equal(got["scores"], want["scores"]), f"step {step} table {name}"
    for name in DIMS:
        freed = loaded.table(name).metrics()["ttl_evictions"] - before[name]
        assert freed > 0
        saved.table(name).close()
        loaded.table(name).close()


def test_ttl_over_a_tier_needs_lru_scores(tmp_path):
    ttl = TTLOptions(steps=2)
    with pytest.raises(ValueError, match="ttl with a lower tier .* needs eviction=LRU"):
        KVTableOptions(
            capacity=64, eviction=EvictionPolicy.LFU, ttl=ttl, host_tier=HostTierOptions()
        )
    with pytest.raises(ValueError, match="ttl with an SSD tier needs SSDOptions"):
        KVTableOptions(
            capacity=64, ttl=ttl, ssd=SSDOptions(str(tmp_path), eviction=EvictionPolicy.NONE)
        )
    KVTableOptions(capacity=64, ttl=ttl, ssd=SSDOptions(str(tmp_path)))  # accepted


def test_a_restart_over_the_ssd_tier_keeps_the_last_steps(tmp_path, monkeypatch):
    # close() flushes every tier with its memory scores and the step; the reopened
    # table frees what the table that was never closed frees
    monkeypatch.setenv(ENV_VAR, "auto")
    batches = [
        torch.cat([b.values()[:20], torch.tensor([3 + s])]) for s, b in enumerate(_batches())
    ]
    options = _options("host-bounded-over-ssd", tmp_path / "closed")
    closed = KVTable("t", 4, options)
    kept = KVTable("t", 4, _options("host-bounded-over-ssd", tmp_path / "kept"))
    for ids in batches[:4]:
        closed.lookup_train(ids)
        kept.lookup_train(ids)
    closed.close()
    reopened = KVTable("t", 4, options)
    assert reopened.step == kept.step
    for step, ids in enumerate(batches[4:], start=5):
        reopened.lookup_train(ids)
        kept.lookup_train(ids)
        got, want = reopened.export(), kept.export()
        assert torch.equal(got["ids"], want["ids"]), f"step {step}"
        assert torch.equal(got["scores"], want["scores"]), f"step {step}"
    assert kept.metrics()["ttl_evictions"] > 0
    reopened.close()
    kept.close()


def test_tiered_ttl_on_the_device(device, tmp_path):
    """The tiered TTL collection on the device under test (its default backend; on
    CUDA the host tier's rows pinned), the all-in-memory TTL twin on the CPU torch
    path: the same outputs, rows and TTL frees at every step."""
    with backend("auto"):
        tiered = _ebc("host-bounded-over-ssd", tmp_path, device=device)
    with backend("torch"):
        full = _ebc(None)
    for step, kjt in enumerate(_batches(6)):
        grad = torch.randn(4, sum(DIMS.values()), generator=torch.Generator().manual_seed(step))
        with backend("auto"):
            got = tiered(kjt_to(kjt, device)).values()
            (got * grad.to(device)).sum().backward()
        with backend("torch"):
            want = full(kjt).values()
            (want * grad).sum().backward()
        torch.testing.assert_close(got.cpu(), want, rtol=RTOL, atol=ATOL)
        for name in DIMS:
            a, b = tiered.table(name), full.table(name)
            assert_tables_equal(f"step {step} {name}", a.export(), b.export())
            assert a.metrics()["ttl_evictions"] == b.metrics()["ttl_evictions"], step
    for name in DIMS:
        m = tiered.table(name).metrics()
        assert m["ttl_evictions"] > 0 and m["host_evictions"] > 0, m
        tiered.table(name).close()
