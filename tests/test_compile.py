"""``torch.compile`` of the KV collections: one graph, the eager results.

The KV lookup is registered ops (``torch.ops.kvemb.*``) with fake kernels, and
the step clocks and learning rates are tensors the ops advance, so a whole
training step (lookup, pooled forward, fused backward) and an eval step trace
with ``fullgraph=True`` (a graph break anywhere would raise). A compiled
collection and an eager twin then see the same batches: outputs bit for bit at
every step, and the same rows, optimizer state, scores and counters after.
"""

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor
from torchrec.modules.embedding_configs import PoolingType

from torchrec_kvemb import (
    EvictionPolicy,
    KVEmbeddingBagCollection,
    KVEmbeddingCollection,
    KVTableOptions,
)

from .spies import run_on

OPTIONS = {
    "t0": KVTableOptions(capacity=64, init_low=-0.1, init_high=0.1),
    "t1": KVTableOptions(
        capacity=48,
        eviction=EvictionPolicy.LFU,
        admission_threshold=2,
        init_low=-0.1,
        init_high=0.1,
    ),
    "t2": KVTableOptions(capacity=32, init_low=-0.1, init_high=0.1),
}
OPTIMIZERS = {
    "rowwise-adagrad": {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05},
    "adam-decoupled-decay": {
        "optimizer": EmbOptimType.ADAM,
        "learning_rate": 0.02,
        "weight_decay": 0.01,
        "weight_decay_mode": 2,
    },
}
BATCH, BAG = 5, 3


def _bags(fused: dict) -> KVEmbeddingBagCollection:
    configs = [
        EmbeddingBagConfig(
            name=f"t{i}",
            embedding_dim=8,
            num_embeddings=2**40,
            feature_names=[f"f{i}"],
            pooling=PoolingType.MEAN if i == 1 else PoolingType.SUM,
        )
        for i in range(3)
    ]
    return KVEmbeddingBagCollection(configs, OPTIONS, fused_params=fused)


def _sequences(fused: dict) -> KVEmbeddingCollection:
    configs = [
        EmbeddingConfig(
            name=f"t{i}", embedding_dim=8, num_embeddings=2**40, feature_names=[f"f{i}"]
        )
        for i in range(3)
    ]
    return KVEmbeddingCollection(configs, OPTIONS, fused_params=fused)


def _batch(seed: int) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, BAG + 1, (3 * BATCH,), generator=gen)
    values = torch.randint(0, 90, (int(lengths.sum()),), generator=gen)
    return KeyedJaggedTensor(keys=["f0", "f1", "f2"], values=values, lengths=lengths)


def _pooled(module: torch.nn.Module, kjt: KeyedJaggedTensor) -> torch.Tensor:
    """The output's values: a KeyedTensor's, or every feature's JaggedTensor's."""
    out = module(kjt)
    if isinstance(out, dict):
        return torch.cat([out[key].values() for key in sorted(out)])
    return out.values()


def _same_tables(eager, compiled) -> None:
    for name in OPTIONS:
        want, got = eager.table(name).export(), compiled.table(name).export()
        assert want.keys() == got.keys()
        for key in want:
            assert torch.equal(want[key], got[key]), f"table {name!r}: {key} differs"
        assert eager.table(name).metrics() == compiled.table(name).metrics(), name
        assert eager.table(name).step == compiled.table(name).step
        assert eager.table(name).optim_step == compiled.table(name).optim_step


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("kind", ["bags", "sequences"])
def test_compiled_collection_trains_and_evaluates_as_eager(kind, optimizer, monkeypatch):
    ran = run_on(monkeypatch, "native")
    make = _bags if kind == "bags" else _sequences
    eager, compiled = make(OPTIMIZERS[optimizer]), make(OPTIMIZERS[optimizer])
    torch._dynamo.reset()
    # A sequence collection's per-feature outputs have sizes read from the batch, as
    # the stock EmbeddingCollection's: TorchRec's advice for KJTs, scalar capture.
    with torch._dynamo.config.patch(capture_scalar_outputs=kind == "sequences"):
        step_fn = torch.compile(compiled, fullgraph=True)
        for step in range(5):
            kjt = _batch(step)
            want, got = _pooled(eager, kjt), _pooled(step_fn, kjt)
            assert torch.equal(want, got), f"step {step}: outputs differ"
            grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(100 + step))
            (want * grad).sum().backward()
            (got * grad).sum().backward()
        _same_tables(eager, compiled)
        assert sum(m["evictions"] for m in compiled.metrics().values()) > 0, "no table filled"
        ran.check()

        eager.eval()
        compiled.eval()
        for step in range(3):
            kjt = _batch(50 + step)
            assert torch.equal(_pooled(eager, kjt), _pooled(step_fn, kjt)), f"eval step {step}"
        _same_tables(eager, compiled)


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_the_kv_lookup_is_one_graph(training):
    ebc = _bags(OPTIMIZERS["rowwise-adagrad"])
    ebc.train(training)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(ebc)(_batch(0))
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    ops = {
        str(node.target).removesuffix(".default")
        for graph in explained.graphs
        for module in graph.modules()  # the autograd function's forward is a subgraph
        if isinstance(module, torch.fx.GraphModule)
        for node in module.graph.nodes
        if "kvemb" in str(node.target)
    }
    if training:  # the fused backward is traced too, in the autograd function's backward
        want = {"kvemb.lookup_train_group", "kvemb.pooled_forward", "kvemb.fused_backward"}
    else:
        want = {"kvemb.pooled_eval_group"}
    assert ops == want, ops


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_a_compiled_lookup_refuses_a_bad_batch_and_changes_nothing(training):
    """A traced lookup checks the batch on the device (no branch): a negative id fails
    the step before any table changes; the eager lookup names table and feature."""
    ebc = _bags(OPTIMIZERS["rowwise-adagrad"])
    ebc(_batch(0)).values().sum().backward()
    ebc.train(training)
    torch._dynamo.reset()
    compiled = torch.compile(ebc, fullgraph=True)
    _pooled(compiled, _batch(1))  # compiled, and a step taken
    before = {name: ebc.table(name).export() for name in OPTIONS}
    bad = _batch(2)
    bad = KeyedJaggedTensor(keys=bad.keys(), values=bad.values().clone(), lengths=bad.lengths())
    bad.values()[0] = -3
    with pytest.raises(RuntimeError, match="negative id"):
        _pooled(compiled, bad)
    for name, rows in before.items():
        after = ebc.table(name).export()
        assert all(torch.equal(rows[k], after[k]) for k in rows), f"table {name!r} changed"
