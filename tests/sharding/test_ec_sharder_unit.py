"""KVEmbeddingCollectionSharder in one process: planning with the stock planner,
per-table answers, the sharded module over a fake process group, bad input."""

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import ParameterSharding, ShardingEnv
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb import KVEmbeddingCollection, KVEmbeddingCollectionSharder, KVTableOptions
from torchrec_kvemb.sharding import KV_COMPUTE_KERNEL, ShardedKVEmbeddingCollection

META = torch.device("meta")
RW, TW, DP = "row_wise", "table_wise", "data_parallel"
TWRW = "table_row_wise"
ADAGRAD = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
OPTIONS = {"kv": KVTableOptions(capacity=3000, total_num_buckets=90)}


def _configs() -> list[EmbeddingConfig]:
    return [
        EmbeddingConfig(name="kv", embedding_dim=12, num_embeddings=2**40, feature_names=["f"]),
        EmbeddingConfig(name="stock", embedding_dim=12, num_embeddings=101, feature_names=["s"]),
    ]


def _plan(module: nn.Module, sharder, constraints=None) -> dict[str, ParameterSharding]:
    topology = Topology(world_size=3, compute_device="cpu")
    planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints)
    return planner.plan(nn.Sequential(module), [sharder]).plan["0"]


def test_stock_planner_gives_kv_tables_the_kv_kernel():
    sharder = KVEmbeddingCollectionSharder(OPTIONS, fused_params=ADAGRAD)
    plan = _plan(EmbeddingCollection(_configs(), device=META), sharder)
    assert plan["kv"].compute_kernel == KV_COMPUTE_KERNEL
    assert plan["kv"].sharding_type in (RW, TW)
    assert plan["stock"].compute_kernel != KV_COMPUTE_KERNEL


def test_sharding_types_and_kernels_are_per_table():
    sharder = KVEmbeddingCollectionSharder(OPTIONS, fused_params=ADAGRAD)
    answers = {}
    for name, _ in sharder.shardable_parameters(
        EmbeddingCollection(_configs(), device=META)
    ).items():
        types = sharder.sharding_types("cpu")
        answers[name] = (types, {t: sharder.compute_kernels(t, "cpu") for t in types})
    kv_types = [RW, TW, "column_wise", TWRW]
    assert answers["kv"] == (kv_types, {t: [KV_COMPUTE_KERNEL] for t in kv_types})
    assert all(KV_COMPUTE_KERNEL not in k for k in answers["stock"][1].values())


@pytest.mark.parametrize("sharding_type", [RW, TW])
def test_sharded_module_holds_kv_shards(fake_world, sharding_type):
    sharder = KVEmbeddingCollectionSharder(OPTIONS, fused_params=ADAGRAD)
    ec = EmbeddingCollection(_configs(), device=META)
    constraints = {
        "kv": ParameterConstraints(sharding_types=[sharding_type]),
        # A stock table's ShardedTensor needs real collectives: keep it whole.
        "stock": ParameterConstraints(sharding_types=[DP]),
    }
    plan = _plan(ec, sharder, constraints)
    assert plan["kv"].sharding_type == sharding_type
    sharded = sharder.shard(ec, plan, fake_world, torch.device("cpu"))
    assert isinstance(sharded, ShardedKVEmbeddingCollection)
    table = sharded.kv_tables()["kv"]
    assert table.capacity >= (1000 if sharding_type == RW else 3000)
    assert table.capacity < (2000 if sharding_type == RW else 6000)
    assert set(sharded.metrics()) == {"kv"}
    # Resharding in place checks the change before anything else (tests/sharding/test_reshard.py).
    with pytest.raises(ValueError, match="tables \\['nope'\\] are not tables"):
        sharded.update_shards({"nope": plan["kv"]}, fake_world, None)
    sharded.update_shards({"kv": plan["kv"]}, fake_world, None)  # no change: nothing moves
    assert sharded.kv_tables()["kv"] is table


def test_bad_sharder_arguments():
    with pytest.raises(ValueError, match="names no table"):
        KVEmbeddingCollectionSharder({})
    with pytest.raises(TypeError, match="module_type must be EmbeddingCollection"):
        KVEmbeddingCollectionSharder(OPTIONS, module_type=nn.Linear)
    with pytest.raises(TypeError, match="table 'kv': expected KVTableOptions"):
        KVEmbeddingCollectionSharder({"kv": {"capacity": 8}})


def _sharding(kernel: str, sharding_type: str = RW) -> ParameterSharding:
    return ParameterSharding(sharding_type=sharding_type, compute_kernel=kernel, ranks=[0, 1])


@pytest.mark.parametrize(
    "plan, message",
    [
        pytest.param(
            {"kv": _sharding("fused"), "stock": _sharding("fused", TW)},
            "table 'kv' has KVTableOptions but the plan gives it compute kernel 'fused'",
            id="kv-table-stock-kernel",
        ),
        pytest.param(
            {"kv": _sharding(KV_COMPUTE_KERNEL, DP), "stock": _sharding("fused", TW)},
            "table 'kv': KV tables shard row_wise or table_wise",
            id="kv-table-data-parallel",
        ),
        pytest.param(
            {"kv": _sharding(KV_COMPUTE_KERNEL), "stock": _sharding(KV_COMPUTE_KERNEL, TW)},
            "table 'stock'.*has no KVTableOptions",
            id="stock-table-kv-kernel",
        ),
        pytest.param(
            {"kv": _sharding(KV_COMPUTE_KERNEL)},
            "table 'stock': the sharding plan has no",
            id="table-missing",
        ),
    ],
)
def test_shard_refuses_plans_that_do_not_fit(plan, message):
    sharder = KVEmbeddingCollectionSharder(OPTIONS)
    env = ShardingEnv(world_size=2, rank=0, pg=None)
    with pytest.raises(ValueError, match=message):
        sharder.shard(EmbeddingCollection(_configs(), device=META), plan, env)


def test_kv_collection_that_holds_rows_is_refused():
    module = KVEmbeddingCollection(_configs()[:1], OPTIONS, fused_params=ADAGRAD)
    module(KeyedJaggedTensor.from_lengths_sync(["f"], torch.tensor([5, 9]), torch.tensor([2])))
    sharder = KVEmbeddingCollectionSharder(module_type=KVEmbeddingCollection)
    env = ShardingEnv(world_size=2, rank=0, pg=None)
    with pytest.raises(ValueError, match="KVEmbeddingCollection tables already hold rows"):
        sharder.shard(module, {"kv": _sharding(KV_COMPUTE_KERNEL)}, env)


@pytest.mark.parametrize("sharding_type", [RW, TW])
def test_a_stock_module_built_off_meta_keeps_its_stock_weights(fake_world, sharding_type):
    """Built on CPU, a stock EmbeddingCollection's weights are copied into its sharded
    form (TorchRec's rule for this collection): its stock tables' as the stock sharder
    copies them; a KV table's rows are born from (id, seed), never from its weight."""
    torch.manual_seed(3)
    ec = EmbeddingCollection(
        [
            EmbeddingConfig(name="kv", embedding_dim=12, num_embeddings=97, feature_names=["f"]),
            _configs()[1],
        ]
    )
    constraints = {
        "kv": ParameterConstraints(sharding_types=[sharding_type]),
        "stock": ParameterConstraints(sharding_types=[DP]),
    }
    sharder = KVEmbeddingCollectionSharder(OPTIONS, fused_params=ADAGRAD)
    sharded = sharder.shard(ec, _plan(ec, sharder, constraints), fake_world, torch.device("cpu"))
    got = dict(sharded.named_parameters())["embeddings.stock.weight"]
    assert torch.equal(got.detach(), ec.embeddings["stock"].weight.detach())
    assert sharded.kv_tables()["kv"].size == 0
