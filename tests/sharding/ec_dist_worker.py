"""Sharded KV sequence embeddings against an unsharded ``KVEmbeddingCollection``,
one torchrun job.

Run by ``tests/sharding/test_ec_distributed.py``::

    torchrun --nproc_per_node N -m tests.sharding.ec_dist_worker RESULT.json [DIR]

Every rank builds the unsharded reference from the same options and feeds it the
global batch (all ranks' bags, rank-major); the sharded model sees its own
rank's bags. Rank r's loss is ``sum(rows_r * coeff_r)`` (one coefficient row per
id), the reference loss their mean over ranks (TorchRec divides gradients by
the world size). Outputs are compared per output name at every step (rows and
lengths), every id's row, optimizer state and score at the end. The
``shared_*`` scenarios add a table reading the features another table reads
(outputs ``feature@table``, as TorchRec's ``EmbeddingCollection`` names them).

With ``DIR``: the ``save`` scenario (2 ranks) trains row-wise and writes a
checkpoint to ``DIR/ckpt`` and the reference's tables to ``DIR/expected.pt``;
``load`` (any world size) loads it into a fresh sharded model and compares.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.torchrun_jobs import Tally, gather, gloo_job, run_scenarios
from torchrec_kvemb import (
    EvictionPolicy,
    KVEmbeddingCollection,
    KVEmbeddingCollectionSharder,
    KVTableOptions,
    checkpoint,
)
from torchrec_kvemb.sharding import ShardedKVEmbeddingCollection, owner_rank

#: Bags per rank and feature, training steps per scenario.
BATCH = 5
STEPS = 4
TOL = 1e-5
DIM = 8
RW, TW = "row_wise", "table_wise"
KV_KERNEL = "customized_kernel"
META = torch.device("meta")
CPU = torch.device("cpu")

FEATURES = {"item": ["history", "candidate"], "user": ["user_id"]}
KEYS = ["history", "candidate", "user_id"]
# 90 buckets: divisible by every world size the jobs run (2 and 3).
OPTIONS = {
    "item": KVTableOptions(capacity=2048, seed=3, total_num_buckets=90),
    "user": KVTableOptions(
        capacity=1024, eviction=EvictionPolicy.LFU, admission_threshold=2, seed=4,
        total_num_buckets=90,
    ),
}  # fmt: skip
#: A third table reading both features of ``item``: every one of them is shared.
SHARED_FEATURES = {**FEATURES, "recent": ["candidate", "history"]}
SHARED_OPTIONS = {**OPTIONS, "recent": KVTableOptions(capacity=1024, seed=5, total_num_buckets=90)}
STOCK = EmbeddingConfig(name="stock", embedding_dim=DIM, num_embeddings=97, feature_names=["s"])

ADAGRAD = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1}
SGD = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.3}
ADAM = {"optimizer": EmbOptimType.ADAM, "learning_rate": 0.05}


def kv_configs(features: dict[str, list[str]] = FEATURES) -> list[EmbeddingConfig]:
    return [
        EmbeddingConfig(name=name, embedding_dim=DIM, num_embeddings=2**40, feature_names=names)
        for name, names in features.items()
    ]


def pools() -> dict[str, torch.Tensor]:
    """Ids each feature draws from: few enough to repeat (admission, updates)."""
    g = torch.Generator().manual_seed(0)
    big = torch.randint(0, 2**40, (37,), generator=g)
    return {
        "history": big,
        "candidate": torch.cat([big[:11], torch.arange(9)]),
        "user_id": torch.randint(0, 2**40, (23,), generator=g),
        "s": torch.arange(97),
    }


class GlobalBatch:
    """All ranks' bags per feature (lengths [W*B], ids) and one loss coefficient row per id."""

    def __init__(self, step: int, world: int, keys: list[str]) -> None:
        g = torch.Generator().manual_seed(500 + step)
        self.keys = keys
        self.features: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for key in keys:
            pool = pools()[key]
            lens = torch.randint(0, 5, (world * BATCH,), generator=g)
            ids = pool[torch.randint(0, pool.numel(), (int(lens.sum()),), generator=g)]
            coeff = torch.randn(ids.numel(), DIM, generator=g)
            self.features[key] = (lens, ids, coeff)

    def span(self, key: str, rank: int | None) -> slice:
        """Positions of ``rank``'s ids (every id with ``None``) in the feature's ids."""
        lens = self.features[key][0]
        if rank is None:
            return slice(0, int(lens.sum()))
        return slice(int(lens[: rank * BATCH].sum()), int(lens[: (rank + 1) * BATCH].sum()))

    def kjt(self, keys: list[str], rank: int | None = None) -> KeyedJaggedTensor:
        lengths, values = [], []
        for key in keys:
            lens, ids, _ = self.features[key]
            bags = (
                slice(0, lens.numel()) if rank is None else slice(rank * BATCH, (rank + 1) * BATCH)
            )
            lengths.append(lens[bags])
            values.append(ids[self.span(key, rank)])
        return KeyedJaggedTensor.from_lengths_sync(
            keys=keys, values=torch.cat(values), lengths=torch.cat(lengths)
        )

    def loss(self, out: dict, rank: int | None) -> torch.Tensor:
        """Over every output (``feature`` or ``feature@table``) of the batch's features."""
        total = 0.0
        for name, jt in out.items():
            key = name.split("@")[0]
            if key in self.keys:
                total = total + (jt.values() * self.features[key][2][self.span(key, rank)]).sum()
        return total


class ECModel(nn.Module):
    def __init__(self, ec: nn.Module) -> None:
        super().__init__()
        self.ec = ec

    def forward(self, kjt: KeyedJaggedTensor):
        return self.ec(kjt)


# ------------------------------------------------------------- comparisons
def compare_outputs(tally: Tally, got: dict, ref: dict, batch: GlobalBatch, rank: int) -> None:
    """Every output of the reference (named ``feature`` or ``feature@table``)."""
    tally.check("output names", set(ref.keys()) <= set(got.keys()))
    for name in ref:
        key = name.split("@")[0]
        tally.diff("outputs", got[name].values(), ref[name].values()[batch.span(key, rank)])
        bags = slice(rank * BATCH, (rank + 1) * BATCH)
        tally.exact("output lengths", got[name].lengths(), ref[name].lengths()[bags])


def merged_exports(sharded: ShardedKVEmbeddingCollection) -> dict[str, dict]:
    """Every KV table's rows from all ranks, sorted by id, and where they were."""
    parts = list(enumerate(gather({n: t.export() for n, t in sharded.kv_tables().items()})))
    merged = {}
    for name in sorted({name for _, d in parts for name in d}):
        held = [(r, d[name]) for r, d in parts if name in d]
        rows = {k: torch.cat([d[k] for _, d in held]) for k in held[0][1]}
        order = torch.argsort(rows["ids"])
        merged[name] = {
            "rows": {k: v[order] for k, v in rows.items()},
            "held": [(r, d["ids"]) for r, d in held],
        }
    return merged


def compare_tables(
    tally: Tally, merged: dict, want: dict[str, dict], shardings: dict[str, str]
) -> None:
    world = dist.get_world_size()
    tally.check("tables", set(merged) == set(want))
    for name, table in merged.items():
        held = table["held"]
        if shardings[name] == TW:
            tally.check(f"{name} on one rank", len(held) == 1)
        else:
            tally.check(f"{name} on every rank", len(held) == world)
            for r, ids in held:
                owners = owner_rank(ids, SHARED_OPTIONS[name].total_num_buckets, world)
                tally.check(f"{name} ids on their owner rank", bool((owners == r).all()))
        got = table["rows"]
        same_ids = torch.equal(got["ids"], want[name]["ids"])
        tally.check(f"{name} same ids", same_ids)
        if not same_ids:
            continue
        tally.check(f"{name} same scores", torch.equal(got["scores"], want[name]["scores"]))
        tally.diff("rows", got["weights"], want[name]["weights"])
        for key in want[name]:
            if key not in ("ids", "weights", "scores"):
                tally.diff("optimizer state", got[key], want[name][key])


# ----------------------------------------------------------------- running
def planned(model: nn.Module, sharder, sharding: str | None, tables: list[str]):
    constraints = None
    if sharding is not None:
        constraints = {n: ParameterConstraints(sharding_types=[sharding]) for n in tables}
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=dist.get_world_size(), compute_device="cpu"),
        constraints=constraints,
    )
    return planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)


def sharded_model(
    sharding: str | None,
    fused: dict,
    kv_module: bool = False,
    stock: bool = False,
    features: dict[str, list[str]] = FEATURES,
):
    options = {name: SHARED_OPTIONS[name] for name in features}
    if kv_module:
        module = KVEmbeddingCollection(kv_configs(features), options, fused_params=fused)
        sharder = KVEmbeddingCollectionSharder(module_type=KVEmbeddingCollection)
    else:
        configs = kv_configs(features) + ([STOCK] if stock else [])
        module = EmbeddingCollection(configs, device=META)
        sharder = KVEmbeddingCollectionSharder(options, fused_params=fused)
    model = ECModel(module)
    plan = planned(model, sharder, sharding, list(features))
    return DistributedModelParallel(model, device=CPU, plan=plan, sharders=[sharder]), plan


def train(dmp, ref: KVEmbeddingCollection, tally: Tally, keys: list[str] = KEYS) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(STEPS):
        batch = GlobalBatch(step, world, keys)
        out = dmp(batch.kjt(keys, rank))
        ref_out = ref(batch.kjt(KEYS))
        compare_outputs(tally, out, ref_out, batch, rank)
        batch.loss(out, rank).backward()
        (batch.loss(ref_out, None) / world).backward()


def scenario(
    sharding: str | None,
    fused: dict,
    kv_module: bool = False,
    features: dict[str, list[str]] = FEATURES,
) -> Callable[[], dict]:
    """KV tables reading ``features`` sharded ``sharding`` (DMP's own plan with
    ``None``), trained and evaluated against the unsharded reference."""

    def run() -> dict:
        world, rank = dist.get_world_size(), dist.get_rank()
        dmp, plan = sharded_model(sharding, fused, kv_module, features=features)
        options = {name: SHARED_OPTIONS[name] for name in features}
        ref = KVEmbeddingCollection(kv_configs(features), options, fused_params=fused)
        sharded = dmp.module.ec
        tally = Tally(TOL)
        tally.check("sharded type", isinstance(sharded, ShardedKVEmbeddingCollection))
        shardings = {}
        for name, ps in plan.plan["ec"].items():
            shardings[name] = ps.sharding_type
            if sharding is not None:
                tally.check(f"{name} planned {sharding}", ps.sharding_type == sharding)
            tally.check(f"{name} planned {KV_KERNEL}", ps.compute_kernel == KV_KERNEL)
        train(dmp, ref, tally)
        # Eval: read-only, ids without a row give zeros.
        dmp.eval()
        ref.eval()
        batch = GlobalBatch(STEPS, world, KEYS)
        with torch.no_grad():
            compare_outputs(tally, dmp(batch.kjt(KEYS, rank)), ref(batch.kjt(KEYS)), batch, rank)
        want = {n: t.export() for n, t in ref.kv_tables().items()}
        compare_tables(tally, merged_exports(sharded), want, shardings)
        return tally.result()

    return run


def mixed_scenario() -> dict:
    """KV tables and a stock table in one EmbeddingCollection, DMP's own plan: the
    stock table stays stock and looks its rows up as the stock module would."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dmp, plan = sharded_model(None, ADAGRAD, stock=True)
    ref = KVEmbeddingCollection(kv_configs(), OPTIONS, fused_params=ADAGRAD)
    tally = Tally(TOL)
    for name, ps in plan.plan["ec"].items():
        tally.check(f"{name} kernel", (ps.compute_kernel == KV_KERNEL) == (name in OPTIONS))
    stock_weight = full_stock_weight(dmp)
    batch = GlobalBatch(0, world, KEYS + ["s"])
    out = dmp(batch.kjt(KEYS + ["s"], rank))
    ref_out = ref(batch.kjt(KEYS))
    compare_outputs(tally, out, ref_out, batch, rank)
    ids = batch.features["s"][1][batch.span("s", rank)]
    tally.diff("stock outputs", out["s"].values(), stock_weight[ids])
    batch.loss(out, rank).backward()
    (batch.loss(ref_out, None) / world).backward()
    train(dmp, ref, tally, KEYS + ["s"])
    want = {n: t.export() for n, t in ref.kv_tables().items()}
    shardings = {n: plan.plan["ec"][n].sharding_type for n in OPTIONS}
    compare_tables(tally, merged_exports(dmp.module.ec), want, shardings)
    return tally.result()


def full_stock_weight(dmp) -> torch.Tensor:
    value = dmp.state_dict()["ec.embeddings.stock.weight"]
    local = [(s.metadata.shard_offsets, s.tensor.clone()) for s in value.local_shards()]
    full = torch.zeros(STOCK.num_embeddings, DIM)
    for part in gather(local):
        for (row, col), tensor in part:
            full[row : row + tensor.shape[0], col : col + tensor.shape[1]] = tensor
    return full


def save_scenario(directory: str) -> dict:
    """Train row-wise, save a checkpoint; the reference's tables go to expected.pt."""
    dmp, _ = sharded_model(RW, ADAGRAD)
    ref = KVEmbeddingCollection(kv_configs(), OPTIONS, fused_params=ADAGRAD)
    tally = Tally(TOL)
    train(dmp, ref, tally)
    checkpoint.save(dmp, os.path.join(directory, "ckpt"))
    if dist.get_rank() == 0:
        torch.save(
            {n: t.export() for n, t in ref.kv_tables().items()},
            os.path.join(directory, "expected.pt"),
        )
    return tally.result()


def load_scenario(directory: str, sharding: str) -> Callable[[], dict]:
    def run() -> dict:
        dmp, plan = sharded_model(sharding, ADAGRAD)
        checkpoint.load(dmp, os.path.join(directory, "ckpt"))
        tally = Tally(TOL)
        want = torch.load(os.path.join(directory, "expected.pt"))
        shardings = {n: plan.plan["ec"][n].sharding_type for n in OPTIONS}
        compare_tables(tally, merged_exports(dmp.module.ec), want, shardings)
        return tally.result()

    return run


SCENARIOS: dict[str, Callable[[], dict]] = {
    "row_wise_adagrad": scenario(RW, ADAGRAD),
    "table_wise_sgd": scenario(TW, SGD),
    "row_wise_adam": scenario(RW, ADAM),
    "kv_module_own_plan": scenario(None, ADAGRAD, kv_module=True),
    "mixed_with_stock": mixed_scenario,
    "shared_features_row_wise": scenario(RW, ADAGRAD, features=SHARED_FEATURES),
    "shared_features_table_wise": scenario(TW, SGD, kv_module=True, features=SHARED_FEATURES),
}


def main() -> None:
    scenarios = dict(SCENARIOS)
    if len(sys.argv) > 2:
        directory, step = sys.argv[2], sys.argv[3]
        if step == "save":
            scenarios = {"save": lambda: save_scenario(directory)}
        else:
            scenarios = {f"load_{s}": load_scenario(directory, s) for s in (RW, TW)}
    with gloo_job():
        run_scenarios(sys.argv[1], scenarios)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
