"""Migration between stock TorchRec collections (``EmbeddingBagCollection``,
``EmbeddingCollection``) and KV tables."""

import pytest
import torch
import torch.distributed.checkpoint as dcp
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.modules.embedding_configs import EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb import KVEmbeddingBagCollection, KVEmbeddingCollection, KVTableOptions
from torchrec_kvemb.checkpoint import CheckpointError
from torchrec_kvemb.checkpoint.migrate import export_dense, load_dense_into_kv

ROWS = {"user": 57, "item": 23}
DIMS = {"user": 8, "item": 4}
ADAGRAD = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1}


def configs(user_dim: int = 8) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name="user", embedding_dim=user_dim, num_embeddings=ROWS["user"], feature_names=["u"]
        ),
        EmbeddingBagConfig(
            name="item",
            embedding_dim=4,
            num_embeddings=ROWS["item"],
            feature_names=["i"],
            pooling=PoolingType.MEAN,
        ),
    ]


def stock() -> EmbeddingBagCollection:
    torch.manual_seed(0)
    return EmbeddingBagCollection(configs())


def kv(capacity: int = 128, **kwargs) -> KVEmbeddingBagCollection:
    options = KVTableOptions(capacity=capacity, total_num_buckets=16, seed=4)
    return KVEmbeddingBagCollection(configs(**kwargs), options, fused_params=ADAGRAD)


def batch(seed: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    u = torch.randint(0, ROWS["user"], (40,), generator=g)
    i = torch.randint(0, ROWS["item"], (20,), generator=g)
    return KeyedJaggedTensor.from_lengths_sync(
        keys=["u", "i"],
        values=torch.cat([u, i]),
        lengths=torch.tensor([10, 10, 15, 5, 0, 7, 7, 6]),
    )


def assert_rows_equal(module: KVEmbeddingBagCollection, ebc: EmbeddingBagCollection) -> None:
    for name, n in ROWS.items():
        rows, found = module.table(name).find(torch.arange(n))
        assert bool(found.all())
        assert torch.equal(rows, ebc.embedding_bags[name].weight.detach())
        assert module.table(name).size == n
        assert int(module.table(name).state.abs().sum()) == 0  # optimizer state starts at 0


def test_stock_state_dict_into_kv():
    ebc = stock()
    module = kv()
    stored = load_dense_into_kv(module, ebc.state_dict())
    assert stored == ROWS
    assert_rows_equal(module, ebc)
    module.eval()
    want = ebc(batch(1)).values()
    got = module(batch(1)).values()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_stock_dcp_checkpoint_into_kv(tmp_path):
    ebc = stock()
    dcp.save({"model": {"sparse": ebc.state_dict()}}, checkpoint_id=str(tmp_path), no_dist=True)
    module = kv()
    load_dense_into_kv(module, tmp_path)
    assert_rows_equal(module, ebc)


def test_renamed_tables_and_bad_input():
    ebc = stock()
    module = kv()
    state = {"ebc.embedding_bags.other.weight": ebc.embedding_bags["item"].weight}
    assert load_dense_into_kv(module, state, tables={"item": "other"}) == {"item": ROWS["item"]}
    with pytest.raises(CheckpointError, match="'user'"):
        load_dense_into_kv(module, {"embedding_bags.item.weight": torch.zeros(3, 4)})
    with pytest.raises(CheckpointError, match="'user'.*dim 4"):
        load_dense_into_kv(kv(user_dim=4), ebc.state_dict())
    small = kv(capacity=32)
    with pytest.raises(CheckpointError, match="'user'.*capacity"):
        load_dense_into_kv(small, ebc.state_dict())
    assert small.table("item").size == 0  # nothing changed


def test_kv_back_to_stock():
    ebc = stock()
    module = kv()
    load_dense_into_kv(module, ebc.state_dict())
    for step in range(3):  # train the KV tables on ids below the stock row counts
        module(batch(step)).values().sum().backward()
    for name, n in ROWS.items():
        weight = export_dense(module, name, n)
        assert weight.shape == (n, DIMS[name])
        rows, _ = module.table(name).find(torch.arange(n))
        assert torch.equal(weight, rows)
        ebc.embedding_bags[name].weight.data.copy_(weight)
    module.eval()
    torch.testing.assert_close(module(batch(9)).values(), ebc(batch(9)).values(), rtol=0, atol=1e-6)


def test_export_dense_of_missing_ids():
    module = kv()
    module(batch(0)).values().sum().backward()
    table = module.table("user")
    n = 70  # more than any stored id
    ids = torch.arange(n)
    rows, found = table.find(ids)
    assert not bool(found.all())
    weight = export_dense(module, "user", n)
    assert torch.equal(weight[found], rows[found])
    assert torch.equal(weight[~found], table.initial_rows(ids[~found]))
    zeros = export_dense(module, "user", n, missing_as_zeros=True)
    assert torch.equal(zeros[found], rows[found])
    assert int(zeros[~found].abs().sum()) == 0
    with pytest.raises(CheckpointError, match="no KV table named 'nope'"):
        export_dense(module, "nope", 3)


# ------------------------------------------------------- sequence collections
SEQUENCE_ROWS = {"user": 57, "item": 23}


def sequence_configs() -> list[EmbeddingConfig]:
    return [
        EmbeddingConfig(name=name, embedding_dim=6, num_embeddings=n, feature_names=[name[0]])
        for name, n in SEQUENCE_ROWS.items()
    ]


def kv_sequences() -> KVEmbeddingCollection:
    options = KVTableOptions(capacity=128, total_num_buckets=16, seed=4)
    return KVEmbeddingCollection(sequence_configs(), options, fused_params=ADAGRAD)


def stock_sequences() -> EmbeddingCollection:
    torch.manual_seed(1)
    return EmbeddingCollection(sequence_configs())


def assert_sequence_rows_equal(module: KVEmbeddingCollection, ec: EmbeddingCollection) -> None:
    for name, n in SEQUENCE_ROWS.items():
        rows, found = module.table(name).find(torch.arange(n))
        assert bool(found.all()), name
        assert torch.equal(rows, ec.embeddings[name].weight.detach()), name
        assert module.table(name).size == n
        assert int(module.table(name).state.abs().sum()) == 0


def test_stock_sequence_state_dict_into_kv_sequences():
    ec = stock_sequences()
    module = kv_sequences()
    assert load_dense_into_kv(module, ec.state_dict()) == SEQUENCE_ROWS
    assert_sequence_rows_equal(module, ec)
    module.eval()
    kjt = batch(2)
    want, got = ec(kjt), module(kjt)
    for feature in ("u", "i"):
        assert torch.equal(got[feature].values(), want[feature].values()), feature


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_stock_sequence_dcp_checkpoint_into_kv_sequences(tmp_path):
    ec = stock_sequences()
    dcp.save({"model": {"ec": ec.state_dict()}}, checkpoint_id=str(tmp_path), no_dist=True)
    module = kv_sequences()
    load_dense_into_kv(module, tmp_path)
    assert_sequence_rows_equal(module, ec)


def test_either_stock_layout_fits_either_kv_collection():
    """Rows are rows: a stock EmbeddingCollection's fill KV bags, and back."""
    ec = EmbeddingCollection(
        [EmbeddingConfig(name="user", embedding_dim=8, num_embeddings=57, feature_names=["u"])]
    )
    bags = kv()
    load_dense_into_kv(bags, ec.state_dict(), tables={"user": "user"})
    rows, _ = bags.table("user").find(torch.arange(57))
    assert torch.equal(rows, ec.embeddings["user"].weight.detach())
    ebc = EmbeddingBagCollection(
        [EmbeddingBagConfig(name=n, embedding_dim=6, num_embeddings=r, feature_names=[n[0]])
         for n, r in SEQUENCE_ROWS.items()]
    )  # fmt: skip
    sequences = kv_sequences()
    load_dense_into_kv(sequences, ebc.state_dict())
    rows, _ = sequences.table("item").find(torch.arange(SEQUENCE_ROWS["item"]))
    assert torch.equal(rows, ebc.embedding_bags["item"].weight.detach())


@pytest.mark.parametrize(
    "state,message",
    [
        (
            {"tables.user.weight": torch.zeros(3, 6), "tables.item.weight": torch.zeros(3, 6)},
            r"table 'user': the state_dict has no entry ending in 'embedding_bags.user.weight' "
            r"or 'embeddings.user.weight'",
        ),
        (
            {
                "ebc.embedding_bags.user.weight": torch.zeros(3, 6),
                "ec.embeddings.user.weight": torch.zeros(3, 6),
                "ec.embeddings.item.weight": torch.zeros(3, 6),
            },
            r"table 'user': the state_dict has 2 entries ending in",
        ),
    ],
    ids=["neither-layout", "both-layouts"],
)
def test_a_state_dict_without_one_stock_weight_is_refused(state, message):
    module = kv_sequences()
    with pytest.raises(CheckpointError, match=message):
        load_dense_into_kv(module, state)
    assert all(t.size == 0 for t in module.kv_tables().values())  # nothing changed
