"""Row transfers between a group of tables and their host tiers (``transfers.py``).

Three tables of one dim over host tiers share their group's arrays: a training
step moves the promoted rows of all three up in one scatter and their demoted
rows down in one gather (spies count the calls), and the group trains as one
all-in-memory collection does (outputs, and by id the rows, optimizer state and
scores of every tier). On the native kernels (CPU) and on the Triton kernels
(``tiered_triton.py``; here in the interpreter, one copy up of the promoted ids
and scores and one of their rows), over host tiers alone and over bounded host
tiers above SSD tiers with admission; the Triton group's counters equal those
of the same tables over the same tiers on the torch path (with CUSTOM_SCORE
tables and the batches' scores too). The device twins run
the tiered group on the device under test (on CUDA: the Triton kernels, pinned
host rows, copies on the side stream).
"""

from dataclasses import replace

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
    KVTableOptions,
    SSDOptions,
    native_lib,
    tiered_lookup,
    tiered_triton,
    transfers,
)
from torchrec_kvemb.backend import ENV_VAR, implementation
from torchrec_kvemb.ops import native
from torchrec_kvemb.ops.hashing import index_bucket
from torchrec_kvemb.options import WAYS
from torchrec_kvemb.table import KVTable
from torchrec_kvemb.tiered import TieredKVTable

DIM = 5
TABLES = ("a", "b", "c")
MEMORY_BUCKETS = 2
STEPS = 5
#: table -> (policy, host tier capacity: None grows; the others hold every id)
POLICIES = {
    "a": (EvictionPolicy.LRU, None),
    "b": (EvictionPolicy.LFU, 16 * WAYS),
    "c": (EvictionPolicy.LRU, 14 * WAYS),
}
FUSED = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.2}
#: case -> (table -> (policy, host tier capacity), SSD tiers under the host tiers,
#: admission threshold). "host": the host tiers hold every id (None: it grows);
#: "host-over-ssd-admission": small host tiers move rows down to SSD tiers, and an
#: id earns a row at its second sighting.
CASES = {
    "host": (POLICIES, False, 1),
    "host-over-ssd-admission": (
        {
            "a": (EvictionPolicy.LRU, WAYS),
            "b": (EvictionPolicy.LFU, WAYS),
            "c": (EvictionPolicy.LRU, WAYS),
        },
        True,
        2,
    ),
}
#: Admission counters of one size in every twin (a table's default is its capacity).
COUNTED = 32 * WAYS
#: The Triton kernels pool a bag in another order than the torch path.
TRITON_TOL = {"rtol": 1e-5, "atol": 1e-6}


def _batches() -> list[KeyedJaggedTensor]:
    gen = torch.Generator().manual_seed(29)
    pool = torch.randperm(40_000, generator=gen)[:211] * 5_003 + 2**40
    crowded = pool[index_bucket(pool, MEMORY_BUCKETS) == 0][:23]  # > 16 of a batch
    out = []
    for _ in range(STEPS):
        values, lengths = [], []
        for _ in TABLES:
            ids = torch.cat(
                [
                    crowded[torch.randperm(crowded.numel(), generator=gen)[:19]],
                    pool[torch.randint(0, pool.numel(), (31,), generator=gen)],
                ]
            )
            values.append(ids)
            lengths.append(torch.tensor([10, 0, 17, 23]))
        out.append(
            KeyedJaggedTensor.from_lengths_sync(
                keys=[f"f{t}" for t in TABLES],
                values=torch.cat(values),
                lengths=torch.cat(lengths),
            )
        )
    return out


def _ebc(
    all_in_memory: bool, device=None, case: str = "host", path=None
) -> KVEmbeddingBagCollection:
    """The tables of ``case`` over their tiers (SSD files under ``path``), or all in
    memory."""
    configs = [
        EmbeddingBagConfig(name=t, embedding_dim=DIM, num_embeddings=2**50, feature_names=[f"f{t}"])
        for t in TABLES
    ]
    policies, over_ssd, threshold = CASES[case]
    options = {}
    for t in TABLES:
        policy, host_rows = policies[t]
        common = dict(eviction=policy, init_low=-0.1, init_high=0.1, seed=7)
        if threshold > 1:
            common.update(admission_threshold=threshold, admission_counter_capacity=COUNTED)
        if all_in_memory:
            options[t] = KVTableOptions(capacity=64 * WAYS, **common)
        else:
            host = policy if policy == EvictionPolicy.LFU else EvictionPolicy.LRU
            options[t] = KVTableOptions(
                capacity=MEMORY_BUCKETS * WAYS,
                host_tier=HostTierOptions(capacity=host_rows, eviction=host),
                ssd=SSDOptions(str(path / t)) if over_ssd else None,
                **common,
            )
    return KVEmbeddingBagCollection(configs, options, device=device, fused_params=FUSED)


def _spy(monkeypatch, owner, name: str, calls: dict) -> None:
    real = getattr(owner, name)

    def spy(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)


def test_a_group_moves_its_rows_in_one_gather_and_one_scatter(monkeypatch):
    """Native kernels: per step one gather down and one scatter up for the three
    tables (none per table), and the rows of every tier equal all in memory's."""
    assert native_lib.available(), native_lib.unavailable_reason()
    monkeypatch.setenv(ENV_VAR, "auto")
    tiered, full = _ebc(False), _ebc(True)
    arrays = {tiered.table(t).weights.untyped_storage().data_ptr() for t in TABLES}
    assert len(arrays) == 1, "the three tables share their group's arrays"
    calls: dict = {}
    for name in ("gather_down", "scatter_up"):
        _spy(monkeypatch, tiered_lookup, name, calls)
    for name in ("demote", "promote", "set_rows", "rows_at"):  # a table's own transfers
        _spy(monkeypatch, TieredKVTable, name, calls)
    gen = torch.Generator().manual_seed(2)
    for step, kjt in enumerate(_batches()):
        before = {t: tiered.table(t).metrics() for t in TABLES}
        calls.clear()
        got, want = tiered(kjt).values(), full(kjt).values()
        assert calls == {"gather_down": 1, "scatter_up": 1} or step == 0, (step, calls)
        moved = {
            t: {k: tiered.table(t).metrics()[k] - before[t][k] for k in ("promotions", "demotions")}
            for t in TABLES
        }
        if step > 0:  # the counts above stand for rows of at least two tables each way
            assert sum(m["promotions"] > 0 for m in moved.values()) >= 2, (step, moved)
            assert sum(m["demotions"] > 0 for m in moved.values()) >= 2, (step, moved)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
        grad = torch.randn(want.shape, generator=gen)
        (got * grad).sum().backward()
        (want * grad).sum().backward()
        for t in TABLES:
            got_rows, want_rows = tiered.table(t).export(), full.table(t).export()
            assert torch.equal(got_rows["ids"], want_rows["ids"]), f"step {step} {t}"
            assert torch.equal(got_rows["scores"], want_rows["scores"]), f"step {step} {t}"
            for key in got_rows.keys() - {"ids", "scores"}:
                torch.testing.assert_close(got_rows[key], want_rows[key], rtol=1e-6, atol=1e-7)
    for t in TABLES:
        m = tiered.table(t).metrics()
        assert m["host_reads"] > 0 and m["host_writes"] > 0 and m["scratch_rows"] > 0, (t, m)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_gather_down_and_scatter_up_equal_index_ops(dtype):
    """Odd sizes: the gather gives ``index_select`` of weights and state side by
    side as float32; the scatter writes them back as ``index_copy_`` does."""
    gen = torch.Generator().manual_seed(4)
    weights = torch.randn(37, 7, generator=gen).to(dtype)
    state = torch.randn(37, 2, generator=gen)
    slots = torch.tensor([36, 0, 11, 5, 29])
    rows = transfers.gather_down(weights, state, slots).rows()
    want = torch.cat([weights[slots].float(), state[slots]], dim=1)
    assert torch.equal(rows, want)
    new_w, new_s = torch.zeros_like(weights), torch.zeros_like(state)
    transfers.scatter_up(new_w, new_s, slots, rows)
    assert torch.equal(new_w[slots], weights[slots]) and torch.equal(new_s[slots], state[slots])
    untouched = torch.ones(37, dtype=torch.bool)
    untouched[slots] = False
    assert not new_w[untouched].any() and not new_s[untouched].any()


def test_a_tiered_group_on_the_device(device):
    """The group of three tables over host tiers on the device under test (its
    default backend; on CUDA pinned host rows, transfers on the side stream)
    against the all-in-memory collection on the CPU torch path."""
    with backend("auto"):
        tiered = _ebc(False, device=device)
    with backend("torch"):
        full = _ebc(True)
    for step, kjt in enumerate(_batches()):
        grad = torch.randn(4, 3 * DIM, generator=torch.Generator().manual_seed(step))
        with backend("auto"):
            got = tiered(kjt_to(kjt, device)).values()
            (got * grad.to(device)).sum().backward()
        with backend("torch"):
            want = full(kjt).values()
            (want * grad).sum().backward()
        torch.testing.assert_close(got.cpu(), want, rtol=RTOL, atol=ATOL)
        for t in TABLES:
            got_rows = tiered.table(t).export()
            assert_tables_equal(f"step {step} {t}", got_rows, full.table(t).export())
    for t in TABLES:
        m = tiered.table(t).metrics()
        assert m["promotions"] > 0 and m["demotions"] > 0, (t, m)
        assert tiered.table(t).tier.pinned == (device.type == "cuda")


def _spy_transfers(monkeypatch, calls: dict) -> None:
    """Spies on the group's transfers, each table's own, the kernel passes and the
    per-table torch path."""
    from torchrec_kvemb.kernels import group_lookup

    for name in ("gather_down", "scatter_up"):
        _spy(monkeypatch, tiered_lookup, name, calls)
    for name in ("demote", "promote", "set_rows", "rows_at"):  # a table's own transfers
        _spy(monkeypatch, TieredKVTable, name, calls)
    _spy(monkeypatch, KVTable, "lookup_train", calls)  # the per-table path
    _spy(monkeypatch, tiered_triton, "upload", calls)  # copies up of the Triton pass
    _spy(monkeypatch, group_lookup, "group_lookup_train_tiers_triton", calls)
    _spy(monkeypatch, native, "lookup_train_group", calls)


def _group_steps(case: str, kernels: str, device, tmp_path, monkeypatch) -> None:
    """The group of ``case`` on ``device`` by ``kernels`` (``"triton"``, or the
    device's default: ``"auto"``) against the all-in-memory collection (outputs;
    ids, scores, rows and optimizer state of every tier) and, for its counters,
    the same tables over the same tiers on the torch path (both CPU), at every
    step; spies count the transfers of each step."""
    with backend(kernels):
        triton = implementation(device) == "triton"
        tiered = _ebc(False, device, case, tmp_path / "group")
    tol = TRITON_TOL if triton else {"rtol": 1e-6, "atol": 1e-7}
    if device.type == "cuda":
        tol = {"rtol": RTOL, "atol": ATOL}
    with backend("torch"):
        ref, full = _ebc(False, None, case, tmp_path / "ref"), _ebc(True, None, case)
    calls: dict = {}
    _spy_transfers(monkeypatch, calls)
    moved = {t: {"promotions": 0, "demotions": 0} for t in TABLES}
    for step, kjt in enumerate(_batches()):
        grad = torch.randn(4, 3 * DIM, generator=torch.Generator().manual_seed(step))
        before = {t: tiered.table(t).metrics() for t in TABLES}
        calls.clear()
        with backend(kernels):
            got = tiered(kjt_to(kjt, device)).values()
            (got * grad.to(device)).sum().backward()
        ran = dict(calls)
        with backend("torch"):
            want = full(kjt).values()
            (want * grad).sum().backward()
            (ref(kjt).values() * grad).sum().backward()
        # One pass of the group's kernel; one gather down for the three tables where
        # a row left memory, one scatter up where a tier held an id; none per table.
        after = {t: tiered.table(t).metrics() for t in TABLES}
        delta = {
            k: sum(after[t][k] - before[t][k] for t in TABLES) for k in ("demotions", "ssd_hits")
        }
        kernel = "group_lookup_train_tiers_triton" if triton else "lookup_train_group"
        # Copies up: the promoted rows of the three tables (the native kernel's: host
        # memory, no copy), and for the Triton pass their ids and scores before it.
        expected = {kernel: 1, "upload": 2 if triton else 1}
        if delta["demotions"]:
            expected["gather_down"] = 1
        if delta["ssd_hits"]:
            expected["scatter_up"] = 1
        assert ran == expected, (step, ran, delta)
        torch.testing.assert_close(got.cpu(), want, **tol, msg=lambda m, s=step: f"step {s}: {m}")
        for t in TABLES:
            what = f"step {step} table {t}"
            exported = tiered.table(t).export()  # both settle their scratch rows
            assert_tables_equal(what, exported, full.table(t).export(), **tol)
            assert_tables_equal(f"{what} (torch)", ref.table(t).export(), full.table(t).export())
            m, m_ref = tiered.table(t).metrics(), ref.table(t).metrics()
            assert m == m_ref, (what, {k: (m[k], m_ref[k]) for k in m if m[k] != m_ref.get(k)})
            assert m["admission_rejects"] == full.table(t).metrics()["admission_rejects"], what
            assert tiered.table(t).total_size == full.table(t).size, what
            for k in moved[t]:
                moved[t][k] += int(m[k] > before[t][k])
    for t in TABLES:  # rows of every table went each way at several steps
        assert moved[t]["promotions"] >= 2 and moved[t]["demotions"] >= 3, (t, moved)
        m = tiered.table(t).metrics()
        assert m["scratch_rows"] > 0 and m["host_reads"] > 0 and m["host_writes"] > 0, (t, m)
        if CASES[case][1]:  # the small host tiers moved rows down to the SSD tiers
            assert m["host_evictions"] > 0 and m["ssd_size"] > 0 and m["ssd_evictions"] == 0, m
        if CASES[case][2] > 1:
            assert m["admission_rejects"] > 0, (t, m)
        assert tiered.table(t).tier.pinned == (device.type == "cuda")
    for collection in (tiered, ref):
        for t in TABLES:
            collection.table(t).close()


@pytest.mark.parametrize("case", list(CASES))
def test_a_group_on_triton_kernels_moves_its_rows_in_one_gather_and_one_scatter(
    case, tmp_path, monkeypatch
):
    """The Triton kernels (the interpreter, CPU tensors): one pass of the group's
    kernel, one gather and one scatter per step for the three tables, and the rows,
    outputs and counters of the reference systems."""
    _group_steps(case, "triton", torch.device("cpu"), tmp_path, monkeypatch)


def test_a_tiered_group_moves_its_rows_in_one_gather_and_one_scatter_on_the_device(
    device, tmp_path, monkeypatch
):
    """The spy test on the device under test, by its default kernels (CUDA: the
    Triton kernels compiled, the copies on the side stream; CPU: the native
    kernel), over small host tiers above SSD tiers with admission."""
    _group_steps("host-over-ssd-admission", "auto", device, tmp_path, monkeypatch)


def test_custom_scores_over_tiers_on_triton_kernels_equal_the_torch_path(tmp_path):
    """CUSTOM_SCORE tables over bounded host tiers above SSD tiers, the batches'
    scores given: the Triton group pass (the interpreter) keeps the ids, scores,
    rows and counters of the same tables over the same tiers on the torch path."""

    def collection(path) -> KVEmbeddingBagCollection:
        configs = [
            EmbeddingBagConfig(
                name=t, embedding_dim=DIM, num_embeddings=2**50, feature_names=[f"f{t}"]
            )
            for t in TABLES
        ]
        options = KVTableOptions(
            capacity=MEMORY_BUCKETS * WAYS,
            eviction=EvictionPolicy.CUSTOM_SCORE,
            host_tier=HostTierOptions(capacity=2 * WAYS, eviction=EvictionPolicy.NONE),
            init_low=-0.1,
            init_high=0.1,
            seed=7,
        )
        opts = {t: replace(options, ssd=SSDOptions(str(path / t))) for t in TABLES}
        return KVEmbeddingBagCollection(configs, opts, fused_params=FUSED)

    with backend("triton"):
        tiered = collection(tmp_path / "triton")
    with backend("torch"):
        ref = collection(tmp_path / "torch")
    gen = torch.Generator().manual_seed(8)
    for step, kjt in enumerate(_batches()):
        scores = {
            f"f{t}": torch.randint(0, 50, (kjt[f"f{t}"].values().numel(),), generator=gen)
            for t in TABLES
        }
        grad = torch.randn(4, 3 * DIM, generator=gen)
        for collection_, name in ((tiered, "triton"), (ref, "torch")):
            with backend(name):
                (collection_(kjt, eviction_scores=scores).values() * grad).sum().backward()
        for t in TABLES:
            what = f"step {step} table {t}"
            got, want = tiered.table(t).export(), ref.table(t).export()
            assert_tables_equal(what, got, want, **TRITON_TOL)
            m, m_ref = tiered.table(t).metrics(), ref.table(t).metrics()
            assert m == m_ref, (what, {k: (m[k], m_ref[k]) for k in m if m[k] != m_ref.get(k)})
    for t in TABLES:
        m = tiered.table(t).metrics()
        assert m["promotions"] > 0 and m["demotions"] > 0 and m["host_evictions"] > 0, (t, m)
        tiered.table(t).close()
        ref.table(t).close()
