"""Table-row-wise KV tables against an unsharded ``KVEmbeddingBagCollection``, and
their checkpoints at other world sizes and shardings: the jobs of
``tests/sharding/test_twrw_distributed.py``.

Train job: 4 processes standing for 2 nodes x 2 local ranks (one
``torchrun --nproc_per_node 4``; every worker sets ``LOCAL_WORLD_SIZE=2``
before the process group starts, which TorchRec reads for its node groups)::

    torchrun --nproc_per_node 4 -m tests.sharding.twrw_worker train DIR   # repo root

* ``twrw_training``: a weighted EBC with two KV tables (SUM ``user`` on node 1,
  MEAN ``item`` on node 0) and two stock tables (table-wise) in one collection;
  outputs at every step (and an eval step) against the unsharded KV collection
  fed the global batch, stock outputs against their weights; at the end every
  id's row, optimizer state and score, which local rank holds each id, shard
  capacities, the state_dict's bucket ranges and the fused optimizer's state by
  id. Saves ``DIR/ckpt`` and ``DIR/expected.pt`` (every id's row, state, score
  and admission counts, merged over ranks).
* ``planner``: the stock planner constrained to ``table_row_wise`` proposes it
  for both KV tables on the ranks of one node; the model it plans trains as the
  reference does.
* ``load_row_wise``: ``DIR/ckpt`` loaded into the same tables sharded row-wise
  over the 4 ranks: bit-exact rows, then one more step equal to the reference's.
* ``load_swapped_nodes``: ``DIR/ckpt`` loaded table-row-wise with each table on
  the other node: bit-exact rows.
* ``sequence_twrw``: the same for an ``EmbeddingCollection`` of two KV tables
  table-row-wise on different nodes and a stock table-wise table: rows at
  every step against the unsharded
  ``KVEmbeddingCollection``, tables at the end, and its checkpoint
  (``DIR/ec_ckpt``) loaded table-wise.
* ``sequence_dedup``: sequence tables table-row-wise under ``use_index_dedup``.

Load job (3 processes, one node of 3: ``user`` table-row-wise, ``item``
row-wise)::

    torchrun --nproc_per_node 3 -m tests.sharding.twrw_worker load DIR

and :func:`load_unsharded` (1 process, in the test's process) compare what they
loaded with ``expected.pt`` (and the sequence tables with ``ec_expected.pt``),
bit for bit. Rank 0 writes ``DIR/<job>.json``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingCollection
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.sharding_plan import (
    construct_module_sharding_plan,
    table_row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingPlan

import torchrec_kvemb.checkpoint as ckpt
from tests.sharding import ec_dist_worker as ec
from tests.sharding.dist_worker import (
    ADAGRAD,
    BATCH,
    OPTIONS,
    STEPS,
    STOCK_CONFIGS,
    EBCModel,
    GlobalBatch,
    compare_outputs,
    gather_stock_weights,
    global_batch,
    id_pools,
    kv_configs,
    plan_summary,
)
from tests.torchrun_jobs import Tally, gather, gloo_job, run_scenarios
from torchrec_kvemb import (
    KVEmbeddingBagCollection,
    KVEmbeddingBagCollectionSharder,
    KVEmbeddingCollection,
    KVEmbeddingCollectionSharder,
    KVTableOptions,
)
from torchrec_kvemb.ops.hashing import route_bucket
from torchrec_kvemb.sharding.kv_embedding import shard_options
from torchrec_kvemb.state_dict import admission_state
from torchrec_kvemb.table import resolve_capacity

TWRW, RW, TW = "table_row_wise", "row_wise", "table_wise"
KV_KERNEL = "customized_kernel"
#: The stock tables' kernel in hand-made plans (fbgemm's TBE, as the planner picks).
STOCK_KERNEL = "fused"
#: Ranks per node of the train job.
LOCAL = 2
#: Float32 sums in another order.
TOL = 1e-5
KV_KEYS = ["u1", "u2", "i"]
STOCK_KEYS = ["sa", "sb"]
DIMS = {"u1": 8, "u2": 8, "i": 4, "sa": 4, "sb": 8}
#: The train job's nodes: ``user`` on node 1, ``item`` on node 0.
HOSTS = {"user": 1, "item": 0}
META, CPU = torch.device("meta"), torch.device("cpu")
#: What the training scenario leaves for the next ones of its job: its reference.
TRAINED: dict[str, KVEmbeddingBagCollection] = {}


# ------------------------------------------------------------------ models
def reference() -> KVEmbeddingBagCollection:
    return KVEmbeddingBagCollection(
        kv_configs(2**40), OPTIONS, is_weighted=True, fused_params=ADAGRAD
    )


def sharder() -> KVEmbeddingBagCollectionSharder:
    return KVEmbeddingBagCollectionSharder(OPTIONS, fused_params=ADAGRAD)


def meta_model(with_stock: bool) -> EBCModel:
    configs = kv_configs(2**40) + (STOCK_CONFIGS if with_stock else [])
    return EBCModel(EmbeddingBagCollection(configs, device=META, is_weighted=True))


def placed_twrw_model(
    hosts: dict[str, int], with_stock: bool = True
) -> tuple[DistributedModelParallel, ShardingPlan]:
    """KV tables table-row-wise on the nodes of ``hosts``, stock tables table-wise."""
    model, kv_sharder = meta_model(with_stock), sharder()
    per_table = {name: table_row_wise(host_index=host) for name, host in hosts.items()}
    if with_stock:
        per_table.update({"stock_a": table_wise(rank=1), "stock_b": table_wise(rank=2)})
    module_plan = construct_module_sharding_plan(
        model.ebc, per_table, kv_sharder, local_size=LOCAL, world_size=4, device_type="cpu"
    )
    for name, sharding in module_plan.items():
        sharding.compute_kernel = KV_KERNEL if name in hosts else STOCK_KERNEL
    plan = ShardingPlan({"ebc": module_plan})
    return DistributedModelParallel(model, device=CPU, plan=plan, sharders=[kv_sharder]), plan


def planned_model(
    shardings: dict[str, str], with_stock: bool
) -> tuple[DistributedModelParallel, ShardingPlan]:
    """The stock planner, each KV table constrained to ``shardings[name]``."""
    model, kv_sharder = meta_model(with_stock), sharder()
    world = dist.get_world_size()
    local = int(os.environ["LOCAL_WORLD_SIZE"])
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, local_world_size=local, compute_device="cpu"),
        constraints={n: ParameterConstraints(sharding_types=[s]) for n, s in shardings.items()},
    )
    plan = planner.collective_plan(model, [kv_sharder], dist.GroupMember.WORLD)
    return DistributedModelParallel(model, device=CPU, plan=plan, sharders=[kv_sharder]), plan


# ----------------------------------------------------------------- training
def step(dmp, ref, batch: GlobalBatch, tally: Tally, label: str, stock: dict | None = None) -> None:
    """One training step of both twins on ``batch``; ``stock``: the stock tables'
    weights before any update, to check their outputs against (step 0)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    keys = KV_KEYS + (STOCK_KEYS if stock is not None else [])
    kt = dmp(batch.kjt(keys, True, rank))
    ref_kt = ref(batch.kjt(KV_KEYS, True)).to_dict()
    compare_outputs(tally, {k: kt[k] for k in KV_KEYS}, ref_kt, KV_KEYS, rank)
    rows = slice(rank * BATCH, (rank + 1) * BATCH)
    got = torch.cat([kt[k] for k in KV_KEYS], 1)
    tally.diff(f"{label} outputs", got, torch.cat([ref_kt[k][rows] for k in KV_KEYS], 1))
    if stock:
        for key, table in (("sa", "stock_a"), ("sb", "stock_b")):
            lens, ids, w = batch.features[key]
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
            want = nn.functional.embedding_bag(
                ids, stock[table], offsets[:-1], mode="sum", per_sample_weights=w
            )
            tally.diff("stock outputs (step 0)", kt[key], want[rows])
    loss = sum((kt[k] * batch.coeff[k][rows]).sum() for k in keys)
    loss.backward()
    (sum((ref_kt[k] * batch.coeff[k]).sum() for k in KV_KEYS) / world).backward()


# ------------------------------------------------------------- comparisons
def merged_tables(tables: dict, sharded: bool) -> dict[str, dict[str, torch.Tensor]]:
    """Every KV table's export (sorted by id) and admission counts, over ranks."""
    local = {name: (t.export(), admission_state(t)) for name, t in tables.items()}
    merged: dict[str, list] = {}
    for part in gather(local) if sharded else [local]:
        for name, value in part.items():
            merged.setdefault(name, []).append(value)
    out = {}
    for name, parts in merged.items():
        export = {k: torch.cat([p[0][k] for p in parts]) for k in parts[0][0]}
        order = torch.argsort(export["ids"])
        out[name] = {k: v[order] for k, v in export.items()}
        admission = [torch.cat([p[1][i] for p in parts]) for i in range(3)]
        adm_order = torch.argsort(admission[0])
        for i, key in enumerate(("admission_ids", "admission_counts", "admission_scores")):
            out[name][key] = admission[i][adm_order]
    return out


def compare_exact(tally: Tally, got: dict, want: dict, label: str) -> None:
    tally.check(f"{label}: tables", set(got) == set(want))
    for name in want:
        for key, value in want[name].items():
            tally.exact(f"{label}: {name} {key}", got.get(name, {}).get(key), value)


def compare_with_reference(tally: Tally, got: dict, ref: KVEmbeddingBagCollection) -> None:
    """Ids and scores bit-exact, rows and optimizer state to float tolerance."""
    for name, ref_table in ref.kv_tables().items():
        want = ref_table.export()
        same = torch.equal(got[name]["ids"], want["ids"])
        tally.check(f"{name} same ids", same)
        if not same:
            continue
        tally.exact(f"{name} same scores", got[name]["scores"], want["scores"])
        tally.diff("rows", got[name]["weights"], want["weights"])
        for key in want:
            if key not in ("ids", "weights", "scores"):
                tally.diff("optimizer state", got[name][key], want[key])


def check_twrw_shards(tally: Tally, dmp, ref: KVEmbeddingBagCollection, plan) -> None:
    """Each table on the ranks of its node only, every id on the local rank owning
    its bucket, ``1 / L`` of the capacity per shard, the state_dict's bucket ranges
    and the fused optimizer's state by id."""
    rank = dist.get_rank()
    sharded = dmp.module.ebc
    local = sharded.kv_tables()
    holders = gather(sorted(local))
    for name in OPTIONS:
        ranks = plan.plan["ebc"][name].ranks
        node = [r for r, names in enumerate(holders) if name in names]
        tally.check(f"{name} on the ranks of its node", node == ranks and len(ranks) == LOCAL)
        if name not in local:
            continue
        table = local[name]
        options = shard_options(ref.table(name).options, LOCAL)
        tally.check(
            f"{name} shard capacity",
            table.capacity == resolve_capacity(options, table.dim, table.state_dim),
        )
        g = options.total_num_buckets
        owner = route_bucket(table.export()["ids"], g) // (g // LOCAL)
        tally.check(f"{name} ids on their local rank", bool((owner == ranks.index(rank)).all()))
    layouts = {layout.name: layout for layout in sharded.kv_layouts()}
    for name in OPTIONS:
        ranks = plan.plan["ebc"][name].ranks
        g = OPTIONS[name].total_num_buckets
        want = None
        if rank in ranks:
            local_rank = ranks.index(rank)
            want = (local_rank * g // LOCAL, (local_rank + 1) * g // LOCAL)
        tally.check(f"{name} layout owns its buckets", layouts[name].owned == want)
        tally.check(f"{name} layout sharding", layouts[name].sharding == TWRW)
    state = dmp.state_dict()
    for name in OPTIONS:
        key = f"ebc.embedding_bags.{name}."
        bucket = state[key + "bucket"]
        tally.check(f"{name} state_dict buckets", bucket.size(0) == OPTIONS[name].total_num_buckets)
        tally.check(
            f"{name} state_dict rows", state[key + "weight_id"].size(0) == ref.table(name).size
        )
    optim = dmp.fused_optimizer.state_dict()["state"]
    for name, table in local.items():
        by_id = optim[f"ebc.embedding_bags.{name}.weight"]["by_id"]
        ids = by_id["weight_id"]
        tally.check(f"{name} optimizer state rows", ids.size(0) == ref.table(name).size)
        mine = torch.cat([s.tensor for s in ids.local_shards()])
        tally.exact(
            f"{name} optimizer state ids",
            torch.sort(mine).values,
            torch.sort(table.export()["ids"]).values,
        )


# ---------------------------------------------------------------- scenarios
def twrw_training(directory: Path):
    def run() -> dict:
        world = dist.get_world_size()
        dmp, plan = placed_twrw_model(HOSTS)
        ref = reference()
        tally = Tally(TOL)
        for name, host in HOSTS.items():
            ps = plan.plan["ebc"][name]
            tally.check(
                f"{name} planned", ps.sharding_type == TWRW and ps.compute_kernel == KV_KERNEL
            )
            tally.check(
                f"{name} on node {host}", ps.ranks == [host * LOCAL + r for r in range(LOCAL)]
            )
        pools = id_pools(2**62)
        stock = gather_stock_weights(dmp)
        for s in range(STEPS):
            batch = global_batch(s, world, pools, DIMS)
            step(dmp, ref, batch, tally, "train", stock if s == 0 else {})
        dmp.eval()
        ref.eval()
        batch = global_batch(STEPS, world, id_pools(2**61), DIMS)
        rank = dist.get_rank()
        with torch.no_grad():
            kt = dmp(batch.kjt(KV_KEYS + STOCK_KEYS, True, rank))
            ref_kt = ref(batch.kjt(KV_KEYS, True)).to_dict()
        for key in KV_KEYS:
            tally.diff("eval outputs", kt[key], ref_kt[key][rank * BATCH : (rank + 1) * BATCH])
        dmp.train()
        ref.train()
        got = merged_tables(dmp.module.ebc.kv_tables(), True)
        compare_with_reference(tally, got, ref)
        check_twrw_shards(tally, dmp, ref, plan)
        ckpt.save(dmp, directory / "ckpt")
        if rank == 0:
            torch.save(got, directory / "expected.pt")
        dist.barrier()
        TRAINED["reference"] = ref
        result = tally.result()
        result["plan"] = plan_summary(plan)
        return result

    return run


def planner_scenario() -> dict:
    world = dist.get_world_size()
    dmp, plan = planned_model({name: TWRW for name in OPTIONS}, with_stock=True)
    ref = reference()
    tally = Tally(TOL)
    for name in OPTIONS:
        ps = plan.plan["ebc"][name]
        tally.check(f"{name} planned {TWRW}", ps.sharding_type == TWRW)
        tally.check(f"{name} planned {KV_KERNEL}", ps.compute_kernel == KV_KERNEL)
        node = ps.ranks[0] // LOCAL
        tally.check(f"{name} on one node", ps.ranks == [node * LOCAL + r for r in range(LOCAL)])
    pools = id_pools(2**62)
    for s in range(2):
        step(dmp, ref, global_batch(s, world, pools, DIMS), tally, "planned", {})
    compare_with_reference(tally, merged_tables(dmp.module.ebc.kv_tables(), True), ref)
    result = tally.result()
    result["plan"] = plan_summary(plan)
    return result


def load_row_wise(directory: Path):
    def run() -> dict:
        world = dist.get_world_size()
        dmp, plan = planned_model({name: RW for name in OPTIONS}, with_stock=False)
        tally = Tally(TOL)
        for name in OPTIONS:
            tally.check(f"{name} planned {RW}", plan.plan["ebc"][name].sharding_type == RW)
        ckpt.load(dmp, directory / "ckpt")
        want = torch.load(directory / "expected.pt")
        compare_exact(tally, merged_tables(dmp.module.ebc.kv_tables(), True), want, "row_wise")
        # One step further from the checkpoint and from the reference that was never stopped.
        ref = TRAINED["reference"]
        batch = global_batch(STEPS + 1, world, id_pools(2**62), DIMS)
        step(dmp, ref, batch, tally, "after load")
        compare_with_reference(tally, merged_tables(dmp.module.ebc.kv_tables(), True), ref)
        result = tally.result()
        result["plan"] = plan_summary(plan)
        return result

    return run


def load_swapped_nodes(directory: Path):
    def run() -> dict:
        swapped = {name: 1 - host for name, host in HOSTS.items()}
        dmp, plan = placed_twrw_model(swapped, with_stock=False)
        tally = Tally(TOL)
        for name, host in swapped.items():
            ranks = plan.plan["ebc"][name].ranks
            tally.check(f"{name} on node {host}", ranks == [host * LOCAL + r for r in range(LOCAL)])
        ckpt.load(dmp, directory / "ckpt")
        want = torch.load(directory / "expected.pt")
        got = merged_tables(dmp.module.ebc.kv_tables(), True)
        compare_exact(tally, got, want, "swapped nodes")
        result = tally.result()
        result["plan"] = plan_summary(plan)
        return result

    return run


def sequence_dedup() -> dict:
    """Sequence KV tables table-row-wise under ``use_index_dedup`` (each rank sends
    each (table, id) of its batch once): rows at every step and the tables at the
    end against the unsharded ``KVEmbeddingCollection``. (No admission or LFU here:
    under dedup an id is sighted once per batch per rank, docs/sharding.md.)"""
    world = dist.get_world_size()
    options = {
        "item": ec.OPTIONS["item"],
        "user": KVTableOptions(capacity=1024, seed=4, total_num_buckets=90),
    }
    kv_sharder = KVEmbeddingCollectionSharder(
        options, fused_params=ec.ADAGRAD, use_index_dedup=True
    )
    model = ec.ECModel(EmbeddingCollection(ec.kv_configs(), device=META))
    per_table = {"item": table_row_wise(host_index=0), "user": table_row_wise(host_index=1)}
    module_plan = construct_module_sharding_plan(
        model.ec, per_table, kv_sharder, local_size=LOCAL, world_size=world, device_type="cpu"
    )
    for sharding in module_plan.values():
        sharding.compute_kernel = KV_KERNEL
    plan = ShardingPlan({"ec": module_plan})
    dmp = DistributedModelParallel(model, device=CPU, plan=plan, sharders=[kv_sharder])
    ref = KVEmbeddingCollection(ec.kv_configs(), options, fused_params=ec.ADAGRAD)
    tally = Tally(TOL)
    ec.train(dmp, ref, tally)
    merged = ec.merged_exports(dmp.module.ec)
    for name, ref_table in ref.kv_tables().items():
        want = ref_table.export()
        got = merged[name]["rows"]
        tally.exact(f"dedup {name} ids", got["ids"], want["ids"])
        if torch.equal(got["ids"], want["ids"]):
            tally.exact(f"dedup {name} scores", got["scores"], want["scores"])
            tally.diff("dedup rows", got["weights"], want["weights"])
    result = tally.result()
    result["plan"] = plan_summary(plan)
    return result


def sequence_twrw(directory: Path):
    """An ``EmbeddingCollection`` of two KV tables table-row-wise on different nodes
    and a stock table-wise table: rows at every step and an eval step against the
    unsharded ``KVEmbeddingCollection`` (stock rows against their weights), every
    id's row, state and score at the end, each id on its local owner; its
    checkpoint loaded table-wise, bit-exact."""

    def run() -> dict:
        world, rank = dist.get_world_size(), dist.get_rank()
        kv_sharder = KVEmbeddingCollectionSharder(ec.OPTIONS, fused_params=ec.ADAGRAD)
        model = ec.ECModel(EmbeddingCollection(ec.kv_configs() + [ec.STOCK], device=META))
        hosts = {"item": 1, "user": 0}
        per_table = {name: table_row_wise(host_index=host) for name, host in hosts.items()}
        per_table["stock"] = table_wise(rank=3)
        module_plan = construct_module_sharding_plan(
            model.ec, per_table, kv_sharder, local_size=LOCAL, world_size=world, device_type="cpu"
        )
        for name in hosts:
            module_plan[name].compute_kernel = KV_KERNEL
        # why fused: stock TorchRec's sequence table-wise DENSE kernel corrupts the heap
        # at 4 gloo ranks (docs/sharding.md, "Table-row-wise").
        module_plan["stock"].compute_kernel = STOCK_KERNEL
        plan = ShardingPlan({"ec": module_plan})
        dmp = DistributedModelParallel(model, device=CPU, plan=plan, sharders=[kv_sharder])
        ref = KVEmbeddingCollection(ec.kv_configs(), ec.OPTIONS, fused_params=ec.ADAGRAD)
        tally = Tally(TOL)
        stock = ec.full_stock_weight(dmp)
        batch = ec.GlobalBatch(0, world, ec.KEYS + ["s"])
        out = dmp(batch.kjt(ec.KEYS + ["s"], rank))
        ref_out = ref(batch.kjt(ec.KEYS))
        ec.compare_outputs(tally, out, ref_out, batch, rank)
        ids = batch.features["s"][1][batch.span("s", rank)]
        tally.diff("sequence stock outputs (step 0)", out["s"].values(), stock[ids])
        batch.loss(out, rank).backward()
        (batch.loss(ref_out, None) / world).backward()
        ec.train(dmp, ref, tally, ec.KEYS + ["s"])
        dmp.eval()
        ref.eval()
        batch = ec.GlobalBatch(ec.STEPS, world, ec.KEYS + ["s"])
        with torch.no_grad():
            out = dmp(batch.kjt(ec.KEYS + ["s"], rank))
            ec.compare_outputs(tally, out, ref(batch.kjt(ec.KEYS)), batch, rank)
        dmp.train()
        merged = ec.merged_exports(dmp.module.ec)
        for name, host in hosts.items():
            ranks = [host * LOCAL + r for r in range(LOCAL)]
            held = merged[name]["held"]
            tally.check(f"{name} on the ranks of its node", [r for r, _ in held] == ranks)
            g = ec.OPTIONS[name].total_num_buckets
            for r, ids in held:
                owner = route_bucket(ids, g) // (g // LOCAL)
                tally.check(
                    f"{name} ids on their local rank", bool((owner == ranks.index(r)).all())
                )
            want = ref.kv_tables()[name].export()
            got = merged[name]["rows"]
            same = torch.equal(got["ids"], want["ids"])
            tally.check(f"sequence {name} same ids", same)
            if same:
                tally.exact(f"sequence {name} same scores", got["scores"], want["scores"])
                tally.diff("sequence rows", got["weights"], want["weights"])
                tally.diff("sequence optimizer state", got["momentum1"], want["momentum1"])
        ckpt.save(dmp, directory / "ec_ckpt")
        if rank == 0:
            torch.save({n: merged[n]["rows"] for n in hosts}, directory / "ec_expected.pt")
        loaded, _ = ec.sharded_model(TW, ec.ADAGRAD)
        ckpt.load(loaded, directory / "ec_ckpt")
        reloaded = ec.merged_exports(loaded.module.ec)
        for name in hosts:
            for key, value in merged[name]["rows"].items():
                tally.exact(
                    f"sequence {name} {key} loaded table-wise", reloaded[name]["rows"][key], value
                )
        result = tally.result()
        result["plan"] = plan_summary(plan)
        return result

    return run


def load_scenario(directory: Path) -> dict:
    """``DIR/ckpt`` into ``user`` table-row-wise over one node of every rank and
    ``item`` row-wise: every id's row, state, score and admission count bit-exact;
    ``DIR/ec_ckpt`` likewise into the sequence tables (``user`` table-row-wise,
    ``item`` row-wise)."""
    dmp, plan = planned_model({"user": TWRW, "item": RW}, with_stock=False)
    tally = Tally(TOL)
    world = dist.get_world_size()
    tally.check("user planned table_row_wise", plan.plan["ebc"]["user"].sharding_type == TWRW)
    tally.check("user on every rank", plan.plan["ebc"]["user"].ranks == list(range(world)))
    tally.check("item planned row_wise", plan.plan["ebc"]["item"].sharding_type == RW)
    ckpt.load(dmp, directory / "ckpt")
    want = torch.load(directory / "expected.pt")
    got = merged_tables(dmp.module.ebc.kv_tables(), True)
    compare_exact(tally, got, want, f"{world} ranks")
    # The sequence collection's checkpoint.
    model = ec.ECModel(EmbeddingCollection(ec.kv_configs(), device=META))
    kv_sharder = KVEmbeddingCollectionSharder(ec.OPTIONS, fused_params=ec.ADAGRAD)
    shardings = {"user": TWRW, "item": RW}
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, local_world_size=world, compute_device="cpu"),
        constraints={n: ParameterConstraints(sharding_types=[t]) for n, t in shardings.items()},
    )
    ec_plan = planner.collective_plan(model, [kv_sharder], dist.GroupMember.WORLD)
    for name, sharding in shardings.items():
        tally.check(
            f"sequence {name} planned {sharding}",
            ec_plan.plan["ec"][name].sharding_type == sharding,
        )
    ec_dmp = DistributedModelParallel(model, device=CPU, plan=ec_plan, sharders=[kv_sharder])
    ckpt.load(ec_dmp, directory / "ec_ckpt")
    want = torch.load(directory / "ec_expected.pt")
    merged = ec.merged_exports(ec_dmp.module.ec)
    compare_exact(tally, {n: merged[n]["rows"] for n in want}, want, f"sequence {world} ranks")
    result = tally.result()
    result["plan"] = {**plan_summary(plan), **plan_summary(ec_plan)}
    return result


def load_unsharded(directory: str) -> dict:
    """``DIR/ckpt`` into an unsharded KV collection, in this process."""
    model = EBCModel(reference())
    ckpt.load(model, Path(directory) / "ckpt")
    want = torch.load(Path(directory) / "expected.pt")
    tally = Tally(TOL)
    compare_exact(tally, merged_tables(model.ebc.kv_tables(), False), want, "unsharded")
    sequence = ec.ECModel(
        KVEmbeddingCollection(ec.kv_configs(), ec.OPTIONS, fused_params=ec.ADAGRAD)
    )
    ckpt.load(sequence, Path(directory) / "ec_ckpt")
    want = torch.load(Path(directory) / "ec_expected.pt")
    got = {n: t.export() for n, t in sequence.ec.kv_tables().items()}
    compare_exact(tally, got, want, "sequence unsharded")
    return tally.result()


def main() -> None:
    job, directory = sys.argv[1], Path(sys.argv[2])
    if job == "train":
        # 4 processes as 2 nodes x 2 local ranks: TorchRec reads LOCAL_WORLD_SIZE.
        os.environ["LOCAL_WORLD_SIZE"] = str(LOCAL)
        scenarios = {
            "twrw_training": twrw_training(directory),
            "planner": planner_scenario,
            "load_row_wise": load_row_wise(directory),
            "load_swapped_nodes": load_swapped_nodes(directory),
            "sequence_twrw": sequence_twrw(directory),
            "sequence_dedup": sequence_dedup,
        }
    else:
        scenarios = {"load": lambda: load_scenario(directory)}
    with gloo_job():
        run_scenarios(str(directory / f"{job}.json"), scenarios)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
