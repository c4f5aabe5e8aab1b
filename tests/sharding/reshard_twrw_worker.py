"""Resharding table-row-wise KV tables in place against resharding through a
checkpoint: 4 processes standing for 2 nodes x 2 local ranks.

Run by ``tests/sharding/test_reshard.py``::

    torchrun --nproc_per_node 4 -m tests.sharding.reshard_twrw_worker RESULT.json WORK_DIR

Every worker sets ``LOCAL_WORLD_SIZE=2`` before the process group starts (TorchRec
reads it for its node groups). Each scenario trains a model, saves it, reshards
it in place with ``DistributedModelParallel.reshard``, and builds a twin with the
new plan that loads the checkpoint; both train on, and outputs at every step and,
at the end, every table's rows, optimizer state, scores, last-seen steps,
admission counters, step counters and learning rates must be equal bit for bit,
every id on the rank owning it.

* ``bags``: an EBC of five KV tables and a stock one, each KV table changing:
  ``a`` row-wise -> table-row-wise on node 1, ``b`` (MEAN, TTL) table-row-wise
  on node 0 -> row-wise, ``c`` table-wise on rank 3 -> table-row-wise on node 0,
  ``d`` table-row-wise on node 1 -> table-wise on rank 1, ``e`` table-row-wise
  node 0 -> node 1; then the plans refused (a table-row-wise table not on the
  ranks of one node, a column-wise one).
* ``sequences``: an EC of three KV tables and a stock one: ``a`` row-wise ->
  table-row-wise on node 1, ``b`` table-row-wise on node 0 -> table-wise on rank
  3, ``c`` table-row-wise node 1 -> node 0.
"""

from __future__ import annotations

import dataclasses
import os
import sys

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
from torchrec.distributed.types import ParameterSharding, ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.sharding.reshard_worker import compare, kv_snapshot, refused
from tests.torchrun_jobs import Tally, scenarios_main
from torchrec_kvemb import (
    EvictionPolicy,
    KVEmbeddingBagCollectionSharder,
    KVEmbeddingCollectionSharder,
    KVTableOptions,
    TTLOptions,
    checkpoint,
)
from torchrec_kvemb.sharding import owner_rank

#: Ranks per node.
LOCAL = 2
WORLD = 4
#: Every table's routing buckets: a multiple of the world (row-wise) and of L.
G = 100
BATCH = 4
STEPS_BEFORE = 3
STEPS_AFTER = 3
KV = "customized_kernel"
META, CPU = torch.device("meta"), torch.device("cpu")
TWRW = "table_row_wise"


def node(n: int) -> list[int]:
    return list(range(n * LOCAL, (n + 1) * LOCAL))


def plan_for(module: nn.Module, sharder, placement: dict) -> dict[str, ParameterSharding]:
    """The plan of ``placement`` (table -> ``("rw",)``, ``("tw", rank)``, ``("twrw",
    node)``, or ``("stock", rank)``: a stock table table-wise)."""
    generators = {}
    for name, (kind, *where) in placement.items():
        if kind == "rw":
            generators[name] = row_wise(compute_kernel=KV)
        elif kind == "tw":
            generators[name] = table_wise(rank=where[0], compute_kernel=KV)
        elif kind == "twrw":
            generators[name] = table_row_wise(host_index=where[0])
        else:
            generators[name] = table_wise(rank=where[0], compute_kernel="fused")
    plan = construct_module_sharding_plan(
        module, generators, sharder, local_size=LOCAL, world_size=WORLD, device_type="cpu"
    )
    for name, (kind, *_) in placement.items():
        if kind == "twrw":
            plan[name].compute_kernel = KV
    return plan


def check_owners(tally: Tally, snap: dict, placement: dict, label: str) -> None:
    """Each table on the ranks its placement names, each id on the rank owning it."""
    for name, (kind, *where) in placement.items():
        if kind == "stock":
            continue
        ranks = list(range(WORLD)) if kind == "rw" else where if kind == "tw" else node(where[0])
        held = [r for r, ids in snap[name]["rows per rank"].items() if ids.numel()]
        tally.check(f"{label}: {name} rows on {ranks}", set(held) <= set(ranks) and held != [])
        tally.check(f"{label}: {name} shards on {ranks}", snap[name]["ranks"] == ranks)
        for rank, ids in snap[name]["rows per rank"].items():
            local = owner_rank(ids, G, len(ranks))
            want = torch.tensor(ranks)[local] if kind != "tw" else torch.full_like(ids, ranks[0])
            tally.check(f"{label}: {name} ids on their owner", bool((want == rank).all()))


def twin_round(
    tally: Tally,
    build,
    step,
    path: str,
    before_placement: dict,
    after_placement: dict,
    label: str,
) -> DistributedModelParallel:
    """Train ``before``, save, reshard in place to ``after``, against a twin built with
    ``after`` that loads the checkpoint; both train on. Returns the resharded model."""
    model = build(before_placement)
    for i in range(STEPS_BEFORE):
        if i == 1:
            for group in model.fused_optimizer.param_groups:
                group["lr"] = 0.07
        step(model, i)
    module = next(iter(model.plan.plan))
    before = kv_snapshot(model, module)
    tally.check(
        f"{label}: rows trained", all(v["export"]["ids"].numel() > 8 for v in before.values())
    )
    check_owners(tally, before, before_placement, f"{label} before")
    ckpt = os.path.join(path, f"{label}_ckpt")
    checkpoint.save(model, ckpt)
    new_plan = build.plan(after_placement)
    delta = {k: v for k, v in new_plan.items() if after_placement[k][0] != "stock"}
    model.reshard({module: (0.0, delta)}, module)
    after = kv_snapshot(model, module)
    # Step counters: the largest over the old shards, as a checkpoint saves them (a
    # sequence shard that received no id in a step has not counted it).
    saved = {n: {**v, "steps": [max(v["steps"])]} for n, v in before.items()}
    compare(tally, after, saved, f"{label}: in place, nothing lost")
    check_owners(tally, after, after_placement, f"{label} after")
    tally.check(
        f"{label}: module plan",
        dict(getattr(model.module, module).module_sharding_plan) == new_plan,
    )
    twin = build(after_placement)
    checkpoint.load(twin, ckpt)
    compare(tally, kv_snapshot(twin, module), after, f"{label}: checkpoint twin vs in place")
    for i in range(STEPS_BEFORE, STEPS_BEFORE + STEPS_AFTER):
        got, want = step(model, i), step(twin, i)
        for key in want:
            tally.exact(f"{label}: outputs {key}", got[key], want[key])
    final = kv_snapshot(model, module)
    compare(tally, final, kv_snapshot(twin, module), f"{label}: after training on")
    return model


# ------------------------------------------------------------------- bags
FUSED = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1}
OPTIONS = {
    "a": KVTableOptions(
        capacity=400,
        eviction=EvictionPolicy.LFU,
        admission_threshold=2,
        seed=1,
        total_num_buckets=G,
    ),
    "b": KVTableOptions(capacity=400, ttl=TTLOptions(steps=1000), seed=2, total_num_buckets=G),
    "c": KVTableOptions(capacity=300, seed=3, total_num_buckets=G),
    "d": KVTableOptions(capacity=300, eviction=EvictionPolicy.LFU, seed=4, total_num_buckets=G),
    "e": KVTableOptions(capacity=300, seed=5, total_num_buckets=G),
}
DIMS = {"a": 8, "b": 4, "c": 6, "d": 4, "e": 8, "s": 4}
KEYS = ["a", "b", "c", "d", "e", "s"]


def bag_configs() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=k if k != "s" else "stock",
            embedding_dim=DIMS[k],
            num_embeddings=2**40 if k != "s" else 97,
            feature_names=[k],
            pooling=PoolingType.MEAN if k == "b" else PoolingType.SUM,
        )
        for k in KEYS
    ]


class BagModel(nn.Module):
    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.ebc = ebc
        self.dense = nn.Linear(4, 1)

    def forward(self, kjt: KeyedJaggedTensor):
        kt = self.ebc(kjt)
        return kt, self.dense(kt["s"])


def bag_sharder() -> KVEmbeddingBagCollectionSharder:
    return KVEmbeddingBagCollectionSharder(OPTIONS, fused_params=FUSED)


def bag_plan(placement: dict) -> dict[str, ParameterSharding]:
    return plan_for(EmbeddingBagCollection(bag_configs(), device=META), bag_sharder(), placement)


def bag_build(placement: dict) -> DistributedModelParallel:
    model = BagModel(EmbeddingBagCollection(bag_configs(), device=META))
    plan = ShardingPlan({"ebc": bag_plan(placement)})
    return DistributedModelParallel(model, device=CPU, plan=plan, sharders=[bag_sharder()])


bag_build.plan = bag_plan


def pools() -> dict[str, torch.Tensor]:
    return {
        "a": torch.randint(0, 2**62, (40,), generator=torch.Generator().manual_seed(7)),
        "b": torch.arange(30) * 101,
        "c": torch.arange(25) + 2**50,
        "d": torch.arange(20) * 1000,
        "e": torch.arange(30) * 7919,
        "s": torch.arange(97),
    }


def bag_step(model: DistributedModelParallel, i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * i + dist.get_rank())
    ids = pools()
    lengths = [torch.randint(0, 4, (BATCH,), generator=g) for _ in KEYS]
    values = [
        ids[k][torch.randint(0, ids[k].numel(), (int(n.sum()),), generator=g)]
        for k, n in zip(KEYS, lengths, strict=True)
    ]
    kjt = KeyedJaggedTensor.from_lengths_sync(KEYS, torch.cat(values), torch.cat(lengths))
    kt, dense = model(kjt)
    kt = kt.to_dict()
    coeff = {k: torch.randn(BATCH, DIMS[k], generator=g) for k in KEYS}
    (sum((kt[k] * coeff[k]).sum() for k in KEYS) + dense.sum()).backward()
    return {k: v.detach() for k, v in kt.items()}


BAGS_BEFORE = {
    "a": ("rw",),
    "b": ("twrw", 0),
    "c": ("tw", 3),
    "d": ("twrw", 1),
    "e": ("twrw", 0),
    "stock": ("stock", 2),
}
BAGS_AFTER = {
    "a": ("twrw", 1),
    "b": ("rw",),
    "c": ("twrw", 0),
    "d": ("tw", 1),
    "e": ("twrw", 1),
    "stock": ("stock", 2),
}


def bags(work_dir: str) -> dict:
    tally = Tally(0.0)
    model = twin_round(tally, bag_build, bag_step, work_dir, BAGS_BEFORE, BAGS_AFTER, "bags")
    # Refused plans, nothing changed.
    sharded = model.module.ebc
    env = sharded._env
    snap = kv_snapshot(model)
    plan = dict(sharded.module_sharding_plan)
    split = dataclasses.replace(plan["a"], ranks=[1, 2])
    tally.check(
        "twrw not on one node refused",
        refused(sharded, {"a": split}, env, "all ranks of one node"),
    )
    column_wise = dataclasses.replace(plan["d"], sharding_type="column_wise")
    tally.check(
        "column-wise refused, saying why",
        refused(sharded, {"d": column_wise}, env, "cut or joined by columns"),
    )
    compare(tally, kv_snapshot(model), snap, "refused changes nothing")
    tally.check("plan unchanged", dict(sharded.module_sharding_plan) == plan)
    return tally.result()


# -------------------------------------------------------------- sequences
EC_FUSED = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05}
EC_OPTIONS = {
    "a": KVTableOptions(capacity=300, admission_threshold=2, seed=6, total_num_buckets=G),
    "b": KVTableOptions(capacity=300, seed=7, total_num_buckets=G),
    "c": KVTableOptions(capacity=300, eviction=EvictionPolicy.LFU, seed=8, total_num_buckets=G),
}
EC_KEYS = ["a", "b", "c", "s"]


def ec_configs() -> list[EmbeddingConfig]:
    return [
        EmbeddingConfig(
            name=k if k != "s" else "stock",
            embedding_dim=8,
            num_embeddings=2**40 if k != "s" else 97,
            feature_names=[k],
        )
        for k in EC_KEYS
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
    return plan_for(EmbeddingCollection(ec_configs(), device=META), ec_sharder(), placement)


def ec_build(placement: dict) -> DistributedModelParallel:
    model = ECModel(EmbeddingCollection(ec_configs(), device=META))
    plan = ShardingPlan({"ec": ec_plan(placement)})
    return DistributedModelParallel(model, device=CPU, plan=plan, sharders=[ec_sharder()])


ec_build.plan = ec_plan


def ec_step(model: DistributedModelParallel, i: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(500 + 10 * i + dist.get_rank())
    ids = pools()
    lengths = [torch.randint(0, 4, (BATCH,), generator=g) for _ in EC_KEYS]
    values = [
        ids[k][torch.randint(0, ids[k].numel(), (int(n.sum()),), generator=g)]
        for k, n in zip(EC_KEYS, lengths, strict=True)
    ]
    kjt = KeyedJaggedTensor.from_lengths_sync(EC_KEYS, torch.cat(values), torch.cat(lengths))
    out, dense = model(kjt)
    got = {k: out[k].values() for k in EC_KEYS}
    weight = {k: torch.randn(v.shape, generator=g) for k, v in got.items()}
    (sum((v * weight[k]).sum() for k, v in got.items()) + dense.sum()).backward()
    return {k: v.detach() for k, v in got.items()}


EC_BEFORE = {"a": ("rw",), "b": ("twrw", 0), "c": ("twrw", 1), "stock": ("stock", 0)}
EC_AFTER = {"a": ("twrw", 1), "b": ("tw", 3), "c": ("twrw", 0), "stock": ("stock", 0)}


def sequences(work_dir: str) -> dict:
    tally = Tally(0.0)
    twin_round(tally, ec_build, ec_step, work_dir, EC_BEFORE, EC_AFTER, "sequences")
    return tally.result()


if __name__ == "__main__":
    # 4 processes as 2 nodes x 2 local ranks: TorchRec reads LOCAL_WORLD_SIZE.
    os.environ["LOCAL_WORLD_SIZE"] = str(LOCAL)
    work = sys.argv[2]
    scenarios_main({"bags": lambda: bags(work), "sequences": lambda: sequences(work)})
