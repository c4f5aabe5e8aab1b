"""KV tables under 2D parallelism on CPU: 4 gloo processes as 2 replica groups x 2
sharding ranks, laid out as ``DMPCollection`` lays them out, KV replicas synced by
``KVReplicaSync`` after every step. Run by ``tests/sharding/test_replica_2d.py``::

    torchrun --nproc_per_node 4 -m tests.sharding.replica_2d_worker RESULT.json

``DMPCollection`` itself refuses non-CUDA devices, so this builds what it builds:
its ``_create_process_groups`` mesh (sharding groups ``[0, 2]``, ``[1, 3]``; replica
groups ``[0, 1]``, ``[2, 3]``), a plan for 2 ranks remapped by its
``_remap_sharding_plan``, a ``ShardingEnv2D``, and ``DistributedModelParallel``.

Scenarios:

* ``sgd_global_batch``: SGD, ample capacity: after every sync every replica's rows
  and scores equal an unsharded ``KVEmbeddingBagCollection`` fed the global batch
  (ids and scores exactly, rows to float tolerance), and the outputs of each step too.
* ``sequence_row_wise``: the same for sequence tables (``EmbeddingCollection``).
* ``eviction_pressure``: small capacities (LRU with row-wise Adagrad, NONE), ids
  drawn from a large pool: the merge evicts, and after every sync the replicas
  hold the same ids in the same slots with bitwise equal rows, state, scores and
  clocks.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection
from torchrec.distributed.model_parallel import DistributedModelParallel, DMPCollection
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.types import ShardingEnv2D
from torchrec.modules.embedding_configs import PoolingType

from tests.sharding import ec_dist_worker as ec_worker
from tests.sharding.dist_worker import ADAGRAD, BATCH, SGD, EBCModel, global_batch
from tests.torchrun_jobs import Tally, gather, gloo_job, run_scenarios
from torchrec_kvemb import (
    EvictionPolicy,
    KVEmbeddingBagCollection,
    KVEmbeddingBagCollectionSharder,
    KVEmbeddingCollection,
    KVEmbeddingCollectionSharder,
    KVTableOptions,
)
from torchrec_kvemb.sharding.dmp_collection import kv_syncs_for_contexts
from torchrec_kvemb.sharding.replica_sync import (
    KVReplicaSync,
    ShardState,
    kv_replica_sync_enabled,
)

#: Replica groups x sharding ranks.
R, S = 2, 2
STEPS = 5
TOL = 1e-5
CPU = torch.device("cpu")
META = torch.device("meta")
KEYS = ["u1", "u2", "i"]
DIMS = {"u1": 6, "u2": 6, "i": 3}


def configs() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name="user", embedding_dim=6, num_embeddings=2**40, feature_names=["u1", "u2"]
        ),
        EmbeddingBagConfig(
            name="item",
            embedding_dim=3,
            num_embeddings=2**40,
            feature_names=["i"],
            pooling=PoolingType.MEAN,
        ),
    ]


def env_2d() -> ShardingEnv2D:
    """The mesh and groups DMPCollection builds for N = R x S (its own methods, on CPU)."""
    like_dmp = SimpleNamespace(_device=CPU)
    mesh, sharding_pg, replica_pg = DMPCollection._create_process_groups(
        like_dmp, global_rank=dist.get_rank(), world_size=R * S, local_size=S
    )
    assert isinstance(mesh, DeviceMesh)
    return ShardingEnv2D(
        sharding_pg=sharding_pg,
        replica_pg=replica_pg,
        global_pg=dist.GroupMember.WORLD,
        device_mesh=mesh,
    )


def sharded_2d(options: dict, fused: dict, sharding: str):
    """The bag model sharded ``sharding`` within each sharding group, its env and plan."""
    sharder = KVEmbeddingBagCollectionSharder(options, fused_params=fused)
    return shard_2d(EBCModel(EmbeddingBagCollection(configs(), device=META)), sharder, sharding)


def shard_2d(model, sharder, sharding: str):
    """``model`` (on meta) planned for S ranks with every KV table ``sharding``, the plan
    remapped to this rank's sharding group, sharded over the ``ShardingEnv2D``."""
    tables = sharder.table_options
    constraints = {name: ParameterConstraints(sharding_types=[sharding]) for name in tables}
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=S, compute_device="cpu"), constraints=constraints
    )
    plan = planner.plan(model, [sharder])
    DMPCollection._remap_sharding_plan(
        SimpleNamespace(_device=CPU),
        plan=plan,
        rank=dist.get_rank(),
        step=R,
        sharding_group_size=S,
    )
    env = env_2d()
    with kv_replica_sync_enabled():
        dmp = DistributedModelParallel(model, env=env, device=CPU, plan=plan, sharders=[sharder])
    return dmp, env, plan


def train_step(dmp, ref, step: int, pools: dict, tally: Tally | None) -> None:
    """One global batch: this rank's bags through the 2D model, all of them through
    ``ref`` (if any; loss divided by R x S, as TorchRec divides by S and the sync by R)."""
    rank = dist.get_rank()
    batch = global_batch(step, R * S, pools, DIMS)
    kt = dmp(batch.kjt(KEYS, False, rank))
    rows = slice(rank * BATCH, (rank + 1) * BATCH)
    sum(((kt[k] * batch.coeff[k][rows]).sum() for k in KEYS), torch.zeros(())).backward()
    if ref is None:
        return
    ref_kt = ref(batch.kjt(KEYS, False)).to_dict()
    for k in KEYS:
        tally.diff("outputs", kt[k], ref_kt[k][rows])
    (sum((ref_kt[k] * batch.coeff[k]).sum() for k in KEYS) / (R * S)).backward()


def replicas_equal(sync: KVReplicaSync, env: ShardingEnv2D) -> bool:
    """Whether every replica holds the same bits as this one (every rank calls it)."""
    same = True
    for table in sync.tables.values():
        for part in ("keys", "scores", "weights", "state"):
            mine = getattr(table, part).contiguous()
            seen = [torch.empty_like(mine) for _ in range(R)]
            dist.all_gather(seen, mine, group=env.replica_pg)
            same = same and all(torch.equal(s, mine) for s in seen)
    return same


def check_replicas_equal(tally: Tally, sync: KVReplicaSync, env: ShardingEnv2D) -> None:
    """Every table's keys (ids by slot), scores, rows, state and clocks are the same
    bits on every replica."""
    for name, table in sync.tables.items():
        for part in ("keys", "scores", "weights", "state", "clock"):
            mine = getattr(table, part).contiguous()
            seen = [torch.empty_like(mine) for _ in range(R)]
            dist.all_gather(seen, mine, group=env.replica_pg)
            tally.check(
                f"{name} {part} equal over replicas", all(torch.equal(s, mine) for s in seen)
            )


def compare_with_reference(tally: Tally, sync: KVReplicaSync, ref, env: ShardingEnv2D) -> None:
    """This sharding group's shards, put together, hold every id of ``ref`` with its
    score (exactly) and row (to tolerance)."""
    group = dist.get_rank() % R  # sharding group [g, g + R]
    exports = gather((group, {n.split(".")[-1]: t.export() for n, t in sync.tables.items()}))
    mine = [d for g, d in exports if g == group]
    for name, ref_table in ref.kv_tables().items():
        parts = [d[name] for d in mine if name in d]
        merged = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        order = torch.argsort(merged["ids"])
        merged = {k: v[order] for k, v in merged.items()}
        want = ref_table.export()
        same = torch.equal(merged["ids"], want["ids"])
        tally.check(f"{name} same ids as the global-batch table", same)
        if same:
            tally.check(f"{name} same scores", torch.equal(merged["scores"], want["scores"]))
            tally.diff("rows", merged["weights"], want["weights"])


def check_state_dict(tally: Tally, dmp, sync: KVReplicaSync, env: ShardingEnv2D) -> None:
    """``state_dict()`` under ``ShardingEnv2D``: each rank's shard holds its table's ids
    and rows, and the global size is that of its sharding group's shards (the hooks
    gather over ``sharding_pg``, not the global group)."""
    sd = dmp.state_dict()
    for fqn, table in sync.tables.items():
        prefix = f"ebc.embedding_bags.{fqn.split('.')[-1]}."
        want = table.export()
        ids = torch.cat([s.tensor for s in sd[prefix + "weight_id"].local_shards()]).view(-1)
        rows = torch.cat([s.tensor for s in sd[prefix + "weight"].local_shards()])
        order = torch.argsort(ids)
        tally.exact(f"{fqn} state_dict ids", ids[order], want["ids"])
        tally.exact(f"{fqn} state_dict rows", rows[order], want["weights"])
    for fqn, table in sync.tables.items():  # row-wise: every rank holds every table
        total = torch.tensor([table.size])
        dist.all_reduce(total, group=env.sharding_pg)
        prefix = f"ebc.embedding_bags.{fqn.split('.')[-1]}."
        tally.check(f"{fqn} state_dict size", sd[prefix + "weight_id"].size()[0] == int(total))


def sgd_scenario(sharding: str) -> Callable[[], dict]:
    def run() -> dict:
        options = {
            "user": KVTableOptions(
                capacity=1024, seed=3, total_num_buckets=16, init_low=-0.5, init_high=0.5
            ),
            "item": KVTableOptions(
                capacity=512, seed=4, total_num_buckets=16, init_low=-0.5, init_high=0.5
            ),
        }
        dmp, env, _ = sharded_2d(options, SGD, sharding)
        ref = KVEmbeddingBagCollection(configs(), options, fused_params=SGD)
        # what KVDMPCollection builds for its one context
        (sync,) = kv_syncs_for_contexts(dmp, [SimpleNamespace(replica_pg=env.replica_pg)])
        tally = Tally(TOL)
        held = sum(gather(len(sync.tables)))
        tally.check(
            "every table has a shard in every group",
            held == 2 * (R * S if sharding == "row_wise" else R),
        )
        pools = {"u1": torch.arange(40) * 7 + 2**41, "u2": torch.arange(30), "i": torch.arange(25)}
        apart = []
        for step in range(STEPS):
            train_step(dmp, ref, step, pools, tally)
            apart.append(not replicas_equal(sync, env))
            stats = sync.sync()
            tally.check("no sync evictions", all(s.sync_evictions == 0 for s in stats.values()))
            check_replicas_equal(tally, sync, env)
            compare_with_reference(tally, sync, ref, env)
        if sharding == "row_wise":
            check_state_dict(tally, dmp, sync, env)
        # the check has teeth: before each sync the replicas had trained apart
        tally.check("replicas differ before every sync", all(gather(all(apart))))
        return tally.result()

    return run


def pressure_scenario() -> dict:
    options = {
        "user": KVTableOptions(
            capacity=64, seed=5, total_num_buckets=4, init_low=-0.5, init_high=0.5
        ),
        "item": KVTableOptions(
            capacity=64,
            seed=6,
            total_num_buckets=4,
            eviction=EvictionPolicy.NONE,
            init_low=-0.5,
            init_high=0.5,
        ),
    }
    dmp, env, _ = sharded_2d(options, ADAGRAD, "row_wise")
    sync = KVReplicaSync.of_module(dmp, env.replica_pg)
    tally = Tally(0.0)
    pools = {
        "u1": torch.arange(400) * 5 + 2**50,
        "u2": torch.arange(300),
        "i": torch.arange(300) * 3,
    }
    evictions = changed = capacities = 0
    for step in range(STEPS):
        train_step(dmp, None, step, pools, None)
        stats = sync.sync()
        evictions += sum(s.sync_evictions for s in stats.values())
        changed += sum(s.changed_slots for s in stats.values())
        capacities += sum(t.capacity for t in sync.tables.values())
        check_replicas_equal(tally, sync, env)
        for name, table in sync.tables.items():
            keys = table.keys[table.keys >= 0]
            tally.check(f"{name} each id once", keys.unique().numel() == keys.numel())
    # the exchange is by changed slot: fewer than all, and none after no training
    tally.check("sent fewer slots than the shards hold", changed < capacities)
    before = {n: ShardState.of_table(t) for n, t in sync.tables.items()}
    stats = sync.sync()
    tally.check("nothing sent without training", all(s.changed_slots == 0 for s in stats.values()))
    for name, table in sync.tables.items():
        after = ShardState.of_table(table)
        tally.exact(f"{name} keys unchanged by an idle sync", after.keys, before[name].keys)
        tally.exact(f"{name} rows unchanged by an idle sync", after.rows, before[name].rows)
    total = sum(gather(evictions))
    tally.check("the merge evicted ids", total > 0)
    result = tally.result()
    result["sync_evictions"] = total
    result["changed_slots_per_slot"] = changed / capacities
    return result


def sequence_scenario() -> dict:
    """Sequence tables (``EmbeddingCollection``), row-wise, SGD: every
    step's outputs and, after each sync, the ids, scores and rows equal an unsharded
    ``KVEmbeddingCollection`` fed the global batch; replicas bitwise equal."""
    options = {
        name: KVTableOptions(
            capacity=512, seed=7 + i, total_num_buckets=16, init_low=-0.5, init_high=0.5
        )
        for i, name in enumerate(ec_worker.FEATURES)
    }
    sharder = KVEmbeddingCollectionSharder(options, fused_params=SGD)
    model = ec_worker.ECModel(EmbeddingCollection(ec_worker.kv_configs(), device=META))
    dmp, env, _ = shard_2d(model, sharder, "row_wise")
    ref = KVEmbeddingCollection(ec_worker.kv_configs(), options, fused_params=SGD)
    sync = KVReplicaSync.of_module(dmp, env.replica_pg)
    tally = Tally(TOL)
    rank, keys = dist.get_rank(), ec_worker.KEYS
    for step in range(STEPS):
        batch = ec_worker.GlobalBatch(step, R * S, keys)
        out = dmp(batch.kjt(keys, rank))
        ref_out = ref(batch.kjt(keys))
        ec_worker.compare_outputs(tally, out, ref_out, batch, rank)
        batch.loss(out, rank).backward()
        (batch.loss(ref_out, None) / (R * S)).backward()
        sync.sync()
        check_replicas_equal(tally, sync, env)
        compare_with_reference(tally, sync, ref, env)
    return tally.result()


SCENARIOS: dict[str, Callable[[], dict]] = {
    "sgd_global_batch_row_wise": sgd_scenario("row_wise"),
    "sgd_global_batch_table_wise": sgd_scenario("table_wise"),
    "sequence_row_wise": sequence_scenario,
    "eviction_pressure": pressure_scenario,
}


def main() -> None:
    with gloo_job():
        run_scenarios(sys.argv[1], SCENARIOS)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
