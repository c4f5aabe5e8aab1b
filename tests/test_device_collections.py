"""``KVEmbeddingBagCollection`` and ``KVEmbeddingCollection`` on the device under
test against the same collection on the CPU (torch path), on the same ids.

Each case trains a few steps with fused row-wise Adagrad or Adam (eviction,
admission, MEAN / weighted pooling, half-precision rows), then evaluates a
batch with ids never seen. Outputs at every step, then every table's export
(ids and scores bit for bit; rows and optimizer state to a tolerance) and its
counters must agree. ``make test`` runs this on CPU (the native kernels against
the torch path); ``make test-gpu`` on CUDA, where the Triton kernels run compiled.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.device_support import CPU, assert_on, assert_tables_equal, backend, kjt_to
from torchrec_kvemb import (
    EvictionPolicy,
    Initializer,
    KVEmbeddingBagCollection,
    KVEmbeddingCollection,
    KVTableOptions,
)

LRU, LFU = EvictionPolicy.LRU, EvictionPolicy.LFU
ADAGRAD, ADAM = EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.ADAM
#: Training steps per case, bags per feature per step.
STEPS = 4
BATCH = 7


@dataclass(frozen=True)
class Case:
    optim: EmbOptimType
    sequence: bool = False  # KVEmbeddingCollection (else the bag collection)
    pooling: PoolingType = PoolingType.SUM
    weighted: bool = False
    policies: tuple[EvictionPolicy, EvictionPolicy] = (LRU, LFU)
    dtype: torch.dtype = torch.float32
    atol: float = 1e-5  # outputs, rows and optimizer state against the CPU run
    rtol: float = 1e-4

    @property
    def keys(self) -> list[str]:
        return ["x", "y", "z"]


CASES = {
    "bags-adagrad-sum-lru-lfu": Case(ADAGRAD),
    "bags-adam-mean-lfu-lru": Case(ADAM, pooling=PoolingType.MEAN, policies=(LFU, LRU)),
    "bags-adagrad-weighted": Case(ADAGRAD, weighted=True),
    "bags-adam-float16-rows": Case(ADAM, dtype=torch.float16, atol=2e-3, rtol=1e-3),
    "sequences-adagrad-lru-lfu": Case(ADAGRAD, sequence=True),
    "sequences-adam-lfu-lru": Case(ADAM, sequence=True, policies=(LFU, LRU)),
}


def build(case: Case, device: torch.device):
    """Two tables: ``a`` (features x, y; admission after 2 sightings, 32 rows, so it
    evicts) and ``b`` (feature z; 16 rows, normal initial rows). Bags: dims 5 and 3;
    sequences: one dim, 5."""
    fused = {"optimizer": case.optim, "learning_rate": 0.2, "weight_decay": 0.01}
    options = {
        "a": KVTableOptions(
            capacity=32,
            eviction=case.policies[0],
            admission_threshold=2,
            init_low=-0.5,
            init_high=0.5,
            seed=3,
            weights_dtype=case.dtype,
        ),
        "b": KVTableOptions(
            capacity=16,
            eviction=case.policies[1],
            initializer=Initializer.NORMAL,
            init_std=0.3,
            seed=5,
            weights_dtype=case.dtype,
        ),
    }
    if case.sequence:
        configs = [
            EmbeddingConfig(
                name="a", embedding_dim=5, num_embeddings=2**63 - 1, feature_names=["x", "y"]
            ),
            EmbeddingConfig(
                name="b", embedding_dim=5, num_embeddings=2**63 - 1, feature_names=["z"]
            ),
        ]
        return KVEmbeddingCollection(configs, options, device=device, fused_params=fused)
    configs = [
        EmbeddingBagConfig(
            name="a",
            embedding_dim=5,
            num_embeddings=2**63 - 1,
            feature_names=["x", "y"],
            pooling=case.pooling,
        ),
        EmbeddingBagConfig(
            name="b",
            embedding_dim=3,
            num_embeddings=2**63 - 1,
            feature_names=["z"],
            pooling=case.pooling,
        ),
    ]
    return KVEmbeddingBagCollection(
        configs, options, device=device, is_weighted=case.weighted, fused_params=fused
    )


def batches(case: Case, seed: int, steps: int) -> list[KeyedJaggedTensor]:
    """CPU batches: about 150 distinct ids spread over the int64 range, 2**63 - 1 among
    them, repeated within and across steps (updates, admission, eviction)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        lengths = torch.randint(0, 7, (len(case.keys) * BATCH,), generator=gen)
        values = torch.randint(0, 150, (int(lengths.sum()),), generator=gen) * 61_489_823_461
        if values.numel():
            values[0] = 2**63 - 1
        weights = torch.rand(values.numel(), generator=gen) if case.weighted else None
        out.append(
            KeyedJaggedTensor.from_lengths_sync(
                keys=case.keys, values=values, lengths=lengths, weights=weights
            )
        )
    return out


def outputs(case: Case, model, kjt: KeyedJaggedTensor) -> dict[str, torch.Tensor]:
    """The model's output as named tensors: the pooled values (bags), or each
    feature's rows and lengths (sequences)."""
    out = model(kjt)
    if not case.sequence:
        return {"pooled": out.values()}
    named = {}
    for key, jt in out.items():
        named[f"{key} rows"] = jt.values()
        named[f"{key} lengths"] = jt.lengths()
    return named


def run(case: Case, device: torch.device, backend_name: str) -> dict:
    """Train ``STEPS`` steps, then evaluate fresh and known ids: every output, each
    table's export and metrics."""
    with backend(backend_name):
        model = build(case, device)
        seen = []
        for kjt in batches(case, seed=11, steps=STEPS):
            named = outputs(case, model, kjt_to(kjt, device))
            assert_on(device, *named.values())
            float_outs = [v for v in named.values() if v.is_floating_point()]
            loss = sum((v * torch.cos(torch.arange(v.numel(), device=device)).view_as(v)).sum()
                       for v in float_outs)  # fmt: skip
            loss.backward()
            seen.append({k: v.detach().cpu() for k, v in named.items()})
        model.eval()
        (held_out,) = batches(case, seed=12, steps=1)
        with torch.no_grad():
            named = outputs(case, model, kjt_to(held_out, device))
        seen.append({k: v.cpu() for k, v in named.items()})
        return {
            "outputs": seen,
            "tables": {name: t.export() for name, t in model.kv_tables().items()},
            "metrics": model.metrics(),
        }


@pytest.mark.parametrize("name", list(CASES), ids=list(CASES))
def test_collection_on_device_matches_cpu(name: str, device: torch.device) -> None:
    case = CASES[name]
    got = run(case, device, "auto")
    want = run(case, CPU, "torch")
    for step, (g, w) in enumerate(zip(got["outputs"], want["outputs"], strict=True)):
        tag = "eval" if step == STEPS else f"step {step}"
        assert sorted(g) == sorted(w)
        for key, ref in w.items():
            if ref.is_floating_point():
                torch.testing.assert_close(
                    g[key],
                    ref,
                    atol=case.atol,
                    rtol=case.rtol,
                    msg=lambda m, at=f"{tag} {key}": f"{at}: {m}",
                )
            else:
                assert torch.equal(g[key], ref), f"{tag} {key}"
    for table, export in want["tables"].items():
        assert_on(device, *got["tables"][table].values())
        assert_tables_equal(f"table {table}", got["tables"][table], export, case.atol, case.rtol)
    assert got["metrics"] == want["metrics"]
    totals = {
        m: sum(t[m] for t in want["metrics"].values()) for m in ("evictions", "admission_rejects")
    }
    assert all(v > 0 for v in totals.values()), f"the case never counts {totals}"


@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_a_batch_without_bags_gives_its_output_on_the_device(training, device) -> None:
    configs = [EmbeddingBagConfig(name="t", embedding_dim=5, num_embeddings=2**40,
                                  feature_names=["f"])]  # fmt: skip
    ebc = KVEmbeddingBagCollection(configs, KVTableOptions(capacity=32), device=device)
    ebc.train(training)
    empty = torch.empty(0, dtype=torch.int64)
    kjt = kjt_to(KeyedJaggedTensor.from_lengths_sync(keys=["f"], values=empty, lengths=empty),
                 device)  # fmt: skip
    out = ebc(kjt).values()
    assert out.shape == (0, 5)
    assert_on(device, out)
