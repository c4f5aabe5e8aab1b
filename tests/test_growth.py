"""Tables that grow (``KVTableOptions(initial_capacity=...)``) against twins built
at the maximum capacity.

A grown table must look up, train, evict and count exactly as the twin, step by
step, on every backend: the torch path table by table, the native CPU kernels
and the Triton kernels (interpreted) of a group; only ``size``, ``capacity``,
``load_factor`` and ``growths`` may differ. Its memory follows its capacity, and
its rows survive a state-dict round trip into a table that starts small again.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.torchrun_jobs import assert_scenarios_passed, read_result, run_job, torchrun_command
from torchrec_kvemb import EvictionPolicy, KVEmbeddingBagCollection, KVTableOptions
from torchrec_kvemb.backend import ENV_VAR
from torchrec_kvemb.memory import table_memory
from torchrec_kvemb.ops import native
from torchrec_kvemb.optimizer import FusedOptimConfig
from torchrec_kvemb.options import WAYS
from torchrec_kvemb.sharding.kv_embedding import shard_options
from torchrec_kvemb.sharding.planner import kv_table_bytes
from torchrec_kvemb.table import KVTable

#: Metrics a grown table and its fixed twin may differ in.
SHAPE_METRICS = {"size", "capacity", "load_factor", "growths"}


def _twin(options: KVTableOptions, table: KVTable) -> KVTableOptions:
    """``options`` of a table built at ``table``'s maximum capacity."""
    return replace(options, capacity=table.max_capacity, initial_capacity=None)


def _same_rows(grown: dict, fixed: dict, what: str) -> None:
    assert grown.keys() == fixed.keys(), what
    for key, ref in fixed.items():
        if ref.dtype == torch.int64:
            assert torch.equal(grown[key], ref), f"{what}: {key}"
        else:
            torch.testing.assert_close(grown[key], ref, atol=1e-6, rtol=1e-6, msg=what + key)


def _counters(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k not in SHAPE_METRICS}


@pytest.mark.parametrize("admission", [1, 3], ids=["admit_all", "admit_3"])
@pytest.mark.parametrize("policy", list(EvictionPolicy), ids=lambda p: p.name)
def test_table_grows_as_a_fixed_table_looks_up(policy, admission):
    options = KVTableOptions(
        capacity=190, initial_capacity=3, eviction=policy, admission_threshold=admission, seed=5
    )
    grown = KVTable("g", 5, options)
    fixed = KVTable("f", 5, _twin(options, grown))
    assert grown.capacity == 2 * WAYS and grown.max_capacity == 16 * WAYS
    assert grown.max_capacity >= 190 and fixed.capacity == grown.max_capacity
    gen = torch.Generator().manual_seed(11)
    capacities = []
    for step in range(30):
        ids = torch.randint(0, 500 // admission + 200, (41,), generator=gen) * 7919
        scores = torch.randint(0, 6, (41,), generator=gen)
        slots_g, slots_f = grown.lookup_train(ids, scores), fixed.lookup_train(ids, scores)
        assert torch.equal(slots_g >= 0, slots_f >= 0), f"step {step}: ids with a row"
        _same_rows(grown.export(), fixed.export(), f"step {step}")
        assert torch.equal(
            grown.admission_entries()[0].sort()[0], fixed.admission_entries()[0].sort()[0]
        )
        assert _counters(grown.metrics()) == _counters(fixed.metrics()), f"step {step}"
        capacities.append(grown.capacity)
    assert capacities == sorted(capacities) and capacities[-1] == fixed.capacity
    metrics = grown.metrics()
    assert metrics["growths"] == 3 and metrics["max_capacity"] == fixed.capacity
    if policy == EvictionPolicy.NONE:
        assert metrics["insert_failures"] > 0
    else:
        assert metrics["evictions"] > 0


def test_insert_and_load_grow_to_fit():
    options = KVTableOptions(capacity=500, initial_capacity=20, eviction=EvictionPolicy.NONE)
    table = KVTable("t", 3, options)
    assert (table.capacity, table.max_capacity) == (2 * WAYS, 32 * WAYS)
    ids = torch.arange(300) * 1_000_003
    rows = torch.randn(300, 3)
    slots = table.insert(ids, rows)
    assert bool((slots >= 0).all()) and table.metrics()["insert_failures"] == 0
    assert table.capacity > 2 * WAYS
    found, hit = table.find(ids)
    assert bool(hit.all()) and torch.equal(found, rows)
    # a fresh small table loads the grown one's rows: it grows to hold them all
    saved = table.export()
    fresh = KVTable("u", 3, options)
    lost = fresh.load_rows(saved["ids"], saved["weights"], None, saved["scores"], (4, 2))
    assert (
        lost == 0 and fresh.capacity == table.capacity and (fresh.step, fresh.optim_step) == (4, 2)
    )
    _same_rows(fresh.export(), saved, "loaded")


def test_memory_follows_capacity():
    optim = FusedOptimConfig.from_fused_params({"optimizer": EmbOptimType.ADAM})
    options = KVTableOptions(capacity=2000, initial_capacity=40, admission_threshold=2)
    table = KVTable("t", 7, options, optim)

    def allocated() -> int:
        arrays = (table.keys, table.scores, table.weights, table.state)
        counter = (table.counter.keys, table.counter.scores, table.counts)
        return sum(a.nbytes for a in arrays + counter)

    start = allocated()
    assert start == table.memory_bytes() < kv_table_bytes(options, 7, optim)
    table.grow(table.max_capacity)
    assert allocated() == table.memory_bytes() == kv_table_bytes(options, 7, optim)
    assert table_memory(options, 7, optim).initial_rows * 32 == table.capacity


def _collection(options_a, options_b, optimizer):
    configs = [
        EmbeddingBagConfig(
            name=n,
            embedding_dim=4,
            num_embeddings=2**63 - 1,
            feature_names=f,
            weight_init_min=-0.1,
            weight_init_max=0.1,
        )
        for n, f in (("a", ["x", "y"]), ("b", ["z"]))
    ]
    return KVEmbeddingBagCollection(
        configs,
        {"a": options_a, "b": options_b},
        fused_params={"optimizer": optimizer, "learning_rate": 0.1},
    )


def _batches(steps=9, batch=9):
    gen = torch.Generator().manual_seed(3)
    for _ in range(steps):
        lengths = torch.randint(0, 6, (3 * batch,), generator=gen)
        values = torch.randint(0, 400, (int(lengths.sum()),), generator=gen) * 1_000_003
        yield KeyedJaggedTensor.from_lengths_sync(
            keys=["x", "y", "z"], values=values, lengths=lengths
        )


_CASES = {
    "lru_adam": (EvictionPolicy.LRU, 1, EmbOptimType.ADAM),
    "lfu_admit2_adagrad": (EvictionPolicy.LFU, 2, EmbOptimType.EXACT_ROWWISE_ADAGRAD),
    "none_sgd": (EvictionPolicy.NONE, 1, EmbOptimType.EXACT_SGD),
}
_RUNS = [(b, c) for b in ("torch", "native") for c in _CASES] + [("triton", "lfu_admit2_adagrad")]


@pytest.mark.parametrize("backend,case", _RUNS, ids=[f"{b}-{c}" for b, c in _RUNS])
def test_grouped_tables_grow_as_fixed_ones_train(backend, case, monkeypatch):
    """Two tables of one group grow unequally (from 1/16 and 1/4 of their maximum).
    The Triton kernels run interpreted (slowly): the case with admission only."""
    policy, admission, optimizer = _CASES[case]
    if backend == "native":
        assert native.available(), native.unavailable_reason()
    monkeypatch.setenv(ENV_VAR, "auto" if backend == "native" else backend)
    a = KVTableOptions(
        capacity=250, initial_capacity=5, eviction=policy, admission_threshold=admission
    )
    b = KVTableOptions(capacity=130, initial_capacity=40, eviction=policy, seed=9)
    grown = _collection(a, b, optimizer)
    tables = grown.kv_tables()
    fixed = _collection(_twin(a, tables["a"]), _twin(b, tables["b"]), optimizer)
    assert [t.capacity for t in tables.values()] == [WAYS, 5 * WAYS]
    for step, kjt in enumerate(_batches(steps=6 if backend == "triton" else 9)):
        out_g, out_f = grown(kjt).values(), fixed(kjt).values()
        torch.testing.assert_close(out_g, out_f, atol=1e-6, rtol=1e-6, msg=f"output {step}")
        grad = torch.cos(torch.arange(out_f.numel(), dtype=torch.float32)).view_as(out_f)
        out_g.backward(grad)
        out_f.backward(grad)
        for name, table in fixed.kv_tables().items():
            _same_rows(tables[name].export(), table.export(), f"step {step} table {name}")
        metrics_g, metrics_f = grown.metrics(), fixed.metrics()
        for name in metrics_f:
            assert _counters(metrics_g[name]) == _counters(metrics_f[name]), (step, name)
    growths = {name: grown.metrics()[name]["growths"] for name in tables}
    assert growths["a"] >= 2 and growths["b"] >= 1, growths
    for name, table in fixed.kv_tables().items():
        dropped = fixed.metrics()[name]["evictions"] + fixed.metrics()[name]["insert_failures"]
        # a table evicts (or fails) only at its maximum
        assert tables[name].capacity == table.capacity or dropped == 0, name
    assert sum(m["evictions"] + m["insert_failures"] for m in fixed.metrics().values()) > 0
    # the state dict of the grown collection loads into a collection that starts small
    again = _collection(a, b, optimizer)
    again.load_state_dict(grown.state_dict())
    for name, table in again.kv_tables().items():
        _same_rows(table.export(), tables[name].export(), f"loaded table {name}")
        assert table.capacity <= tables[name].capacity


def test_shards_grow_from_their_share():
    options = KVTableOptions(capacity=1000, initial_capacity=100)
    shard = shard_options(options, 3)
    assert (shard.capacity, shard.initial_capacity) == (334, 34)
    table = KVTable("s", 2, shard)
    assert table.capacity < table.max_capacity


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"capacity": 100, "initial_capacity": 0}, "initial_capacity must be > 0"),
        ({"capacity": 100, "initial_capacity": 101}, "is above capacity 100"),
    ],
    ids=["zero", "above_capacity"],
)
def test_bad_initial_capacity_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KVTableOptions(**kwargs)


def test_initial_capacity_above_what_a_budget_holds_is_refused():
    options = KVTableOptions(memory_budget_bytes=10_000, initial_capacity=500)
    with pytest.raises(ValueError, match="initial_capacity=500 is above"):
        KVTable("t", 4, options)


def test_checkpoint_round_trip_grows_the_loading_table(tmp_path):
    """A grown collection saved by ``checkpoint.save`` loads into one that starts
    small again (it grows to fit), which then trains on as the fixed twin does."""
    from torchrec_kvemb import checkpoint

    a = KVTableOptions(capacity=250, initial_capacity=5, eviction=EvictionPolicy.LFU)
    b = KVTableOptions(capacity=130, initial_capacity=40, admission_threshold=2)
    grown = _collection(a, b, EmbOptimType.ADAM)
    tables = grown.kv_tables()
    fixed = _collection(_twin(a, tables["a"]), _twin(b, tables["b"]), EmbOptimType.ADAM)
    batches = list(_batches(steps=7))
    grad = None
    for kjt in batches[:4]:
        for model in (grown, fixed):
            out = model(kjt).values()
            grad = torch.sin(torch.arange(out.numel(), dtype=torch.float32)).view_as(out)
            out.backward(grad)
    checkpoint.save(grown, tmp_path / "ckpt")
    loaded = _collection(a, b, EmbOptimType.ADAM)
    assert loaded.table("a").capacity < tables["a"].capacity
    checkpoint.load(loaded, tmp_path / "ckpt")
    for name, table in loaded.kv_tables().items():
        _same_rows(table.export(), tables[name].export(), f"loaded table {name}")
        assert table.capacity <= table.max_capacity
    for step, kjt in enumerate(batches[4:]):
        out_l, out_f = loaded(kjt).values(), fixed(kjt).values()
        torch.testing.assert_close(out_l, out_f, atol=1e-6, rtol=1e-6, msg=f"step {step}")
        grad = torch.sin(torch.arange(out_f.numel(), dtype=torch.float32)).view_as(out_f)
        out_l.backward(grad)
        out_f.backward(grad)
    for name, table in fixed.kv_tables().items():
        _same_rows(loaded.table(name).export(), table.export(), f"trained on, table {name}")


def test_sharded_tables_grow_as_the_unsharded_one(tmp_path):
    # one 2-rank job: row-wise and table-wise (tests/sharding/growth_worker.py)
    result_path = tmp_path / "result.json"
    job = run_job(torchrun_command(2, "-m", "tests.sharding.growth_worker", str(result_path)))
    result = read_result(result_path, job)
    assert_scenarios_passed(result, job, {"growth_row_wise", "growth_table_wise"})


def test_a_grown_collection_quantizes_for_inference():
    """Its read-only copy holds every id at the table's capacity now (no growth)."""
    from torchrec.inference.modules import quantize_inference_model

    a = KVTableOptions(capacity=250, initial_capacity=5)
    b = KVTableOptions(capacity=130, initial_capacity=40, eviction=EvictionPolicy.NONE)
    model = torch.nn.Module()
    model.ebc = _collection(a, b, EmbOptimType.EXACT_SGD)
    for kjt in _batches(steps=1):
        model.ebc(kjt).values().sum().backward()
    rows = {n: t.export() for n, t in model.ebc.kv_tables().items()}
    assert model.ebc.table("a").capacity < model.ebc.table("a").max_capacity
    quantize_inference_model(model, quantization_dtype=torch.float16)
    for name, table in model.ebc.kv_tables().items():
        assert table.capacity == table.max_capacity
        copy = table.export()
        assert torch.equal(copy["ids"], rows[name]["ids"]), name
        assert torch.equal(copy["weights"], rows[name]["weights"].to(torch.float16)), name


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_sequence_tables_grow_as_fixed_ones_train(backend, monkeypatch):
    from torchrec.modules.embedding_configs import EmbeddingConfig

    from torchrec_kvemb import KVEmbeddingCollection

    monkeypatch.setenv(ENV_VAR, "auto" if backend == "native" else backend)
    configs = [
        EmbeddingConfig(
            name="s", embedding_dim=3, num_embeddings=2**40, feature_names=["x", "y", "z"],
            weight_init_min=-0.1, weight_init_max=0.1,
        )
    ]  # fmt: skip
    options = KVTableOptions(capacity=200, initial_capacity=7, eviction=EvictionPolicy.LFU)
    fused = {"optimizer": EmbOptimType.ADAM, "learning_rate": 0.05}
    grown = KVEmbeddingCollection(configs, options, fused_params=fused)
    twin = _twin(options, grown.table("s"))
    fixed = KVEmbeddingCollection(configs, twin, fused_params=fused)
    for step, kjt in enumerate(_batches(steps=7)):
        out_g, out_f = grown(kjt), fixed(kjt)
        loss_g = sum((out_g[k].values() * (i + 1)).sum() for i, k in enumerate(out_g))
        loss_f = sum((out_f[k].values() * (i + 1)).sum() for i, k in enumerate(out_f))
        for key in out_f:
            torch.testing.assert_close(out_g[key].values(), out_f[key].values(), msg=key)
        loss_g.backward()
        loss_f.backward()
        _same_rows(grown.table("s").export(), fixed.table("s").export(), f"step {step}")
    metrics, fixed_metrics = grown.table("s").metrics(), fixed.table("s").metrics()
    assert metrics["growths"] > 0
    assert metrics["evictions"] == fixed_metrics["evictions"] > 0


def test_grow_refuses_what_is_not_a_power_of_two_step_to_the_maximum():
    table = KVTable("t", 2, KVTableOptions(capacity=16 * 16, initial_capacity=16))
    assert table.room() == table.max_capacity == 256
    for rows in (48, 512, 8):
        with pytest.raises(ValueError, match="cannot grow from 16"):
            table.grow(rows)
    table.grow(64)
    assert table.capacity == 64 and table.metrics()["growths"] == 1
