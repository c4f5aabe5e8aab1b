"""2D parallelism (``ShardingEnv2D``) and the KV sharders: refused unless the caller
syncs the KV replicas by id (inside ``kv_replica_sync_enabled()``, which
``KVDMPCollection`` enters), and then only for tables replica sync serves, naming
the tables and what keeps them out. The sync itself: ``test_replica_2d.py``."""

from __future__ import annotations

import pytest
import torch
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
)
from torchrec.distributed.types import ShardingEnv2D

from torchrec_kvemb import (
    EvictionPolicy,
    KVEmbeddingBagCollectionSharder,
    KVEmbeddingCollectionSharder,
    KVTableOptions,
    SSDOptions,
    TTLOptions,
)
from torchrec_kvemb.sharding.replica_sync import (
    check_replicable,
    kv_replica_sync_enabled,
    replica_sync_is_enabled,
)

META = torch.device("meta")


def _env_2d() -> ShardingEnv2D:
    # why no __init__: the refusal comes before any use of the groups it would hold.
    return object.__new__(ShardingEnv2D)


def _ebc() -> EmbeddingBagCollection:
    configs = [
        EmbeddingBagConfig(name="u", embedding_dim=8, num_embeddings=2**40, feature_names=["f"]),
        EmbeddingBagConfig(name="s", embedding_dim=8, num_embeddings=99, feature_names=["g"]),
    ]
    return EmbeddingBagCollection(configs, device=META)


def test_bag_sharder_refuses_2d_without_replica_sync():
    sharder = KVEmbeddingBagCollectionSharder({"u": KVTableOptions(capacity=101)})
    with pytest.raises(
        NotImplementedError,
        match=r"KV tables \['u'\]: 2D parallelism.*KVDMPCollection.*docs/sharding-design.md",
    ):
        sharder.shard(_ebc(), {}, _env_2d(), torch.device("cpu"))


def test_sequence_sharder_refuses_2d_without_replica_sync():
    configs = [
        EmbeddingConfig(name="q", embedding_dim=4, num_embeddings=2**40, feature_names=["f"])
    ]
    ec = EmbeddingCollection(configs, device=META)
    sharder = KVEmbeddingCollectionSharder({"q": KVTableOptions(capacity=101)})
    with pytest.raises(NotImplementedError, match=r"KV tables \['q'\]: 2D parallelism"):
        sharder.shard(ec, {}, _env_2d(), torch.device("cpu"))


def test_replica_sync_scope():
    assert not replica_sync_is_enabled()
    with kv_replica_sync_enabled():
        assert replica_sync_is_enabled()
    assert not replica_sync_is_enabled()


REFUSED = {
    "lfu": (KVTableOptions(capacity=101, eviction=EvictionPolicy.LFU), "eviction LFU"),
    "custom_score": (
        KVTableOptions(capacity=101, eviction=EvictionPolicy.CUSTOM_SCORE),
        "eviction CUSTOM_SCORE",
    ),
    "admission": (KVTableOptions(capacity=101, admission_threshold=3), "admission_threshold=3"),
    "ttl": (KVTableOptions(capacity=101, ttl=TTLOptions(steps=5)), "ttl"),
    "sightings": (KVTableOptions(capacity=101, count_sightings=True), "count_sightings"),
    "growth": (KVTableOptions(capacity=1024, initial_capacity=256), "initial_capacity"),
    "ssd": (KVTableOptions(capacity=101, ssd=SSDOptions("/tmp/x")), "lower tier"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_replica_sync_refuses_what_v1_does_not_serve(case):
    options, reason = REFUSED[case]
    with pytest.raises(NotImplementedError, match=rf"table 'u': .*{reason}"):
        check_replicable({"u": options, "ok": KVTableOptions(capacity=101)})


def test_bag_sharder_under_replica_sync_refuses_lfu():
    options = KVTableOptions(capacity=101, eviction=EvictionPolicy.LFU)
    sharder = KVEmbeddingBagCollectionSharder({"u": options})
    with (
        kv_replica_sync_enabled(),
        pytest.raises(NotImplementedError, match=r"table 'u': eviction LFU"),
    ):
        sharder.shard(_ebc(), {}, _env_2d(), torch.device("cpu"))


def test_replicable_tables_pass():
    check_replicable(
        {
            "lru": KVTableOptions(capacity=101),
            "none": KVTableOptions(capacity=101, eviction=EvictionPolicy.NONE),
        }
    )
