"""An unsharded KV collection inside ``DistributedDataParallel`` (directly, or as DMP
wraps a module no sharder shards) is refused at its first forward with an error
that says to shard it: DDP would leave every process training rows of its own."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor
from torchrec.distributed.model_parallel import DistributedModelParallel

from torchrec_kvemb import KVEmbeddingBagCollection, KVEmbeddingCollection, KVTableOptions


@pytest.fixture
def one_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


class Bags(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        config = EmbeddingBagConfig(
            name="t", embedding_dim=5, num_embeddings=1000, feature_names=["f"]
        )
        self.ebc = KVEmbeddingBagCollection([config], {"t": KVTableOptions(capacity=97)})
        self.over = nn.Linear(5, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.over(self.ebc(kjt)["f"])


class Sequences(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        config = EmbeddingConfig(
            name="s", embedding_dim=3, num_embeddings=1000, feature_names=["f"]
        )
        self.ec = KVEmbeddingCollection([config], {"s": KVTableOptions(capacity=97)})
        self.over = nn.Linear(3, 1)

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.over(self.ec(kjt)["f"].values())


def _batch() -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(
        keys=["f"], values=torch.tensor([4, 8, 15, 16, 23]), lengths=torch.tensor([2, 0, 3])
    )


@pytest.mark.parametrize(
    "model, kind",
    [(Bags, "KVEmbeddingBagCollection"), (Sequences, "KVEmbeddingCollection")],
    ids=["bags", "sequences"],
)
def test_ddp_is_refused_and_nothing_is_stored(one_process_group, model, kind):
    module = model()
    wrapped = nn.parallel.DistributedDataParallel(module)
    with pytest.raises(
        RuntimeError,
        match=rf"{kind} \(tables .*\) runs inside Distri"
        rf"butedDataParallel.*Shard the collection instead.*{kind}Sharder",
    ):
        wrapped(_batch())
    tables = next(iter(module.children())).kv_tables()
    assert [t.size for t in tables.values()] == [0]  # the refused forward stored no id


def test_dmp_without_a_kv_sharder_is_refused(one_process_group):
    model = DistributedModelParallel(Bags(), device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match="runs inside DistributedDataParallel"):
        model(_batch())


def test_the_collection_alone_runs_in_a_process_group(one_process_group):
    module = Bags()
    out = module(_batch())
    out.sum().backward()
    assert out.shape == (3, 1)
    assert module.ebc.table("t").size == 5
