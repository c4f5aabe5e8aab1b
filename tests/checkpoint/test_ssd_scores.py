"""KV tables with an SSD tier in checkpoints: every row's eviction score comes back as
saved, whichever tier it lands in (memory or SSD) at load, for LRU, LFU and
CUSTOM_SCORE tables, unsharded and sharded (one rank), into a memory of the saved
size or of another; with LRU, training then goes on as in the run that never stopped,
down to which ids are demoted and promoted."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

from tests.checkpoint.test_learning_rate import one_rank  # noqa: F401 (a fixture)
from tests.checkpoint.test_state_dict import ADAGRAD, ADAM, assert_same, configs, kjt, snapshot
from torchrec_kvemb import (
    EvictionPolicy,
    KVEmbeddingBagCollection,
    KVEmbeddingBagCollectionSharder,
    KVTable,
    KVTableOptions,
    SSDOptions,
    checkpoint,
)
from torchrec_kvemb.ops.hashing import index_bucket

#: Memory rows of the saved tables: 4 index buckets for the ~90 ``user`` and ~50
#: ``item`` ids of the training steps, so both tiers hold rows of both tables.
SAVED_MEMORY = 64
#: Memories the checkpoint is loaded into: as saved, larger (5 buckets: rows saved on
#: SSD land in memory), smaller (3 buckets: rows saved in memory land on SSD).
MEMORY = {"same-memory": SAVED_MEMORY, "more-memory": 80, "less-memory": 48}
POLICIES = {
    "lru": EvictionPolicy.LRU,
    "lfu": EvictionPolicy.LFU,
    "custom_score": EvictionPolicy.CUSTOM_SCORE,
}
SAVED_STEPS = range(9)
MORE_STEPS = range(9, 14)


def options(path, policy: EvictionPolicy, memory: int) -> dict[str, KVTableOptions]:
    """Both tables with ``memory`` rows over an SSD tier that ranks by the table's
    own scores (LRU: its default)."""
    return {
        name: KVTableOptions(
            capacity=memory,
            eviction=policy,
            total_num_buckets=buckets,
            seed=seed,
            ssd=SSDOptions(path=str(path / name), eviction=policy),
        )
        for name, buckets, seed in (("user", 24, 0), ("item", 10, 3))
    }


def build(path, policy: EvictionPolicy, memory: int = SAVED_MEMORY, fused=ADAGRAD):
    return KVEmbeddingBagCollection(configs(), options(path, policy, memory), fused_params=fused)


def eviction_scores(module: nn.Module, step: int) -> dict[str, torch.Tensor] | None:
    """Custom scores of a step's ids (a per-id hash that drifts up with the step)."""
    if next(iter(module.kv_tables().values())).options.eviction != EvictionPolicy.CUSTOM_SCORE:
        return None
    features = kjt(step).to_dict()
    return {f: (jt.values() * 2654435761 + 17 * step) % 1009 for f, jt in features.items()}


def train(model: nn.Module, module: nn.Module, steps: range) -> list[torch.Tensor]:
    """Fused-optimizer training steps; returns the pooled outputs."""
    outs = []
    for step in steps:
        scores = eviction_scores(module, step)
        kt = model(kjt(step)) if scores is None else model(kjt(step), eviction_scores=scores)
        g = torch.Generator().manual_seed(100 + step)
        (kt.values() * torch.randn(kt.values().shape, generator=g)).sum().backward()
        outs.append(kt.values().detach())
    return outs


def tiers(table: KVTable) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids in memory and the ids on SSD, sorted."""
    return table.keys[table.keys >= 0].sort().values, table.ssd.export()[0].sort().values


def assert_in_both_tiers(module: nn.Module) -> None:
    for name, table in module.kv_tables().items():
        memory, ssd = tiers(table)
        assert memory.numel() > 0 and ssd.numel() > 0, f"table {name!r}: rows in one tier only"


def assert_memory_keeps_the_highest_scores(table: KVTable) -> None:
    """In each index bucket, the rows in memory outrank (score, then smaller id) every
    row of that bucket on SSD, as a fresh insert of the saved rows ranks them."""
    exported = table.export()
    ids, scores = exported["ids"], exported["scores"]
    in_memory = torch.isin(ids, tiers(table)[0])
    buckets = index_bucket(ids, table.keys.shape[0])
    for bucket in torch.unique(buckets[~in_memory]).tolist():
        here = buckets == bucket
        rank = sorted(zip((-scores[here]).tolist(), ids[here].tolist(), in_memory[here].tolist()))
        kept = [m for _, _, m in rank]
        assert kept == sorted(kept, reverse=True), f"table {table.name!r}, bucket {bucket}"


def assert_ssd_ranks_by_the_saved_scores(table: KVTable) -> None:
    """The SSD tier's own eviction scores are the saved ones (its policy is the table's)."""
    ssd = table.ssd
    ids, memory_scores, _ = ssd.export()
    assert torch.equal(ssd.scores_of(ssd.lookup(ids)), memory_scores), table.name


# -------------------------------------------------------------------- unsharded
@pytest.mark.parametrize("memory", list(MEMORY))
@pytest.mark.parametrize("policy", list(POLICIES))
def test_every_score_comes_back_in_either_tier(policy, memory, tmp_path):
    saved = build(tmp_path / "saved", POLICIES[policy])
    train(saved, saved, SAVED_STEPS)
    assert_in_both_tiers(saved)
    state = saved.state_dict()

    loaded = build(tmp_path / "loaded", POLICIES[policy], MEMORY[memory])
    train(loaded, loaded, range(20, 23))  # other rows, to be replaced
    loaded.load_state_dict(state)
    assert_same(snapshot(loaded), snapshot(saved))  # ids, rows, state and scores of both tiers
    assert_in_both_tiers(loaded)
    for name, table in loaded.kv_tables().items():
        assert_memory_keeps_the_highest_scores(table)
        assert_ssd_ranks_by_the_saved_scores(table)
        if memory != "same-memory":
            moved = tiers(table)[0] if memory == "more-memory" else tiers(table)[1]
            was = tiers(saved.table(name))[1 if memory == "more-memory" else 0]
            assert bool(torch.isin(moved, was).any()), f"{name}: no row changed tier"


@pytest.mark.parametrize("memory", list(MEMORY))
def test_lru_training_goes_on_as_if_it_never_stopped(memory, tmp_path):
    """The memory of an LRU table holds each bucket's latest rows, so placing the saved
    rows by their scores puts them where the run left them: the next steps demote and
    promote the same ids (same memory) and give the same rows (any memory)."""
    saved = build(tmp_path / "saved", EvictionPolicy.LRU, fused=ADAM)
    train(saved, saved, SAVED_STEPS)
    checkpoint.save(saved, tmp_path / "ckpt")
    loaded = build(tmp_path / "loaded", EvictionPolicy.LRU, MEMORY[memory], fused=ADAM)
    checkpoint.load(loaded, tmp_path / "ckpt")
    assert_same(snapshot(loaded), snapshot(saved))
    if memory == "same-memory":
        for name, table in loaded.kv_tables().items():
            for got, want in zip(tiers(table), tiers(saved.table(name)), strict=True):
                assert torch.equal(got, want), f"table {name!r}: the tiers hold other ids"

    before = {name: t.metrics() for name, t in saved.kv_tables().items()}
    loaded_before = {name: t.metrics() for name, t in loaded.kv_tables().items()}
    for step in MORE_STEPS:
        (want,) = train(saved, saved, range(step, step + 1))
        (got,) = train(loaded, loaded, range(step, step + 1))
        assert torch.equal(got, want), f"step {step}: pooled outputs differ"
        assert_same(snapshot(loaded), snapshot(saved))
        if memory == "same-memory":
            for name, table in loaded.kv_tables().items():
                for got_ids, want_ids in zip(tiers(table), tiers(saved.table(name)), strict=True):
                    assert torch.equal(got_ids, want_ids), f"step {step}, {name}: tiers differ"
    for name, table in loaded.kv_tables().items():
        m, m0 = table.metrics(), loaded_before[name]
        w, w0 = saved.table(name).metrics(), before[name]
        keys = ("demotions", "promotions", "evictions") if memory == "same-memory" else ()
        for key in ("insert_failures", *keys):
            assert m[key] - m0[key] == w[key] - w0[key], (name, key)
        assert w["demotions"] > w0["demotions"] and w["promotions"] > w0["promotions"], name


# ---------------------------------------------------------------------- sharded
def sharded(path, policy: EvictionPolicy, sharding: str, memory: int = SAVED_MEMORY):
    model = build(path, policy, memory)
    for table in model.kv_tables().values():
        table.close()  # its files go to the sharded module's table
    sharders = [KVEmbeddingBagCollectionSharder(module_type=KVEmbeddingBagCollection)]
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=1, compute_device="cpu"),
        constraints={t: ParameterConstraints(sharding_types=[sharding]) for t in ("user", "item")},
    )
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    return DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)


@pytest.mark.parametrize(
    "policy, sharding, memory",
    [
        ("lru", "row_wise", "less-memory"),
        ("lfu", "table_wise", "same-memory"),
        ("custom_score", "row_wise", "more-memory"),
    ],
    ids=[
        "lru-row_wise-less-memory",
        "lfu-table_wise-same-memory",
        "custom_score-row_wise-more-memory",
    ],
)
def test_sharded_load_keeps_every_score(policy, sharding, memory, one_rank, tmp_path):  # noqa: F811
    saved = build(tmp_path / "saved", POLICIES[policy])
    train(saved, saved, SAVED_STEPS)
    checkpoint.save(saved, tmp_path / "ckpt")
    model = sharded(tmp_path / "loaded", POLICIES[policy], sharding, MEMORY[memory])
    module = model.module
    checkpoint.load(model, tmp_path / "ckpt")
    assert_same(snapshot(module), snapshot(saved))
    assert_in_both_tiers(module)
    for table in module.kv_tables().values():
        assert_memory_keeps_the_highest_scores(table)
        assert_ssd_ranks_by_the_saved_scores(table)
    if policy == "lru":
        train(saved, saved, MORE_STEPS)
        train(model, module, MORE_STEPS)
        assert_same(snapshot(module), snapshot(saved))
