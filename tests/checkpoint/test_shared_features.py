"""A collection whose features feed several tables, sharded by the KV sharder at
world size 1 (row-wise and table-wise), trained, saved with ``checkpoint.save``
and reloaded into the unsharded ``KVEmbeddingBagCollection``: the same rows and
the same outputs, keyed as TorchRec keys them (``feature@table``)."""

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.modules.embedding_configs import PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.checkpoint.one_rank_dmp import shard_on_one_rank
from tests.checkpoint.test_state_dict import ADAGRAD
from torchrec_kvemb import (
    KVEmbeddingBagCollection,
    KVEmbeddingBagCollectionSharder,
    KVTableOptions,
    checkpoint,
)

# "x" feeds tables of two dims, "y" two tables of one dim (one group when sharded).
CONFIGS = [
    EmbeddingBagConfig(name="a", embedding_dim=5, num_embeddings=2**40, feature_names=["x", "y"]),
    EmbeddingBagConfig(
        name="b",
        embedding_dim=3,
        num_embeddings=2**40,
        feature_names=["x"],
        pooling=PoolingType.MEAN,
    ),
    EmbeddingBagConfig(name="c", embedding_dim=5, num_embeddings=2**40, feature_names=["y", "z"]),
]
OPTIONS = {c.name: KVTableOptions(capacity=128, total_num_buckets=24, seed=7) for c in CONFIGS}
NAMES = ["x@a", "y@a", "x@b", "y@c", "z"]


class Model(nn.Module):
    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, features: KeyedJaggedTensor) -> dict[str, torch.Tensor]:
        return self.ebc(features).to_dict()


def batch(step: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 4, (3 * 5,), generator=g)
    values = torch.randint(0, 40, (int(lengths.sum()),), generator=g) * 2**33
    return KeyedJaggedTensor.from_lengths_sync(keys=["y", "z", "x"], values=values, lengths=lengths)


def sharded(sharding: str) -> DistributedModelParallel:
    model = Model(EmbeddingBagCollection(CONFIGS, device=torch.device("meta")))
    sharders = [KVEmbeddingBagCollectionSharder(OPTIONS, ADAGRAD)]
    return shard_on_one_rank(model, sharders, [c.name for c in CONFIGS], sharding)


@pytest.mark.parametrize("sharding", ["row_wise", "table_wise"])
def test_sharded_model_reloads_unsharded(sharding, one_rank, tmp_path):
    model = sharded(sharding)
    for step in range(3):
        out = model(batch(step))
        sum(
            (v * torch.linspace(-1, 1, v.numel()).view_as(v)).sum() for v in out.values()
        ).backward()
    # Sharded, the KeyedTensor's key order is the shardings' (as for stock tables).
    assert sorted(model(batch(0))) == sorted(NAMES)
    checkpoint.save(model, tmp_path / "ckpt")
    unsharded = Model(KVEmbeddingBagCollection(CONFIGS, OPTIONS, fused_params=ADAGRAD))
    checkpoint.load(unsharded, tmp_path / "ckpt")
    for table in CONFIGS:
        stored = unsharded.ebc.table(table.name).size
        assert stored > 0, f"table {table.name!r} reloaded empty"
    model.eval()
    unsharded.eval()
    for step in range(3, 5):
        kt = unsharded.ebc(batch(step))
        assert kt.keys() == NAMES
        torch.testing.assert_close(kt.to_dict(), model(batch(step)), msg=f"step {step}")
