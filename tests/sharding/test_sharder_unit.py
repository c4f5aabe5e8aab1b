"""KVEmbeddingBagCollectionSharder in one process: planning with the stock planner,
storage estimates, the sharded module built over a fake process group, bad configs."""

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.estimator.config import EmbeddingPerfEstimatorConfig
from torchrec.distributed.planner.types import PlannerError
from torchrec.distributed.types import ParameterSharding, ShardingEnv
from torchrec.modules.embedding_configs import PoolingType
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb import (
    FusedOptimConfig,
    HostTierOptions,
    KVEmbeddingBagCollection,
    KVEmbeddingBagCollectionSharder,
    KVTable,
    KVTableOptions,
    SSDOptions,
)
from torchrec_kvemb.sharding import KV_COMPUTE_KERNEL, ShardedKVEmbeddingBagCollection
from torchrec_kvemb.sharding.kv_embedding import shard_options
from torchrec_kvemb.sharding.planner import kv_table_bytes, storage_proxy

META = torch.device("meta")
RW, TW, CW, DP = "row_wise", "table_wise", "column_wise", "data_parallel"
TWRW = "table_row_wise"
ADAGRAD = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
MAX_ID = 2**63 - 1


def _ebc_configs():
    return [
        EmbeddingBagConfig(name="kv", embedding_dim=16, num_embeddings=2**40, feature_names=["f"]),
        EmbeddingBagConfig(
            name="kv_mean",
            embedding_dim=8,
            num_embeddings=2**40,
            feature_names=["g"],
            pooling=PoolingType.MEAN,
        ),
        EmbeddingBagConfig(
            name="stock_small", embedding_dim=8, num_embeddings=100, feature_names=["s"]
        ),
        EmbeddingBagConfig(
            name="stock_big", embedding_dim=16, num_embeddings=500_000, feature_names=["b"]
        ),
    ]


def _huge_configs():
    return [
        EmbeddingBagConfig(
            name="huge_a", embedding_dim=8, num_embeddings=MAX_ID, feature_names=["ha"]
        ),
        EmbeddingBagConfig(
            name="huge_b", embedding_dim=4, num_embeddings=MAX_ID, feature_names=["hb1", "hb2"]
        ),
    ]


EBC_OPTIONS = {
    "kv": KVTableOptions(capacity=100_000, total_num_buckets=96),
    "kv_mean": KVTableOptions(memory_budget_bytes=1 << 20, admission_threshold=3),
}


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(_ebc_configs(), device=META)
        self.kvebc = KVEmbeddingBagCollection(
            _huge_configs(),
            KVTableOptions(capacity=4096, total_num_buckets=96),
            fused_params=ADAGRAD,
        )


def _sharders():
    return [
        KVEmbeddingBagCollectionSharder(EBC_OPTIONS, fused_params=ADAGRAD),
        KVEmbeddingBagCollectionSharder(module_type=KVEmbeddingBagCollection),
    ]


def _planner(world_size=2, constraints=None):
    topology = Topology(world_size=world_size, compute_device="cpu")
    return EmbeddingShardingPlanner(topology=topology, constraints=constraints)


# ----------------------------------------------------------------- planning
def test_stock_planner_plans_kv_and_stock_tables():
    plan = _planner().plan(Model(), _sharders())
    kv_tables = {"ebc": set(EBC_OPTIONS), "kvebc": {"huge_a", "huge_b"}}
    seen = set()
    for path, module_plan in plan.plan.items():
        for table, ps in module_plan.items():
            seen.add(table)
            assert set(ps.ranks) <= {0, 1}
            if table in kv_tables[path]:
                assert ps.compute_kernel == KV_COMPUTE_KERNEL, table
                assert ps.sharding_type in (RW, TW, CW), table
                if ps.sharding_type == RW:
                    assert sorted(ps.ranks) == [0, 1]
            else:
                assert ps.compute_kernel != KV_COMPUTE_KERNEL, table
                assert ps.sharding_type in (
                    "data_parallel",
                    TW,
                    "column_wise",
                    "table_column_wise",
                ), table
    assert seen == {c.name for c in _ebc_configs() + _huge_configs()}


def test_constraints_still_narrow_the_choice():
    constraints = {
        "kv": ParameterConstraints(sharding_types=[TW]),
        "kv_mean": ParameterConstraints(sharding_types=[RW]),
    }
    plan = _planner(constraints=constraints).plan(Model(), _sharders())
    assert plan.plan["ebc"]["kv"].sharding_type == TW
    assert plan.plan["ebc"]["kv_mean"].sharding_type == RW


def test_planner_storage_follows_the_options():
    sharder = _sharders()[0]
    params = sharder.shardable_parameters(EmbeddingBagCollection(_ebc_configs(), device=META))
    optim = FusedOptimConfig.from_fused_params(ADAGRAD)
    for name, options in EBC_OPTIONS.items():
        dim = params[name].shape[1]
        proxy = params[name]
        assert proxy.device == META
        nbytes = proxy.numel() * proxy.element_size()
        assert 0 <= nbytes - kv_table_bytes(options, dim, optim) < 4 * dim
    # Stock tables keep their own weight.
    assert params["stock_big"].shape == (500_000, 16)


def test_planner_counts_the_optimizer_apply_optimizer_in_backward_marked():
    """A KV table whose stock weight ``apply_optimizer_in_backward`` marked with Adam
    is planned with Adam's state (two values per column), as it will be sharded."""
    sharder = _sharders()[0]
    ebc = EmbeddingBagCollection(_ebc_configs(), device=META)
    adam = {"lr": 0.01, "betas": (0.8, 0.95), "eps": 1e-6}
    apply_optimizer_in_backward(torch.optim.Adam, [ebc.embedding_bags["kv"].weight], adam)
    params = sharder.shardable_parameters(ebc)

    def planned(name):
        return params[name].numel() * params[name].element_size()

    # TorchRec's merge: the weight's kwargs over the sharder's (its lr the learning rate).
    adam_optim = FusedOptimConfig.from_fused_params(
        {"optimizer": EmbOptimType.ADAM, "learning_rate": 0.01, "betas": (0.8, 0.95), "eps": 1e-6}
    )
    adagrad_optim = FusedOptimConfig.from_fused_params(ADAGRAD)
    options = EBC_OPTIONS["kv"]
    assert 0 <= planned("kv") - kv_table_bytes(options, 16, adam_optim) < 4 * 16
    assert kv_table_bytes(options, 16, adam_optim) > kv_table_bytes(options, 16, adagrad_optim)
    # The unmarked table keeps the sharder's optimizer.
    assert 0 <= planned("kv_mean") - kv_table_bytes(EBC_OPTIONS["kv_mean"], 8, adagrad_optim) < 32


@pytest.mark.parametrize(
    "options",
    [
        KVTableOptions(capacity=1000),
        KVTableOptions(memory_budget_bytes=123_457),
        KVTableOptions(capacity=999, admission_threshold=2),
        KVTableOptions(capacity=999, admission_threshold=2, admission_counter_capacity=5000),
    ],
)
@pytest.mark.parametrize(
    "optimizer", [EmbOptimType.EXACT_SGD, EmbOptimType.ADAM, EmbOptimType.EXACT_ROWWISE_ADAGRAD]
)
def test_kv_table_bytes_is_the_tables_memory(options, optimizer):
    optim = FusedOptimConfig.from_fused_params({"optimizer": optimizer})
    table = KVTable("t", 12, options, optim)
    assert kv_table_bytes(options, 12, optim) == table.memory_bytes()
    proxy = storage_proxy(options, 12, optim)
    assert proxy.shape[1] == 12 and proxy.dtype == torch.float32


def test_planner_refuses_kv_tables_larger_than_the_hosts():
    sharder = KVEmbeddingBagCollectionSharder({"kv": KVTableOptions(capacity=2**32)})
    ebc = EmbeddingBagCollection(_ebc_configs()[:1], device=META)
    with pytest.raises(PlannerError):
        _planner().plan(ebc, [sharder])


def test_perf_estimator_knows_the_kv_kernel():
    known = EmbeddingPerfEstimatorConfig.kernel_device_bandwidths
    assert ("cpu", KV_COMPUTE_KERNEL) in known and ("cuda", KV_COMPUTE_KERNEL) in known


def test_sharding_types_and_kernels_are_per_table():
    sharder = _sharders()[0]
    ebc = EmbeddingBagCollection(_ebc_configs(), device=META)
    answers = {}
    for name, _ in sharder.shardable_parameters(ebc).items():
        types = sharder.sharding_types("cpu")
        answers[name] = (types, {t: sharder.compute_kernels(t, "cpu") for t in types})
    kv_types = [RW, TW, CW, TWRW]
    assert answers["kv"] == (kv_types, {t: [KV_COMPUTE_KERNEL] for t in kv_types})
    stock_types, stock_kernels = answers["stock_small"]
    assert RW not in stock_types  # stock CPU sharding has no row-wise
    assert all(KV_COMPUTE_KERNEL not in k for k in stock_kernels.values())
    # Outside the planner's loop: the union.
    assert RW in sharder.sharding_types("cpu")
    assert KV_COMPUTE_KERNEL in sharder.compute_kernels(TW, "cpu")


def test_capacity_is_per_table():
    options = KVTableOptions(
        capacity=1000,
        memory_budget_bytes=None,
        admission_threshold=2,
        admission_counter_capacity=301,
    )
    part = shard_options(options, 4)
    assert (part.capacity, part.admission_counter_capacity) == (250, 76)
    budget = shard_options(KVTableOptions(memory_budget_bytes=10_001), 2)
    assert budget.memory_budget_bytes == 5001
    assert shard_options(options, 1) is options
    tiers = KVTableOptions(
        capacity=100,
        ssd=SSDOptions(path="/tmp/unused", capacity=1001),
        host_tier=HostTierOptions(capacity=501),
    )
    part = shard_options(tiers, 2)
    assert (part.ssd.capacity, part.host_tier.capacity) == (501, 251)
    assert part.ssd.path == tiers.ssd.path
    host_budget = shard_options(
        KVTableOptions(capacity=9, host_tier=HostTierOptions(memory_budget_bytes=999)), 3
    )
    assert host_budget.host_tier.memory_budget_bytes == 333
    unbounded = shard_options(KVTableOptions(capacity=9, ssd=SSDOptions(path="/tmp/unused")), 3)
    assert unbounded.ssd.capacity is None


# ------------------------------------------- sharded module, fake process group


def _plan_for(module, sharder, world_size, constraints=None):
    plan = _planner(world_size, constraints).plan(nn.Sequential(module), [sharder])
    return plan.plan["0"]


def test_sharded_module_over_three_ranks(fake_world):
    options = {name: KVTableOptions(capacity=3000, total_num_buckets=96) for name in EBC_OPTIONS}
    sharder = KVEmbeddingBagCollectionSharder(options, fused_params=ADAGRAD)
    ebc = EmbeddingBagCollection(_ebc_configs(), device=META)
    constraints = {
        "kv": ParameterConstraints(sharding_types=[RW]),
        "kv_mean": ParameterConstraints(sharding_types=[RW]),
    }
    plan = _plan_for(ebc, sharder, 3, constraints)
    sharded = sharder.shard(ebc, plan, fake_world, torch.device("cpu"))
    assert isinstance(sharded, ShardedKVEmbeddingBagCollection)
    tables = sharded.kv_tables()
    assert set(tables) == {"kv", "kv_mean"}
    assert tables["kv"].capacity == 1008  # ceil(3000 / 3) = 1000, in whole 16-slot buckets
    assert set(sharded.metrics()) == {"kv", "kv_mean"}
    groups = sharded.fused_optimizer.param_groups
    assert groups[0]["lr"] == pytest.approx(0.05)  # KV groups come first
    assert "embedding_bags.kv.weight" in sharded.fused_optimizer.params
    state = sharded.fused_optimizer.state_dict()["state"]
    by_id = state["embedding_bags.kv.weight"]["by_id"]  # optimizer state by id, not by slot
    assert by_id["momentum1"].shape == by_id["weight_id"].shape == (0,)
    # Row-wise MEAN is pooled from per-id weights: the stock divisor leaves it alone.
    assert "g" not in sharded._pooling_type_to_rs_features.get("MEAN", [])


def test_row_wise_needs_buckets_divisible_by_world_size(fake_world):
    options = KVTableOptions(capacity=64, total_num_buckets=1024)
    sharder = KVEmbeddingBagCollectionSharder({"kv": options})
    ebc = EmbeddingBagCollection(_ebc_configs()[:1], device=META)
    plan = _plan_for(ebc, sharder, 3, {"kv": ParameterConstraints(sharding_types=[RW])})
    with pytest.raises(ValueError, match="table 'kv'.*multiple of 3, got 1024"):
        sharder.shard(ebc, plan, fake_world, torch.device("cpu"))


def test_kv_collection_with_max_ids_shards(fake_world):
    module = KVEmbeddingBagCollection(
        _huge_configs(), KVTableOptions(capacity=900, total_num_buckets=96), fused_params=ADAGRAD
    )
    sharder = KVEmbeddingBagCollectionSharder(module_type=KVEmbeddingBagCollection)
    plan = _plan_for(module, sharder, 3, {"huge_a": ParameterConstraints(sharding_types=[RW])})
    sharded = sharder.shard(module, plan, fake_world, torch.device("cpu"))
    table = sharded.kv_tables()["huge_a"]
    assert table.optim == module.table("huge_a").optim
    assert table.capacity == 304  # ceil(900 / 3), rounded up to whole buckets


# --------------------------------------------------------------- bad configs
def test_bad_sharder_arguments():
    with pytest.raises(TypeError, match="dict of KVTableOptions"):
        KVEmbeddingBagCollectionSharder(KVTableOptions(capacity=8))
    with pytest.raises(TypeError, match="table 'kv': expected KVTableOptions"):
        KVEmbeddingBagCollectionSharder({"kv": {"capacity": 8}})
    with pytest.raises(ValueError, match="names no table"):
        KVEmbeddingBagCollectionSharder({})
    with pytest.raises(ValueError, match="optimizer"):
        KVEmbeddingBagCollectionSharder(
            {"kv": KVTableOptions(capacity=8)}, fused_params={"optimizer": EmbOptimType.LAMB}
        )
    with pytest.raises(TypeError, match="module_type"):
        KVEmbeddingBagCollectionSharder({"kv": KVTableOptions(capacity=8)}, module_type=nn.Linear)


def _sharding(kernel, sharding_type=RW):
    return ParameterSharding(sharding_type=sharding_type, compute_kernel=kernel, ranks=[0, 1])


@pytest.mark.parametrize(
    "plan, message",
    [
        (
            {"kv": _sharding("fused"), "stock_small": _sharding("fused", TW)},
            "table 'kv' has KVTableOptions but the plan gives it compute kernel 'fused'",
        ),
        (
            {"kv": _sharding(KV_COMPUTE_KERNEL, DP), "stock_small": _sharding("fused", TW)},
            "table 'kv': KV tables shard row_wise or table_wise",
        ),
        (
            {"kv": _sharding(KV_COMPUTE_KERNEL), "stock_small": _sharding(KV_COMPUTE_KERNEL, TW)},
            "table 'stock_small'.*has no KVTableOptions",
        ),
        ({"kv": _sharding(KV_COMPUTE_KERNEL)}, "table 'stock_small': the sharding plan has no"),
    ],
)
def test_shard_refuses_plans_that_do_not_fit(plan, message):
    sharder = KVEmbeddingBagCollectionSharder({"kv": KVTableOptions(capacity=8)})
    ebc = EmbeddingBagCollection([_ebc_configs()[0], _ebc_configs()[2]], device=META)
    env = ShardingEnv(world_size=2, rank=0, pg=None)
    with pytest.raises(ValueError, match=message):
        sharder.shard(ebc, plan, env)


def test_kv_collection_that_holds_rows_or_disagrees_is_refused():
    module = KVEmbeddingBagCollection(
        _huge_configs(), KVTableOptions(capacity=64), fused_params=ADAGRAD
    )
    env = ShardingEnv(world_size=2, rank=0, pg=None)
    plan = {name: _sharding(KV_COMPUTE_KERNEL) for name in ("huge_a", "huge_b")}
    other = KVEmbeddingBagCollectionSharder(
        {"huge_a": KVTableOptions(capacity=128)}, module_type=KVEmbeddingBagCollection
    )
    with pytest.raises(ValueError, match="table 'huge_a': the sharder's KVTableOptions differ"):
        other.shard(module, plan, env)
    sgd = KVEmbeddingBagCollectionSharder(
        fused_params={"optimizer": EmbOptimType.EXACT_SGD}, module_type=KVEmbeddingBagCollection
    )
    with pytest.raises(ValueError, match="table 'huge_a': the sharder's fused_params"):
        sgd.shard(module, plan, env)
    module(
        KeyedJaggedTensor.from_lengths_sync(
            keys=["ha", "hb1", "hb2"],
            values=torch.tensor([1, 2, 3]),
            lengths=torch.tensor([1, 1, 1]),
        )
    )
    sharder = KVEmbeddingBagCollectionSharder(module_type=KVEmbeddingBagCollection)
    with pytest.raises(ValueError, match="already hold rows"):
        sharder.shard(module, plan, env)
