"""Inference tracing: the unsharded ``KVEmbeddingBagCollection`` and
``KVEmbeddingCollection`` trace with ``torch.fx.symbolic_trace`` and TorchRec's
``torchrec.fx.symbolic_trace``, and script with ``torch.jit.script`` (directly, and
after tracing, as TorchRec's inference flow does), as the stock
``EmbeddingBagCollection`` and ``EmbeddingCollection`` do in this torch version. The
graphs run and give the eager module's outputs; they share its tables."""

import pytest
import torch
import torchrec.fx
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb import KVEmbeddingBagCollection, KVEmbeddingCollection, KVTableOptions

CONFIGS = [
    EmbeddingBagConfig(name="a", embedding_dim=5, num_embeddings=2**40, feature_names=["x", "y"]),
    EmbeddingBagConfig(
        name="b", embedding_dim=3, num_embeddings=2**40, feature_names=["x"],
        pooling=PoolingType.MEAN,
    ),
]  # fmt: skip
KEYS = ["y", "x"]


def fx_trace(module):
    return torch.fx.symbolic_trace(module)


def torchrec_trace(module):
    return torchrec.fx.symbolic_trace(module)


def script(module):
    return torch.jit.script(module)


def trace_then_script(module):
    return torch.jit.script(torchrec.fx.symbolic_trace(module))


WAYS = [
    pytest.param(fx_trace, id="torch.fx"),
    pytest.param(torchrec_trace, id="torchrec.fx"),
    pytest.param(script, id="jit.script"),
    pytest.param(trace_then_script, id="torchrec.fx+jit.script"),
]


def batch(seed: int, weighted: bool) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 4, (len(KEYS) * 7,), generator=g)
    values = torch.randint(0, 50, (int(lengths.sum()),), generator=g) * 2**30
    weights = torch.rand(values.numel(), generator=g) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(
        keys=KEYS, values=values, lengths=lengths, weights=weights
    )


def trained(weighted: bool) -> KVEmbeddingBagCollection:
    ebc = KVEmbeddingBagCollection(
        CONFIGS, KVTableOptions(capacity=64, seed=3), is_weighted=weighted
    )
    for seed in range(3):  # store rows for about half the ids
        ebc(batch(seed, weighted)).values().sum().backward()
    return ebc.eval()


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_traced_module_gives_the_eager_outputs(way, weighted):
    ebc = trained(weighted)
    graph = way(ebc)
    sizes = {name: t.size for name, t in ebc.kv_tables().items()}
    for seed in range(3, 6):  # stored ids and ids without a row
        kjt = batch(seed, weighted)
        want, got = ebc(kjt), graph(kjt)
        assert got.keys() == want.keys() == ["x@a", "y", "x@b"]
        assert got.length_per_key() == want.length_per_key()
        assert torch.equal(got.values(), want.values()), f"batch {seed}"
    assert {name: t.size for name, t in ebc.kv_tables().items()} == sizes, "eval stored ids"


@pytest.mark.parametrize("way", WAYS)
def test_the_graph_shares_the_tables(way):
    ebc = trained(False)
    graph = way(ebc)
    ids = torch.tensor([7 * 2**30])
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=KEYS, values=torch.cat([ids, ids]), lengths=torch.tensor([1] + [0] * 6 + [1] + [0] * 6)
    )
    row = torch.arange(5, dtype=torch.float32)
    ebc.table("a").insert(ids, row.unsqueeze(0))
    assert torch.equal(graph(kjt)["x@a"][0], row)
    assert torch.equal(graph(kjt)["y"][0], row)


@pytest.mark.parametrize("way", WAYS)
def test_the_stock_module_takes_the_same_ways(way):
    """The oracle of this file: what the stock module supports here."""
    stock = EmbeddingBagCollection(
        [EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=10, feature_names=["x"])]
    ).eval()
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["x"], values=torch.tensor([1, 2, 9]), lengths=torch.tensor([2, 1])
    )
    assert torch.equal(way(stock)(kjt).values(), stock(kjt).values())


def test_a_scripted_module_cannot_be_saved_for_another_runtime(tmp_path):
    """Its KV lookup stays a Python call (torch.jit.ignore): it runs where the
    collection lives, and torch.jit.save refuses it."""
    scripted = torch.jit.script(trained(False))
    with pytest.raises(Exception, match="(?i)python"):
        torch.jit.save(scripted, str(tmp_path / "m.pt"))


# ------------------------------------------------------------------ sequences
SEQUENCE_CONFIGS = [
    EmbeddingConfig(name="a", embedding_dim=5, num_embeddings=2**40, feature_names=["x", "y"]),
    EmbeddingConfig(name="b", embedding_dim=5, num_embeddings=2**40, feature_names=["x"]),
]
SEQUENCE_NAMES = ["x@a", "y", "x@b"]


def trained_sequences(need_indices: bool) -> KVEmbeddingCollection:
    ec = KVEmbeddingCollection(
        SEQUENCE_CONFIGS, KVTableOptions(capacity=64, seed=3), need_indices=need_indices
    )
    for seed in range(3):  # store rows for about half the ids
        out = ec(batch(seed, False))
        sum(jt.values().sum() for jt in out.values()).backward()
    return ec.eval()


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("need_indices", [False, True], ids=["rows", "rows-and-indices"])
def test_traced_sequence_collection_gives_the_eager_outputs(way, need_indices):
    ec = trained_sequences(need_indices)
    graph = way(ec)
    sizes = {name: t.size for name, t in ec.kv_tables().items()}
    for seed in range(3, 6):  # stored ids and ids without a row
        kjt = batch(seed, False)
        want, got = ec(kjt), graph(kjt)
        assert list(got) == list(want) == SEQUENCE_NAMES
        for name in SEQUENCE_NAMES:
            assert torch.equal(got[name].values(), want[name].values()), f"{name} batch {seed}"
            assert torch.equal(got[name].lengths(), want[name].lengths()), name
            if need_indices:
                assert torch.equal(got[name].weights(), want[name].weights()), name
            else:
                assert got[name].weights_or_none() is None
    assert {name: t.size for name, t in ec.kv_tables().items()} == sizes, "eval stored ids"


@pytest.mark.parametrize("way", WAYS)
def test_the_sequence_graph_shares_the_tables(way):
    ec = trained_sequences(False)
    graph = way(ec)
    ids = torch.tensor([7 * 2**30, 9 * 2**30])
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=KEYS, values=torch.cat([ids, ids]), lengths=torch.tensor([2] + [0] * 6 + [2] + [0] * 6)
    )
    rows = torch.arange(10, dtype=torch.float32).view(2, 5)
    ec.table("b").insert(ids, rows)
    assert torch.equal(graph(kjt)["x@b"].values(), rows)
    ec.table("a").insert(ids, -rows)
    assert torch.equal(graph(kjt)["x@a"].values(), -rows)
    assert torch.equal(graph(kjt)["y"].values(), -rows)


@pytest.mark.parametrize("way", WAYS)
def test_the_stock_sequence_module_takes_the_same_ways(way):
    """The oracle of the sequence tests: what the stock module supports here."""
    stock = EmbeddingCollection(
        [
            EmbeddingConfig(name="a", embedding_dim=4, num_embeddings=10, feature_names=["x"]),
            EmbeddingConfig(name="b", embedding_dim=4, num_embeddings=10, feature_names=["x"]),
        ]
    ).eval()
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["x"], values=torch.tensor([1, 2, 9]), lengths=torch.tensor([2, 1])
    )
    want, got = stock(kjt), way(stock)(kjt)
    assert list(got) == list(want) == ["x@a", "x@b"]
    assert all(torch.equal(got[name].values(), want[name].values()) for name in want)
