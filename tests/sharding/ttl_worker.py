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

import torch.distributed as dist
from torchrec import EmbeddingBagCollection
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import ParameterConstraints

from tests.sharding import dist_worker as base
from tests.torchrun_jobs import Tally, gather, scenarios_main
from torchrec_kvemb import KVEmbeddingBagCollection, KVEmbeddingBagCollectionSharder
from torchrec_kvemb.options import TTLOptions

STEPS = 6
#: Whole sweeps: a shard (fewer buckets) frees what the unsharded table frees.
OPTIONS = {
    "user": replace(base.OPTIONS["user"], ttl=TTLOptions(steps=2, sweep_buckets_per_step=10**6)),
    "item": replace(base.OPTIONS["item"], ttl=TTLOptions(steps=3, sweep_buckets_per_step=10**6)),
}


def ttl_scenario(sharding: str, fused: dict):
    def run() -> dict:
        configs = base.kv_configs(2**40)
        sharder = KVEmbeddingBagCollectionSharder(OPTIONS, fused_params=fused)
        model = base.EBCModel(EmbeddingBagCollection(configs, device=base.META))
        constraints = {name: ParameterConstraints(sharding_types=[sharding]) for name in OPTIONS}
        plan = base.planned(model, [sharder], constraints)
        dmp = DistributedModelParallel(model, device=base.CPU, plan=plan, sharders=[sharder])
        sharded = dmp.module.ebc
        ref = KVEmbeddingBagCollection(configs, OPTIONS, fused_params=fused)
        tally = Tally(base.TOL)
        keys = ["u1", "u2", "i"]
        pools = base.id_pools(2**62)
        dims = {"u1": 8, "u2": 8, "i": 4, "sa": 4, "sb": 8}
        for step in range(STEPS):
            batch = base.global_batch(step, dist.get_world_size(), pools, dims)
            base.train_step(dmp, ref, batch, keys, False, tally)
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
