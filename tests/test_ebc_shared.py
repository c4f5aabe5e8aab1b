"""Shared features: one feature read by several tables, as TorchRec's
``EmbeddingBagCollection`` allows. Outputs are keyed as the stock module keys
them (``feature@table`` for a shared feature) and, with the stock module's rows
copied in, equal its outputs and its rows after plain SGD steps (the stock
module's gradients from both reads add up in its weight; the KV tables' fused
SGD adds them up per row)."""

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb import KVEmbeddingBagCollection, KVTableOptions

LR = 0.3
BATCH = 5
# "x" feeds tables of two dims (two groups), "y" two tables of one dim (one group).
TABLES = (("a", 5, ("x", "y"), 31), ("b", 3, ("x",), 23), ("c", 5, ("y", "z"), 17))
KEYS = ("z", "x", "y")  # not the tables' order


def configs(pooling: PoolingType) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=name,
            embedding_dim=dim,
            num_embeddings=rows,
            feature_names=list(features),
            pooling=pooling,
        )
        for name, dim, features, rows in TABLES
    ]


def batch(gen: torch.Generator, weighted: bool) -> KeyedJaggedTensor:
    """Ids below every table's rows (all tables of a shared feature hold them)."""
    lengths = torch.randint(0, 4, (len(KEYS) * BATCH,), generator=gen)
    lengths[BATCH + 1] = 0  # an empty bag of the shared "x"
    values = torch.randint(0, 17, (int(lengths.sum()),), generator=gen)
    weights = torch.rand(values.numel(), generator=gen) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(
        keys=list(KEYS), values=values, lengths=lengths, weights=weights
    )


def twins(pooling: PoolingType, weighted: bool):
    torch.manual_seed(0)
    stock = EmbeddingBagCollection(configs(pooling), is_weighted=weighted)
    kv = KVEmbeddingBagCollection(
        configs(pooling),
        KVTableOptions(capacity=64),
        is_weighted=weighted,
        fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR},
    )
    for name, bag in stock.embedding_bags.items():
        kv.table(name).insert(torch.arange(bag.weight.shape[0]), bag.weight.detach().clone())
    return stock, kv


@pytest.mark.parametrize(
    "pooling, weighted",
    [
        pytest.param(PoolingType.SUM, False, id="sum"),
        pytest.param(PoolingType.MEAN, False, id="mean"),
        pytest.param(PoolingType.SUM, True, id="weighted"),
    ],
)
def test_shared_features_match_the_stock_module(pooling, weighted):
    stock, kv = twins(pooling, weighted)
    sgd = torch.optim.SGD(stock.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        kjt = batch(gen, weighted)
        ref, out = stock(kjt), kv(kjt)
        assert out.keys() == ref.keys() == ["x@a", "y@a", "x@b", "y@c", "z"]
        assert out.length_per_key() == ref.length_per_key()
        torch.testing.assert_close(out.values(), ref.values(), msg=f"step {step} outputs")
        grad = torch.randn(ref.values().shape, generator=gen)
        ref.values().backward(grad)
        out.values().backward(grad)
        sgd.step()
        sgd.zero_grad()
    for name, bag in stock.embedding_bags.items():
        rows, found = kv.table(name).find(torch.arange(17))
        assert bool(found.all()), f"table {name!r} lost rows"
        torch.testing.assert_close(rows, bag.weight.detach()[:17], msg=f"table {name!r} rows")


def test_eval_reads_every_reader_of_a_shared_feature():
    stock, kv = twins(PoolingType.SUM, False)
    stock.eval()
    kv.eval()
    kjt = batch(torch.Generator().manual_seed(2), False)
    torch.testing.assert_close(kv(kjt).to_dict(), stock(kjt).to_dict())


def test_a_table_reading_a_feature_twice_is_refused():
    config = EmbeddingBagConfig(
        name="t", embedding_dim=4, num_embeddings=10, feature_names=["f", "f"]
    )
    with pytest.raises(ValueError, match="table 't' reads a feature twice"):
        KVEmbeddingBagCollection([config], KVTableOptions(capacity=16))
