"""Column shards in one process: a table cut into column pieces, each a KV table of
the piece's width with ``column_offset``, gives the whole table's columns.

This is what COLUMN_WISE sharding of KV tables rests on: initial rows are the
wide table's columns, and the same ids make the same slot, eviction and
admission decisions in every piece (element-wise optimizers then give the wide
table's rows column by column)."""

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingConfig
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import ParameterSharding
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb import (
    EvictionPolicy,
    FusedOptimConfig,
    HostTierOptions,
    KVEmbeddingBagCollection,
    KVEmbeddingBagCollectionSharder,
    KVEmbeddingCollectionSharder,
    KVTableOptions,
    SSDOptions,
)
from torchrec_kvemb.contracts import InitSpec
from torchrec_kvemb.memory import resolve_capacity
from torchrec_kvemb.ops.hashing import init_rows
from torchrec_kvemb.sharding.cw import check_column_shards
from torchrec_kvemb.sharding.cw_columns import column_shard_options
from torchrec_kvemb.sharding.planner import check_plan
from torchrec_kvemb.sharding.sequence_shardings import KV_SEQUENCE_SHARDINGS

DIM = 11
PIECES = ((0, 4), (4, 5), (9, 2))  # (first column, width): odd widths


@pytest.mark.parametrize("kind", [0, 1, 2], ids=["uniform", "normal", "trunc_normal"])
def test_init_rows_column_offset(kind: int) -> None:
    ids = torch.tensor([0, 3, 7, 2**40 + 1, 2**63 - 1, 12345])
    spec = (
        InitSpec.trunc_normal(5, 0.0, 0.3, -0.4, 0.4)
        if kind == 2
        else InitSpec(5, kind, -0.5 if kind == 0 else 0.0, 0.5 if kind == 0 else 0.2)
    )
    wide = init_rows(ids, DIM, spec.seed, spec.normal, spec.a, spec.b)
    for first, width in PIECES:
        piece = init_rows(ids, width, spec.seed, spec.normal, spec.a, spec.b, first)
        assert torch.equal(piece, wide[:, first : first + width]), (first, width)


def test_column_offset_refused_when_negative() -> None:
    with pytest.raises(ValueError, match="column_offset"):
        KVTableOptions(capacity=16, column_offset=-1)


def _kjt(step: int, n_bags: int = 7) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 4, (n_bags,), generator=g)
    ids = torch.randint(0, 90, (int(lengths.sum()),), generator=g) * 7919
    return KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=ids, lengths=lengths)


def _collection(width: int, options: KVTableOptions, fused: dict) -> KVEmbeddingBagCollection:
    config = EmbeddingBagConfig(
        name="t", embedding_dim=width, num_embeddings=2**40, feature_names=["f"]
    )
    return KVEmbeddingBagCollection([config], options, fused_params=fused)


@pytest.mark.parametrize(
    "optimizer",
    [EmbOptimType.EXACT_SGD, EmbOptimType.ADAM],
    ids=["sgd", "adam"],
)
@pytest.mark.parametrize(
    "policy,admission",
    [(EvictionPolicy.LRU, 1), (EvictionPolicy.LFU, 2), (EvictionPolicy.NONE, 1)],
    ids=["lru", "lfu-admission", "none"],
)
def test_pieces_equal_wide_table(optimizer, policy, admission) -> None:
    """Outputs at every step, then ids, scores and rows of every piece equal the wide
    table's (small capacity: ids are evicted and admitted all along)."""
    fused = {"optimizer": optimizer, "learning_rate": 0.1}
    base = KVTableOptions(
        capacity=32,
        eviction=policy,
        admission_threshold=admission,
        seed=3,
        init_low=-0.5,
        init_high=0.5,
    )
    wide = _collection(DIM, base, fused)
    pieces = [
        _collection(width, replace(base, column_offset=first), fused) for first, width in PIECES
    ]
    for step in range(12):
        kjt = _kjt(step)
        out = wide(kjt).values()
        parts = torch.cat([p(kjt).values() for p in pieces], dim=1)
        torch.testing.assert_close(parts, out, rtol=0, atol=1e-6)
        # The same gradient, column by column: each piece gets its columns of it.
        ((out + parts) * (step + 1)).sum().backward()
    # Churn happened: evictions (a full NONE table refuses new ids instead).
    metrics = wide.table("t").metrics()
    assert metrics["insert_failures" if policy == EvictionPolicy.NONE else "evictions"] > 0
    whole = wide.table("t").export()
    order = torch.argsort(whole["ids"])
    for (first, width), p in zip(PIECES, pieces, strict=True):
        mine = p.table("t").export()
        mine_order = torch.argsort(mine["ids"])
        assert torch.equal(mine["ids"][mine_order], whole["ids"][order])
        assert torch.equal(mine["scores"][mine_order], whole["scores"][order])
        torch.testing.assert_close(
            mine["weights"][mine_order],
            whole["weights"][order][:, first : first + width],
            rtol=0,
            atol=1e-6,
        )


# ------------------------------------------------------- column shard options
def test_column_shard_options_keep_the_table_options() -> None:
    options = KVTableOptions(capacity=100, eviction=EvictionPolicy.LFU, seed=9)
    shard = column_shard_options(options, "t", dim=11, first_col=4)
    assert shard == replace(options, column_offset=4)


def test_memory_budget_becomes_one_capacity_for_every_shard() -> None:
    """Shards of different widths must hold the same rows: the budget is read at the
    table's whole width, and each shard gets that capacity."""
    options = KVTableOptions(memory_budget_bytes=200_000)
    adam = FusedOptimConfig.from_fused_params({"optimizer": EmbOptimType.ADAM})
    want = resolve_capacity(options, 11, adam.state_dim(11))
    shards = [column_shard_options(options, "t", 11, c, adam) for c in (0, 6)]
    assert {s.capacity for s in shards} == {want}
    assert all(s.memory_budget_bytes is None for s in shards)


@pytest.mark.parametrize(
    "tier",
    [{"ssd": SSDOptions(path="/tmp/unused")}, {"host_tier": HostTierOptions(capacity=64)}],
    ids=["ssd", "host"],
)
def test_tiered_tables_are_refused(tier) -> None:
    options = KVTableOptions(capacity=32, **tier)
    with pytest.raises(ValueError, match="table 'big': column-wise KV tables take no lower tier"):
        column_shard_options(options, "big", 8, 4)


def test_two_column_shards_on_one_rank_are_refused() -> None:
    info = SimpleNamespace(
        param_sharding=SimpleNamespace(ranks=[0, 1, 0]),
        embedding_config=SimpleNamespace(name="user"),
    )
    with pytest.raises(ValueError, match=r"table 'user'.*ranks \[0\] hold several"):
        check_column_shards([info], world_size=2)
    info.param_sharding.ranks = [1, 0]
    check_column_shards([info], world_size=2)


def test_both_sharders_offer_column_wise() -> None:
    """Bags and sequences: column-wise is offered to KV tables and accepted in a plan."""
    bags = KVEmbeddingBagCollectionSharder({"t": KVTableOptions(capacity=64)})
    sequences = KVEmbeddingCollectionSharder({"items": KVTableOptions(capacity=64)})
    assert "column_wise" in bags.kv_sharding_types
    assert "column_wise" in sequences.kv_sharding_types
    configs = [
        EmbeddingConfig(name="items", embedding_dim=8, num_embeddings=100, feature_names=["i"])
    ]
    plan = {
        "items": ParameterSharding(
            sharding_type="column_wise", compute_kernel="customized_kernel", ranks=[0, 1]
        )
    }
    check_plan({"items"}, configs, plan, list(KV_SEQUENCE_SHARDINGS))  # accepted


def test_stock_planner_plans_kv_tables_column_wise() -> None:
    """Constrained column-wise, the stock planner cuts a KV table's columns with the KV
    kernel (the storage stand-in keeps the table's width), one shard per rank."""
    configs = [
        EmbeddingBagConfig(name="kv", embedding_dim=64, num_embeddings=2**40, feature_names=["f"]),
        EmbeddingBagConfig(name="stock", embedding_dim=8, num_embeddings=100, feature_names=["s"]),
    ]
    model = nn.Module()
    model.ebc = EmbeddingBagCollection(configs, device=torch.device("meta"))
    sharder = KVEmbeddingBagCollectionSharder({"kv": KVTableOptions(capacity=1000)})
    constraints = {"kv": ParameterConstraints(sharding_types=["column_wise"], min_partition=32)}
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=2, compute_device="cpu"), constraints=constraints
    )
    ps = planner.plan(model, [sharder]).plan["ebc"]["kv"]
    assert (ps.sharding_type, ps.compute_kernel) == ("column_wise", "customized_kernel")
    shards = ps.sharding_spec.shards
    assert [s.shard_offsets[1] for s in shards] == [0, 32]
    assert [s.shard_sizes[1] for s in shards] == [32, 32]
    assert sorted(ps.ranks) == [0, 1]
