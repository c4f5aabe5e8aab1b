"""2D parallelism (``DMPCollection``'s ``ShardingEnv2D``) is refused by both KV sharders,
naming the KV tables and the design page: its sync would leave KV replicas apart."""

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
    KVEmbeddingBagCollectionSharder,
    KVEmbeddingCollectionSharder,
    KVTableOptions,
)

META = torch.device("meta")


def _env_2d() -> ShardingEnv2D:
    # why no __init__: the refusal comes before any use of the groups it would hold.
    return object.__new__(ShardingEnv2D)


def test_bag_sharder_refuses_2d():
    configs = [
        EmbeddingBagConfig(name="u", embedding_dim=8, num_embeddings=2**40, feature_names=["f"]),
        EmbeddingBagConfig(name="s", embedding_dim=8, num_embeddings=99, feature_names=["g"]),
    ]
    ebc = EmbeddingBagCollection(configs, device=META)
    sharder = KVEmbeddingBagCollectionSharder({"u": KVTableOptions(capacity=101)})
    with pytest.raises(
        NotImplementedError, match=r"KV tables \['u'\]: 2D parallelism.*docs/sharding-design.md"
    ):
        sharder.shard(ebc, {}, _env_2d(), torch.device("cpu"))


def test_sequence_sharder_refuses_2d():
    configs = [
        EmbeddingConfig(name="q", embedding_dim=4, num_embeddings=2**40, feature_names=["f"])
    ]
    ec = EmbeddingCollection(configs, device=META)
    sharder = KVEmbeddingCollectionSharder({"q": KVTableOptions(capacity=101)})
    with pytest.raises(NotImplementedError, match=r"KV tables \['q'\]: 2D parallelism"):
        sharder.shard(ec, {}, _env_2d(), torch.device("cpu"))
