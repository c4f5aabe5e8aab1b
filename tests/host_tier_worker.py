"""Sharded tables over host tiers against the unsharded all-in-memory collection,
and their checkpoint, one torchrun job.

Run by ``tests/test_host_tier.py``::

    torchrun --nproc_per_node 2 -m tests.host_tier_worker RESULT.json CKPT_DIR   # repo root

``dist_worker``'s two KV tables, row-wise on 2 ranks, each shard keeping 1
bucket of rows over a host tier without a bound: outputs at every step and,
at the end, every id's row, optimizer state and score equal those of the
unsharded collection holding every row in memory. Then ``checkpoint.save``
writes the sharded model to ``CKPT_DIR/ckpt``, and rank 0 writes every id's row
(all ranks' exports, merged) to ``CKPT_DIR/rows.pt`` for the test to load at
world size 1.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from tests.sharding import dist_worker as base
from tests.torchrun_jobs import Tally, gather, scenarios_main
from torchrec_kvemb import (
    HostTierOptions,
    checkpoint,
)
from torchrec_kvemb.options import WAYS

STEPS = 5
#: The all-in-memory options, admission counters of one size in both collections.
REFERENCE = {
    name: replace(options, admission_counter_capacity=options.capacity)
    for name, options in base.OPTIONS.items()
}
#: 1 bucket of rows per shard on 2 ranks, over a host tier.
TIERED = {
    name: replace(options, capacity=2 * WAYS, host_tier=HostTierOptions())
    for name, options in REFERENCE.items()
}


def merged_exports(local: dict) -> dict[str, dict[str, torch.Tensor]]:
    """Every id's row of each table, all ranks' shards merged, sorted by id."""
    parts = gather({name: table.export() for name, table in local.items()})
    out = {}
    for name in local:
        held = [p[name] for p in parts]
        merged = {k: torch.cat([h[k] for h in held]) for k in held[0]}
        order = torch.argsort(merged["ids"])
        out[name] = {k: v[order] for k, v in merged.items()}
    return out


def host_tier_scenario() -> dict:
    out_dir = Path(sys.argv[2])
    dmp, ref = base.sharded_twin(TIERED, REFERENCE, base.RW, base.ADAGRAD)
    tally = Tally(base.TOL)
    base.train_twins(dmp, ref, STEPS, tally)
    local = dmp.module.ebc.kv_tables()
    moved = gather({n: t.metrics()["host_size"] for n, t in local.items()})
    for name in TIERED:
        tally.check(f"{name}: rows in the host tiers", sum(m[name] for m in moved) > 0)
    rows = merged_exports(local)
    for name, ref_table in ref.kv_tables().items():
        want, got = ref_table.export(), rows[name]
        tally.check(f"{name}: no eviction in the reference", ref_table.metrics()["evictions"] == 0)
        tally.exact(f"{name} ids", got["ids"], want["ids"])
        tally.exact(f"{name} scores", got["scores"], want["scores"])
        for key in want.keys() - {"ids", "scores"}:
            tally.diff(f"{name} {key}", got[key], want[key])
    checkpoint.save(dmp, out_dir / "ckpt")
    if dist.get_rank() == 0:
        torch.save(rows, out_dir / "rows.pt")
    return tally.result()


SCENARIOS = {"host_tier_row_wise": host_tier_scenario}


if __name__ == "__main__":
    scenarios_main(SCENARIOS)
