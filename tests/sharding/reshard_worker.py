"""Resharding in place against resharding through a checkpoint, one torchrun job.

Run by ``tests/sharding/test_reshard.py``::

    torchrun --nproc_per_node 3 -m tests.sharding.reshard_worker RESULT.json WORK_DIR

An EBC on meta holds three KV tables and a stock one under plan ``BEFORE``
(``user`` row-wise, ``item`` table-wise on rank 0, ``tag`` table-wise on rank
1, ``stock`` table-wise on rank 1). The model trains a few steps (its KV
learning rate changed through ``fused_optimizer``), is saved, and resharded in
place to ``AFTER`` (``user`` table-wise on rank 2, ``item`` row-wise, ``tag``
moved to rank 0) by ``DistributedModelParallel.reshard``. Its twin is built
with ``AFTER`` and loads the checkpoint. Both then train on: outputs at every
step, and at the end every table's rows, optimizer state, scores, last-seen
steps, admission counters, step counters and learning rates, must be equal bit
for bit. A last scenario hands ``update_shards`` bad plans: each is refused
naming the table, and nothing changes; then a table-wise table moves
table-row-wise over the node of 3 ranks. Table-row-wise tables across 2 nodes:
``reshard_twrw_worker``.
"""

from __future__ import annotations

import dataclasses
import os
import sys
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
    table_row_wise,
    table_wise,
)
from torchrec.distributed.types import ParameterSharding, ShardingEnv, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.torchrun_jobs import Tally, gather, scenarios_main
from torchrec_kvemb import (
    EvictionPolicy,
    KVEmbeddingBagCollection,
    KVEmbeddingBagCollectionSharder,
    KVEmbeddingCollectionSharder,
    KVTableOptions,
    SSDOptions,
    TTLOptions,
    checkpoint,
)
from torchrec_kvemb.sharding import ShardedKVEmbeddingBagCollection, owner_rank, reshard_rows
from torchrec_kvemb.state_dict import admission_state
from torchrec_kvemb.ttl import last_seen_state, uses_last_seen

BATCH = 5
STEPS_BEFORE = 3
STEPS_AFTER = 3
KV = "customized_kernel"
META = torch.device("meta")
CPU = torch.device("cpu")
FUSED = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1}
#: 3 ranks: 99 buckets divide by 3 (and the last scenario's 2 ranks do not matter).
OPTIONS = {
    "user": KVTableOptions(
        capacity=700,
        eviction=EvictionPolicy.LFU,
        admission_threshold=2,
        seed=1,
        total_num_buckets=99,
    ),
    "item": KVTableOptions(
        capacity=500,
        eviction=EvictionPolicy.LFU,
        ttl=TTLOptions(steps=1000),
        seed=2,
        total_num_buckets=99,
    ),
    "tag": KVTableOptions(capacity=300, seed=3, total_num_buckets=99),
}
KEYS = ["u1", "u2", "i", "t", "s"]
DIMS = {"u1": 8, "u2": 8, "i": 4, "t": 6, "s": 4}


def configs() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name="user",
            embedding_dim=8,
            num_embeddings=2**40,
            feature_names=["u1", "u2"],
            init_fn=partial(torch.nn.init.uniform_, a=-0.3, b=0.3),
        ),
        EmbeddingBagConfig(
            name="item",
            embedding_dim=4,
            num_embeddings=2**40,
            feature_names=["i"],
            pooling=PoolingType.MEAN,
        ),
        EmbeddingBagConfig(name="tag", embedding_dim=6, num_embeddings=2**40, feature_names=["t"]),
        EmbeddingBagConfig(name="stock", embedding_dim=4, num_embeddings=97, feature_names=["s"]),
    ]


class Model(nn.Module):
    """The collection and a dense layer (DMP wraps the dense part in DDP, which
    TorchRec's ``DistributedModelParallel.reshard`` expects)."""

    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.ebc = ebc
        self.dense = nn.Linear(4, 1)

    def forward(self, kjt: KeyedJaggedTensor):
        kt = self.ebc(kjt)
        return kt, self.dense(kt["s"])


def sharder(options: dict | None = None) -> KVEmbeddingBagCollectionSharder:
    return KVEmbeddingBagCollectionSharder(options or OPTIONS, fused_params=FUSED)


def plan_of(placement: dict) -> dict[str, ParameterSharding]:
    """The collection's plan for ``placement`` (table -> TorchRec plan generator)."""
    world = dist.get_world_size()
    return construct_module_sharding_plan(
        EmbeddingBagCollection(configs(), device=META),
        placement,
        sharder=sharder(),
        local_size=world,
        world_size=world,
        device_type="cpu",
    )


BEFORE = {
    "user": row_wise(compute_kernel=KV),
    "item": table_wise(rank=0, compute_kernel=KV),
    "tag": table_wise(rank=1, compute_kernel=KV),
    "stock": table_wise(rank=1, compute_kernel="fused"),
}
AFTER = {
    "user": table_wise(rank=2, compute_kernel=KV),
    "item": row_wise(compute_kernel=KV),
    "tag": table_wise(rank=0, compute_kernel=KV),
    "stock": table_wise(rank=1, compute_kernel="fused"),
}


def build(placement: dict, options: dict | None = None) -> DistributedModelParallel:
    model = Model(EmbeddingBagCollection(configs(), device=META))
    plan = ShardingPlan({"ebc": plan_of(placement)})
    return DistributedModelParallel(model, device=CPU, plan=plan, sharders=[sharder(options)])


def batch(step: int, rank: int) -> tuple[KeyedJaggedTensor, dict[str, torch.Tensor]]:
    """This rank's bags of step ``step`` (ids repeat: admission, updates) and loss
    coefficients."""
    g = torch.Generator().manual_seed(100 * step + rank)
    pools = {
        "u1": torch.randint(0, 2**62, (40,), generator=torch.Generator().manual_seed(7)),
        "u2": torch.arange(30) * 99,
        "i": torch.arange(25) + 2**50,
        "t": torch.arange(20) * 1000,
        "s": torch.arange(97),
    }
    lengths, values, coeff = [], [], {}
    for key in KEYS:
        lens = torch.randint(0, 4, (BATCH,), generator=g)
        pool = pools[key]
        values.append(pool[torch.randint(0, pool.numel(), (int(lens.sum()),), generator=g)])
        lengths.append(lens)
        coeff[key] = torch.randn(BATCH, DIMS[key], generator=g)
    kjt = KeyedJaggedTensor.from_lengths_sync(KEYS, torch.cat(values), torch.cat(lengths))
    return kjt, coeff


def step(model: DistributedModelParallel, i: int) -> dict[str, torch.Tensor]:
    kjt, coeff = batch(i, dist.get_rank())
    kt, dense = model(kjt)
    kt = kt.to_dict()
    (sum((kt[k] * coeff[k]).sum() for k in KEYS) + dense.sum()).backward()
    return {k: v.detach() for k, v in kt.items()}


def set_lr(model: DistributedModelParallel, lr: float) -> None:
    for group in model.fused_optimizer.param_groups:
        group["lr"] = lr


def kv_snapshot(model: DistributedModelParallel, path: str = "ebc") -> dict:
    """Every KV table merged over ranks, by id: export, step counters, admission, lr;
    and which rank holds which rows."""
    local = {}
    for name, table in getattr(model.module, path).kv_tables().items():
        export = table.export()
        if uses_last_seen(table.options):
            export["last_seen"] = last_seen_state(table, export["ids"])
        local[name] = {
            "export": export,
            "steps": (table.step, table.optim_step),
            "admission": admission_state(table),
            "lr": table.learning_rate,
        }
    merged: dict = {}
    for rank, part in enumerate(gather(local)):
        for name, value in part.items():
            merged.setdefault(name, []).append((rank, value))
    out = {}
    for name, parts in merged.items():
        export = {k: torch.cat([p["export"][k] for _, p in parts]) for k in parts[0][1]["export"]}
        order = torch.argsort(export["ids"])
        adm = [torch.cat([p["admission"][i] for _, p in parts]) for i in range(3)]
        adm_order = torch.argsort(adm[0])
        out[name] = {
            "export": {k: v[order] for k, v in export.items()},
            "steps": sorted({p["steps"] for _, p in parts}),
            "admission": [t[adm_order] for t in adm],
            "lr": sorted({p["lr"] for _, p in parts}),
            "ranks": [r for r, _ in parts],
            "rows per rank": {r: p["export"]["ids"] for r, p in parts},
        }
    return out


def compare(tally: Tally, got: dict, want: dict, label: str) -> None:
    tally.check(f"{label}: same tables", set(got) == set(want))
    for name in want:
        g, w = got[name], want[name]
        for key in w["export"]:
            tally.exact(f"{label}: {name} {key}", g["export"][key], w["export"][key])
        for i, what in enumerate(("ids", "counts", "scores")):
            tally.exact(f"{label}: {name} admission {what}", g["admission"][i], w["admission"][i])
        tally.check(f"{label}: {name} step counters", g["steps"] == w["steps"])
        tally.check(f"{label}: {name} learning rate", g["lr"] == w["lr"])


def stock_snapshot(model: DistributedModelParallel) -> dict:
    """The stock table's rows and fused optimizer state, on the rank holding them."""
    weight = model.state_dict()["ebc.embedding_bags.stock.weight"]
    state = model.fused_optimizer.state_dict()["state"].get("ebc.embedding_bags.stock.weight", {})
    rows = [s.tensor.clone() for s in weight.local_shards()]
    momentum = [
        s.tensor.clone()
        for value in state.values()
        if hasattr(value, "local_shards")
        for s in value.local_shards()
    ]
    return {"rows": rows, "momentum": momentum}


def check_placement(tally: Tally, snap: dict) -> None:
    """``AFTER``: user on rank 2 only, tag on rank 0 only, item on every rank by owner."""
    world = dist.get_world_size()
    tally.check("user held by rank 2 only", snap["user"]["ranks"] == [2])
    tally.check("tag held by rank 0 only", snap["tag"]["ranks"] == [0])
    tally.check("item held by every rank", snap["item"]["ranks"] == list(range(world)))
    for rank, ids in snap["item"]["rows per rank"].items():
        tally.check("item ids on their owner", bool((owner_rank(ids, 99, world) == rank).all()))


def in_place_vs_checkpoint(work_dir: str) -> dict:
    tally = Tally(0.0)
    rank = dist.get_rank()
    model = build(BEFORE)
    sharded = model.module.ebc
    tally.check("sharded type", isinstance(sharded, ShardedKVEmbeddingBagCollection))
    for i in range(STEPS_BEFORE):
        if i == 1:
            set_lr(model, 0.07)
        step(model, i)
    before = kv_snapshot(model)
    tally.check("rows were trained", all(v["export"]["ids"].numel() > 10 for v in before.values()))
    tally.check("admission waits", before["user"]["admission"][0].numel() > 0)
    tally.check(
        "last-seen steps differ", before["item"]["export"]["last_seen"].unique().numel() > 1
    )
    stock_before = stock_snapshot(model)
    path = os.path.join(work_dir, "ckpt")
    checkpoint.save(model, path)

    new_plan = plan_of(AFTER)
    delta = {k: v for k, v in new_plan.items() if k != "stock"}
    model.reshard({"ebc": (0.0, delta)}, "ebc")
    after = kv_snapshot(model)
    compare(tally, after, before, "in place, nothing lost")
    check_placement(tally, after)
    tally.check("DMP plan is the new one", model.plan.plan["ebc"] == new_plan)
    tally.check("module plan is the new one", dict(sharded.module_sharding_plan) == new_plan)
    tally.check("same module", model.module.ebc is sharded)
    stock_after = stock_snapshot(model)
    for key in ("rows", "momentum"):
        for a, b in zip(stock_after[key], stock_before[key], strict=True):
            tally.exact(f"stock {key} kept", a, b)
    held = {"user": rank == 2, "item": True, "tag": rank == 0}
    tally.check(
        "kv_tables() holds the new shards",
        set(sharded.kv_tables()) == {n for n, h in held.items() if h},
    )
    tally.check("metrics() follows", set(sharded.metrics()) == set(sharded.kv_tables()))

    twin = build(AFTER)
    checkpoint.load(twin, path)
    compare(tally, kv_snapshot(twin), after, "checkpoint twin vs in place")
    tally.check("same state_dict keys", set(twin.state_dict()) == set(model.state_dict()))
    fused_keys = set(model.fused_optimizer.state_dict()["state"])
    tally.check(
        "same fused optimizer keys", fused_keys == set(twin.fused_optimizer.state_dict()["state"])
    )

    for i in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
        if i == STEPS_BEFORE + 1:  # the fused optimizer still drives the KV tables
            set_lr(model, 0.2)
            set_lr(twin, 0.2)
        got, want = step(model, i), step(twin, i)
        for key in KEYS:
            tally.exact(f"outputs {key}", got[key], want[key])
    final = kv_snapshot(model)
    compare(tally, final, kv_snapshot(twin), "after training on")
    tally.check("lr change reached the KV tables", all(v["lr"] == [0.2] for v in final.values()))
    for key in ("rows", "momentum"):
        for a, b in zip(stock_snapshot(model)[key], stock_snapshot(twin)[key], strict=True):
            tally.exact(f"stock {key} after training on", a, b)
    # A second round trip of the resharded model's state_dict loads into itself.
    model.load_state_dict(model.state_dict())
    compare(tally, kv_snapshot(model), final, "resharded state_dict round trip")
    return tally.result()


def refused(module, change: dict, env: ShardingEnv, words: str) -> bool:
    try:
        module.update_shards(change, env, CPU)
    except ValueError as e:
        return words in str(e)
    return False


def bad_plans(work_dir: str) -> dict:
    tally = Tally(0.0)
    model = build(BEFORE)
    for i in range(2):
        step(model, i)
    sharded = model.module.ebc
    before = kv_snapshot(model)
    plan_before = dict(sharded.module_sharding_plan)
    env = sharded._env
    new = plan_of(AFTER)
    world = dist.get_world_size()
    bigger = ShardingEnv(world + 1, env.rank, env.process_group)
    tally.check("another world size refused", refused(sharded, new, bigger, "world size"))
    wrong_kernel = plan_of({**AFTER, "tag": table_wise(rank=0, compute_kernel="fused")})
    tally.check(
        "KV table with a stock kernel refused",
        refused(sharded, {"tag": wrong_kernel["tag"]}, env, "table 'tag'"),
    )
    column_wise = dataclasses.replace(new["tag"], sharding_type="column_wise")
    tally.check(
        "KV table column-wise refused",
        refused(sharded, {"tag": column_wise}, env, "table 'tag'"),
    )
    tally.check("unknown table refused", refused(sharded, {"nope": new["tag"]}, env, "'nope'"))
    moved_stock = plan_of({**BEFORE, "stock": table_wise(rank=0, compute_kernel="fused")})
    tally.check(
        "moving a stock table refused",
        refused(sharded, {"stock": moved_stock["stock"]}, env, "table 'stock' is a stock table"),
    )
    off_world = plan_of({**AFTER, "tag": table_wise(rank=0, compute_kernel=KV)})["tag"]
    off_world.ranks = [world]
    tally.check(
        "a rank outside the world refused", refused(sharded, {"tag": off_world}, env, "table 'tag'")
    )
    not_a_node = dataclasses.replace(new["tag"], sharding_type="table_row_wise", ranks=[0, 1])
    tally.check(
        "table-row-wise off the node's ranks refused",
        refused(sharded, {"tag": not_a_node}, env, "all ranks of one node"),
    )
    compare(tally, kv_snapshot(model), before, "refused changes nothing")
    tally.check("plan unchanged", dict(sharded.module_sharding_plan) == plan_before)
    step(model, 2)  # still trains
    # Table-row-wise moves: ``tag`` from rank 1 to the node of 3 (LOCAL_WORLD_SIZE=3).
    trained = kv_snapshot(model)
    node_plan = plan_of({**BEFORE, "tag": table_row_wise(host_index=0)})["tag"]
    node_plan.compute_kernel = KV
    model.reshard({"ebc": (0.0, {"tag": node_plan})}, "ebc")
    spread = kv_snapshot(model)
    compare(tally, spread, trained, "tag table-row-wise, nothing lost")
    tally.check("tag on the node's ranks", spread["tag"]["ranks"] == list(range(world)))
    for rank, ids in spread["tag"]["rows per rank"].items():
        tally.check("tag ids on their owner", bool((owner_rank(ids, 99, world) == rank).all()))
    step(model, 3)
    # A collection holding a table with an SSD tier (here the one that does not move).
    ssd = SSDOptions(path=os.path.join(work_dir, "ssd"), capacity=1000)
    options = {**OPTIONS, "tag": dataclasses.replace(OPTIONS["tag"], ssd=ssd)}
    with_ssd = build(BEFORE, options)
    tally.check(
        "a collection with an SSD tier refused",
        refused(with_ssd.module.ebc, {"user": new["user"]}, env, "table 'tag' has an SSD tier"),
    )
    return tally.result()


def failing_switch() -> None:
    raise RuntimeError("switch (injected)")


def failure_midway(work_dir: str) -> dict:
    """Placing rows fails on rank 0 after its first new shard took its rows, then the
    switch fails on rank 1: every rank raises each time, the collection keeps its
    plan, shards and rows, trains on, and a later reshard loses nothing."""
    tally = Tally(0.0)
    rank = dist.get_rank()
    model = build(BEFORE)
    for i in range(2):
        step(model, i)
    sharded = model.module.ebc
    before = kv_snapshot(model)
    plan_before = dict(sharded.module_sharding_plan)
    tables_before = sharded.kv_tables()
    real = reshard_rows.restore_table
    calls = []

    def failing(table, rows):
        calls.append(table.name)
        if rank == 0 and len(calls) == 2:
            raise OSError("no space left on device (injected)")
        return real(table, rows)

    delta = {k: v for k, v in plan_of(AFTER).items() if k != "stock"}
    reshard_rows.restore_table = failing
    try:
        model.reshard({"ebc": (0.0, delta)}, "ebc")
        tally.check("failure raised", False)
    except RuntimeError as e:
        tally.check("failure raised on every rank, naming it", "injected" in str(e))
    finally:
        reshard_rows.restore_table = real
    tally.check("plan kept", dict(sharded.module_sharding_plan) == plan_before)
    tally.check("DMP plan kept", dict(model.plan.plan["ebc"]) == plan_before)
    tally.check(
        "same shards",
        all(sharded.kv_tables()[n] is t for n, t in tables_before.items())
        and set(sharded.kv_tables()) == set(tables_before),
    )
    compare(tally, kv_snapshot(model), before, "after the failure")
    step(model, 2)
    trained = kv_snapshot(model)
    # The switch to the new shardings fails on rank 1 (after rank 0 and 2 switched
    # theirs): every rank goes back to its old shardings.
    if rank == 1:
        sharded._update_output_dist = failing_switch
    try:
        model.reshard({"ebc": (0.0, delta)}, "ebc")
        tally.check("switch failure raised", False)
    except RuntimeError as e:
        tally.check("switch failure raised on every rank", "switch (injected)" in str(e))
    finally:
        sharded.__dict__.pop("_update_output_dist", None)
    tally.check(
        "plan kept after a failed switch", dict(sharded.module_sharding_plan) == plan_before
    )
    tally.check(
        "shards kept after a failed switch",
        all(sharded.kv_tables()[n] is t for n, t in tables_before.items()),
    )
    compare(tally, kv_snapshot(model), trained, "after the failed switch")
    model.reshard({"ebc": (0.0, delta)}, "ebc")
    compare(tally, kv_snapshot(model), trained, "a reshard after the failure")
    check_placement(tally, kv_snapshot(model))
    step(model, 3)
    return tally.result()


def kv_collection_module(work_dir: str) -> dict:
    """A ``KVEmbeddingBagCollection`` (Adam) sharded by its own sharder: ``DMP.reshard``
    (no module path: DMP finds the module by its sharder) moves its row-wise table
    to rank 1, then to rank 0, nothing lost."""
    tally = Tally(0.0)
    configs_kv = [c for c in configs() if c.name == "user"]
    adam = {"optimizer": EmbOptimType.ADAM, "learning_rate": 0.05}
    ebc = KVEmbeddingBagCollection(configs_kv, {"user": OPTIONS["user"]}, fused_params=adam)
    model = Model(ebc)
    model.dense = nn.Linear(8, 1)
    kv_sharder = KVEmbeddingBagCollectionSharder(module_type=KVEmbeddingBagCollection)
    world = dist.get_world_size()
    plan = {"user": row_wise(compute_kernel=KV)}

    def plan_for(placement: dict) -> dict:
        return construct_module_sharding_plan(
            ebc,
            placement,
            sharder=kv_sharder,
            local_size=world,
            world_size=world,
            device_type="cpu",
        )

    dmp = DistributedModelParallel(
        model, device=CPU, plan=ShardingPlan({"ebc": plan_for(plan)}), sharders=[kv_sharder]
    )
    keys = ["u1", "u2"]
    for i in range(2):
        kjt, coeff = batch(i, dist.get_rank())
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys,
            torch.cat([kjt[k].values() for k in keys]),
            torch.cat([kjt[k].lengths() for k in keys]),
        )
        kt = dmp.module.ebc(kjt).to_dict()
        sum((kt[k] * coeff[k]).sum() for k in keys).backward()
    before = kv_snapshot(dmp)
    new = plan_for({"user": table_wise(rank=1, compute_kernel=KV)})
    dmp.reshard({"ebc": (0.0, new)})
    after = kv_snapshot(dmp)
    compare(tally, after, before, "KVEmbeddingBagCollection resharded")
    tally.check("user on rank 1 only", after["user"]["ranks"] == [1])
    tally.check("DMP plan", dmp.plan.plan["ebc"]["user"].ranks == [1])
    # Rank 1 to rank 0: rank 2 holds neither shard, yet takes part in every exchange.
    dmp.reshard({"ebc": (0.0, plan_for({"user": table_wise(rank=0, compute_kernel=KV)}))})
    moved = kv_snapshot(dmp)
    compare(tally, moved, before, "moved on to rank 0")
    tally.check("user on rank 0 only", moved["user"]["ranks"] == [0])
    tally.check("Adam state moved", {"exp_avg", "exp_avg_sq"} <= set(moved["user"]["export"]))
    return tally.result()


# ------------------------------------------------------ sequence collection
EC_FUSED = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
EC_OPTIONS = {
    "a": KVTableOptions(capacity=400, admission_threshold=2, seed=4, total_num_buckets=99),
    "b": KVTableOptions(capacity=300, seed=5, total_num_buckets=99),
}
EC_KEYS = ["a1", "a2", "b", "s"]


def ec_configs() -> list[EmbeddingConfig]:
    return [
        EmbeddingConfig(
            name="a", embedding_dim=8, num_embeddings=2**40, feature_names=["a1", "a2"]
        ),
        EmbeddingConfig(name="b", embedding_dim=8, num_embeddings=2**40, feature_names=["b"]),
        EmbeddingConfig(name="stock", embedding_dim=8, num_embeddings=97, feature_names=["s"]),
    ]


class ECModel(nn.Module):
    def __init__(self, ec: nn.Module) -> None:
        super().__init__()
        self.ec = ec
        self.dense = nn.Linear(8, 1)

    def forward(self, kjt: KeyedJaggedTensor):
        out = self.ec(kjt)
        return out, self.dense(out["s"].values())


def ec_sharder() -> KVEmbeddingCollectionSharder:
    return KVEmbeddingCollectionSharder(EC_OPTIONS, fused_params=EC_FUSED)


def ec_plan(placement: dict) -> dict[str, ParameterSharding]:
    world = dist.get_world_size()
    return construct_module_sharding_plan(
        EmbeddingCollection(ec_configs(), device=META),
        placement,
        sharder=ec_sharder(),
        local_size=world,
        world_size=world,
        device_type="cpu",
    )


EC_BEFORE = {
    "a": row_wise(compute_kernel=KV),
    "b": table_wise(rank=0, compute_kernel=KV),
    "stock": table_wise(rank=2, compute_kernel="fused"),
}
EC_AFTER = {
    **EC_BEFORE,
    "a": table_wise(rank=1, compute_kernel=KV),
    "b": row_wise(compute_kernel=KV),
}


def ec_build(placement: dict) -> DistributedModelParallel:
    model = ECModel(EmbeddingCollection(ec_configs(), device=META))
    plan = ShardingPlan({"ec": ec_plan(placement)})
    return DistributedModelParallel(model, device=CPU, plan=plan, sharders=[ec_sharder()])


def ec_step(model: DistributedModelParallel, i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + 10 * i + dist.get_rank())
    pools = {"a1": torch.arange(60) * 7919, "a2": torch.arange(30), "b": torch.arange(40) + 2**45}
    pools["s"] = torch.arange(97)
    lengths = [torch.randint(0, 4, (BATCH,), generator=g) for _ in EC_KEYS]
    values = [
        pools[k][torch.randint(0, pools[k].numel(), (int(n.sum()),), generator=g)]
        for k, n in zip(EC_KEYS, lengths, strict=True)
    ]
    kjt = KeyedJaggedTensor.from_lengths_sync(EC_KEYS, torch.cat(values), torch.cat(lengths))
    out, dense = model(kjt)
    got = {k: out[k].values() for k in EC_KEYS}
    weight = {k: torch.randn(v.shape, generator=g) for k, v in got.items()}
    (sum((v * weight[k]).sum() for k, v in got.items()) + dense.sum()).backward()
    return {k: v.detach() for k, v in got.items()}


def sequence_collection(work_dir: str) -> dict:
    """The sequence collection: in place (``DMP.reshard``: ``a`` row-wise to table-wise
    on rank 1, ``b`` table-wise to row-wise, a stock table beside) against the
    checkpoint twin, bit for bit over training on."""
    tally = Tally(0.0)
    model = ec_build(EC_BEFORE)
    for i in range(STEPS_BEFORE):
        ec_step(model, i)
    before = kv_snapshot(model, "ec")
    tally.check("admission waits", before["a"]["admission"][0].numel() > 0)
    path = os.path.join(work_dir, "ec_ckpt")
    checkpoint.save(model, path)
    new_plan = ec_plan(EC_AFTER)
    model.reshard({"ec": (0.0, {k: new_plan[k] for k in ("a", "b")})}, "ec")
    after = kv_snapshot(model, "ec")
    compare(tally, after, before, "sequences in place, nothing lost")
    tally.check("a on rank 1 only", after["a"]["ranks"] == [1])
    tally.check("b on every rank", after["b"]["ranks"] == list(range(dist.get_world_size())))
    tally.check(
        "module plan is the new one", dict(model.module.ec.module_sharding_plan) == new_plan
    )
    twin = ec_build(EC_AFTER)
    checkpoint.load(twin, path)
    compare(tally, kv_snapshot(twin, "ec"), after, "sequences: checkpoint twin vs in place")
    for i in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
        got, want = ec_step(model, i), ec_step(twin, i)
        for key in EC_KEYS:
            tally.exact(f"sequence outputs {key}", got[key], want[key])
    compare(tally, kv_snapshot(model, "ec"), kv_snapshot(twin, "ec"), "sequences after training on")
    return tally.result()


if __name__ == "__main__":
    work = sys.argv[2]
    scenarios_main(
        {
            "in_place_vs_checkpoint": lambda: in_place_vs_checkpoint(work),
            "bad_plans": lambda: bad_plans(work),
            "failure_midway": lambda: failure_midway(work),
            "kv_collection_module": lambda: kv_collection_module(work),
            "sequence_collection": lambda: sequence_collection(work),
        }
    )
