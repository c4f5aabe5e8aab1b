"""Twin test: KVEmbeddingBagCollection against fbgemm's CPU TBE.

With ids below num_embeddings, rows copied from the stock table and no
eviction, both must give the same pooled outputs at every step and the same
rows and optimizer state after several fused row-wise Adagrad / SGD steps, on
each implementation (the native kernels, the torch path, the Triton kernels in
the interpreter), each checked to be the one that ran.
"""

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
    EmbeddingLocation,
    PoolingMode,
)
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb import KVEmbeddingBagCollection, KVTableOptions

from .spies import IMPLEMENTATIONS, run_on

ROWS = (37, 23)
DIMS = (8, 12)
BATCH = 7
LR = 0.3
EPS = 1e-4


def _build(pooling: PoolingType, weighted: bool, optim: EmbOptimType):
    torch.manual_seed(0)
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(n, d, EmbeddingLocation.HOST, ComputeDevice.CPU) for n, d in zip(ROWS, DIMS)],
        optimizer=optim,
        learning_rate=LR,
        eps=EPS,
        pooling_mode=PoolingMode.SUM if pooling == PoolingType.SUM else PoolingMode.MEAN,
    )
    for w in tbe.split_embedding_weights():
        w.copy_(torch.randn_like(w))
    configs = [
        EmbeddingBagConfig(
            name=f"t{i}",
            embedding_dim=d,
            num_embeddings=2**63 - 1,
            feature_names=[f"f{i}"],
            pooling=pooling,
        )
        for i, d in enumerate(DIMS)
    ]
    kv = KVEmbeddingBagCollection(
        configs,
        KVTableOptions(capacity=1024),
        is_weighted=weighted,
        fused_params={"optimizer": optim, "learning_rate": LR, "eps": EPS},
    )
    for i, w in enumerate(tbe.split_embedding_weights()):
        kv.table(f"t{i}").insert(torch.arange(ROWS[i]), w.detach().clone())
    return tbe, kv


def _batch(gen: torch.Generator, weighted: bool):
    lengths = torch.randint(0, 5, (len(ROWS) * BATCH,), generator=gen)
    lengths[3] = 0  # an empty bag
    values = torch.cat(
        [
            torch.randint(0, n, (int(lengths[i * BATCH : (i + 1) * BATCH].sum()),), generator=gen)
            for i, n in enumerate(ROWS)
        ]
    )
    weights = torch.rand(values.numel(), generator=gen) if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(
        keys=["f0", "f1"], values=values, lengths=lengths, weights=weights
    )


CASES = [
    pytest.param(PoolingType.SUM, False, EmbOptimType.EXACT_ROWWISE_ADAGRAD, id="sum-adagrad"),
    pytest.param(PoolingType.MEAN, False, EmbOptimType.EXACT_ROWWISE_ADAGRAD, id="mean-adagrad"),
    pytest.param(PoolingType.SUM, True, EmbOptimType.EXACT_ROWWISE_ADAGRAD, id="weighted-adagrad"),
    pytest.param(PoolingType.SUM, False, EmbOptimType.EXACT_SGD, id="sum-sgd"),
    pytest.param(PoolingType.SUM, True, EmbOptimType.EXACT_SGD, id="weighted-sgd"),
]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("pooling,weighted,optim", CASES)
def test_matches_fbgemm_tbe(pooling, weighted, optim, implementation, monkeypatch):
    ran = run_on(monkeypatch, implementation)
    tbe, kv = _build(pooling, weighted, optim)
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        kjt = _batch(gen, weighted)
        ref = tbe(
            kjt.values(),
            kjt.offsets(),
            per_sample_weights=kjt.weights() if weighted else None,
        )
        out = kv(kjt).values()
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5, msg=f"step {step} outputs")
        grad = torch.randn(ref.shape, generator=gen)
        ref.backward(grad)
        out.backward(grad)
    for i, w in enumerate(tbe.split_embedding_weights()):
        exported = kv.table(f"t{i}").export()
        ids = exported["ids"]
        assert torch.equal(ids, torch.arange(ROWS[i])), f"table t{i} stored ids {ids.tolist()}"
        torch.testing.assert_close(exported["weights"], w, atol=1e-5, rtol=1e-5)
        assert kv.table(f"t{i}").metrics()["evictions"] == 0
    ran.check()
    if optim == EmbOptimType.EXACT_ROWWISE_ADAGRAD:
        states = tbe.split_optimizer_states()
        for i in range(len(ROWS)):
            torch.testing.assert_close(
                kv.table(f"t{i}").export()["momentum1"], states[i][0], atol=1e-5, rtol=1e-5
            )


def test_output_layout_matches_stock_ebc():
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    configs = [
        EmbeddingBagConfig(name="a", embedding_dim=4, num_embeddings=11, feature_names=["x", "y"]),
        EmbeddingBagConfig(name="b", embedding_dim=6, num_embeddings=13, feature_names=["z"]),
    ]
    stock = EmbeddingBagCollection(configs)
    kv = KVEmbeddingBagCollection(configs, KVTableOptions(capacity=64))
    for name, param in stock.embedding_bags.items():
        rows = param.weight.shape[0]
        kv.table(name).insert(torch.arange(rows), param.weight.detach().clone())
    kv.eval()
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["x", "y", "z"],
        values=torch.tensor([1, 2, 10, 3, 9, 12, 5]),
        lengths=torch.tensor([2, 1, 0, 2, 1, 1]),
    )
    ref, out = stock(kjt), kv(kjt)
    assert out.keys() == ref.keys()
    assert out.length_per_key() == ref.length_per_key()
    torch.testing.assert_close(out.values(), ref.values())
