"""``use_index_dedup`` against the same sharding without it and the unsharded module,
one torchrun job.

Run by ``tests/sharding/test_index_dedup.py``::

    torchrun --nproc_per_node 2 -m tests.sharding.dedup_worker RESULT.json DIR

Sequence collections (the batches and loss of ``ec_dist_worker``, a table
reading both features of another): the sharded module with dedup and the one
without are trained side by side on each rank's bags, the unsharded references
on the global batch. ``item`` and ``recent`` count nothing per sighting: their
outputs, rows and optimizer state equal the plain unsharded module's. ``user``
admits an id at its second sighting and evicts by LFU: under dedup an id is
sighted once per batch per rank, so its reference is an unsharded ``user``
table fed each rank's de-duplicated bags (docs/sharding.md); its outputs, ids,
scores and rows equal that reference's.

Bag collections (the tables and batches of ``dist_worker``, row-wise, weighted
and not): ``item`` (MEAN) equals the plain sharded and unsharded modules;
``user`` (two features, LFU, admission at 2, SUM) equals an unsharded ``user``
table fed each rank's de-duplicated ids, its bags pooled from those rows.
A deduplicated bag module's checkpoint (written under ``DIR``) loads into the
module without dedup; table-wise KV bags with dedup are refused.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import ParameterConstraints
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.sharding import dist_worker as bags
from tests.sharding import ec_dist_worker as ec
from tests.torchrun_jobs import Tally, scenarios_main
from torchrec_kvemb import (
    KVEmbeddingBagCollection,
    KVEmbeddingBagCollectionSharder,
    KVEmbeddingCollection,
    KVEmbeddingCollectionSharder,
    checkpoint,
)
from torchrec_kvemb.sharding import (
    ShardedKVEmbeddingBagCollection,
    ShardedKVEmbeddingCollection,
    owner_rank,
)
from torchrec_kvemb.sharding.index_dedup import dedup_features

TOL = 1e-5
STEPS = 3
KEYS = ec.KEYS
FEATURES = ec.SHARED_FEATURES
OPTIONS = ec.SHARED_OPTIONS
#: The tables whose rows and scores do not depend on how often a batch sights an id.
PLAIN = ["item", "recent"]


def sequence_model(sharding: str, dedup: bool) -> DistributedModelParallel:
    configs = ec.kv_configs(FEATURES)
    sharder = KVEmbeddingCollectionSharder(OPTIONS, fused_params=ec.ADAGRAD, use_index_dedup=dedup)
    model = ec.ECModel(EmbeddingCollection(configs, device=ec.META))
    plan = ec.planned(model, sharder, sharding, list(FEATURES))
    return DistributedModelParallel(model, device=ec.CPU, plan=plan, sharders=[sharder])


class UserReference:
    """The unsharded ``user`` table fed every rank's de-duplicated ``user_id`` bags."""

    def __init__(self) -> None:
        self.ec = KVEmbeddingCollection(
            ec.kv_configs({"user": ["user_id"]}), {"user": OPTIONS["user"]},
            fused_params=ec.ADAGRAD,
        )  # fmt: skip

    def step(self, batch: ec.GlobalBatch, world: int, train: bool) -> list[torch.Tensor]:
        """Each rank's ``user_id`` rows (every occurrence); trains when ``train``."""
        parts, reverses = [], []
        for r in range(world):
            dedup, reverse = dedup_features(batch.kjt(["user_id"], r), [0])
            parts.append(dedup)
            reverses.append(reverse)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=["user_id"],
            values=torch.cat([p.values() for p in parts]),
            lengths=torch.cat([p.lengths() for p in parts]),
        )
        rows = self.ec(kjt)["user_id"].values()
        per_rank = [
            piece[reverse]
            for piece, reverse in zip(
                rows.split([p.values().numel() for p in parts]), reverses, strict=True
            )
        ]
        if train:
            coeff = batch.features["user_id"][2]
            loss = sum(
                (rows_r * coeff[batch.span("user_id", r)]).sum()
                for r, rows_r in enumerate(per_rank)
            )
            (loss / world).backward()
        return per_rank


def sequence_scenario(sharding: str) -> Callable[[], dict]:
    def run() -> dict:
        world, rank = dist.get_world_size(), dist.get_rank()
        plain, dedup = sequence_model(sharding, False), sequence_model(sharding, True)
        ref = KVEmbeddingCollection(ec.kv_configs(FEATURES), OPTIONS, fused_params=ec.ADAGRAD)
        user_ref = UserReference()
        tally = Tally(TOL)
        tally.check("sharded type", isinstance(dedup.module.ec, ShardedKVEmbeddingCollection))
        tally.check("dedup on", dedup.module.ec._use_index_dedup)
        for step in range(STEPS + 1):
            train = step < STEPS
            for module in (plain, dedup, ref, user_ref.ec):
                module.train(train)
            batch = ec.GlobalBatch(step, world, KEYS)
            with torch.set_grad_enabled(train):
                out = dedup(batch.kjt(KEYS, rank))
                plain_out = plain(batch.kjt(KEYS, rank))
                ref_out = ref(batch.kjt(KEYS))
                user_rows = user_ref.step(batch, world, train)[rank]
            for name in plain_out.keys():
                tally.exact("output lengths", out[name].lengths(), plain_out[name].lengths())
                if name != "user_id":
                    got, want = out[name].values(), plain_out[name].values()
                    tally.diff("dedup outputs = plain sharded", got, want)
            tally.diff("user outputs = user reference", out["user_id"].values(), user_rows)
            ec.compare_outputs(
                tally, {k: v for k, v in out.items() if k != "user_id"},
                {k: v for k, v in ref_out.items() if k != "user_id"}, batch, rank,
            )  # fmt: skip
            if train:
                batch.loss(out, rank).backward()
                batch.loss(plain_out, rank).backward()
                (batch.loss(ref_out, None) / world).backward()
        # Fewer ids travel, and counting sightings once per batch per rank matters here.
        tally.check("fewer ids looked up", looked_up(dedup.module.ec) < looked_up(plain.module.ec))
        sightings = [r.kv_tables()["user"].export()["scores"] for r in (ref, user_ref.ec)]
        tally.check("user scores depend on dedup", not torch.equal(*sightings))
        want = {n: t.export() for n, t in ref.kv_tables().items() if n in PLAIN}
        want["user"] = user_ref.ec.kv_tables()["user"].export()
        want = {n: sort_by_id(rows) for n, rows in want.items()}
        compare_tables(tally, dedup.module.ec, want, sharding, OPTIONS)
        return tally.result()

    return run


def compare_tables(tally: Tally, sharded, want: dict, sharding: str, options: dict) -> None:
    """Every KV table's ids (on their owner ranks), scores, rows and optimizer state."""
    world = dist.get_world_size()
    merged = ec.merged_exports(sharded)
    tally.check("tables", set(merged) == set(want))
    for name, table in merged.items():
        held = table["held"]
        if sharding == ec.TW:
            tally.check(f"{name} on one rank", len(held) == 1)
        else:
            tally.check(f"{name} on every rank", len(held) == world)
            for r, ids in held:
                owners = owner_rank(ids, options[name].total_num_buckets, world)
                tally.check(f"{name} ids on their owner rank", bool((owners == r).all()))
        got = table["rows"]
        same_ids = torch.equal(got["ids"], want[name]["ids"])
        tally.check(f"{name} same ids", same_ids)
        if same_ids:
            tally.check(f"{name} same scores", torch.equal(got["scores"], want[name]["scores"]))
            tally.diff("rows", got["weights"], want[name]["weights"])
            for key in want[name]:
                if key not in ("ids", "weights", "scores"):
                    tally.diff("optimizer state", got[key], want[name][key])


def looked_up(sharded) -> int:
    """Ids the KV tables of all ranks looked up (hits and misses)."""
    metrics = sharded.metrics().values()
    count = torch.tensor(sum(m["hits"] + m["misses"] for m in metrics))
    dist.all_reduce(count)
    return int(count)


def sort_by_id(rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    order = torch.argsort(rows["ids"])
    return {k: v[order] for k, v in rows.items()}


# -------------------------------------------------------------------- bags
BAG_KEYS = ["u1", "u2", "i"]
USER_KEYS = ["u1", "u2"]
BAG_DIMS = {"u1": 8, "u2": 8, "i": 4}


def bag_model(
    dedup: bool, fused: dict, weighted: bool, sharding: str = ec.RW
) -> DistributedModelParallel:
    sharder = KVEmbeddingBagCollectionSharder(
        bags.OPTIONS, fused_params=fused, use_index_dedup=dedup
    )
    configs = bags.kv_configs(2**40)
    model = bags.EBCModel(EmbeddingBagCollection(configs, device=ec.META, is_weighted=weighted))
    constraints = {n: ParameterConstraints(sharding_types=[sharding]) for n in bags.OPTIONS}
    plan = bags.planned(model, [sharder], constraints)
    return DistributedModelParallel(model, device=ec.CPU, plan=plan, sharders=[sharder])


class PooledUserReference:
    """The unsharded ``user`` table (a sequence collection: one row per id) fed every
    rank's de-duplicated ``u1`` / ``u2`` ids; each rank's bags pooled from those rows
    here (per-sample weights, SUM)."""

    def __init__(self, fused: dict) -> None:
        (user,) = [c for c in bags.kv_configs(2**40) if c.name == "user"]
        config = EmbeddingConfig(
            name="user", embedding_dim=user.embedding_dim, num_embeddings=user.num_embeddings,
            feature_names=USER_KEYS, init_fn=user.init_fn,
        )  # fmt: skip
        self.ec = KVEmbeddingCollection(
            [config], {"user": bags.OPTIONS["user"]}, fused_params=fused
        )

    def pooled(self, kjts: list[KeyedJaggedTensor]) -> list[torch.Tensor]:
        """Each rank's pooled ``[bags, u1 and u2 columns]`` from its KJT of ``USER_KEYS``."""
        parts = [dedup_features(kjt, [0, 0]) for kjt in kjts]
        per_key = {key: [dedup[key] for dedup, _ in parts] for key in USER_KEYS}
        merged = KeyedJaggedTensor.from_lengths_sync(
            keys=USER_KEYS,
            values=torch.cat([jt.values() for key in USER_KEYS for jt in per_key[key]]),
            lengths=torch.cat([jt.lengths() for key in USER_KEYS for jt in per_key[key]]),
        )
        out = self.ec(merged)
        pooled = []
        for r, (kjt, (_, reverse)) in enumerate(zip(kjts, parts, strict=True)):
            rows = torch.cat(
                [
                    out[key].values().split([jt.values().numel() for jt in per_key[key]])[r]
                    for key in USER_KEYS
                ]
            )
            rows = rows.index_select(0, reverse)
            if kjt.weights_or_none() is not None:
                rows = rows * kjt.weights().unsqueeze(1)
            bag_of = torch.repeat_interleave(torch.arange(kjt.lengths().numel()), kjt.lengths())
            sums = torch.zeros(kjt.lengths().numel(), rows.shape[1]).index_add(0, bag_of, rows)
            stride = kjt.stride()
            pooled.append(sums.view(len(USER_KEYS), stride, -1).transpose(0, 1).reshape(stride, -1))
        return pooled


def bag_scenario(fused: dict, weighted: bool) -> Callable[[], dict]:
    def run() -> dict:
        world, rank = dist.get_world_size(), dist.get_rank()
        plain, dedup = bag_model(False, fused, weighted), bag_model(True, fused, weighted)
        configs = bags.kv_configs(2**40)
        ref = KVEmbeddingBagCollection(
            configs, bags.OPTIONS, is_weighted=weighted, fused_params=fused
        )
        user_ref = PooledUserReference(fused)
        tally = Tally(TOL)
        tally.check("sharded type", isinstance(dedup.module.ebc, ShardedKVEmbeddingBagCollection))
        pools = {k: v for k, v in bags.id_pools(2**62).items() if k in BAG_KEYS}
        rows = slice(rank * bags.BATCH, (rank + 1) * bags.BATCH)
        for step in range(STEPS):
            batch = bags.global_batch(step, world, pools, BAG_DIMS)
            kt = dedup(batch.kjt(BAG_KEYS, weighted, rank))
            plain_kt = plain(batch.kjt(BAG_KEYS, weighted, rank))
            ref_kt = ref(batch.kjt(BAG_KEYS, weighted)).to_dict()
            user = user_ref.pooled([batch.kjt(USER_KEYS, weighted, r) for r in range(world)])
            tally.diff("dedup outputs = plain sharded (item, MEAN)", kt["i"], plain_kt["i"])
            tally.diff("outputs = unsharded (item, MEAN)", kt["i"], ref_kt["i"][rows])
            got_user = torch.cat([kt["u1"], kt["u2"]], dim=1)
            tally.diff("user outputs = user reference", got_user, user[rank])
            loss = sum((kt[k] * batch.coeff[k][rows]).sum() for k in BAG_KEYS)
            loss.backward()
            sum((plain_kt[k] * batch.coeff[k][rows]).sum() for k in BAG_KEYS).backward()
            ref_loss = sum((ref_kt[k] * batch.coeff[k]).sum() for k in BAG_KEYS) / world
            ref_loss.backward()
            coeff = torch.cat([batch.coeff[k] for k in USER_KEYS], dim=1)
            user_loss = sum(
                (u * coeff[r * bags.BATCH : (r + 1) * bags.BATCH]).sum() for r, u in enumerate(user)
            )
            (user_loss / world).backward()
        tally.check(
            "fewer ids looked up", looked_up(dedup.module.ebc) < looked_up(plain.module.ebc)
        )
        sightings = [t.export()["scores"] for t in (ref.table("user"), user_ref.ec.table("user"))]
        tally.check("user scores depend on dedup", not torch.equal(*sightings))
        want = {"item": ref.table("item").export(), "user": user_ref.ec.table("user").export()}
        want = {n: sort_by_id(rows) for n, rows in want.items()}
        compare_tables(tally, dedup.module.ebc, want, ec.RW, bags.OPTIONS)
        return tally.result()

    return run


def bags_checkpoint() -> dict:
    """A deduplicated bag module's checkpoint (its KV tables are looked up by the
    sequence lookup) loads into the same module without dedup, every row equal."""
    world, rank = dist.get_world_size(), dist.get_rank()
    dedup = bag_model(True, ec.ADAGRAD, False)
    pools = {k: v for k, v in bags.id_pools(2**62).items() if k in BAG_KEYS}
    for step in range(2):
        batch = bags.global_batch(step, world, pools, BAG_DIMS)
        dedup(batch.kjt(BAG_KEYS, False, rank)).values().sum().backward()
    path = os.path.join(sys.argv[2], "ckpt")
    checkpoint.save(dedup, path)
    plain = bag_model(False, ec.ADAGRAD, False)
    checkpoint.load(plain, path)
    want = {n: t["rows"] for n, t in ec.merged_exports(dedup.module.ebc).items()}
    tally = Tally(0.0)
    compare_tables(tally, plain.module.ebc, want, ec.RW, bags.OPTIONS)
    return tally.result()


def table_wise_bags_refused() -> dict:
    """Table-wise KV bags with dedup: refused at sharding, naming the tables."""
    tally = Tally(TOL)
    try:
        bag_model(True, ec.ADAGRAD, False, sharding=ec.TW)
        tally.check("refused", False)
    except ValueError as error:
        message = str(error)
        tally.check("refused naming the tables", "['item', 'user']" in message)
        tally.check("refusal names the remedy", "row_wise" in message)
    return tally.result()


SCENARIOS: dict[str, Callable[[], dict]] = {
    "sequence_row_wise": sequence_scenario(ec.RW),
    "sequence_table_wise": sequence_scenario(ec.TW),
    "bags_row_wise": bag_scenario(ec.ADAGRAD, weighted=False),
    "bags_row_wise_weighted": bag_scenario(ec.SGD, weighted=True),
    "bags_checkpoint": bags_checkpoint,
    "bags_table_wise_refused": table_wise_bags_refused,
}


if __name__ == "__main__":
    scenarios_main(SCENARIOS)
