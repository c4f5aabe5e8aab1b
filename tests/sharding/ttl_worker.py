"""Sharded TTL tables against the unsharded collection, one torchrun job.

Run by ``tests/test_ttl.py``::

    torchrun --nproc_per_node 2 -m tests.sharding.ttl_worker RESULT.json   # repo root

``dist_worker``'s two KV tables with a TTL (an LFU table with admission, an LRU
one), swept whole every step, sharded row-wise and table-wise by a constrained
stock planner: every rank's shard frees its own rows, so outputs at every step
and, at the end, every id's row, score and optimizer state equal the unsharded
collection's, and the ranks' ``ttl_evictions`` add up to its own.
"""

from __future__ import annotations

from dataclasses import replace

from tests.sharding import dist_worker as base
from tests.torchrun_jobs import Tally, gather, scenarios_main
from torchrec_kvemb.options import TTLOptions

STEPS = 6
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


SCENARIOS = {
    "ttl_row_wise": ttl_scenario(base.RW, base.ADAGRAD),
    "ttl_table_wise": ttl_scenario(base.TW, base.SGD),
}


if __name__ == "__main__":
    scenarios_main(SCENARIOS)
