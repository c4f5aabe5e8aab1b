"""KVStorageEstimator: the stock planner's storage per shard, with KV tables' host
tier and SSD tier in ddr / ssd, checked against ``ssd.storage_estimate`` of each
shard's options and against the stock estimator on the same plan."""

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.planner.enumerators import EmbeddingEnumerator
from torchrec.distributed.planner.shard_estimators import (
    EmbeddingPerfEstimator,
    EmbeddingStorageEstimator,
)
from torchrec.distributed.planner.types import PlannerError

from torchrec_kvemb import (
    FusedOptimConfig,
    HostTierOptions,
    KVEmbeddingBagCollectionSharder,
    KVTableOptions,
    SSDOptions,
)
from torchrec_kvemb.sharding.kv_embedding import shard_options
from torchrec_kvemb.sharding.storage_estimator import KVStorageEstimator
from torchrec_kvemb.ssd import storage_estimate

ADAGRAD = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
DIM = 24
OPTIONS = {
    "host": KVTableOptions(capacity=4_001, host_tier=HostTierOptions(capacity=40_003)),
    "disk": KVTableOptions(
        capacity=3_001, ssd=SSDOptions(path="/tmp/kvemb-unused", capacity=90_001)
    ),
    "plain": KVTableOptions(capacity=5_003),
}


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        configs = [
            EmbeddingBagConfig(name=n, embedding_dim=DIM, num_embeddings=2**40, feature_names=[n])
            for n in OPTIONS
        ] + [
            EmbeddingBagConfig(
                name="stock", embedding_dim=8, num_embeddings=97, feature_names=["s"]
            )
        ]
        self.ebc = EmbeddingBagCollection(configs, device=torch.device("meta"))


def _options(sharder, topology, estimator_cls, constraints, **kwargs):
    """The sharding options the enumerator proposes, with storage from ``estimator_cls``."""
    enumerator = EmbeddingEnumerator(topology=topology, batch_size=64, constraints=constraints)
    options = enumerator.enumerate(Model(), [sharder])
    if estimator_cls is KVStorageEstimator:
        estimator = KVStorageEstimator(topology, [sharder], constraints, **kwargs)
    else:
        estimator = estimator_cls(topology, constraints)
    # The enumerator's sharders as its TorchRec version's estimators take them (a
    # SharderDataMap since TorchRec 1.7, the sharders by name before).
    sharders = getattr(enumerator, "_sharder_data_map", None) or enumerator._sharder_map
    estimator.estimate(options, sharders)
    return {(o.name, o.sharding_type): o for o in options if o.name in OPTIONS}


@pytest.mark.parametrize("compute_device", ["cuda", "cpu"])
@pytest.mark.parametrize("sharding", ["row_wise", "table_wise", "table_row_wise"])
def test_each_shard_gets_its_lower_tiers_in_ddr_and_ssd(compute_device, sharding):
    """The planner's topology for either compute device (a plan, not a GPU run)."""
    topology = Topology(world_size=3, compute_device=compute_device)
    constraints = {n: ParameterConstraints(sharding_types=[sharding]) for n in OPTIONS}
    sharder = KVEmbeddingBagCollectionSharder(OPTIONS, fused_params=ADAGRAD)
    stock = _options(sharder, topology, EmbeddingStorageEstimator, constraints)
    ours = _options(sharder, topology, KVStorageEstimator, constraints)
    optim = FusedOptimConfig.from_fused_params(ADAGRAD)
    # table-row-wise: one node of the 3 ranks (the topology's local world size)
    num_shards = 1 if sharding == "table_wise" else 3
    for name, options in OPTIONS.items():
        key = (name, sharding)
        expected = storage_estimate(shard_options(options, num_shards), DIM, optim)
        assert len(ours[key].shards) == num_shards
        for mine, theirs in zip(ours[key].shards, stock[key].shards, strict=True):
            assert mine.storage.hbm == theirs.storage.hbm
            assert mine.storage.ddr - theirs.storage.ddr == expected["host_bytes"], name
            assert mine.storage.ssd - theirs.storage.ssd == expected["disk_bytes"], name
        if name == "plain":
            assert expected["host_bytes"] == expected["disk_bytes"] == 0
        else:
            assert expected["host_bytes"] > 0


def test_the_planner_refuses_host_tiers_the_hosts_cannot_hold():
    sharder = KVEmbeddingBagCollectionSharder(OPTIONS, fused_params=ADAGRAD)
    constraints = {n: ParameterConstraints(sharding_types=["row_wise"]) for n in OPTIONS}

    def plan(ddr_cap, kv=True):
        topology = Topology(world_size=2, compute_device="cuda", ddr_cap=ddr_cap)
        estimators = [
            EmbeddingPerfEstimator(topology, constraints),
            KVStorageEstimator(topology, [sharder], constraints)
            if kv
            else EmbeddingStorageEstimator(topology, constraints),
        ]
        enumerator = EmbeddingEnumerator(
            topology=topology, batch_size=64, constraints=constraints, estimator=estimators
        )
        planner = EmbeddingShardingPlanner(
            topology=topology, batch_size=64, constraints=constraints, enumerator=enumerator
        )
        return planner.plan(Model(), [sharder])

    optim = FusedOptimConfig.from_fused_params(ADAGRAD)
    host = storage_estimate(shard_options(OPTIONS["host"], 2), DIM, optim)["host_bytes"]
    assert plan(ddr_cap=64 * 2**30).plan  # room: planned
    assert plan(ddr_cap=host // 2, kv=False).plan  # the stock estimator counts no host bytes
    with pytest.raises(PlannerError):
        plan(ddr_cap=host // 2)


def test_unbounded_lower_tiers_need_their_expected_rows():
    options = {"host": KVTableOptions(capacity=101, host_tier=HostTierOptions())}
    sharder = KVEmbeddingBagCollectionSharder(options, fused_params=ADAGRAD)
    topology = Topology(world_size=2, compute_device="cpu")
    constraints = {"host": ParameterConstraints(sharding_types=["row_wise"])}

    class One(torch.nn.Module):
        def __init__(self):
            super().__init__()
            config = EmbeddingBagConfig(
                name="host", embedding_dim=DIM, num_embeddings=2**40, feature_names=["h"]
            )
            self.ebc = EmbeddingBagCollection([config], device=torch.device("meta"))

    enumerator = EmbeddingEnumerator(topology=topology, batch_size=64, constraints=constraints)
    sharding_options = enumerator.enumerate(One(), [sharder])
    with pytest.raises(ValueError, match="'host'.*lower_tier_rows"):
        KVStorageEstimator(topology, [sharder], constraints).estimate(
            sharding_options, enumerator._sharder_data_map
        )
    KVStorageEstimator(topology, [sharder], constraints, lower_tier_rows={"host": 5001}).estimate(
        sharding_options, enumerator._sharder_data_map
    )
    optim = FusedOptimConfig.from_fused_params(ADAGRAD)
    expected = storage_estimate(shard_options(options["host"], 2), DIM, optim, host_rows=2501)[
        "host_bytes"
    ]
    assert expected > 0
    assert all(s.storage.ddr >= expected for s in sharding_options[0].shards)


def test_a_sharder_list_without_kv_sharders_is_refused():
    with pytest.raises(ValueError, match="no KV sharder"):
        KVStorageEstimator(Topology(world_size=1, compute_device="cpu"), sharders=[])
