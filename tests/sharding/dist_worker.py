"""Sharded KV training against an unsharded ``KVEmbeddingBagCollection``, one torchrun job.

Run by ``tests/sharding/test_distributed.py``::

    torchrun --nproc_per_node N -m tests.sharding.dist_worker RESULT.json   # repo root

Every rank builds the unsharded reference from the same options and seeds and
feeds it the global batch (all ranks' bags, rank-major); the sharded model sees
its own rank's bags. The sharded loss on rank r is ``sum(out_r * coeff_r)``,
the reference loss their mean over ranks (TorchRec divides gradients by the
world size). Per scenario, rank 0 writes the largest differences (outputs at
every step; every id's row, optimizer state and score at the end) and whether
they pass. The assertions live in the test.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist
from torchrec.modules.embedding_configs import PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

from tests.torchrun_jobs import Tally, gather, gloo_job, run_scenarios
from torchrec_kvemb import (
    EvictionPolicy,
    Initializer,
    KVEmbeddingBagCollection,
    KVEmbeddingBagCollectionSharder,
    KVTableOptions,
)
from torchrec_kvemb.sharding import ShardedKVEmbeddingBagCollection, owner_rank
from torchrec_kvemb.sharding.kv_embedding import shard_options
from torchrec_kvemb.table import KVTable, resolve_capacity

#: Bags per rank and feature, training steps per scenario.
BATCH = 6
STEPS = 4
#: Largest difference that passes: float32 sums over a different order.
TOL = 1e-5
RW, TW = "row_wise", "table_wise"
KV_KERNEL = "customized_kernel"
META = torch.device("meta")
CPU = torch.device("cpu")


# ------------------------------------------------------------------ tables
def kv_configs(num_embeddings: int) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name="user",
            embedding_dim=8,
            num_embeddings=num_embeddings,
            feature_names=["u1", "u2"],
            # honoured sharded as unsharded: the same rows at any world size
            init_fn=partial(torch.nn.init.trunc_normal_, std=0.5, a=-0.4, b=0.9),
        ),
        EmbeddingBagConfig(
            name="item",
            embedding_dim=4,
            num_embeddings=num_embeddings,
            feature_names=["i"],
            pooling=PoolingType.MEAN,
        ),
    ]


STOCK_CONFIGS = [
    EmbeddingBagConfig(name="stock_a", embedding_dim=4, num_embeddings=200, feature_names=["sa"]),
    EmbeddingBagConfig(
        name="stock_b", embedding_dim=8, num_embeddings=200_000, feature_names=["sb"]
    ),
]

# 96 buckets: divisible by every world size the test runs (2 and 3).
OPTIONS = {
    "user": KVTableOptions(
        capacity=4096,
        eviction=EvictionPolicy.LFU,
        admission_threshold=2,
        seed=1,
        total_num_buckets=96,
    ),
    "item": KVTableOptions(
        capacity=2048, initializer=Initializer.NORMAL, seed=2, total_num_buckets=96
    ),
}

ADAGRAD = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1}
ADAM = {"optimizer": EmbOptimType.ADAM, "learning_rate": 0.05}
SGD = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.3}


# ----------------------------------------------------------------- batches
def id_pools(max_id: int) -> dict[str, torch.Tensor]:
    """Ids each feature draws from: few enough to repeat (admission, updates)."""
    g = torch.Generator().manual_seed(0)
    big = torch.randint(0, max_id, (48,), generator=g)
    big[:2] = torch.tensor([max_id, max_id - 1])
    strided = torch.arange(40) * 96  # one routing-bucket stride apart: still spread
    return {
        "u1": big,
        "u2": torch.cat([big[:16], torch.arange(16)]),
        "i": strided,
        "sa": torch.arange(200),
        "sb": torch.arange(100),
    }


@dataclass
class GlobalBatch:
    """All ranks' bags: feature -> (lengths [W*B], ids, weights)."""

    features: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    coeff: dict[str, torch.Tensor] = field(default_factory=dict)

    def kjt(self, keys: list[str], weighted: bool, rank: int | None = None) -> KeyedJaggedTensor:
        """The KJT of ``keys``: every bag, or only ``rank``'s."""
        lengths, values, weights = [], [], []
        for key in keys:
            lens, ids, w = self.features[key]
            offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
            lo, hi = (0, lens.numel()) if rank is None else (rank * BATCH, (rank + 1) * BATCH)
            lengths.append(lens[lo:hi])
            values.append(ids[offsets[lo] : offsets[hi]])
            weights.append(w[offsets[lo] : offsets[hi]])
        return KeyedJaggedTensor.from_lengths_sync(
            keys=keys,
            values=torch.cat(values),
            lengths=torch.cat(lengths),
            weights=torch.cat(weights) if weighted else None,
        )


def global_batch(step: int, world: int, pools: dict[str, torch.Tensor], dims: dict) -> GlobalBatch:
    g = torch.Generator().manual_seed(1000 + step)
    features, coeff = {}, {}
    for key, pool in pools.items():
        lens = torch.randint(0, 5, (world * BATCH,), generator=g)
        ids = pool[torch.randint(0, pool.numel(), (int(lens.sum()),), generator=g)]
        weights = torch.rand(ids.numel(), generator=g) + 0.5
        features[key] = (lens, ids, weights)
        coeff[key] = torch.randn(world * BATCH, dims[key], generator=g)
    return GlobalBatch(features, coeff)


# ------------------------------------------------------------------- models
class EBCModel(nn.Module):
    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, kjt: KeyedJaggedTensor):
        return self.ebc(kjt)


class PipelineBatch(Pipelineable):
    """A rank's batch for TrainPipelineSparseDist: features and the loss coefficients
    (one column per output column)."""

    def __init__(self, kjt: KeyedJaggedTensor, coeff: torch.Tensor) -> None:
        self.kjt = kjt
        self.coeff = coeff

    def to(self, device: torch.device, non_blocking: bool = False) -> PipelineBatch:
        return PipelineBatch(self.kjt.to(device), self.coeff.to(device))

    def record_stream(self, stream) -> None:
        pass


class LossModel(nn.Module):
    """What TrainPipelineSparseDist drives (and fx-traces): batch -> (loss, pooled values)."""

    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, batch: PipelineBatch):
        values = self.ebc(batch.kjt).values()
        return (values * batch.coeff).sum(), values.detach()


# ------------------------------------------------------------- comparisons
def compare_outputs(tally: Tally, got: dict, ref: dict, keys: list[str], rank: int) -> None:
    for key in keys:
        tally.diff("outputs", got[key], ref[key][rank * BATCH : (rank + 1) * BATCH])


def gather_exports(tables: dict[str, KVTable]) -> list[tuple[int, dict]]:
    """Every rank's exports of its table shards, with its rank."""
    return list(enumerate(gather({name: t.export() for name, t in tables.items()})))


def compare_tables(
    tally: Tally,
    sharded: ShardedKVEmbeddingBagCollection,
    ref: KVEmbeddingBagCollection,
    shardings: dict[str, str],
) -> None:
    """Every id's row, optimizer state and score; ids on the rank that owns them;
    shard capacities (1 / W of the table row-wise, all of it table-wise)."""
    world = dist.get_world_size()
    local = sharded.kv_tables()
    for name, table in local.items():
        num_shards = world if shardings[name] == RW else 1
        options = shard_options(ref.table(name).options, num_shards)
        expected = resolve_capacity(options, table.dim, table.state_dim)
        tally.check(f"{name} shard capacity", table.capacity == expected)
    parts = gather_exports(local)
    for name, ref_table in ref.kv_tables().items():
        held = [(r, d[name]) for r, d in parts if name in d]
        if shardings[name] == TW:
            tally.check(f"{name} on one rank", len(held) == 1)
        else:
            tally.check(f"{name} on every rank", len(held) == world)
            for r, d in held:
                owners = owner_rank(d["ids"], ref_table.options.total_num_buckets, world)
                tally.check(f"{name} ids on their owner rank", bool((owners == r).all()))
        merged = {k: torch.cat([d[k] for _, d in held]) for k in held[0][1]}
        order = torch.argsort(merged["ids"])
        merged = {k: v[order] for k, v in merged.items()}
        want = ref_table.export()
        same_ids = torch.equal(merged["ids"], want["ids"])
        tally.check(f"{name} same ids", same_ids)
        if not same_ids:
            continue
        tally.check(f"{name} same scores", torch.equal(merged["scores"], want["scores"]))
        tally.diff("rows", merged["weights"], want["weights"])
        for key in want:
            if key not in ("ids", "weights", "scores"):
                tally.diff("optimizer state", merged[key], want[key])


# ----------------------------------------------------------------- running
def planned(model: nn.Module, sharders: list, constraints: dict | None = None):
    world = dist.get_world_size()
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, compute_device="cpu"), constraints=constraints
    )
    return planner.collective_plan(model, sharders, dist.GroupMember.WORLD)


def train_step(model, ref, batch: GlobalBatch, keys, weighted, tally, step_hook=None) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    kt = model(batch.kjt(keys, weighted, rank))
    ref_kt = ref(batch.kjt(keys, weighted)).to_dict()
    compare_outputs(tally, {k: kt[k] for k in keys}, ref_kt, keys, rank)
    rows = slice(rank * BATCH, (rank + 1) * BATCH)
    loss = sum((kt[k] * batch.coeff[k][rows]).sum() for k in keys)
    loss.backward()
    ref_loss = sum((ref_kt[k] * batch.coeff[k]).sum() for k in keys) / world
    ref_loss.backward()


#: The bag features the training twins read, and the dims of every pool
#: ``global_batch`` draws.
TWIN_KEYS = ["u1", "u2", "i"]
TWIN_DIMS = {"u1": 8, "u2": 8, "i": 4, "sa": 4, "sb": 8}


def sharded_twin(
    options: dict, ref_options: dict, sharding: str, fused: dict
) -> tuple[DistributedModelParallel, KVEmbeddingBagCollection]:
    """An EBC on meta whose ``options`` tables are KV, sharded ``sharding`` by a
    constrained stock planner, and its unsharded KV twin of ``ref_options``."""
    configs = kv_configs(2**40)
    sharder = KVEmbeddingBagCollectionSharder(options, fused_params=fused)
    model = EBCModel(EmbeddingBagCollection(configs, device=META))
    constraints = {name: ParameterConstraints(sharding_types=[sharding]) for name in options}
    plan = planned(model, [sharder], constraints)
    dmp = DistributedModelParallel(model, device=CPU, plan=plan, sharders=[sharder])
    return dmp, KVEmbeddingBagCollection(configs, ref_options, fused_params=fused)


def train_twins(dmp, ref: KVEmbeddingBagCollection, steps: int, tally: Tally) -> None:
    """``steps`` global batches through both twins (``train_step``)."""
    pools = id_pools(2**62)
    for step in range(steps):
        batch = global_batch(step, dist.get_world_size(), pools, TWIN_DIMS)
        train_step(dmp, ref, batch, TWIN_KEYS, False, tally)


def kv_scenario(
    sharding: str, fused: dict, weighted: bool = False, lr_schedule: dict | None = None
) -> Callable[[], dict]:
    """EBC on meta with two KV tables, sharded ``sharding`` by a constrained stock planner."""

    def run() -> dict:
        world = dist.get_world_size()
        configs = kv_configs(2**40)
        sharder = KVEmbeddingBagCollectionSharder(OPTIONS, fused_params=fused)
        model = EBCModel(EmbeddingBagCollection(configs, device=META, is_weighted=weighted))
        constraints = {name: ParameterConstraints(sharding_types=[sharding]) for name in OPTIONS}
        plan = planned(model, [sharder], constraints)
        dmp = DistributedModelParallel(model, device=CPU, plan=plan, sharders=[sharder])
        sharded = dmp.module.ebc
        ref = KVEmbeddingBagCollection(configs, OPTIONS, is_weighted=weighted, fused_params=fused)
        tally = Tally(TOL)
        tally.check("sharded type", isinstance(sharded, ShardedKVEmbeddingBagCollection))
        for name, ps in plan.plan["ebc"].items():
            tally.check(f"{name} planned {sharding}", ps.sharding_type == sharding)
            tally.check(f"{name} planned {KV_KERNEL}", ps.compute_kernel == KV_KERNEL)
        keys = ["u1", "u2", "i"]
        pools = id_pools(2**62)
        dims = {"u1": 8, "u2": 8, "i": 4, "sa": 4, "sb": 8}
        for step in range(STEPS):
            if lr_schedule and step in lr_schedule:
                set_lr(dmp, ref, lr_schedule[step], tally)
            batch = global_batch(step, world, pools, dims)
            frozen = lr_schedule is not None and lr_schedule.get(step) == 0.0
            before = gather_exports(sharded.kv_tables()) if frozen else None
            train_step(dmp, ref, batch, keys, weighted, tally)
            if frozen:
                check_frozen(tally, before, gather_exports(sharded.kv_tables()))
        # Eval: read-only, ids without a row pool as zeros (fresh ids in this batch).
        dmp.eval()
        ref.eval()
        batch = global_batch(STEPS, world, id_pools(2**61), dims)
        rank = dist.get_rank()
        with torch.no_grad():
            kt = dmp(batch.kjt(keys, weighted, rank))
            ref_kt = ref(batch.kjt(keys, weighted)).to_dict()
        for key in keys:
            tally.diff("eval outputs", kt[key], ref_kt[key][rank * BATCH : (rank + 1) * BATCH])
        compare_tables(tally, sharded, ref, {n: sharding for n in OPTIONS})
        result = tally.result()
        result["plan"] = plan_summary(plan)
        return result

    return run


def set_lr(dmp, ref: KVEmbeddingBagCollection, lr: float, tally: Tally) -> None:
    """The change goes through DMP's fused optimizer; the reference follows by hand."""
    groups = dmp.fused_optimizer.param_groups
    tally.check("fused_optimizer has a group", len(groups) > 0)
    for group in groups:
        group["lr"] = lr
    for table in ref.kv_tables().values():
        table.optim = table.optim.with_learning_rate(lr)


def check_frozen(tally: Tally, before: list, after: list) -> None:
    """At lr 0, rows stored before the step are unchanged by it."""
    for (_, old), (_, new) in zip(before, after):
        for name in old:
            kept = torch.isin(new[name]["ids"], old[name]["ids"])
            was = torch.isin(old[name]["ids"], new[name]["ids"])
            same = torch.equal(new[name]["weights"][kept], old[name]["weights"][was])
            tally.check("lr 0 leaves stored rows unchanged", same)


def plan_summary(plan) -> dict:
    return {
        f"{path}.{table}": f"{ps.sharding_type}/{ps.compute_kernel} ranks={ps.ranks}"
        for path, module_plan in plan.plan.items()
        for table, ps in module_plan.items()
    }


def mixed_scenario() -> dict:
    """KV and stock tables in one EBC, planned by a bare stock planner (DMP, plan=None)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    configs = kv_configs(2**40) + STOCK_CONFIGS
    sharder = KVEmbeddingBagCollectionSharder(OPTIONS, fused_params=ADAGRAD)
    model = EBCModel(EmbeddingBagCollection(configs, device=META))
    dmp = DistributedModelParallel(model, device=CPU, sharders=[sharder])
    sharded = dmp.module.ebc
    plan = dmp.plan.plan["ebc"]
    ref = KVEmbeddingBagCollection(kv_configs(2**40), OPTIONS, fused_params=ADAGRAD)
    tally = Tally(TOL)
    for name, ps in plan.items():
        is_kv = ps.compute_kernel == KV_KERNEL
        tally.check(f"{name} kernel", is_kv == (name in OPTIONS))
    stock_weights = gather_stock_weights(dmp)
    kv_keys, stock_keys = ["u1", "u2", "i"], ["sa", "sb"]
    pools = id_pools(2**62)
    dims = {"u1": 8, "u2": 8, "i": 4, "sa": 4, "sb": 8}
    for step in range(STEPS):
        batch = global_batch(step, world, pools, dims)
        kt = dmp(batch.kjt(kv_keys + stock_keys, False, rank))
        ref_kt = ref(batch.kjt(kv_keys, False)).to_dict()
        compare_outputs(tally, {k: kt[k] for k in kv_keys}, ref_kt, kv_keys, rank)
        if step == 0:  # stock rows as planned and initialized, before any update
            for key, table in (("sa", "stock_a"), ("sb", "stock_b")):
                lens, ids, _ = batch.features[key]
                offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
                want = nn.functional.embedding_bag(
                    ids, stock_weights[table], offsets[:-1], mode="sum"
                )
                tally.diff(
                    "stock outputs (step 0)", kt[key], want[rank * BATCH : (rank + 1) * BATCH]
                )
        rows = slice(rank * BATCH, (rank + 1) * BATCH)
        loss = sum((kt[k] * batch.coeff[k][rows]).sum() for k in kv_keys + stock_keys)
        loss.backward()
        (sum((ref_kt[k] * batch.coeff[k]).sum() for k in kv_keys) / world).backward()
    compare_tables(tally, sharded, ref, {n: plan[n].sharding_type for n in OPTIONS})
    sizes = {n: m["size"] for n, m in sharded.metrics().items()}
    total = {n: 0 for n in OPTIONS}
    for part in gather(sizes):
        for n, s in part.items():
            total[n] += s
    for n in OPTIONS:
        tally.check(f"{n} metrics size sums to the reference's", total[n] == ref.table(n).size)
    result = tally.result()
    result["plan"] = plan_summary(dmp.plan)
    return result


def gather_stock_weights(dmp) -> dict[str, torch.Tensor]:
    """Full weights of the stock tables, from whichever ranks hold them."""
    state = dmp.state_dict()
    local = {}
    for config in STOCK_CONFIGS:
        value = state[f"ebc.embedding_bags.{config.name}.weight"]
        if hasattr(value, "local_shards"):
            local[config.name] = [
                (s.metadata.shard_offsets, s.tensor.clone()) for s in value.local_shards()
            ]
        else:
            local[config.name] = [([0, 0], value.detach().clone())]
    full = {c.name: torch.zeros(c.num_embeddings, c.embedding_dim) for c in STOCK_CONFIGS}
    for part in gather(local):
        for name, shards in part.items():
            for (row, col), tensor in shards:
                full[name][row : row + tensor.shape[0], col : col + tensor.shape[1]] = tensor
    return full


def pipeline_scenario() -> dict:
    """A KVEmbeddingBagCollection (ids up to 2**63 - 1) sharded by DMP's own plan,
    trained by TrainPipelineSparseDist."""
    rank, world = dist.get_rank(), dist.get_world_size()
    configs = kv_configs(2**63 - 1)
    fused = ADAGRAD

    def build() -> KVEmbeddingBagCollection:
        return KVEmbeddingBagCollection(configs, OPTIONS, fused_params=fused)

    sharder = KVEmbeddingBagCollectionSharder(module_type=KVEmbeddingBagCollection)
    dmp = DistributedModelParallel(LossModel(build()), device=CPU, sharders=[sharder])
    sharded = dmp.module.ebc
    ref = build()
    tally = Tally(TOL)
    tally.check("sharded type", isinstance(sharded, ShardedKVEmbeddingBagCollection))
    keys = ["u1", "u2", "i"]
    pools = {k: v for k, v in id_pools(2**63 - 1).items() if k in keys}
    dims = {"u1": 8, "u2": 8, "i": 4}
    batches = [global_batch(step, world, pools, dims) for step in range(STEPS)]
    rows = slice(rank * BATCH, (rank + 1) * BATCH)
    coeffs = [torch.cat([b.coeff[k] for k in keys], dim=1) for b in batches]
    local = [PipelineBatch(b.kjt(keys, False, rank), c[rows]) for b, c in zip(batches, coeffs)]
    dense = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.0)
    pipeline = TrainPipelineSparseDist(dmp, dense, CPU)
    it = iter(local)
    for step in range(STEPS):
        got = pipeline.progress(it)
        want = ref(batches[step].kjt(keys, False)).values()
        tally.diff("outputs", got, want[rows])
        ((want * coeffs[step]).sum() / world).backward()
    pipelined = [type(m).__name__ for m in pipeline._pipelined_modules]
    tally.check("sharded module pipelined", "ShardedKVEmbeddingBagCollection" in pipelined)
    compare_tables(
        tally, sharded, ref, {n: ps.sharding_type for n, ps in dmp.plan.plan["ebc"].items()}
    )
    result = tally.result()
    result["plan"] = plan_summary(dmp.plan)
    return result


SCENARIOS: dict[str, Callable[[], dict]] = {
    "kv_row_wise": kv_scenario(RW, ADAGRAD),
    "kv_table_wise": kv_scenario(TW, ADAM),
    "weighted_row_wise": kv_scenario(RW, SGD, weighted=True),
    "weighted_table_wise": kv_scenario(TW, ADAGRAD, weighted=True),
    "mixed_stock_planner": mixed_scenario,
    "lr_change": kv_scenario(RW, ADAGRAD, lr_schedule={2: 0.0, 3: 0.02}),
    "train_pipeline": pipeline_scenario,
}


def main() -> None:
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else list(SCENARIOS)
    with gloo_job():
        run_scenarios(sys.argv[1], {name: SCENARIOS[name] for name in only})


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
