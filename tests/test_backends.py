"""The whole KV EBC on the Triton kernels (interpreted) and on the native CPU
kernels against the torch path.

Same batches, same options: ids, slots and eviction choices bit-exact; pooled
outputs, rows and optimizer state within float tolerance, step after step.
"""

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb import EvictionPolicy, Initializer, KVEmbeddingBagCollection, KVTableOptions
from torchrec_kvemb.backend import ENV_VAR
from torchrec_kvemb.ops import native


def _ebc(optim, pooling, weighted, policy):
    configs = [
        EmbeddingBagConfig(
            name="a",
            embedding_dim=5,
            num_embeddings=2**63 - 1,
            feature_names=["x", "y"],
            pooling=pooling,
        ),
        EmbeddingBagConfig(
            name="b",
            embedding_dim=3,
            num_embeddings=2**63 - 1,
            feature_names=["z"],
            pooling=pooling,
        ),
    ]
    options = {
        "a": KVTableOptions(capacity=32, eviction=policy, admission_threshold=2, seed=3),
        "b": KVTableOptions(capacity=16, eviction=policy, initializer=Initializer.NORMAL),
    }
    return KVEmbeddingBagCollection(
        configs,
        options,
        is_weighted=weighted,
        fused_params={"optimizer": optim, "learning_rate": 0.2, "weight_decay": 0.01},
    )


def _batches(weighted, steps=5, batch=7):
    gen = torch.Generator().manual_seed(7)
    for _ in range(steps):
        lengths = torch.randint(0, 7, (3 * batch,), generator=gen)
        values = torch.randint(0, 150, (int(lengths.sum()),), generator=gen) * 1_000_003
        weights = torch.rand(values.numel(), generator=gen) if weighted else None
        yield KeyedJaggedTensor.from_lengths_sync(
            keys=["x", "y", "z"], values=values, lengths=lengths, weights=weights
        )


@pytest.mark.parametrize(
    "optim",
    [EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.ADAM, EmbOptimType.EXACT_SGD],
    ids=lambda o: o.name,
)
@pytest.mark.parametrize(
    "pooling,weighted",
    [(PoolingType.SUM, False), (PoolingType.MEAN, False), (PoolingType.SUM, True)],
    ids=["sum", "mean", "weighted"],
)
@pytest.mark.parametrize("policy", [EvictionPolicy.LRU, EvictionPolicy.LFU], ids=lambda p: p.name)
@pytest.mark.parametrize("kernels", ["triton", "native"])
def test_kernels_match_torch(kernels, optim, pooling, weighted, policy, monkeypatch):
    if kernels == "native":
        assert native.available(), native.unavailable_reason()  # make test builds it
    results = {}
    for backend in ("torch", kernels):
        monkeypatch.setenv(ENV_VAR, "auto" if backend == "native" else backend)
        ebc = _ebc(optim, pooling, weighted, policy)
        outs = []
        for kjt in _batches(weighted):
            out = ebc(kjt).values()
            out.backward(torch.cos(torch.arange(out.numel(), dtype=torch.float32)).view_as(out))
            outs.append(out.detach())
        # Evaluation: read-only lookups of the first batch's ids (some have rows,
        # some were not admitted or were evicted): the pooled output, and per table
        # the rows found for those ids and which ids found one.
        ebc.eval()
        kjt = next(_batches(weighted, steps=1))
        outs.append(ebc(kjt).values())
        found = {}
        for name, features in (("a", ["x", "y"]), ("b", ["z"])):
            rows, found[name] = ebc.table(name).find(torch.cat([kjt[f].values() for f in features]))
            outs.append(rows)
        results[backend] = (
            outs,
            found,
            {n: t.export() for n, t in ebc.kv_tables().items()},
            ebc.metrics(),
        )
    (ref_outs, ref_found, ref_tables, ref_metrics), (outs, found, tables, metrics) = (
        results["torch"],
        results[kernels],
    )
    for step, (a, b) in enumerate(zip(ref_outs, outs, strict=True)):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5, msg=f"output {step}")
    for name, ref in ref_found.items():
        assert torch.equal(found[name], ref), f"table {name}: ids with a row in evaluation"
    every = torch.cat(list(ref_found.values()))
    assert bool(every.any()) and not bool(every.all()), ref_found
    assert metrics == ref_metrics
    for name in ref_tables:
        for key, ref in ref_tables[name].items():
            if ref.dtype == torch.int64:
                assert torch.equal(tables[name][key], ref), f"table {name} {key}"
            else:
                torch.testing.assert_close(tables[name][key], ref, atol=1e-5, rtol=1e-5)
    assert ref_metrics["b"]["evictions"] > 0 and ref_metrics["a"]["admission_rejects"] > 0
