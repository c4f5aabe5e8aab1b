"""Column-wise KV tables against unsharded ones, one torchrun job (gloo, CPU).

Run by ``tests/sharding/test_cw_distributed.py``::

    torchrun --nproc_per_node N -m tests.sharding.cw_worker RESULT.json WORK_DIR   # repo root

One EBC on meta holds two KV tables planned COLUMN_WISE (odd widths, shards on
ranks in and out of order) and a stock table planned COLUMN_WISE with the stock
kernel. Every rank feeds an unsharded twin the global batch (all ranks' bags,
rank-major) and its own bags to the sharded model; the sharded loss on rank r is
``sum(out_r * coeff_r)``, the twin's their mean (TorchRec divides gradients by the
world size). Small capacities keep ids churning (eviction, admission).

Scenarios:

* ``adam``: the twin is ``KVEmbeddingBagCollection`` with the same tables. At
  every step: outputs; every column shard's index (ids by slot, scores) and
  admission counter bit for bit equal to the twin's (so equal on every shard).
  At the end: each shard's rows and Adam moments are its columns of the twin's.
  Then ``checkpoint.save`` to ``WORK_DIR`` (with the twin's export beside it).
* ``rowwise_adagrad``: row-wise Adagrad keeps one state per row and shard, over the
  shard's columns (as stock TorchRec's column-wise tables): the twin is a
  ``KVEmbeddingBagCollection`` with one table per column shard (its width,
  ``column_offset``). Outputs at every step, then rows and momentum per shard.
* ``sequence``: an ``EmbeddingCollection`` with column-wise KV tables (and a stock
  table-wise one) against the unsharded ``KVEmbeddingCollection``, as ``adam``.
* ``load``: the checkpoint the 2-rank job saved, loaded at this world size into
  column-wise, row-wise and table-wise models and into an unsharded collection:
  every shard holds its columns of the saved rows, optimizer state and scores.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torch.distributed.remote_device import _remote_device as _Placement
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    row_wise,
    table_wise,
)
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import PoolingType

from tests.sharding import ec_dist_worker as seq
from tests.sharding.dist_worker import BATCH, EBCModel, GlobalBatch, global_batch
from tests.torchrun_jobs import Tally, gather, gloo_job, run_scenarios
from torchrec_kvemb import (
    EvictionPolicy,
    Initializer,
    KVEmbeddingBagCollection,
    KVEmbeddingBagCollectionSharder,
    KVEmbeddingCollection,
    KVEmbeddingCollectionSharder,
    KVTableOptions,
    checkpoint,
)
from torchrec_kvemb.sharding import ShardedKVEmbeddingBagCollection
from torchrec_kvemb.state_dict.checks import CheckpointError

STEPS = 6
TOL = 1e-5
KV_KERNEL = "customized_kernel"
META = torch.device("meta")
CPU = torch.device("cpu")

CONFIGS = [
    EmbeddingBagConfig(
        name="wide", embedding_dim=11, num_embeddings=2**40, feature_names=["w1", "w2"]
    ),
    EmbeddingBagConfig(
        name="narrow",
        embedding_dim=6,
        num_embeddings=2**40,
        feature_names=["n"],
        pooling=PoolingType.MEAN,
    ),
]
STOCK = EmbeddingBagConfig(name="stock", embedding_dim=8, num_embeddings=300, feature_names=["s"])
# Capacities far below the ids in play: every step evicts; "wide" admits at the
# second sighting. 96 buckets: divisible by 2 and 3 (row-wise loads).
OPTIONS = {
    "wide": KVTableOptions(
        capacity=64,
        eviction=EvictionPolicy.LFU,
        admission_threshold=2,
        admission_counter_capacity=64,
        seed=1,
        init_low=-0.5,
        init_high=0.5,
        total_num_buckets=96,
    ),
    "narrow": KVTableOptions(
        capacity=48,
        eviction=EvictionPolicy.LRU,
        initializer=Initializer.NORMAL,
        init_std=0.3,
        seed=2,
        total_num_buckets=96,
    ),
}
#: Tables that loads go into: room for a row-wise shard's share of the saved rows.
LOAD_OPTIONS = {n: replace(o, capacity=4 * o.capacity) for n, o in OPTIONS.items()}
KV_KEYS = ["w1", "w2", "n"]
DIMS = {"w1": 11, "w2": 11, "n": 6, "s": 8}
ADAM = {"optimizer": EmbOptimType.ADAM, "learning_rate": 0.05}
ADAGRAD = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1}
#: The column widths of "wide" per world size (shard i on rank i), and the ranks of
#: "narrow"'s equal shards (out of rank order: the output dist puts them back).
WIDE_SPLITS = {1: [11], 2: [6, 5], 3: [4, 4, 3]}
NARROW_RANKS = {1: [0], 2: [1, 0], 3: [2, 0, 1]}


def pools() -> dict[str, torch.Tensor]:
    """Ids each feature draws from: many more than the capacities (churn)."""
    g = torch.Generator().manual_seed(3)
    big = torch.randint(0, 2**62, (150,), generator=g)
    return {"w1": big, "w2": big[40:], "n": torch.arange(120) * 96 + 5, "s": torch.arange(300)}


def cw_plan(model: nn.Module, sharder, world: int, fused: dict, kinds: dict[str, str] | None):
    """The plan: KV tables column-wise (or ``kinds``), the stock table column-wise
    (data-parallel under Adam)."""
    kinds = kinds or {}
    per_table = {}
    for config in CONFIGS:
        kind = kinds.get(config.name, "column_wise")
        if kind == "row_wise":
            per_table[config.name] = row_wise(compute_kernel=KV_KERNEL)
        elif kind == "table_wise":
            per_table[config.name] = table_wise(rank=world - 1, compute_kernel=KV_KERNEL)
        elif config.name == "wide":
            per_table[config.name] = column_wise(
                size_per_rank=WIDE_SPLITS[world], compute_kernel=KV_KERNEL
            )
        else:
            per_table[config.name] = column_wise(
                size_per_rank=[6 // world] * world, compute_kernel=KV_KERNEL
            )
    if fused["optimizer"] == EmbOptimType.ADAM:  # fbgemm's CPU tables have no Adam
        per_table["stock"] = data_parallel()
    else:  # stock column shards need widths divisible by 4 (fbgemm): two of 4 columns
        per_table["stock"] = column_wise(ranks=sorted({0, world - 1}), compute_kernel="fused")
    ebc_plan = construct_module_sharding_plan(
        model.ebc, per_table, sharder=sharder, local_size=world, world_size=world, device_type="cpu"
    )
    narrow = ebc_plan["narrow"]
    if narrow.sharding_type == "column_wise":  # shard i on rank NARROW_RANKS[i]
        narrow.ranks = list(NARROW_RANKS[world])
        for shard, rank in zip(narrow.sharding_spec.shards, narrow.ranks, strict=True):
            shard.placement = _Placement(f"rank:{rank}/cpu")
    return ShardingPlan({"ebc": ebc_plan})


def build_sharded(fused: dict, kinds: dict[str, str] | None = None, options: dict = OPTIONS):
    world = dist.get_world_size()
    sharder = KVEmbeddingBagCollectionSharder(options, fused_params=fused)
    model = EBCModel(EmbeddingBagCollection(CONFIGS + [STOCK], device=META))
    plan = cw_plan(model, sharder, world, fused, kinds)
    return DistributedModelParallel(model, device=CPU, plan=plan, sharders=[sharder]), plan


def shard_piece(table) -> tuple[int, int]:
    """(first column, width) of a rank's column shard."""
    return table.options.column_offset, table.dim


def index_state(table) -> dict[str, torch.Tensor]:
    """A table's index (ids by slot, scores) and admission counter, bit for bit."""
    state = {"keys": table.index.keys.clone(), "scores": table.index.scores.clone()}
    if table.counter is not None:
        state["counter_keys"] = table.counter.keys.clone()
        state["counter_scores"] = table.counter.scores.clone()
    return state


def step_loss(kt, batch: GlobalBatch, keys: list[str], rank: int) -> torch.Tensor:
    rows = slice(rank * BATCH, (rank + 1) * BATCH)
    return sum((kt[k] * batch.coeff[k][rows]).sum() for k in keys)


# --------------------------------------------------------------- scenarios
def adam_scenario(work: Path) -> Callable[[], dict]:
    def run() -> dict:
        rank, world = dist.get_rank(), dist.get_world_size()
        dmp, plan = build_sharded(ADAM)
        sharded = dmp.module.ebc
        ref = KVEmbeddingBagCollection(CONFIGS, OPTIONS, fused_params=ADAM)
        tally = Tally(TOL)
        tally.check("sharded type", isinstance(sharded, ShardedKVEmbeddingBagCollection))
        for name in OPTIONS:
            ps = plan.plan["ebc"][name]
            tally.check(f"{name} planned column_wise", ps.sharding_type == "column_wise")
        local = sharded.kv_tables()
        widths = {n: [] for n in OPTIONS}
        for part in gather({n: shard_piece(t) for n, t in local.items()}):
            for n, piece in part.items():
                widths[n].append(piece)
        for n, config in zip(OPTIONS, CONFIGS, strict=True):
            pieces = sorted(widths[n])
            tally.check(f"{n}: one shard per rank", len(pieces) == world)
            cols = [c for c, _ in pieces]
            ends = [c + w for c, w in pieces]
            tally.check(
                f"{n}: shards tile the columns",
                cols[0] == 0 and cols[1:] == ends[:-1] and ends[-1] == config.embedding_dim,
            )
        keys = KV_KEYS + ["s"]
        source = pools()
        churn = {"evictions": 0, "admission_rejects": 0}
        for step in range(STEPS):
            batch = global_batch(step, world, source, DIMS)
            kt = dmp(batch.kjt(keys, False, rank))
            ref_kt = ref(batch.kjt(KV_KEYS, False)).to_dict()
            for k in KV_KEYS:
                tally.diff("outputs", kt[k], ref_kt[k][rank * BATCH : (rank + 1) * BATCH])
            step_loss(kt, batch, keys, rank).backward()
            (sum((ref_kt[k] * batch.coeff[k]).sum() for k in KV_KEYS) / world).backward()
            # Every column shard stores the same ids in the same slots as the twin.
            for n, table in local.items():
                want = index_state(ref.table(n))
                for what, value in index_state(table).items():
                    tally.exact(f"{n} {what} equal the twin's at every step", value, want[what])
        for n in OPTIONS:
            for counter in churn:
                churn[counter] += ref.table(n).metrics()[counter]
        tally.check("ids were evicted", churn["evictions"] > 0)
        tally.check("ids waited for admission", churn["admission_rejects"] > 0)
        compare_columns(tally, local, ref)
        checkpoint.save(dmp, str(work / "cw_ckpt"))
        if rank == 0:
            torch.save({n: ref.table(n).export() for n in OPTIONS}, work / "twin.pt")
        result = tally.result()
        result["churn"] = churn
        return result

    return run


def compare_columns(tally: Tally, local: dict, ref: KVEmbeddingBagCollection) -> None:
    """Each shard's ids, scores, rows and Adam moments: its columns of the twin's."""
    for n, table in local.items():
        first, width = shard_piece(table)
        mine, want = table.export(), ref.table(n).export()
        tally.exact(f"{n} ids", mine["ids"], want["ids"])
        tally.exact(f"{n} scores", mine["scores"], want["scores"])
        if mine["ids"].shape != want["ids"].shape:
            continue
        tally.diff("rows", mine["weights"], want["weights"][:, first : first + width])
        for key in ("exp_avg", "exp_avg_sq"):
            if key in want:
                tally.diff("adam state", mine[key], want[key][:, first : first + width])


def rowwise_adagrad_scenario() -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    dmp, _ = build_sharded(ADAGRAD)
    local = dmp.module.ebc.kv_tables()
    # The twin: one table per column shard, named and fed by shard index.
    pieces: dict[str, list[tuple[int, int]]] = {n: [] for n in OPTIONS}
    for part in gather({n: shard_piece(t) for n, t in local.items()}):
        for n, piece in part.items():
            pieces[n].append(piece)
    twin_configs, twin_options, feature_of = [], {}, {}
    for config in CONFIGS:
        for i, (first, width) in enumerate(sorted(pieces[config.name])):
            name = f"{config.name}_{i}"
            features = [f"{f}_{i}" for f in config.feature_names]
            feature_of.update({f"{f}_{i}": f for f in config.feature_names})
            twin_configs.append(
                EmbeddingBagConfig(
                    name=name,
                    embedding_dim=width,
                    num_embeddings=config.num_embeddings,
                    feature_names=features,
                    pooling=config.pooling,
                )
            )
            twin_options[name] = replace(OPTIONS[config.name], column_offset=first)
    twin = KVEmbeddingBagCollection(twin_configs, twin_options, fused_params=ADAGRAD)
    twin_keys = [f for c in twin_configs for f in c.feature_names]
    tally = Tally(TOL)
    keys = KV_KEYS + ["s"]
    source = pools()
    for step in range(STEPS):
        batch = global_batch(step, world, source, DIMS)
        twin_batch = GlobalBatch(
            {f: batch.features[feature_of[f]] for f in twin_keys},
            {f: batch.coeff[feature_of[f]] for f in twin_keys},
        )
        kt = dmp(batch.kjt(keys, False, rank))
        twin_kt = twin(twin_batch.kjt(twin_keys, False)).to_dict()
        rows = slice(rank * BATCH, (rank + 1) * BATCH)
        for k in KV_KEYS:
            parts = [twin_kt[f][rows] for f in twin_keys if feature_of[f] == k]
            tally.diff("outputs", kt[k], torch.cat(parts, dim=1))
        step_loss(kt, batch, keys, rank).backward()
        loss = 0
        for f in twin_keys:
            config = next(c for c in twin_configs if f in c.feature_names)
            i = int(config.name.rsplit("_", 1)[1])
            first, width = sorted(pieces[config.name.rsplit("_", 1)[0]])[i]
            coeff = batch.coeff[feature_of[f]][:, first : first + width]
            loss = loss + (twin_kt[f] * coeff).sum()
        (loss / world).backward()
    for n, table in local.items():
        i = sorted(pieces[n]).index(shard_piece(table))
        mine, want = table.export(), twin.table(f"{n}_{i}").export()
        tally.exact(f"{n} ids", mine["ids"], want["ids"])
        if mine["ids"].shape == want["ids"].shape:
            tally.diff("rows", mine["weights"], want["weights"])
            tally.diff("momentum", mine["momentum1"], want["momentum1"])
    # The state_dict's momentum1: the mean over all columns, sum(width_i * m_i) / dim,
    # on the shard of the first columns (with the ids).
    state = dmp.state_dict()
    for config in CONFIGS:
        n = config.name
        ids = state[f"ebc.embedding_bags.{n}.weight_id"].local_shards()
        momentum = state[f"ebc.embedding_bags.{n}.momentum1"].local_shards()
        if not ids or ids[0].tensor.numel() == 0:
            continue
        saved_ids, saved = ids[0].tensor, momentum[0].tensor
        parts = [twin.table(f"{n}_{i}").export() for i in range(len(pieces[n]))]
        tally.exact(f"{n} state_dict ids", torch.sort(saved_ids).values, parts[0]["ids"])
        if saved_ids.numel() != parts[0]["ids"].numel():
            continue
        widths = [w for _, w in sorted(pieces[n])]
        mean = sum(w * p["momentum1"] for w, p in zip(widths, parts, strict=True))
        tally.diff("state_dict momentum", saved[torch.argsort(saved_ids)], mean / sum(widths))
        tally.check(f"{n} state_dict momentum on the first shard", shard_piece(local[n])[0] == 0)
    return tally.result()


def check_loaded(tally: Tally, label: str, dmp, twin: dict, kinds: dict[str, str]) -> None:
    """Every shard of ``dmp`` holds its ids and columns of the saved rows (``twin``)."""
    held = {n: 0 for n in OPTIONS}
    for n, table in dmp.module.ebc.kv_tables().items():
        first, width = shard_piece(table)
        mine, want = table.export(), twin[n]
        keep = torch.isin(want["ids"], mine["ids"])
        tally.exact(f"{label} {n} ids", mine["ids"], want["ids"][keep])
        tally.exact(f"{label} {n} scores", mine["scores"], want["scores"][keep])
        if mine["ids"].shape != want["ids"][keep].shape:
            continue
        cols = slice(first, first + width)
        tally.diff("loaded rows", mine["weights"], want["weights"][keep][:, cols])
        for key in ("exp_avg", "exp_avg_sq"):
            tally.diff("loaded adam state", mine[key], want[key][keep][:, cols])
        held[n] = mine["ids"].numel()
    totals = {n: 0 for n in OPTIONS}
    for part in gather(held):
        for n, v in part.items():
            totals[n] += v
    for n in OPTIONS:
        copies = dist.get_world_size() if kinds.get(n, "column_wise") == "column_wise" else 1
        tally.check(
            f"{label} {n}: every saved id loaded", totals[n] == copies * twin[n]["ids"].numel()
        )


def load_scenario(work: Path, save: Path) -> dict:
    """The 2-rank job's checkpoint (in ``work``) loaded here into every sharding and
    unsharded; a row-wise checkpoint and plain tensors loaded into column shards."""
    twin = torch.load(work / "twin.pt")
    tally = Tally(TOL)
    mixed = {"wide": "row_wise", "narrow": "table_wise"}
    for kinds in ({}, mixed, {"wide": "table_wise", "narrow": "row_wise"}):
        dmp, _ = build_sharded(ADAM, kinds, LOAD_OPTIONS)
        checkpoint.load(dmp, str(work / "cw_ckpt"))
        label = "column_wise" if not kinds else "+".join(f"{k}:{v}" for k, v in kinds.items())
        check_loaded(tally, label, dmp, twin, kinds)
        if kinds == mixed:  # its own checkpoint, row-wise and table-wise, into column shards
            checkpoint.save(dmp, str(save / "rw_ckpt"))
            cw, _ = build_sharded(ADAM, {}, LOAD_OPTIONS)
            checkpoint.load(cw, str(save / "rw_ckpt"))
            check_loaded(tally, "row-wise checkpoint into column_wise", cw, twin, {})
    unsharded = KVEmbeddingBagCollection(CONFIGS, LOAD_OPTIONS, fused_params=ADAM)
    checkpoint.load(EBCModel(unsharded), str(work / "cw_ckpt"))
    for n in OPTIONS:
        mine, want = unsharded.table(n).export(), twin[n]
        tally.exact(f"unsharded {n} ids", mine["ids"], want["ids"])
        if mine["ids"].shape == want["ids"].shape:
            tally.diff("loaded rows", mine["weights"], want["weights"])
            tally.diff("loaded adam state", mine["exp_avg_sq"], want["exp_avg_sq"])
    # load_state_dict: whole plain tensors (an unsharded state_dict) give each column
    # shard its columns; a column-wise state_dict's own shards are refused.
    cw, _ = build_sharded(ADAM, {}, LOAD_OPTIONS)
    cw.load_state_dict(EBCModel(unsharded).state_dict(), strict=False)
    check_loaded(tally, "plain tensors into column_wise", cw, twin, {})
    try:
        cw.load_state_dict(cw.state_dict(), strict=False)
        refused = ""
    except CheckpointError as e:
        refused = str(e)
    tally.check("column shards refused by load_state_dict", "column-wise shard" in refused)
    tally.check("the refusal names the table", "table 'wide'" in refused)
    return tally.result()


def sequence_scenario(work: Path) -> dict:
    """An ``EmbeddingCollection`` whose KV tables are column-wise (two shards of 4 of
    8 columns, out of rank order; at 3 ranks one rank holds none) beside a stock
    table-wise table, against the unsharded ``KVEmbeddingCollection`` (SGD: fbgemm's
    CPU tables have no Adam): outputs and every shard's index at every step, then
    ids, scores and rows."""
    rank, world = dist.get_rank(), dist.get_world_size()
    options = {n: replace(o, capacity=32) for n, o in seq.OPTIONS.items()}
    sharder = KVEmbeddingCollectionSharder(options, fused_params=seq.SGD)
    model = seq.ECModel(EmbeddingCollection(seq.kv_configs() + [seq.STOCK], device=META))
    per_table = {
        n: column_wise(size_per_rank=[seq.DIM // 2] * 2, compute_kernel=KV_KERNEL) for n in options
    }
    per_table["stock"] = table_wise(rank=0, compute_kernel="fused")
    ec_plan = construct_module_sharding_plan(
        model.ec, per_table, sharder=sharder, local_size=world, world_size=world, device_type="cpu"
    )
    shard_ranks = [1, 0] if world == 2 else [world - 1, 0]
    for n in options:
        ec_plan[n].ranks = list(shard_ranks)
        for shard, r in zip(ec_plan[n].sharding_spec.shards, shard_ranks, strict=True):
            shard.placement = _Placement(f"rank:{r}/cpu")
    dmp = DistributedModelParallel(
        model, device=CPU, plan=ShardingPlan({"ec": ec_plan}), sharders=[sharder]
    )
    ref = KVEmbeddingCollection(seq.kv_configs(), options, fused_params=seq.SGD)
    local = dmp.module.ec.kv_tables()
    tally = Tally(TOL)
    tally.check("shards on their ranks", bool(local) == (rank in shard_ranks))
    evictions = 0
    for step in range(STEPS):
        batch = seq.GlobalBatch(step, world, seq.KEYS + ["s"])
        out = dmp(batch.kjt(seq.KEYS + ["s"], rank))
        ref_out = ref(batch.kjt(seq.KEYS))
        seq.compare_outputs(tally, {k: out[k] for k in seq.KEYS}, ref_out, batch, rank)
        batch.loss(out, rank).backward()
        (batch.loss(ref_out, None) / world).backward()
        for n, table in local.items():
            want = index_state(ref.table(n))
            for what, value in index_state(table).items():
                tally.exact(f"{n} {what} equal the twin's at every step", value, want[what])
    for n in options:
        evictions += ref.table(n).metrics()["evictions"]
    tally.check("ids were evicted", evictions > 0)
    compare_columns(tally, local, ref)
    # Column shards of two widths in one sequence collection: refused, naming them.
    uneven = {n: column_wise(size_per_rank=[3, 5], compute_kernel=KV_KERNEL) for n in options}
    uneven["stock"] = table_wise(rank=0, compute_kernel="fused")
    other = seq.ECModel(EmbeddingCollection(seq.kv_configs() + [seq.STOCK], device=META))
    uneven_plan = construct_module_sharding_plan(
        other.ec, uneven, sharder=sharder, local_size=world, world_size=world, device_type="cpu"
    )
    try:
        DistributedModelParallel(
            other, device=CPU, plan=ShardingPlan({"ec": uneven_plan}), sharders=[sharder]
        )
        refused = ""
    except ValueError as e:
        refused = str(e)
    tally.check("column shards of two widths refused", "shards of one width" in refused)
    # Its checkpoint, loaded into an unsharded collection: the whole rows.
    path = str(work / "seq_ckpt")
    checkpoint.save(dmp, path)
    loaded = KVEmbeddingCollection(seq.kv_configs(), options, fused_params=seq.SGD)
    checkpoint.load(seq.ECModel(loaded), path)
    for n in options:
        got, want = loaded.table(n).export(), ref.table(n).export()
        tally.exact(f"sequence checkpoint {n} ids", got["ids"], want["ids"])
        if got["ids"].shape == want["ids"].shape:
            tally.diff("sequence checkpoint rows", got["weights"], want["weights"])
    return tally.result()


def main() -> None:
    """``RESULT.json SAVE_DIR [LOAD_DIR] [SCENARIOS]``: the twins save their checkpoint
    to SAVE_DIR; with LOAD_DIR, the load scenario reads the one saved there."""
    out, save = sys.argv[1], Path(sys.argv[2])
    load = Path(sys.argv[3]) if len(sys.argv) > 3 and sys.argv[3] else None
    scenarios: dict[str, Callable[[], dict]] = {
        "adam": adam_scenario(save),
        "rowwise_adagrad": rowwise_adagrad_scenario,
        "sequence": lambda: sequence_scenario(save),
    }
    if load is not None:
        scenarios["load"] = lambda: load_scenario(load, save)
    if len(sys.argv) > 4:
        scenarios = {k: v for k, v in scenarios.items() if k in sys.argv[4].split(",")}
    with gloo_job():
        run_scenarios(out, scenarios)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
