"""Sharded tables that grow against the unsharded collection built at capacity,
one torchrun job.

Run by ``tests/test_growth.py``::

    torchrun --nproc_per_node 2 -m tests.sharding.growth_worker RESULT.json   # repo root

``dist_worker``'s two KV tables (an LFU table with admission, an LRU one) with
``initial_capacity`` at 1/64 of their capacity, sharded row-wise and table-wise
by a constrained stock planner: every shard starts at its share of the initial
capacity and grows on its own, so outputs at every step and, at the end, every
id's row, score and optimizer state equal those of the unsharded collection
built at capacity (``dist_worker``'s options, no growth). At the end each shard
is grown to its maximum (its content rehashed), whose capacity
``compare_tables`` checks.
"""

from __future__ import annotations

from dataclasses import replace

from tests.sharding import dist_worker as base
from tests.torchrun_jobs import Tally, gather, scenarios_main

STEPS = 6
OPTIONS = {
    name: replace(options, initial_capacity=options.capacity // 64)
    for name, options in base.OPTIONS.items()
}


def growth_scenario(sharding: str, fused: dict):
    def run() -> dict:
        dmp, ref = base.sharded_twin(OPTIONS, base.OPTIONS, sharding, fused)
        sharded = dmp.module.ebc
        tally = Tally(base.TOL)
        local = sharded.kv_tables()
        tally.check("shards start small", all(t.capacity < t.max_capacity for t in local.values()))
        base.train_twins(dmp, ref, STEPS, tally)
        parts = gather({n: t.metrics()["growths"] for n, t in local.items()})
        for table in local.values():  # to its maximum, which compare_tables checks
            table.grow(table.max_capacity)
        base.compare_tables(tally, sharded, ref, {n: sharding for n in OPTIONS})
        for name in OPTIONS:
            grown = sum(p.get(name, 0) for p in parts)
            tally.check(f"{name} shards grew", grown > 0)
        result = tally.result()
        result["growths"] = parts
        return result

    return run


SCENARIOS = {
    "growth_row_wise": growth_scenario(base.RW, base.ADAGRAD),
    "growth_table_wise": growth_scenario(base.TW, base.SGD),
}


if __name__ == "__main__":
    scenarios_main(SCENARIOS)
