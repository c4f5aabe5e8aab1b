"""A checkpoint saved by ``torchrec_kvemb.checkpoint.save`` from a collection on the
device under test, loaded by ``checkpoint.load`` into the same collection on the
CPU and into a fresh one on the device: every table's ids, scores, rows and
optimizer state come back bit for bit, and a training step after the load gives
the same outputs on both (the optimizer state went through too).
"""

from __future__ import annotations

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.device_support import CPU, assert_on, assert_tables_equal, backend, kjt_to
from torchrec_kvemb import (
    EvictionPolicy,
    KVEmbeddingBagCollection,
    KVEmbeddingCollection,
    KVTableOptions,
    checkpoint,
)

KEYS = ["f", "g"]
CASES = {
    "bags-adam": (False, EmbOptimType.ADAM, torch.float32),
    "sequences-adagrad-float16-rows": (True, EmbOptimType.EXACT_ROWWISE_ADAGRAD, torch.float16),
}


class Model(nn.Module):
    def __init__(self, kv: nn.Module) -> None:
        super().__init__()
        self.kv = kv

    def forward(self, kjt: KeyedJaggedTensor):
        return self.kv(kjt)


def build(name: str, device: torch.device) -> Model:
    sequence, optim, dtype = CASES[name]
    options = {
        "a": KVTableOptions(capacity=32, eviction=EvictionPolicy.LFU, admission_threshold=2,
                            init_low=-0.5, init_high=0.5, seed=4, weights_dtype=dtype),
        "b": KVTableOptions(capacity=48, init_low=-0.1, init_high=0.3, seed=9,
                            weights_dtype=dtype),
    }  # fmt: skip
    fused = {"optimizer": optim, "learning_rate": 0.1}
    if sequence:
        configs = [
            EmbeddingConfig(name=t, embedding_dim=6, num_embeddings=2**63 - 1, feature_names=[f])
            for t, f in zip("ab", KEYS)
        ]
        return Model(KVEmbeddingCollection(configs, options, device=device, fused_params=fused))
    configs = [
        EmbeddingBagConfig(name=t, embedding_dim=d, num_embeddings=2**63 - 1, feature_names=[f])
        for t, f, d in zip("ab", KEYS, (6, 3))
    ]
    return Model(KVEmbeddingBagCollection(configs, options, device=device, fused_params=fused))


def batch(step: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 6, (2 * 5,), generator=g)
    values = torch.randint(0, 70, (int(lengths.sum()),), generator=g) * 1_000_000_007
    return KeyedJaggedTensor.from_lengths_sync(keys=KEYS, values=values, lengths=lengths)


def train_step(model: Model, kjt: KeyedJaggedTensor, device: torch.device) -> torch.Tensor:
    """One step; the output values (rows or pooled rows) on the CPU."""
    out = model(kjt_to(kjt, device))
    if isinstance(out, dict):  # sequences: each feature's JaggedTensor
        values = torch.cat([jt.values() for jt in out.values()])
    else:  # bags: a KeyedTensor
        values = out.values()
    assert_on(device, values)
    (values.float() * 0.5).sum().backward()
    return values.detach().float().cpu()


def exports(model: Model) -> dict[str, dict[str, torch.Tensor]]:
    return {name: t.export() for name, t in model.kv.kv_tables().items()}


@pytest.mark.parametrize("name", list(CASES))
def test_saved_on_device_loads_on_cpu(device: torch.device, name: str, tmp_path) -> None:
    with backend("auto"):
        source = build(name, device)
        for step in range(4):
            train_step(source, batch(step), device)
        saved = exports(source)
        checkpoint.save(source, tmp_path / "ckpt")
        again = build(name, device)
        checkpoint.load(again, tmp_path / "ckpt")
    with backend("torch"):
        on_cpu = build(name, CPU)
        checkpoint.load(on_cpu, tmp_path / "ckpt")
    assert saved["a"]["ids"].numel() > 0 and saved["b"]["ids"].numel() > 0
    for table, want in saved.items():
        assert_on(device, *want.values())
        assert_tables_equal(f"{table} on cpu", exports(on_cpu)[table], want, atol=0, rtol=0)
        assert_tables_equal(f"{table} on device", exports(again)[table], want, atol=0, rtol=0)
    # The next step from the loaded state: the same outputs and rows on both.
    with backend("auto"):
        got = train_step(again, batch(9), device)
    with backend("torch"):
        want_out = train_step(on_cpu, batch(9), CPU)
    tol = 1e-5 if CASES[name][2] == torch.float32 else 2e-3
    torch.testing.assert_close(got, want_out, atol=tol, rtol=1e-3)
    for table, want in exports(on_cpu).items():
        assert_tables_equal(f"{table} after a step", exports(again)[table], want, tol, 1e-3)
