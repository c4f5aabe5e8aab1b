"""Sharded TTL tables against the unsharded collection, one torchrun job.

Run by ``tests/test_ttl.py``::

    torchrun --nproc_per_node 2 -m tests.sharding.ttl_worker RESULT.json   # repo root

``dist_worker``'s two KV tables with a TTL (an LFU table with admission, an LRU
one), swept whole every step, sharded row-wise and table-wise by a constrained
stock planner: every rank's shard frees its own rows, so outputs at every step
and, at the end, every id's row, score and optimizer state equal the unsharded
collection's, and the ranks' ``ttl_evictions`` add up to its own.

``ttl_checkpoint_row_wise`` (with ``WORK_DIR``, the job's second argument):
after the row-wise steps, ``checkpoint.save`` writes the sharded model to
``WORK_DIR/ckpt``, then the unsharded collection (never saved) trains on
``MORE`` steps and rank 0 writes the ids it holds after each of them to
``WORK_DIR/held.pt``: the test loads the checkpoint at world size 1, trains on
the same batches and must hold the same ids (the LFU table's saved last steps
free the same rows at the same steps).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from tests.sharding import dist_worker as base
from tests.torchrun_jobs import Tally, gather, scenarios_main
from torchrec_kvemb import checkpoint
from torchrec_kvemb.options import TTLOptions

STEPS = 6
#: Steps the unsharded collection trains on after the checkpoint.
MORE = 4
#: Whole sweeps: a shard (fewer buckets) frees what the unsharded table frees.
OPTIONS = {
    "user": replace(base.OPTIONS["user"], ttl=TTLOptions(steps=2, sweep_buckets_per_step=10**6)),
    "item": replace(base.OPTIONS["item"], ttl=TTLOptions(steps=3, sweep_buckets_per_step=10**6)),
}


def ttl_scenario(sharding: str, fused: dict):
    def run() -> dict:
        dmp, ref = base.sharded_twin(OPTIONS, OPTIONS, sharding, fused)
        sharded = dmp.module.ebc
        tally = Tally(base.TOL)
        base.train_twins(dmp, ref, STEPS, tally)
        base.compare_tables(tally, sharded, ref, {n: sharding for n in OPTIONS})
        local = {n: t.metrics()["ttl_evictions"] for n, t in sharded.kv_tables().items()}
        parts = gather(local)
        freed = {}
        for name, table in ref.kv_tables().items():
            freed[name] = (sum(p.get(name, 0) for p in parts), table.metrics()["ttl_evictions"])
            tally.check(f"{name} ttl_evictions add up", freed[name][0] == freed[name][1])
            tally.check(f"{name} freed rows", freed[name][1] > 0)
        result = tally.result()
        result["ttl_evictions"] = freed  # (sharded, unsharded) by table
        return result

    return run


def unsharded_steps(model, first: int, steps: int) -> list[dict[str, torch.Tensor]]:
    """Train the unsharded ``model`` (an EBC, or an ``EBCModel``) on the global batches
    ``first ..``; the ids each table holds after each step."""
    pools, held = base.id_pools(2**62), []
    ebc = getattr(model, "ebc", model)
    for step in range(first, first + steps):
        batch = base.global_batch(step, 2, pools, base.TWIN_DIMS)
        model(batch.kjt(base.TWIN_KEYS, False)).values().sum().backward()
        held.append({n: t.export()["ids"] for n, t in ebc.kv_tables().items()})
    return held


def checkpoint_scenario() -> dict:
    dmp, ref = base.sharded_twin(OPTIONS, OPTIONS, base.RW, base.ADAGRAD)
    tally = Tally(base.TOL)
    base.train_twins(dmp, ref, STEPS, tally)
    work = Path(sys.argv[2])
    checkpoint.save(dmp, work / "ckpt")
    held = unsharded_steps(ref, STEPS, MORE)
    if dist.get_rank() == 0:
        torch.save(held, work / "held.pt")
    return tally.result()


SCENARIOS = {
    "ttl_row_wise": ttl_scenario(base.RW, base.ADAGRAD),
    "ttl_table_wise": ttl_scenario(base.TW, base.SGD),
    "ttl_checkpoint_row_wise": checkpoint_scenario,
}


if __name__ == "__main__":
    scenarios_main(SCENARIOS)
