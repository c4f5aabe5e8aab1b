"""A table over a host-memory tier (``host_tier.HostTier``), alone or over an SSD tier.

The twins: the same batches through a ``KVEmbeddingBagCollection`` whose tables
keep a few buckets of rows in memory over a host tier (unbounded; or bounded,
its evictions moving down into an SSD tier) and through one whose tables hold
every row in memory. Batches overfill a bucket (scratch rows), bring back ids
the tiers hold (promotions) and add new ids (demotions, host evictions); LRU
and LFU tables, admission after two sightings, prefetch. Outputs at every step,
and every id's row, optimizer state and score after every step, must be equal
(ids and scores exactly, floats within 1e-6), on the native kernels, the torch
path and the Triton kernels in the interpreter. Then the host tier's own rules
(its eviction moves rows down by rank, its budget holds), checkpoints that hold
every tier's rows, and a process killed in the middle of a demotion.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.device_support import ATOL, RTOL, assert_tables_equal, backend, kjt_to
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
from torchrec_kvemb.host_tier import HostTier, host_row_bytes
from torchrec_kvemb.ops.hashing import index_bucket
from torchrec_kvemb.options import WAYS
from torchrec_kvemb.ssd import SSDStore
from torchrec_kvemb.ssd.estimate import planner_storage, storage_estimate

DIMS = {"a": 3, "b": 5}
MEMORY_BUCKETS = 3
STEPS = 7
ALL_ROWS = 64 * WAYS  # the all-in-memory twin: room for every id of the stream
#: Admission counters of the same size in both twins (a table's default is its capacity).
COUNTED = 32 * WAYS

#: case -> (table policy, host tier options or None for unbounded, SSD tier below,
#: admission threshold)
CASES = {
    "lru-host-unbounded": (EvictionPolicy.LRU, None, False, 1),
    "lru-host-bounded-over-ssd": (EvictionPolicy.LRU, 5 * WAYS, True, 1),
    "lfu-host-bounded-over-ssd": (EvictionPolicy.LFU, 4 * WAYS, True, 1),
    "lru-admission-host-unbounded": (EvictionPolicy.LRU, None, False, 2),
}
OPTIMIZERS = {
    "rowwise-adagrad": {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.2},
    "adam": {"optimizer": EmbOptimType.ADAM, "learning_rate": 0.05},
}


def _batches() -> list[KeyedJaggedTensor]:
    gen = torch.Generator().manual_seed(23)
    pool = torch.randperm(60_000, generator=gen)[:301] * 7_919 + 2**40
    crowded = pool[index_bucket(pool, MEMORY_BUCKETS) == 1][:37]  # > 16 of a batch
    batches = []
    for step in range(STEPS):
        values, lengths = [], []
        for _ in DIMS:
            ids = torch.cat(
                [
                    crowded[torch.randperm(crowded.numel(), generator=gen)[:21]],
                    pool[torch.randint(0, pool.numel(), (41 + step,), generator=gen)],
                ]
            )
            values.append(ids)
            lengths.append(torch.tensor([5, 0, 9, ids.numel() - 14]))
        batches.append(
            KeyedJaggedTensor.from_lengths_sync(["fa", "fb"], torch.cat(values), torch.cat(lengths))
        )
    return batches


def _options(case: str, path=None, all_in_memory: bool = False) -> KVTableOptions:
    """The options of ``case``'s tables, or of its all-in-memory twin."""
    policy, host_rows, over_ssd, threshold = CASES[case]
    common = dict(
        eviction=policy,
        admission_threshold=threshold,
        admission_counter_capacity=COUNTED,
        init_low=-0.1,
        init_high=0.1,
        seed=5,
    )
    if all_in_memory:
        return KVTableOptions(capacity=ALL_ROWS, **common)
    host_policy = policy if policy == EvictionPolicy.LFU else EvictionPolicy.LRU
    return KVTableOptions(
        capacity=MEMORY_BUCKETS * WAYS,
        host_tier=HostTierOptions(capacity=host_rows, eviction=host_policy),
        ssd=SSDOptions(str(path)) if over_ssd else None,
        **common,
    )


def _ebc(
    case: str, optim: str, path=None, all_in_memory: bool = False, device=None
) -> KVEmbeddingBagCollection:
    configs = [
        EmbeddingBagConfig(
            name=name, embedding_dim=dim, num_embeddings=2**50, feature_names=[f"f{name}"]
        )
        for name, dim in DIMS.items()
    ]
    options = {name: _options(case, path and path / name, all_in_memory) for name in DIMS}
    return KVEmbeddingBagCollection(configs, options, device=device, fused_params=OPTIMIZERS[optim])


#: Float tolerances: the native and torch paths sum in the same order as the
#: all-in-memory twin; the Triton kernels pool a bag in another order.
TOLERANCE = {"rtol": 1e-6, "atol": 1e-7}
TRITON_TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}


def _assert_rows_equal(got: dict, want: dict, what: str, tol: dict = TOLERANCE) -> None:
    assert got.keys() == want.keys(), what
    assert torch.equal(got["ids"], want["ids"]), f"{what}: ids differ"
    assert torch.equal(got["scores"], want["scores"]), f"{what}: scores differ"
    for key in got.keys() - {"ids", "scores"}:
        torch.testing.assert_close(
            got[key], want[key], **tol, msg=lambda m, k=key: f"{what} {k}: {m}"
        )


def _run_twins(
    case: str,
    optim: str,
    tmp_path,
    prefetch: bool = False,
    steps: int = STEPS,
    tol: dict = TOLERANCE,
) -> dict[str, dict]:
    batches = _batches()[:steps]
    tiered, full = _ebc(case, optim, tmp_path), _ebc(case, optim, all_in_memory=True)
    gen = torch.Generator().manual_seed(3)
    for step, kjt in enumerate(batches):
        if prefetch and step + 1 < len(batches):
            tiered.prefetch(batches[step + 1])
        got, want = tiered(kjt).values(), full(kjt).values()
        torch.testing.assert_close(got, want, **tol, msg=lambda m, s=step: f"step {s} outputs: {m}")
        grad = torch.randn(want.shape, generator=gen)
        (got * grad).sum().backward()
        (want * grad).sum().backward()
        for name in DIMS:
            what = f"step {step} table {name}"
            _assert_rows_equal(tiered.table(name).export(), full.table(name).export(), what, tol)
    out = {}
    for name in DIMS:
        table = tiered.table(name)
        out[name] = table.metrics()
        assert full.table(name).metrics()["evictions"] == 0
        assert table.total_size == full.table(name).size
        table.close()
    return out


@pytest.mark.parametrize("optim", list(OPTIMIZERS))
@pytest.mark.parametrize("case", list(CASES))
def test_host_tier_twin_equals_all_in_memory(case, optim, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "auto")
    metrics = _run_twins(case, optim, tmp_path)
    over_ssd = CASES[case][2]
    for name, m in metrics.items():
        assert m["demotions"] > 0 and m["promotions"] > 0, (name, m)
        assert m["scratch_rows"] > 0, f"{name}: the batches should overfill a bucket"
        assert m["host_writes"] > 0 and m["host_reads"] > 0, (name, m)
        assert m["host_size"] > 0
        if over_ssd:  # the bounded host tier moved rows down, the SSD tier dropped none
            assert m["host_evictions"] > 0 and m["ssd_writes"] > 0 and m["ssd_size"] > 0, m
            assert m["host_size"] <= CASES[case][1]
            assert m["ssd_evictions"] == 0
        else:
            assert m["host_evictions"] == 0 and m["ssd_size"] == 0 and m["ssd_writes"] == 0


def test_host_tier_twin_on_the_torch_path(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "torch")
    _run_twins("lru-host-bounded-over-ssd", "rowwise-adagrad", tmp_path)


def test_host_tier_twin_on_triton_kernels(tmp_path, monkeypatch):
    """Both twins on the Triton backend (the interpreter here: few steps)."""
    monkeypatch.setenv(ENV_VAR, "triton")
    m = _run_twins(
        "lru-host-bounded-over-ssd", "rowwise-adagrad", tmp_path, steps=3, tol=TRITON_TOLERANCE
    )
    assert all(x["host_evictions"] > 0 and x["promotions"] > 0 for x in m.values()), m


def test_host_tier_twin_with_prefetch(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "auto")
    metrics = _run_twins("lru-host-bounded-over-ssd", "adam", tmp_path, prefetch=True)
    assert any(m["ssd_prefetch_hits"] > 0 for m in metrics.values()), metrics


def test_host_tier_twin_on_the_device(device, tmp_path):
    """The tiered collection on the device under test (its default backend; on CUDA
    the host tier's rows pinned), the all-in-memory twin on the CPU torch path."""
    case, optim = "lru-host-bounded-over-ssd", "rowwise-adagrad"
    with backend("auto"):
        tiered = _ebc(case, optim, tmp_path, device=device)
    with backend("torch"):
        full = _ebc(case, optim, all_in_memory=True)
    for step, kjt in enumerate(_batches()[:4]):
        grad = torch.randn(4, sum(DIMS.values()), generator=torch.Generator().manual_seed(step))
        with backend("auto"):
            got = tiered(kjt_to(kjt, device)).values()
            (got * grad.to(device)).sum().backward()
        with backend("torch"):
            want = full(kjt).values()
            (want * grad).sum().backward()
        torch.testing.assert_close(got.cpu(), want, rtol=RTOL, atol=ATOL)
        for name in DIMS:
            got_rows = tiered.table(name).export()
            assert_tables_equal(f"step {step} {name}", got_rows, full.table(name).export())
    for name in DIMS:
        tier = tiered.table(name).tier
        assert tier.pinned == (device.type == "cuda") == tier._rows.is_pinned()
        assert tiered.table(name).metrics()["host_evictions"] > 0
        tiered.table(name).close()


def test_close_and_reopen_over_ssd_restores_every_tier(tmp_path, monkeypatch):
    """Over an SSD tier, a flush keeps the memory rows and the host tier's: a table
    reopened on the same files holds every row as before, and trains on alike."""
    monkeypatch.setenv(ENV_VAR, "auto")
    case = "lru-host-bounded-over-ssd"
    model, twin = _ebc(case, "adam", tmp_path / "t"), _ebc(case, "adam", all_in_memory=True)
    batches = _batches()
    for kjt in batches[:4]:
        model(kjt).values().sum().backward()
        twin(kjt).values().sum().backward()
    want = {name: model.table(name).export() for name in DIMS}
    for name in DIMS:
        assert model.table(name).metrics()["host_size"] > 0
        model.table(name).close()
    reopened = _ebc(case, "adam", tmp_path / "t")
    for name in DIMS:
        table = reopened.table(name)
        _assert_rows_equal(table.export(), want[name], f"reopened {name}")
        assert table.step == model.table(name).step
    for kjt in batches[4:]:
        got, want = reopened(kjt).values(), twin(kjt).values()
        torch.testing.assert_close(got, want, **TOLERANCE)
        got.sum().backward()
        want.sum().backward()
    for name in DIMS:
        reopened.table(name).close()


# ---------------------------------------------------------------- the tier alone
def _rows(ids: torch.Tensor, width: int) -> torch.Tensor:
    return ids.to(torch.float32)[:, None] + torch.arange(width, dtype=torch.float32) / 8


@pytest.mark.parametrize("below", [False, True], ids=["alone", "over-ssd"])
def test_a_full_host_tier_moves_its_lowest_ranked_rows_down(below, tmp_path):
    dim, state_dim, capacity = 3, 1, 2 * WAYS
    lower = SSDStore("t", dim, state_dim, SSDOptions(str(tmp_path)), 0) if below else None
    tier = HostTier("t", dim, state_dim, HostTierOptions(capacity=capacity), lower=lower)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randperm(10_000, generator=gen)[:97] * 31 + 5
    scores = torch.randperm(1000, generator=gen)[:97]
    for part in torch.arange(97).split(29):  # three puts: held rows and new ones compete
        tier.reserve(part.numel())
        tier.put(ids[part], scores[part] + 7, scores[part], _rows(ids[part], dim + state_dim))
    assert tier.host_size <= capacity
    held = tier.lookup(ids)
    in_host = (held >= 0) & (held < (1 << 48))
    assert tier.metrics()["host_evictions"] == 97 - int(in_host.sum())
    # In each bucket, every row moved out ranks below every row kept.
    buckets = index_bucket(ids, capacity // WAYS)
    for b in buckets.unique():
        mine = buckets == b
        kept, gone = scores[mine & in_host], scores[mine & ~in_host]
        if kept.numel() and gone.numel():
            assert int(gone.max()) < int(kept.min()), f"bucket {int(b)}"
    if below:  # nothing lost: the rest is in the SSD tier, rows and memory scores intact
        assert bool((held >= 0).all()) and tier.size == 97
        got_scores, got_rows, ok = tier.fetch(ids, held)
        assert bool(ok.all())
        assert torch.equal(got_scores, scores + 7)
        assert torch.equal(got_rows, _rows(ids, dim + state_dim))
        assert tier.metrics()["ssd_writes"] == 97 - int(in_host.sum())
    else:
        assert tier.size == int(in_host.sum())
    tier.close()


def test_host_tier_budget_holds():
    dim, state_dim = 7, 1
    budget = 50_000
    tier = HostTier("t", dim, state_dim, HostTierOptions(memory_budget_bytes=budget))
    assert tier.host_capacity == budget // host_row_bytes(dim, state_dim) // WAYS * WAYS
    assert tier.host_bytes() <= budget
    ids = torch.arange(3 * tier.host_capacity) * 13
    tier.put(ids, ids, ids, _rows(ids, dim + state_dim))
    assert tier.host_bytes() <= budget and tier.host_size <= tier.host_capacity
    with pytest.raises(ValueError, match="table 'u'.*fewer than 16 rows"):
        HostTier("u", dim, state_dim, HostTierOptions(memory_budget_bytes=500))


@pytest.mark.parametrize(
    "host",
    [HostTierOptions(capacity=5 * WAYS + 3), HostTierOptions(memory_budget_bytes=41_017)],
    ids=["capacity", "budget"],
)
@pytest.mark.parametrize("over_ssd", [False, True], ids=["alone", "over-ssd"])
def test_planner_figures_equal_what_the_tiers_allocate(host, over_ssd, tmp_path):
    """``storage_estimate`` / ``planner_storage``: the table's own arrays (HBM on
    CUDA) apart from the lower tiers' host memory (DDR), each equal to the bytes the
    built table and tiers hold."""
    ssd = SSDOptions(str(tmp_path), capacity=300) if over_ssd else None
    options = KVTableOptions(capacity=3 * WAYS, host_tier=host, ssd=ssd)
    table = KVTable("t", 7, options)
    table.lookup_train(torch.arange(3 * WAYS) * 11)  # the scratch pad takes its first rows
    estimate = storage_estimate(options, 7)
    tier = table.tier
    assert estimate["host_rows"] == tier.host_capacity
    assert estimate["table_bytes"] == table.memory_bytes()
    if over_ssd:  # the SSD tier's index at its capacity; its records by the slab bound
        assert estimate["host_bytes"] >= tier.memory_bytes()
    else:
        assert estimate["host_bytes"] == tier.memory_bytes() == tier.host_bytes()
    if host.memory_budget_bytes is not None:
        assert tier.host_bytes() <= host.memory_budget_bytes
    assert estimate["memory_bytes"] == estimate["table_bytes"] + estimate["host_bytes"]
    cuda = planner_storage(options, 7, compute_device="cuda")
    cpu = planner_storage(options, 7, compute_device="cpu")
    assert (cuda.hbm, cuda.ddr) == (estimate["table_bytes"], estimate["host_bytes"])
    assert (cpu.hbm, cpu.ddr) == (0, estimate["memory_bytes"])
    table.close()


def test_bad_host_tier_options():
    with pytest.raises(ValueError, match="at most one of capacity or memory_budget_bytes"):
        HostTierOptions(capacity=10, memory_budget_bytes=10_000)
    with pytest.raises(ValueError, match="capacity must be > 0"):
        HostTierOptions(capacity=0)
    with pytest.raises(TypeError, match="host_tier must be a HostTierOptions"):
        KVTableOptions(capacity=16, host_tier=SSDOptions("/tmp/x"))
    with pytest.raises(ValueError, match="table 'x': host tier eviction LFU"):
        KVTable(
            "x",
            4,
            KVTableOptions(capacity=16, host_tier=HostTierOptions(eviction=EvictionPolicy.LFU)),
        )
    with pytest.raises(ValueError, match="table 'x': a host tier needs a table that evicts"):
        KVTable(
            "x",
            4,
            KVTableOptions(capacity=16, eviction=EvictionPolicy.NONE, host_tier=HostTierOptions()),
        )


# ------------------------------------------------------------------ checkpoints
@pytest.mark.parametrize("over_ssd", [False, True], ids=["host", "host-over-ssd"])
def test_checkpoint_holds_every_tier(over_ssd, tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "auto")
    case = "lru-host-bounded-over-ssd" if over_ssd else "lru-host-unbounded"
    model = _ebc(case, "adam", tmp_path / "tiers")
    batches = _batches()
    for kjt in batches[:5]:
        model(kjt).values().sum().backward()
    want = {name: model.table(name).export() for name in DIMS}
    assert all(model.table(n).metrics()["host_size"] > 0 for n in DIMS)
    checkpoint.save(model, tmp_path / "ckpt")
    # Into tables over fresh tiers, and into all-in-memory tables: the same rows.
    fresh = _ebc(case, "adam", tmp_path / "fresh")
    full = _ebc(case, "adam", all_in_memory=True)
    for target in (fresh, full):
        checkpoint.load(target, tmp_path / "ckpt")
        for name in DIMS:
            _assert_rows_equal(target.table(name).export(), want[name], f"loaded {name}")
    # Both train on as the saved model does.
    for kjt in batches[5:]:
        want_out = model(kjt).values()
        torch.testing.assert_close(fresh(kjt).values(), want_out, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(full(kjt).values(), want_out, rtol=1e-6, atol=1e-7)
    for m in (model, fresh):
        for name in DIMS:
            m.table(name).close()


def test_two_ranks_over_host_tiers_and_their_checkpoint_at_one_process(tmp_path):
    """2 ranks row-wise over host tiers equal the unsharded all-in-memory collection
    (tests/host_tier_worker.py); their checkpoint loads in one process into tables
    over host tiers, and into all-in-memory tables, with every id's row."""
    from tests.host_tier_worker import REFERENCE, TIERED
    from tests.sharding import dist_worker as base
    from tests.torchrun_jobs import read_result, run_job, torchrun_command

    result_path = tmp_path / "result.json"
    job = run_job(
        torchrun_command(2, "-m", "tests.host_tier_worker", str(result_path), str(tmp_path))
    )
    result = read_result(result_path, job)
    failed = {n: r for n, r in result["scenarios"].items() if not r["passed"]}
    assert not failed, failed
    assert job.returncode == 0, job.stderr[-6000:]
    saved = torch.load(tmp_path / "rows.pt")
    for options in (TIERED, REFERENCE):
        model = base.EBCModel(
            KVEmbeddingBagCollection(base.kv_configs(2**40), options, fused_params=base.ADAGRAD)
        )
        checkpoint.load(model, tmp_path / "ckpt")
        for name, want in saved.items():
            table = model.ebc.table(name)
            _assert_rows_equal(table.export(), want, f"{name} loaded at 1 process")
            if options is TIERED:
                assert table.metrics()["host_size"] > 0, name
            table.close()


# ------------------------------------------------------------------------ crash
CHILD = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    import torch
    from tests.test_host_tier import _batches, _ebc, DIMS
    from torchrec_kvemb import checkpoint
    from torchrec_kvemb.host_tier import HostTier

    out = Path(sys.argv[1])
    model = _ebc("lru-host-bounded-over-ssd", "adam", out / "tiers")
    batches = _batches()
    for kjt in batches[:4]:
        model(kjt).values().sum().backward()
    checkpoint.save(model, out / "ckpt")
    torch.save({n: model.table(n).export() for n in DIMS}, out / "saved.pt")
    put = HostTier.put

    def stalled_put(self, ids, memory_scores, tier_scores, rows):
        put(self, ids[: ids.numel() // 2], memory_scores[: ids.numel() // 2],
            tier_scores[: ids.numel() // 2], rows[: ids.numel() // 2])
        (out / "demoting").touch()  # half the rows are down, the rest not yet
        time.sleep(120)

    HostTier.put = stalled_put
    for kjt in batches[4:]:
        model(kjt).values().sum().backward()
    """
)


def test_sigkill_during_a_demotion_loses_nothing_of_the_checkpoint(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "auto")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path)], cwd=root, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "demoting").exists():
            assert child.poll() is None, child.stderr.read().decode()
            assert time.monotonic() < deadline, "the child never demoted a row"
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    saved = torch.load(tmp_path / "saved.pt")
    # A new process over the same SSD files (resumed from their last flush) loads the
    # checkpoint and holds exactly its rows.
    model = _ebc("lru-host-bounded-over-ssd", "adam", tmp_path / "tiers")
    checkpoint.load(model, tmp_path / "ckpt")
    for name in DIMS:
        _assert_rows_equal(model.table(name).export(), saved[name], f"after the kill: {name}")
        assert model.table(name).metrics()["ssd_corrupt"] == 0
        model.table(name).close()


# -------------------------------------------------------------------- benchmark
def test_host_tier_benchmark_runs(tmp_path):
    from benchmarks import host_tier

    out = tmp_path / "host.md"
    result = host_tier.main(["--quick", "--dir", str(tmp_path), "--out", str(out)])
    assert {r.system for r in result.train} == {host_tier.FULL, host_tier.HOST, host_tier.HOST_SSD}
    assert all(r.ids_per_s > 0 for r in result.train)
    assert result.tiers[host_tier.HOST]["host_rows"] > 0
    assert result.tiers[host_tier.HOST_SSD]["ssd_rows"] > 0
    assert f"{host_tier.HOST} / {host_tier.FULL}" in out.read_text()
