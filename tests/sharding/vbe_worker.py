"""Variable batch per feature (VBE): KV tables sharded row-wise or table-wise against
stock fbgemm tables sharded the same way, both fed the same VBE batches.

Run by ``tests/sharding/test_vbe.py``::

    torchrun --nproc_per_node=2 -m tests.sharding.vbe_worker OUT.json [SHARDING]

The KV tables start with the stock tables' rows (every id below ``num_embeddings``
inserted on its owner rank), both train with fused SGD; each step's pooled
outputs (expanded to the full batch by the KJT's inverse indices, as TorchRec
does) must match, and so must the rows at the end.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.modules.embedding_configs import PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.torchrun_jobs import Tally, gloo_job, write_result
from torchrec_kvemb import KVEmbeddingBagCollectionSharder, KVTableOptions
from torchrec_kvemb.sharding import owner_rank

SGD = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1}
BUCKETS = 24
STEPS = 3
BATCH = 7  # the full batch of a rank; features come deduplicated to fewer samples
TOL = 1e-5


def configs(sharding: str) -> list[EmbeddingBagConfig]:
    """Two dims (two KV kernels), MEAN under table-wise (stock row-wise divides MEAN
    bags after its reduce-scatter, a path VBE leaves to the SUM tables here)."""
    mean = PoolingType.MEAN if sharding == "table_wise" else PoolingType.SUM
    return [
        EmbeddingBagConfig(name="tu", embedding_dim=8, num_embeddings=97, feature_names=["u"]),
        EmbeddingBagConfig(
            name="ti", embedding_dim=4, num_embeddings=61, feature_names=["i", "j"], pooling=mean
        ),
        EmbeddingBagConfig(name="tv", embedding_dim=8, num_embeddings=113, feature_names=["v"]),
    ]


class Model(nn.Module):
    """KV: one collection of every table (two dims and poolings: several KV kernels,
    their VBE outputs merged). Stock: one collection per table, since fbgemm's CPU
    TBE cannot merge several kernels' VBE outputs ("pre-allocated vbe_output is not
    supported on CPU")."""

    def __init__(self, sharding: str, kv: bool) -> None:
        super().__init__()
        meta = torch.device("meta")
        tables = configs(sharding)
        groups = [tables] if kv else [[c] for c in tables]
        self.ebcs = nn.ModuleList(EmbeddingBagCollection(g, device=meta) for g in groups)

    def forward(self, kjt: KeyedJaggedTensor) -> dict[str, torch.Tensor]:
        out = {}
        for ebc in self.ebcs:
            out.update(ebc(kjt).to_dict())
        return out


class StockSharder(EmbeddingBagCollectionSharder):
    """The stock sharder, offering row-wise on CPU too (its planner offers it for
    CUDA only; the sharding itself runs on CPU with gloo)."""

    def sharding_types(self, compute_device_type: str) -> list[str]:
        return super().sharding_types("cuda")


def shard(sharding: str, kv: bool) -> DistributedModelParallel:
    if kv:
        options = {
            c.name: KVTableOptions(capacity=256, total_num_buckets=BUCKETS)
            for c in configs(sharding)
        }
        sharder = KVEmbeddingBagCollectionSharder(options, SGD)
    else:
        sharder = StockSharder(fused_params=SGD)
    model = Model(sharding, kv)
    constraints = {
        c.name: ParameterConstraints(sharding_types=[sharding]) for c in configs(sharding)
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=dist.get_world_size(), compute_device="cpu"),
        constraints=constraints,
    )
    plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    return DistributedModelParallel(
        model, device=torch.device("cpu"), plan=plan, sharders=[sharder]
    )


def full_weights(sharding: str) -> dict[str, torch.Tensor]:
    """Every table's rows, the same on every rank."""
    g = torch.Generator().manual_seed(5)
    return {
        c.name: torch.randn(c.num_embeddings, c.embedding_dim, generator=g) * 0.3
        for c in configs(sharding)
    }


def set_stock_rows(model: DistributedModelParallel, weights: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    index = {name: i for i, name in enumerate(weights)}
    for name, full in weights.items():
        for s in state[f"ebcs.{index[name]}.embedding_bags.{name}.weight"].local_shards():
            r, c = s.metadata.shard_offsets
            n, d = s.metadata.shard_sizes
            s.tensor.copy_(full[r : r + n, c : c + d])


def set_kv_rows(
    model: DistributedModelParallel, weights: dict[str, torch.Tensor], sharding: str
) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for name, table in model.module.ebcs[0].kv_tables().items():
        ids = torch.arange(weights[name].shape[0])
        if sharding == "row_wise":
            ids = ids[owner_rank(ids, BUCKETS, world) == rank]
        table.insert(ids, weights[name][ids])


def vbe_batch(step: int, rank: int, same_sizes: bool) -> tuple[KeyedJaggedTensor, torch.Tensor]:
    """This rank's batch: each feature with a batch size of its own (its distinct
    samples) and inverse indices to the full batch; and the loss coefficients.
    ``same_sizes``: every rank has the same batch size per feature."""
    sizes = torch.Generator().manual_seed(1000 * step + (0 if same_sizes else rank))
    keys = ["u", "i", "j", "v"]
    rows = {"u": 97, "i": 61, "j": 61, "v": 113}
    strides = [int(torch.randint(1, BATCH + 1, (1,), generator=sizes)) for _ in keys]
    g = torch.Generator().manual_seed(1000 * step + rank)
    lengths, values, inverse = [], [], []
    for key, b in zip(keys, strides, strict=True):
        n = torch.randint(0, 4, (b,), generator=g)
        lengths.append(n)
        values.append(torch.randint(0, rows[key], (int(n.sum()),), generator=g))
        inverse.append(torch.randint(0, b, (BATCH,), generator=g))
    kjt = KeyedJaggedTensor(
        keys=keys,
        values=torch.cat(values),
        lengths=torch.cat(lengths),
        stride_per_key_per_rank=[[b] for b in strides],
        inverse_indices=(keys, torch.stack(inverse)),
    )
    coeff = torch.randn(BATCH, 8 + 4 + 4 + 8, generator=g)
    return kjt, coeff


def run(sharding: str) -> dict:
    rank = dist.get_rank()
    weights = full_weights(sharding)
    kv, stock = shard(sharding, True), shard(sharding, False)
    set_stock_rows(stock, weights)
    set_kv_rows(kv, weights, sharding)
    tally = Tally(TOL)
    for step in range(STEPS + 1):
        # Row-wise training needs every rank's output of one size: the stock
        # reduce-scatter's backward is an all-gather, which gloo refuses for uneven
        # sizes (stock tables alike). The last step, forward only, has uneven ones.
        train = step < STEPS
        kjt, coeff = vbe_batch(step, rank, same_sizes=train and sharding == "row_wise")
        tally.check("the batch is VBE", kjt.variable_stride_per_key())
        with torch.set_grad_enabled(train):
            got, want = kv(kjt), stock(kjt)
        tally.check("same keys", sorted(got) == sorted(want))
        for key in want:
            tally.diff(
                f"outputs {key}" + ("" if train else " (uneven, forward)"), got[key], want[key]
            )
        for out in (got, want) if train else ():
            flat = torch.cat([out[k] for k in ("u", "i", "j", "v")], dim=1)
            (flat * coeff).sum().backward()
    state = stock.state_dict()
    index = {name: i for i, name in enumerate(weights)}
    stock_rows = {}
    for name in weights:  # every rank, in one order: the stock rows, whole
        full = torch.zeros_like(weights[name])
        for s in state[f"ebcs.{index[name]}.embedding_bags.{name}.weight"].local_shards():
            r, c = s.metadata.shard_offsets
            n, d = s.metadata.shard_sizes
            full[r : r + n, c : c + d] = s.tensor
        dist.all_reduce(full)  # row-wise: disjoint row ranges; table-wise: one holder
        stock_rows[name] = full
    ids = {}
    for name, table in kv.module.ebcs[0].kv_tables().items():
        exported = table.export()
        ids[name] = exported["ids"]
        tally.check(
            f"{name} stores only ids it was given",
            bool((exported["ids"] < weights[name].shape[0]).all()),
        )
        tally.diff(f"rows {name}", exported["weights"], stock_rows[name][exported["ids"]])
        tally.check(
            f"{name} rows moved",
            not torch.equal(exported["weights"], weights[name][exported["ids"]]),
        )
    result = tally.result()
    result["kv_ids"] = {n: int(i.numel()) for n, i in ids.items()}
    return result


def main() -> None:
    out_path = sys.argv[1]
    sharding = sys.argv[2]
    with gloo_job():
        result = run(sharding)
        if dist.get_rank() == 0:
            write_result(out_path, result)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
