"""``KVEmbeddingCollection`` against TorchRec's ``EmbeddingCollection`` and FBGEMM's
sequence TBE, on the same rows and batches.

The KV tables start with the stock tables' rows (ids below ``num_embeddings``);
every step compares the outputs (per feature: rows and lengths) and, after the
update, every row: with SGD the stock module trained by ``torch.optim.SGD``, with
row-wise Adagrad FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` in sequence
mode (``PoolingMode.NONE``) over the same ids. A feature read by two tables gives the
stock module's ``feature@table`` outputs, each from its own table.
"""

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb import KVEmbeddingCollection, KVTableOptions

ROWS = {"item_rows": 41, "user_rows": 23}
FEATURES = {"item_rows": ["history", "candidate"], "user_rows": ["user"]}
DIM = 12  # FBGEMM needs a multiple of 4
BATCH = 5
LR = 0.3


def _configs() -> list[EmbeddingConfig]:
    return [
        EmbeddingConfig(
            name=name, embedding_dim=DIM, num_embeddings=ROWS[name], feature_names=FEATURES[name]
        )
        for name in ROWS
    ]


def _kv(
    optimizer: EmbOptimType, stock_rows: dict[str, torch.Tensor], need_indices: bool = False
) -> KVEmbeddingCollection:
    ec = KVEmbeddingCollection(
        _configs(),
        {name: KVTableOptions(capacity=4 * rows) for name, rows in ROWS.items()},
        fused_params={"optimizer": optimizer, "learning_rate": LR, "eps": 1e-6},
        need_indices=need_indices,
    )
    for name, rows in stock_rows.items():
        ec.table(name).insert(torch.arange(rows.shape[0]), rows.clone())
    return ec


def _batch(gen: torch.Generator) -> KeyedJaggedTensor:
    keys, values, lengths = [], [], []
    for name, features in FEATURES.items():
        for feature in features:
            keys.append(feature)
            lens = torch.randint(0, 6, (BATCH,), generator=gen)
            lengths.append(lens)
            values.append(torch.randint(0, ROWS[name], (int(lens.sum()),), generator=gen))
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.cat(values), lengths=torch.cat(lengths)
    )


def _rows(ec: KVEmbeddingCollection, name: str) -> torch.Tensor:
    rows, found = ec.table(name).find(torch.arange(ROWS[name]))
    assert bool(found.all()), f"table {name!r} lost ids"
    return rows


def test_matches_embedding_collection_with_sgd() -> None:
    torch.manual_seed(0)
    stock = EmbeddingCollection(_configs())
    kv = _kv(EmbOptimType.EXACT_SGD, {n: e.weight.detach() for n, e in stock.embeddings.items()})
    optimizer = torch.optim.SGD(stock.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(1)
    for step in range(5):
        kjt = _batch(gen)
        want, got = stock(kjt), kv(kjt)
        assert list(got) == list(want)
        loss_want, loss_got = 0.0, 0.0
        for feature in want:
            torch.testing.assert_close(got[feature].values(), want[feature].values())
            assert torch.equal(got[feature].lengths(), want[feature].lengths()), feature
            weight = torch.cos(torch.arange(want[feature].values().numel(), dtype=torch.float32))
            loss_want = loss_want + (want[feature].values().reshape(-1) * weight).sum()
            loss_got = loss_got + (got[feature].values().reshape(-1) * weight).sum()
        optimizer.zero_grad()
        loss_want.backward()
        optimizer.step()
        loss_got.backward()
        for name, embedding in stock.embeddings.items():
            torch.testing.assert_close(
                _rows(kv, name), embedding.weight.detach(), msg=f"{name} after step {step}"
            )


@pytest.mark.parametrize("need_indices", [False, True], ids=["rows", "rows-and-indices"])
def test_matches_fbgemm_sequence_tbe_with_rowwise_adagrad(need_indices: bool) -> None:
    gen = torch.Generator().manual_seed(2)
    tbe = {
        name: SplitTableBatchedEmbeddingBagsCodegen(
            [(rows, DIM, EmbeddingLocation.HOST, ComputeDevice.CPU)],
            pooling_mode=PoolingMode.NONE,
            optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            learning_rate=LR,
            eps=1e-6,
        )
        for name, rows in ROWS.items()
    }
    start = {name: t.split_embedding_weights()[0].detach().clone() for name, t in tbe.items()}
    kv = _kv(EmbOptimType.EXACT_ROWWISE_ADAGRAD, start, need_indices)
    for step in range(5):
        kjt = _batch(gen)
        got = kv(kjt)
        jagged = kjt.to_dict()
        for name, features in FEATURES.items():
            ids = torch.cat([jagged[f].values() for f in features])
            offsets = torch.arange(ids.numel() + 1)
            want = tbe[name](ids, offsets)
            rows = torch.cat([got[f].values() for f in features])
            torch.testing.assert_close(rows, want, msg=f"{name} output at step {step}")
            grad = torch.sin(torch.arange(want.numel(), dtype=torch.float32)).view_as(want)
            want.backward(grad)
            rows.backward(grad)
            for f in features:
                if need_indices:
                    assert torch.equal(got[f].weights(), jagged[f].values()), f
                else:
                    assert got[f].weights_or_none() is None
        for name, t in tbe.items():
            torch.testing.assert_close(
                _rows(kv, name),
                t.split_embedding_weights()[0],
                atol=1e-6,
                rtol=1e-5,
                msg=f"{name} rows after step {step}",
            )


SHARED = {
    "item_rows": ["history", "candidate"],
    "recent_rows": ["candidate"],
    "user_rows": ["user"],
}
SHARED_ROWS = {"item_rows": 41, "recent_rows": 29, "user_rows": 23}
# The KJT's keys in another order than the tables read them.
SHARED_KEYS = {"user": 23, "candidate": 29, "history": 41}


def _shared_configs() -> list[EmbeddingConfig]:
    return [
        EmbeddingConfig(
            name=name, embedding_dim=DIM, num_embeddings=SHARED_ROWS[name], feature_names=features
        )
        for name, features in SHARED.items()
    ]


@pytest.mark.parametrize("need_indices", [False, True], ids=["rows", "rows-and-indices"])
def test_a_feature_read_by_two_tables_matches_embedding_collection(need_indices: bool) -> None:
    """``candidate`` feeds ``item_rows`` and ``recent_rows``: the stock module outputs
    ``candidate@item_rows`` and ``candidate@recent_rows`` (each its table's rows), and
    both tables train from their own output's gradient."""
    torch.manual_seed(4)
    stock = EmbeddingCollection(_shared_configs(), need_indices=need_indices)
    kv = KVEmbeddingCollection(
        _shared_configs(),
        {name: KVTableOptions(capacity=4 * rows) for name, rows in SHARED_ROWS.items()},
        fused_params={"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": LR},
        need_indices=need_indices,
    )
    for name, embedding in stock.embeddings.items():
        kv.table(name).insert(torch.arange(SHARED_ROWS[name]), embedding.weight.detach().clone())
    optimizer = torch.optim.SGD(stock.parameters(), lr=LR)
    gen = torch.Generator().manual_seed(5)
    for step in range(3):
        lengths = torch.randint(0, 5, (len(SHARED_KEYS) * BATCH,), generator=gen)
        values = torch.cat(
            [
                torch.randint(0, rows, (int(lens.sum()),), generator=gen)
                for rows, lens in zip(SHARED_KEYS.values(), lengths.split(BATCH))
            ]
        )
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=list(SHARED_KEYS), values=values, lengths=lengths
        )
        want, got = stock(kjt), kv(kjt)
        assert (
            list(got)
            == list(want)
            == [
                "history",
                "candidate@item_rows",
                "candidate@recent_rows",
                "user",
            ]
        )
        loss_want, loss_got = 0.0, 0.0
        for i, name in enumerate(want):
            torch.testing.assert_close(
                got[name].values(), want[name].values(), msg=f"{name} step {step}"
            )
            assert torch.equal(got[name].lengths(), want[name].lengths()), name
            if need_indices:
                assert torch.equal(got[name].weights(), want[name].weights()), name
            else:
                assert got[name].weights_or_none() is None
            coeff = torch.cos(torch.arange(want[name].values().numel()) + 7.0 * i)
            loss_want = loss_want + (want[name].values().reshape(-1) * coeff).sum()
            loss_got = loss_got + (got[name].values().reshape(-1) * coeff).sum()
        optimizer.zero_grad()
        loss_want.backward()
        optimizer.step()
        loss_got.backward()
        for name, embedding in stock.embeddings.items():
            rows, found = kv.table(name).find(torch.arange(SHARED_ROWS[name]))
            assert bool(found.all()), name
            torch.testing.assert_close(rows, embedding.weight.detach(), msg=f"{name} step {step}")
