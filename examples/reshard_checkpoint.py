"""Reshard a checkpoint of ``examples/train_dlrm.py`` to another world size or KV sharding.

What it does
------------
Reads the run's flags from ``WORKDIR/eval_sharded.pt`` (written by
``train_dlrm.py``), builds the same DLRM on the meta device, shards it with
``DistributedModelParallel`` at the launcher's world size, optionally pinning
every KV table to one sharding type (``--sharding``, through the planner's
``ParameterConstraints``), and ``checkpoint.load``s ``WORKDIR/ckpt`` into it
(model and dense Adagrad state). Then it

1. prints, per KV table, the rows the checkpoint holds and the rows the
   resharded model holds (summed over ranks, from its collective
   ``state_dict()``); exit status 1 if they differ;
2. evaluates the run's held-out batches (when the global batch splits evenly
   over the new ranks) and compares the predictions with those of the
   sharded training run (``eval_sharded.pt``); exit status 1 if they differ
   by more than 1e-5 (1e-3 when trained on CUDA);
3. saves the resharded model to ``--out`` with ``checkpoint.save``.

The model, data and options are those of ``train_dlrm.py``, from ``examples/common/``.

How to run
----------
::

    python examples/train_dlrm.py --workdir demo_out                 # 2 ranks
    torchrun --standalone --nproc_per_node 1 examples/reshard_checkpoint.py \\
        --workdir demo_out --out demo_out/ckpt_ws1
    torchrun --standalone --nproc_per_node 3 examples/reshard_checkpoint.py \\
        --workdir demo_out --sharding table_wise --out demo_out/ckpt_tw3
    python examples/reshard_checkpoint.py --world-size 3 --workdir demo_out  # starts torchrun

Flags
-----
--workdir DIR        the training run's directory (eval_sharded.pt, ckpt/); default demo_out
--ckpt PATH          the checkpoint to read (default WORKDIR/ckpt)
--out PATH           where to save the resharded checkpoint (default WORKDIR/ckpt_resharded)
--sharding S         row_wise | table_wise: every KV table's sharding type (default: the
                     planner's choice)
--world-size W       processes to start when run without torchrun (default 1)
--headroom H         KV capacity multiple of the resharded tables (default 4, as the
                     world-size-1 reload of train_dlrm.py: rehashed rows need room)
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

from common.data import Data, slice_batch
from common.evaluation import check_predictions, sharded_predictions
from common.launch import quiet_logs, relaunched_under_torchrun, say, setup_process_group
from common.model import (
    RELOAD_HEADROOM,
    dense_optimizer,
    dlrm_on_meta,
    fused_params,
    kv_options,
    plan_summary,
    table_sizes,
)
from common.workdir import CKPT, directory_bytes, saved_run, shown
from torchrec_kvemb import KVEmbeddingBagCollectionSharder
from torchrec_kvemb import checkpoint as kv_checkpoint


def saved_row_counts(ckpt: str, tables: list[str]) -> dict[str, int]:
    """Rows per KV table in the checkpoint (the length of its ``weight_id`` entry)."""
    metadata = kv_checkpoint.ParallelFileSystemReader(ckpt).read_metadata()
    out = {}
    for key, meta in metadata.state_dict_metadata.items():
        for name in tables:
            if key.endswith(f"embedding_bags.{name}.weight_id"):
                out[name] = int(meta.size[0])
    return out


def model_row_counts(model: torch.nn.Module, tables: list[str]) -> dict[str, int]:
    """Rows per KV table in the (sharded) model, over all ranks; a collective."""
    out = {}
    for key, value in model.state_dict().items():
        for name in tables:
            if key.endswith(f"embedding_bags.{name}.weight_id"):
                out[name] = int(value.size(0) if isinstance(value, ShardedTensor) else len(value))
    return out


def predictions_match(
    model: DistributedModelParallel,
    run: argparse.Namespace,
    saved: dict,
    rank: int,
    world: int,
    device: torch.device,
) -> bool | None:
    """The held-out predictions of the resharded model against the training run's:
    every global held-out batch is cut into ``world`` equal parts, one per rank.
    None when the batch does not split evenly."""
    data = Data(run, table_sizes(run))
    batches = data.held_out_global(saved["world_size"])
    size = batches[0].labels.numel()
    if size % world:
        say(rank, f"prediction check SKIPPED: {size} samples per batch, {world} ranks")
        return None
    part = size // world
    mine = [slice_batch(batch, rank * part, (rank + 1) * part) for batch in batches]
    logits, _ = sharded_predictions(model, mine, device)
    ok, line = check_predictions(logits, saved)
    say(rank, line)
    return ok


def reshard(args: argparse.Namespace) -> None:
    rank, world, device = setup_process_group()
    workdir = os.path.abspath(args.workdir)
    ckpt = os.path.abspath(args.ckpt or os.path.join(workdir, CKPT))
    out = os.path.abspath(args.out or os.path.join(workdir, "ckpt_resharded"))
    run, saved = saved_run(workdir)
    marker = kv_checkpoint.read_marker(ckpt)
    say(
        rank,
        f"reshard_checkpoint: {shown(ckpt)} (saved by {marker['world_size']} ranks) -> "
        f"{world} ranks ({dist.get_backend()}), KV sharding {args.sharding or 'planner'}",
    )

    started = time.perf_counter()
    ssd_dir = os.path.join(workdir, "ssd_reshard") if run.ssd else None
    options = kv_options(run, ssd_dir, headroom=args.headroom)
    model = dlrm_on_meta(run, device)
    sharder = KVEmbeddingBagCollectionSharder(options, fused_params=fused_params(run))
    constraints = (
        {name: ParameterConstraints(sharding_types=[args.sharding]) for name in options}
        if args.sharding
        else None
    )
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, compute_device=device.type),
        constraints=constraints,
    )
    plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    model = DistributedModelParallel(model, device=device, sharders=[sharder], plan=plan)
    optimizer = dense_optimizer(model, run.lr)
    say(rank, plan_summary(model, options, time.perf_counter() - started))

    started = time.perf_counter()
    try:
        kv_checkpoint.load(model, ckpt, optimizer=optimizer)
        what = "model and dense optimizer"
    except kv_checkpoint.CheckpointError as e:
        # The dense optimizer covers the data-parallel stock tables too, and the
        # planner may pick others at this world size; a failed load changes nothing.
        # Stock tables the planner moves between data-parallel and table-wise have
        # their optimizer state under other keys: load the rest (strict=False).
        if "optimizer" not in str(e) and "lacks entries" not in str(e):
            raise
        optimizer = None
        kv_checkpoint.load(model, ckpt, strict=False)
        what = "model (optimizer state of stock tables whose plan changed: not carried)"
    say(rank, f"loaded {shown(ckpt)}: {what}, {time.perf_counter() - started:.1f} s")

    tables = sorted(options)
    before = saved_row_counts(ckpt, tables)
    after = model_row_counts(model, tables)
    sharding = {t: ps.sharding_type for mp in model.plan.plan.values() for t, ps in mp.items()}
    rows_ok = True
    for name in tables:
        same = before.get(name) == after.get(name)
        rows_ok &= same
        say(
            rank,
            f"table {name}: {before.get(name)} rows saved, {after.get(name)} rows loaded "
            f"({sharding.get(name)} over {world} ranks) {'OK' if same else 'DIFFER'}",
        )
    say(rank, "ROW COUNTS MATCH" if rows_ok else "ROW COUNTS DIFFER")
    predictions_ok = predictions_match(model, run, saved, rank, world, device)

    started = time.perf_counter()
    kv_checkpoint.save(model, out, optimizer=optimizer)
    written = kv_checkpoint.read_marker(out)
    say(
        rank,
        f"resharded checkpoint saved: {shown(out)} ({written['world_size']} ranks, "
        f"{directory_bytes(out) / 2**20:.1f} MiB, {time.perf_counter() - started:.1f} s)",
    )
    dist.barrier()
    # Release the model (and the collectives' buffers it holds) while the
    # interpreter is whole: gloo's threads must not free tensors during exit.
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()
    if not rows_ok or predictions_ok is False:
        raise SystemExit(1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Reshard a train_dlrm.py checkpoint (see the module docstring).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--workdir", default="demo_out", help="the training run's directory")
    p.add_argument("--ckpt", default=None, help="checkpoint to read (default WORKDIR/ckpt)")
    p.add_argument("--out", default=None, help="output (default WORKDIR/ckpt_resharded)")
    p.add_argument("--sharding", choices=["row_wise", "table_wise"], default=None)
    p.add_argument("--world-size", type=int, default=None, help="processes without torchrun")
    p.add_argument("--headroom", type=int, default=RELOAD_HEADROOM, help="capacity multiple")
    args = p.parse_args(argv)
    if args.headroom < 1:
        p.error("--headroom must be >= 1")
    return args


def main() -> None:
    quiet_logs()
    args = parse_args()
    if relaunched_under_torchrun(__file__, args.world_size or 1):
        return
    reshard(args)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
