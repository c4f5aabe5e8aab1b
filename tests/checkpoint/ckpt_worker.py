"""Checkpoints across world sizes and sharding types: the jobs of
``tests/checkpoint/test_distributed_checkpoint.py``.

Save job (2 ranks, KV tables row-wise)::

    torchrun --nproc_per_node 2 -m tests.checkpoint.ckpt_worker save DIR   # repo root

trains ``SAVE_AT`` steps (the KV tables' learning rates change at ``LR_STEP``),
saves ``DIR/ckpt`` (model, stock table, fused and dense optimizer state, KV
learning rates), writes what it saved to ``DIR/expected.pt`` (every id's row,
optimizer state and score, gathered), checks the sharded ``state_dict`` layout,
then saves ``DIR/killed`` with rank 0 SIGKILLing itself after every rank has
written its files and before the ``COMPLETE`` marker.

Load jobs (any world size, ``row_wise`` or ``table_wise``; or in-process,
unsharded, through :func:`load_job`)::

    torchrun --nproc_per_node 3 -m tests.checkpoint.ckpt_worker load DIR row_wise

refuse ``DIR/killed`` and a checkpoint of another table config (nothing changes),
load ``DIR/ckpt`` into a model built with other KV learning rates, compare every
id's row, state and score exactly with ``expected.pt`` and the learning rates with
``CHANGED_LR``, then train to ``STEPS`` and compare with a model that was never
stopped: an unsharded reference fed the same global batches, with the mean loss
over the ranks of the run it stands for (TorchRec divides gradients by the world
size; DDP averages dense ones). Rank 0 writes ``DIR/<job>.json``; the test asserts.
"""

from __future__ import annotations

import os
import signal
import sys
import traceback

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.modules.embedding_configs import PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import torchrec_kvemb.checkpoint as ckpt
from tests.torchrun_jobs import Tally, gather, gloo_job, write_result
from torchrec_kvemb import (
    EvictionPolicy,
    Initializer,
    KVEmbeddingBagCollection,
    KVEmbeddingBagCollectionSharder,
    KVTableOptions,
)
from torchrec_kvemb.checkpoint import marker
from torchrec_kvemb.checkpoint.migrate import export_dense, load_dense_into_kv
from torchrec_kvemb.ops.hashing import route_bucket
from torchrec_kvemb.sharding import owner_rank
from torchrec_kvemb.state_dict import admission_state

#: Bags per step over all ranks (divisible by 1, 2 and 3), steps before the save, in all.
GLOBAL_BATCH = 12
SAVE_AT = 3
STEPS = 5
SAVE_WORLD = 2
#: At this step (before the save) the KV tables' learning rates become these, set
#: as a user sets them (:func:`set_kv_lr`); models are built with ADAGRAD's and
#: ADAM's, so only the checkpoint can bring them back.
LR_STEP = 1
CHANGED_LR = {"ebc.embedding_bags.user": 0.07, "kv.embedding_bags.item": 0.03}
#: Largest difference that passes for a run against the reference (float32 sums
#: in another order); loaded rows must be bit-exact.
TOL = 1e-5
META, CPU = torch.device("meta"), torch.device("cpu")

ADAGRAD = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1}
ADAM = {"optimizer": EmbOptimType.ADAM, "learning_rate": 0.05}
SGD = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.1}
# 96 routing buckets: divisible by every world size here (1, 2, 3).
USER_OPTIONS = KVTableOptions(
    capacity=4096,
    eviction=EvictionPolicy.LFU,
    admission_threshold=2,
    seed=1,
    total_num_buckets=96,
)
ITEM_OPTIONS = KVTableOptions(
    capacity=2048, initializer=Initializer.NORMAL, seed=2, total_num_buckets=96
)
STOCK = EmbeddingBagConfig(name="stock", embedding_dim=4, num_embeddings=100, feature_names=["s"])
DIMS = {"u1": 8, "u2": 8, "i": 4, "s": 4}
#: KV tables by state_dict prefix: (module attribute, table).
KV_TABLES = {"ebc.embedding_bags.user": ("ebc", "user"), "kv.embedding_bags.item": ("kv", "item")}


def user_config(dim: int = 8) -> EmbeddingBagConfig:
    return EmbeddingBagConfig(
        name="user", embedding_dim=dim, num_embeddings=2**40, feature_names=["u1", "u2"]
    )


ITEM = EmbeddingBagConfig(
    name="item",
    embedding_dim=4,
    num_embeddings=2**63 - 1,
    feature_names=["i"],
    pooling=PoolingType.MEAN,
)


# ------------------------------------------------------------------ models
class Model(nn.Module):
    """Two KV modules (an EBC with a KV and a stock table, sharded; a
    KVEmbeddingBagCollection) and a dense layer over the KV outputs."""

    def __init__(self, ebc: nn.Module, kv: nn.Module) -> None:
        super().__init__()
        self.ebc = ebc
        self.kv = kv
        torch.manual_seed(0)
        self.dense = nn.Linear(20, 1)

    def forward(self, ebc_kjt: KeyedJaggedTensor, kv_kjt: KeyedJaggedTensor):
        a, b = self.ebc(ebc_kjt), self.kv(kv_kjt)
        x = torch.cat([a["u1"], a["u2"], b["i"]], dim=1)
        return a, b, self.dense(x).squeeze(1)


def unsharded_model(user_fused: dict = ADAGRAD, user_dim: int = 8) -> Model:
    user = KVEmbeddingBagCollection(
        [user_config(user_dim)], {"user": USER_OPTIONS}, fused_params=user_fused
    )
    item = KVEmbeddingBagCollection([ITEM], {"item": ITEM_OPTIONS}, fused_params=ADAM)
    return Model(user, item)


def sharded_model(
    sharding: str, user_dim: int = 8, user_fused: dict = ADAGRAD
) -> DistributedModelParallel:
    ebc = EmbeddingBagCollection([user_config(user_dim), STOCK], device=META)
    model = Model(ebc, KVEmbeddingBagCollection([ITEM], {"item": ITEM_OPTIONS}, fused_params=ADAM))
    sharders = [
        KVEmbeddingBagCollectionSharder({"user": USER_OPTIONS}, fused_params=user_fused),
        KVEmbeddingBagCollectionSharder(module_type=KVEmbeddingBagCollection),
    ]
    constraints = {
        "user": ParameterConstraints(sharding_types=[sharding]),
        "item": ParameterConstraints(sharding_types=[sharding]),
        "stock": ParameterConstraints(sharding_types=["table_wise"]),
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=dist.get_world_size(), compute_device="cpu"),
        constraints=constraints,
    )
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    return DistributedModelParallel(model, device=CPU, plan=plan, sharders=sharders)


def inner(model: nn.Module) -> Model:
    return model.module if isinstance(model, DistributedModelParallel) else model


def dense_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(inner(model).dense.parameters(), lr=0.05)


def kv_tables(model: nn.Module) -> dict:
    """This rank's KV tables (shards) by state_dict prefix."""
    m = inner(model)
    out = {}
    for prefix, (attr, name) in KV_TABLES.items():
        tables = getattr(m, attr).kv_tables()
        if name in tables:
            out[prefix] = tables[name]
    return out


def kv_param_groups(dmp: DistributedModelParallel) -> dict:
    """The ``model.fused_optimizer`` param group holding each KV table's rows on this
    rank, by state_dict prefix."""
    params = dmp.fused_optimizer.params
    out = {}
    for prefix in KV_TABLES:
        weight = params.get(f"{prefix}.weight")
        if weight is not None:
            groups = dmp.fused_optimizer.param_groups
            out[prefix] = next(g for g in groups if any(p is weight for p in g["params"]))
    return out


def kv_lr(model: nn.Module) -> dict[str, float]:
    """This rank's KV tables' learning rates by prefix, where a user reads them."""
    if isinstance(model, DistributedModelParallel):
        return {prefix: group["lr"] for prefix, group in kv_param_groups(model).items()}
    return {prefix: table.optim.learning_rate for prefix, table in kv_tables(model).items()}


def set_kv_lr(model: nn.Module, lrs: dict[str, float]) -> None:
    """Sharded: ``param_groups[i]["lr"] = x`` on ``model.fused_optimizer``; unsharded:
    the table's ``optim``."""
    if isinstance(model, DistributedModelParallel):
        for prefix, group in kv_param_groups(model).items():
            group["lr"] = lrs[prefix]
        return
    for prefix, table in kv_tables(model).items():
        table.optim = table.optim.with_learning_rate(lrs[prefix])


# ----------------------------------------------------------------- batches
def id_pools() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    big = torch.randint(0, 2**62, (48,), generator=g)
    return {
        "u1": big,
        "u2": torch.cat([big[:16], torch.arange(16)]),
        "i": torch.arange(40) * 96 + 2**62,
        "s": torch.arange(100),
    }


def global_batch(step: int) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """feature -> (lengths [GLOBAL_BATCH], ids, loss coefficients [GLOBAL_BATCH, dim]),
    plus ``"dense"``: the dense output's coefficients."""
    g = torch.Generator().manual_seed(1000 + step)
    out = {}
    for key, pool in id_pools().items():
        lengths = torch.randint(0, 5, (GLOBAL_BATCH,), generator=g)
        ids = pool[torch.randint(0, pool.numel(), (int(lengths.sum()),), generator=g)]
        out[key] = (lengths, ids, torch.randn(GLOBAL_BATCH, DIMS[key], generator=g))
    out["dense"] = (None, None, torch.randn(GLOBAL_BATCH, generator=g))
    return out


def kjt(batch: dict, keys: list[str], bags: slice) -> KeyedJaggedTensor:
    lengths, values = [], []
    for key in keys:
        lens, ids, _ = batch[key]
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
        lengths.append(lens[bags])
        values.append(ids[offsets[bags.start] : offsets[bags.stop]])
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=torch.cat(values), lengths=torch.cat(lengths)
    )


def train_step(model, optimizer, step: int, rank: int, world: int, divide: int) -> dict:
    """One step on this rank's share of the global batch (the whole batch when
    ``world == 1``); the loss is divided by ``divide``. Returns the outputs."""
    if step == LR_STEP:
        set_kv_lr(model, CHANGED_LR)
    batch = global_batch(step)
    per_rank = GLOBAL_BATCH // world
    bags = slice(rank * per_rank, (rank + 1) * per_rank)
    sharded = isinstance(model, DistributedModelParallel)
    ebc_keys = ["u1", "u2", "s"] if sharded else ["u1", "u2"]
    a, b, dense = model(kjt(batch, ebc_keys, bags), kjt(batch, ["i"], bags))
    outputs = {k: a[k] for k in ebc_keys} | {"i": b["i"], "dense": dense}
    loss = sum((outputs[k] * batch[k][2][bags]).sum() for k in outputs)
    optimizer.zero_grad()
    (loss / divide).backward()
    optimizer.step()
    return {k: v.detach() for k, v in outputs.items()}


def reference(until: int, worlds: list[tuple[int, int]]) -> tuple[Model, torch.optim.Optimizer]:
    """The unsharded model that never stopped, after ``until`` steps; ``worlds``:
    (first step, world size of the run it stands for) from then on."""
    model = unsharded_model()
    optimizer = dense_optimizer(model)
    for step in range(until):
        world = [w for first, w in worlds if first <= step][-1]
        train_step(model, optimizer, step, 0, 1, world)
    return model, optimizer


# ----------------------------------------------------------- comparisons
def snapshot(model: nn.Module) -> dict:
    """Every KV table's ids (sorted) with rows, state and scores, its step counters
    and admission counts (merged over ranks for a sharded model); the dense layer."""
    local = {}
    for prefix, table in kv_tables(model).items():
        local[prefix] = (
            table.export(),
            (table.step, table.optim_step),
            admission_state(table),
        )
    sharded = isinstance(model, DistributedModelParallel)
    merged: dict = {}
    for part in gather(local) if sharded else [local]:
        for prefix, (export, steps, admission) in part.items():
            merged.setdefault(prefix, []).append((export, steps, admission))
    out = {}
    for prefix, parts in merged.items():
        export = {k: torch.cat([p[0][k] for p in parts]) for k in parts[0][0]}
        order = torch.argsort(export["ids"])
        admission = [torch.cat([p[2][i] for p in parts]) for i in range(3)]
        adm_order = torch.argsort(admission[0])
        out[prefix] = {
            "export": {k: v[order] for k, v in export.items()},
            "steps": sorted({p[1] for p in parts}),
            "admission": [t[adm_order] for t in admission],
        }
    dense = inner(model).dense
    out["dense"] = {"weight": dense.weight.detach().clone(), "bias": dense.bias.detach().clone()}
    return out


def compare_snapshots(tally: Tally, got: dict, want: dict, exact: bool, label: str) -> None:
    for prefix in KV_TABLES:
        g, w = got[prefix], want[prefix]
        tally.exact(f"{label}: {prefix} ids", g["export"]["ids"], w["export"]["ids"])
        if g["export"]["ids"].shape != w["export"]["ids"].shape:
            continue
        tally.exact(f"{label}: {prefix} scores", g["export"]["scores"], w["export"]["scores"])
        tally.check(f"{label}: {prefix} step counters", g["steps"] == w["steps"])
        for i, what in enumerate(("admission ids", "admission counts", "admission scores")):
            tally.exact(f"{label}: {prefix} {what}", g["admission"][i], w["admission"][i])
        for key in w["export"]:
            if key in ("ids", "scores"):
                continue
            if exact:
                tally.exact(f"{label}: {prefix} {key}", g["export"][key], w["export"][key])
            else:
                tally.diff(f"{label}: rows and state", g["export"][key], w["export"][key])
    for key in ("weight", "bias"):
        if exact:
            tally.exact(f"{label}: dense {key}", got["dense"][key], want["dense"][key])
        else:
            tally.diff(f"{label}: dense", got["dense"][key], want["dense"][key])


def stock_snapshot(dmp: DistributedModelParallel) -> dict:
    """The stock table's rows and fused optimizer state, gathered whole."""
    weight = dmp.state_dict()["ebc.embedding_bags.stock.weight"]
    fused = dmp.fused_optimizer.state_dict()["state"].get("ebc.embedding_bags.stock.weight", {})
    local = {
        "weight": [(s.metadata.shard_offsets, s.tensor.clone()) for s in weight.local_shards()],
        "momentum": [
            (s.metadata.shard_offsets, s.tensor.clone())
            for value in fused.values()
            for s in value.local_shards()
        ],
    }
    full = {"weight": torch.zeros(100, 4), "momentum": torch.zeros(100)}
    for part in gather(local):
        for key, shards in part.items():
            for offsets, tensor in shards:
                full[key][offsets[0] : offsets[0] + tensor.shape[0]] = tensor
    return full


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    return {
        i: {k: v.clone() for k, v in s.items()} for i, s in optimizer.state_dict()["state"].items()
    }


def compare_optimizer(tally: Tally, got: dict, want: dict, label: str) -> None:
    tally.check(f"{label}: optimizer params", sorted(got) == sorted(want))
    for i in want:
        for k, v in want[i].items():
            tally.exact(f"{label}: optimizer {k}", got.get(i, {}).get(k, torch.empty(0)), v)


# ------------------------------------------------------------------- jobs
def save_job(directory: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    tally = Tally(TOL)
    dmp = sharded_model("row_wise")
    optimizer = dense_optimizer(dmp)
    ref, ref_optimizer = reference(0, [(0, world)])
    for step in range(SAVE_AT):
        got = train_step(dmp, optimizer, step, rank, world, 1)
        want = train_step(ref, ref_optimizer, step, 0, 1, world)
        bags = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
        for key in ("u1", "u2", "i", "dense"):
            tally.diff("training: outputs", got[key], want[key][bags])
    compare_snapshots(
        tally, snapshot(dmp), snapshot(ref), exact=False, label="sharded vs reference"
    )
    check_layout(tally, dmp)
    check_lr(tally, dmp, "saved")
    saved = snapshot(dmp)
    stock = stock_snapshot(dmp)
    # The sharded module loads its own state_dict (ShardedTensors) back unchanged.
    dmp.load_state_dict(dmp.state_dict())
    compare_snapshots(tally, snapshot(dmp), saved, exact=True, label="load_state_dict round trip")
    ckpt.save(dmp, os.path.join(directory, "ckpt"), optimizer=optimizer)
    expected = {
        "tables": saved,
        "stock": stock,
        "optimizer": optimizer_state(optimizer),
    }
    if rank == 0:
        torch.save(expected, os.path.join(directory, "expected.pt"))
    result = {"world_size": world, **tally.result()}
    if rank == 0:
        write_result(os.path.join(directory, "save.json"), result)
    dist.barrier()

    def die(*args, **kwargs) -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    marker.write_marker = die  # rank 0 dies after every rank's files, before the marker
    ckpt.save(dmp, os.path.join(directory, "killed"), optimizer=optimizer)
    return result


def check_layout(tally: Tally, dmp: DistributedModelParallel) -> None:
    """The sharded state_dict: one shard per rank with its rows, sorted by bucket."""
    state = dmp.state_dict()
    rank, world = dist.get_rank(), dist.get_world_size()
    local = kv_tables(dmp)
    for prefix in KV_TABLES:
        weight = state[f"{prefix}.weight"]
        ids = state[f"{prefix}.weight_id"]
        shards = ids.local_shards()
        tally.check("one shard per rank", len(shards) == 1 and len(weight.local_shards()) == 1)
        mine = shards[0].tensor
        tally.check("shard holds the rank's rows", mine.numel() == local[prefix].size)
        tally.check("rows of the rank's buckets", bool((owner_rank(mine, 96, world) == rank).all()))
        all_ids = torch.cat(gather(mine))  # rank order
        routed = route_bucket(all_ids, 96)
        tally.check("rows sorted by bucket", bool((routed[1:] >= routed[:-1]).all()))
        same = routed[1:] == routed[:-1]
        tally.check("then by id", bool((all_ids[1:][same] > all_ids[:-1][same]).all()))
        tally.check("global rows", weight.size(0) == all_ids.numel() == ids.size(0))
        bucket = state[f"{prefix}.bucket"]
        tally.check("bucket is [G]", tuple(bucket.size()) == (96,))
        counts = bucket.local_shards()[0].tensor
        tally.check("bucket counts the rank's rows", int(counts.sum()) == mine.numel())


def load_job(directory: str, sharding: str | None) -> dict:
    """Load ``directory/ckpt`` at this world size (unsharded without a process group)."""
    distributed = dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    tally = Tally(TOL)
    expected = torch.load(os.path.join(directory, "expected.pt"), weights_only=False)

    def build(user_dim: int = 8, fused: dict = ADAGRAD):
        if distributed:
            return sharded_model(sharding, user_dim, fused)
        return unsharded_model(fused, user_dim)

    model = build()
    optimizer = dense_optimizer(model)
    built_lr = kv_lr(model)
    tally.check(
        "built with other learning rates", all(built_lr[p] != CHANGED_LR[p] for p in built_lr)
    )
    # Refused: an interrupted save, another table config. Nothing changes.
    tally.check("incomplete checkpoint refused", refused(model, directory, "killed", "incomplete"))
    wrong = build(user_dim=4)
    wrong_lr = kv_lr(wrong)
    tally.check("other dim refused", refused(wrong, directory, "ckpt", "'user'"))
    tally.check("refused load changes nothing", all(t.size == 0 for t in kv_tables(wrong).values()))
    tally.check("refused load keeps the learning rates", kv_lr(wrong) == wrong_lr)
    if not distributed or sharding == "table_wise":
        # Table-wise, only the owner rank knows the optimizer: every rank must refuse
        # (not strict: the stock table's fused SGD has no momentum1 to load either).
        other = build(fused=SGD)
        tally.check(
            "other optimizer refused", refused(other, directory, "ckpt", "'user'", strict=False)
        )
    del wrong

    ckpt.load(model, os.path.join(directory, "ckpt"), optimizer=optimizer)
    check_lr(tally, model, "loaded")
    compare_snapshots(tally, snapshot(model), expected["tables"], exact=True, label="loaded")
    compare_optimizer(tally, optimizer_state(optimizer), expected["optimizer"], "loaded")
    if distributed:
        for name, ps in {**model.plan.plan["ebc"], **model.plan.plan["kv"]}.items():
            want = "table_wise" if name == "stock" else sharding
            tally.check(f"{name} planned {want}", ps.sharding_type == want)
        for table in kv_tables(model).values():
            if sharding == "row_wise":
                owners = owner_rank(table.export()["ids"], 96, world)
                tally.check("ids on their owner rank", bool((owners == rank).all()))
        stock = stock_snapshot(model)
        tally.exact("loaded: stock rows", stock["weight"], expected["stock"]["weight"])
        tally.exact("loaded: stock momentum", stock["momentum"], expected["stock"]["momentum"])

    # Go on training; compare with the unsharded model that never stopped.
    ref, ref_optimizer = reference(SAVE_AT, [(0, SAVE_WORLD)])
    for step in range(SAVE_AT, STEPS):
        got = train_step(model, optimizer, step, rank, world, 1)
        want = train_step(ref, ref_optimizer, step, 0, 1, world)
        bags = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
        for key in ("u1", "u2", "i", "dense"):
            tally.diff("continued: outputs", got[key], want[key][bags])
    compare_snapshots(tally, snapshot(model), snapshot(ref), exact=False, label="continued")
    if distributed:
        # Save in this layout; load it into the other sharding type at this world size.
        resaved = os.path.join(directory, f"resaved_{world}_{sharding}")
        ckpt.save(model, resaved, optimizer=optimizer)
        other = sharded_model("table_wise" if sharding == "row_wise" else "row_wise")
        ckpt.load(other, resaved)
        check_lr(tally, other, "resharded")
        compare_snapshots(tally, snapshot(other), snapshot(model), exact=True, label="resharded")
        stock, other_stock = stock_snapshot(model), stock_snapshot(other)
        tally.exact("resharded: stock rows", other_stock["weight"], stock["weight"])
        check_migration(tally, other)
    return {"world_size": world, "sharding": sharding or "unsharded", **tally.result()}


def check_lr(tally: Tally, model: nn.Module, label: str) -> None:
    """Every KV table this rank holds has ``CHANGED_LR``'s learning rate, where a user
    reads it and in the table's ``optim`` (a table-wise table is checked on its rank)."""
    lrs = kv_lr(model)
    for prefix, table in kv_tables(model).items():
        want = CHANGED_LR[prefix]
        ok = lrs.get(prefix) == want and table.optim.learning_rate == want
        tally.check(f"{label}: {prefix} learning rate", ok)


def check_migration(tally: Tally, model: DistributedModelParallel) -> None:
    """Stock rows into a sharded KV table and back (collectives)."""
    table = unsharded_model().ebc.table("user")  # for the initial rows
    before = snapshot(model)["ebc.embedding_bags.user"]["export"]
    n = 4096
    small = before["ids"][before["ids"] < n]
    exported = export_dense(model, "user", n)
    stored = torch.zeros(n, dtype=torch.bool)
    stored[small] = True
    tally.exact("export_dense: stored rows", exported[small], before["weights"][: small.numel()])
    ids = torch.arange(n)[~stored][:1000]
    tally.exact("export_dense: initial rows", exported[ids], table.initial_rows(ids))
    weight = torch.randn(300, 8, generator=torch.Generator().manual_seed(5))
    load_dense_into_kv(model, {"embedding_bags.user.weight": weight}, tables={"user": "user"})
    tally.exact("load_dense_into_kv: rows", export_dense(model, "user", 300), weight)
    after = snapshot(model)["ebc.embedding_bags.user"]["export"]
    tally.exact("load_dense_into_kv: ids", after["ids"], torch.arange(300))
    for t in kv_tables(model).values():
        if t.name == "user" and model.plan.plan["ebc"]["user"].sharding_type == "row_wise":
            owners = owner_rank(t.export()["ids"], 96, dist.get_world_size())
            tally.check(
                "load_dense_into_kv: ids on their owner", bool((owners == dist.get_rank()).all())
            )


def refused(model: nn.Module, directory: str, name: str, words: str, strict: bool = True) -> bool:
    try:
        ckpt.load(model, os.path.join(directory, name), strict=strict)
    except ckpt.CheckpointError as e:
        return words in str(e)
    return False


def main() -> None:
    job, directory = sys.argv[1], sys.argv[2]
    with gloo_job():
        name = job if job == "save" else f"load_{dist.get_world_size()}_{sys.argv[3]}"
        try:
            if job == "save":
                save_job(directory)
            else:
                result = load_job(directory, sys.argv[3])
                if dist.get_rank() == 0:
                    write_result(os.path.join(directory, f"{name}.json"), result)
        except Exception:
            if dist.get_rank() == 0:
                write_result(
                    os.path.join(directory, f"{name}.json"),
                    {"passed": False, "error": traceback.format_exc()},
                )
            raise


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
