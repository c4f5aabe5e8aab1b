"""``DistributedModelParallel`` of one rank with ``KVEmbeddingBagCollectionSharder``
on the device under test: nccl on CUDA, gloo on CPU, a process group of world
size 1 in this process.

A stock ``EmbeddingBagCollection`` on meta with two KV tables is planned by the
stock planner (row-wise, or table-wise), sharded onto the device, trained a few
steps (fused row-wise Adagrad or Adam) and evaluated; an unsharded
``KVEmbeddingBagCollection`` on the CPU (torch path) takes the same batches. Then
the sharded model is saved with ``torchrec_kvemb.checkpoint.save`` and loaded,
without a process group, into an unsharded model on the CPU: its rows are the
device's rows, bit for bit.

On a CUDA machine whose fbgemm is the CPU build (docs/gpu.md), TorchRec's own
input dist calls fbgemm sparse ops that have no CUDA kernel there: the test
serves them through fbgemm's CPU kernels (``device_support``), and says so.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.modules.embedding_configs import PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.device_support import (
    CPU,
    assert_on,
    assert_tables_equal,
    backend,
    install_fbgemm_cuda_fallbacks,
    kjt_to,
)
from torchrec_kvemb import (
    EvictionPolicy,
    Initializer,
    KVEmbeddingBagCollection,
    KVEmbeddingBagCollectionSharder,
    KVTableOptions,
    checkpoint,
)

KEYS = ["u1", "u2", "i"]
DIMS = {"u1": 8, "u2": 8, "i": 4}
STEPS = 4
BATCH = 6
OPTIONS = {
    "user": KVTableOptions(
        capacity=32,
        eviction=EvictionPolicy.LFU,
        admission_threshold=2,
        init_low=-0.5,
        init_high=0.5,
        seed=1,
        total_num_buckets=2,
    ),
    "item": KVTableOptions(
        capacity=32, initializer=Initializer.NORMAL, init_std=0.2, seed=2, total_num_buckets=2
    ),
}
SCENARIOS = {
    "row-wise-adagrad": ("row_wise", {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
                                      "learning_rate": 0.1}),
    "table-wise-adam": ("table_wise", {"optimizer": EmbOptimType.ADAM, "learning_rate": 0.05}),
}  # fmt: skip


def configs() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name="user", embedding_dim=8, num_embeddings=2**40, feature_names=["u1", "u2"]
        ),
        EmbeddingBagConfig(
            name="item",
            embedding_dim=4,
            num_embeddings=2**40,
            feature_names=["i"],
            pooling=PoolingType.MEAN,
        ),
    ]


class Model(nn.Module):
    """The module path ``ebc`` is the same sharded and unsharded (checkpoint keys)."""

    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, kjt: KeyedJaggedTensor):
        return self.ebc(kjt)


def unsharded(fused: dict) -> Model:
    return Model(KVEmbeddingBagCollection(configs(), OPTIONS, device=CPU, fused_params=fused))


def batch(step: int) -> tuple[KeyedJaggedTensor, torch.Tensor]:
    """CPU batch of ``step`` (60 distinct ids: repeats make hits and admissions, and
    overfill the item table's 32 rows: evictions) and the loss coefficients of its output
    columns."""
    g = torch.Generator().manual_seed(100 + step)
    lengths = torch.randint(0, 5, (len(KEYS) * BATCH,), generator=g)
    values = torch.randint(0, 60, (int(lengths.sum()),), generator=g) * 48_271 + 2**39
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=KEYS, values=values, lengths=lengths)
    coeff = torch.randn(BATCH, sum(DIMS.values()), generator=g)
    return kjt, coeff


@pytest.fixture
def one_rank(device: torch.device, tmp_path):
    """A process group of one rank on ``device``'s backend (nccl on CUDA, gloo on CPU)."""
    if device.type == "cuda":
        torch.cuda.set_device(0)
        served = install_fbgemm_cuda_fallbacks()
        if served:
            print(f"fbgemm ops served on CUDA by their CPU kernels: {', '.join(served)}")
    name = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(name, init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield name
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_one_rank_dmp_matches_unsharded_cpu(
    device: torch.device, one_rank: str, scenario: str, tmp_path
) -> None:
    sharding, fused = SCENARIOS[scenario]
    assert dist.get_backend() == one_rank
    sharder = KVEmbeddingBagCollectionSharder(OPTIONS, fused_params=fused)
    model = Model(EmbeddingBagCollection(configs(), device=torch.device("meta")))
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=1, compute_device=device.type),
        constraints={name: ParameterConstraints(sharding_types=[sharding]) for name in OPTIONS},
    )
    plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    for name, ps in plan.plan["ebc"].items():
        assert (ps.sharding_type, ps.compute_kernel) == (sharding, "customized_kernel"), name
    dmp = DistributedModelParallel(model, device=device, plan=plan, sharders=[sharder])
    with backend("torch"):
        ref = unsharded(fused)

    for step in range(STEPS):
        kjt, coeff = batch(step)
        with backend("auto"):
            out = dmp(kjt_to(kjt, device)).values()
            assert_on(device, out)
            (out * coeff.to(device)).sum().backward()
        with backend("torch"):
            want = ref(kjt).values()
            (want * coeff).sum().backward()
        torch.testing.assert_close(out.detach().cpu(), want.detach(), atol=1e-5, rtol=1e-4,
                                   msg=lambda m, step=step: f"step {step}: {m}")  # fmt: skip
    dmp.eval()
    ref.eval()
    held_out, _ = batch(STEPS)
    with torch.no_grad(), backend("auto"):
        out = dmp(kjt_to(held_out, device)).values().cpu()
    with torch.no_grad(), backend("torch"):
        want = ref(held_out).values()
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)

    sharded = {name: t.export() for name, t in dmp.module.ebc.kv_tables().items()}
    assert sorted(sharded) == sorted(OPTIONS)
    metrics = ref.ebc.metrics()
    for name, table in ref.ebc.kv_tables().items():
        assert_on(device, *sharded[name].values())
        assert_tables_equal(f"table {name}", sharded[name], table.export())
    counted = [metrics["user"]["hits"], metrics["user"]["admission_rejects"]]
    assert all(counted) and metrics["item"]["evictions"], metrics

    with backend("auto"):
        checkpoint.save(dmp, tmp_path / "ckpt")
    dist.destroy_process_group()
    with backend("torch"):
        loaded = unsharded(fused)
        checkpoint.load(loaded, tmp_path / "ckpt")
    for name, table in loaded.ebc.kv_tables().items():
        assert_tables_equal(f"reloaded {name}", table.export(), sharded[name], atol=0, rtol=0)
