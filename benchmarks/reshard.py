"""Resharding a KV table in place against resharding through a checkpoint (CPU, gloo).

One KV table (``--rows`` stored rows of dim ``--dim``, row-wise Adagrad, so
``dim + 1`` floats a row) in an ``EmbeddingBagCollection`` on 2 ranks moves
row-wise -> table-wise on rank 0 and back, each way timed twice:

* ``in place``: ``DistributedModelParallel.reshard`` (rows by id through one
  all-to-all, into new shards built beside the old ones);
* ``checkpoint``: ``checkpoint.save`` to a temporary directory, a model built
  with the new plan, ``checkpoint.load`` into it (the same result, tested in
  ``tests/sharding/test_reshard.py``).

Each figure is the slowest rank's wall time (median of the repeats); rows/s
and bytes/s count every row stored before the moves once (``dim + 1`` float32 values).

Run from the repository root::

    torchrun --standalone --nproc_per_node 2 -m benchmarks.reshard            # ~1 min
    torchrun --standalone --nproc_per_node 2 -m benchmarks.reshard --rows 20000   # smoke
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (
    construct_module_sharding_plan,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingPlan

from benchmarks.common import format_ratio, format_table, spread_ids
from torchrec_kvemb import KVEmbeddingBagCollectionSharder, KVTableOptions, checkpoint
from torchrec_kvemb.sharding import owner_rank

KV = "customized_kernel"
META = torch.device("meta")
BUCKETS = 1024


class Model(nn.Module):
    """The collection and a dense layer (``DMP.reshard`` reads the dense part's DDP)."""

    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.ebc = ebc
        self.dense = nn.Linear(4, 1)


def build(rows: int, dim: int, placement) -> DistributedModelParallel:
    world = dist.get_world_size()
    config = EmbeddingBagConfig(
        name="t", embedding_dim=dim, num_embeddings=2**40, feature_names=["f"]
    )
    options = {"t": KVTableOptions(capacity=rows * 2, total_num_buckets=BUCKETS)}
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1}
    sharder = KVEmbeddingBagCollectionSharder(options, fused_params=fused)
    plan = construct_module_sharding_plan(
        EmbeddingBagCollection([config], device=META),
        {"t": placement},
        sharder=sharder,
        local_size=world,
        world_size=world,
        device_type="cpu",
    )
    model = Model(EmbeddingBagCollection([config], device=META))
    return DistributedModelParallel(
        model, device=torch.device("cpu"), plan=ShardingPlan({"ebc": plan}), sharders=[sharder]
    )


def fill(model: DistributedModelParallel, rows: int, dim: int) -> None:
    """``rows`` ids spread over 40 bits, each stored on its owner rank."""
    ids = spread_ids(torch.arange(rows, dtype=torch.int64))
    mine = ids[owner_rank(ids, BUCKETS, dist.get_world_size()) == dist.get_rank()]
    table = model.module.ebc.kv_tables()["t"]
    table.insert(mine, torch.randn(mine.numel(), dim))


def stored_rows(model: DistributedModelParallel) -> int:
    """Rows stored over all ranks."""
    total = torch.tensor([sum(t.size for t in model.module.ebc.kv_tables().values())])
    dist.all_reduce(total)
    return int(total)


def timed(fn: Callable[[], object]) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    took = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)
    return float(took)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=400_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rw, tw = row_wise(compute_kernel=KV), table_wise(rank=0, compute_kernel=KV)
    work = tempfile.mkdtemp(prefix="kvemb-reshard-") if dist.get_rank() == 0 else None
    box = [work]
    dist.broadcast_object_list(box)
    path = os.path.join(box[0], "ckpt")

    model = build(args.rows, args.dim, rw)
    fill(model, args.rows, args.dim)
    filled = stored_rows(model)
    in_place: dict[str, list[float]] = {"row-wise -> table-wise": [], "table-wise -> row-wise": []}
    through: dict[str, list[float]] = {k: [] for k in in_place}
    for _ in range(args.repeats):
        for name, target in (("row-wise -> table-wise", tw), ("table-wise -> row-wise", rw)):
            delta = build_plan(args, target)

            through[name].append(timed(partial(via_checkpoint, model, path, args, target)))
            in_place[name].append(timed(partial(model.reshard, {"ebc": (0.0, delta)}, "ebc")))
    row_bytes = (args.dim + 1) * 4
    out = []
    for name in in_place:
        a, b = statistics.median(in_place[name]), statistics.median(through[name])
        out.append(
            [
                name,
                f"{a:.2f} s",
                f"{b:.2f} s",
                format_ratio(b / a),
                f"{filled / a / 1e6:.2f} M",
                f"{filled * row_bytes / a / 1e6:.0f} MB/s",
            ]
        )
    after = stored_rows(model)
    if dist.get_rank() == 0:
        print(
            f"{args.rows} ids of dim {args.dim} (+1 Adagrad state), 2 gloo ranks, "
            f"{torch.get_num_threads()} thread per rank, table load 0.5; stored rows: "
            f"{filled} after the fill, {after} after the moves (a row whose new index "
            "bucket is full is dropped, as a checkpoint load drops it)"
        )
        print(
            format_table(
                ["move", "in place", "checkpoint", "checkpoint / in place", "rows/s", "bytes/s"],
                out,
            )
        )
        shutil.rmtree(box[0], ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


def via_checkpoint(model: DistributedModelParallel, path: str, args, placement) -> None:
    """The checkpoint route: save, a model built with the new plan, load."""
    checkpoint.save(model, path)
    twin = build(args.rows, args.dim, placement)
    checkpoint.load(twin, path)


def build_plan(args: argparse.Namespace, placement) -> dict:
    world = dist.get_world_size()
    sharder = KVEmbeddingBagCollectionSharder({"t": KVTableOptions(capacity=8)})
    config = EmbeddingBagConfig(
        name="t", embedding_dim=args.dim, num_embeddings=2**40, feature_names=["f"]
    )
    return construct_module_sharding_plan(
        EmbeddingBagCollection([config], device=META),
        {"t": placement},
        sharder=sharder,
        local_size=world,
        world_size=world,
        device_type="cpu",
    )


if __name__ == "__main__":
    main()
