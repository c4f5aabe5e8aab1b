"""``use_index_dedup`` against the same sharding without it and the unsharded module,
one torchrun job.

Run by ``tests/sharding/test_index_dedup.py``::

    torchrun --nproc_per_node 2 -m tests.sharding.dedup_worker RESULT.json

Sequence collections (the batches and loss of ``ec_dist_worker``, a table
reading both features of another): the sharded module with dedup and the one
without are trained side by side on each rank's bags, the unsharded references
on the global batch. ``item`` and ``recent`` count nothing per sighting: their
outputs, rows and optimizer state equal the plain unsharded module's. ``user``
admits an id at its second sighting and evicts by LFU: under dedup an id is
sighted once per batch per rank, so its reference is an unsharded ``user``
table fed each rank's de-duplicated bags (docs/sharding.md); its outputs, ids,
scores and rows equal that reference's.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.sharding import ec_dist_worker as ec
from tests.torchrun_jobs import Tally, gloo_job, run_scenarios
from torchrec_kvemb import KVEmbeddingCollection, KVEmbeddingCollectionSharder
from torchrec_kvemb.sharding import ShardedKVEmbeddingCollection
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
        tally.check("fewer ids looked up", looked_up(dedup) < looked_up(plain))
        sightings = [r.kv_tables()["user"].export()["scores"] for r in (ref, user_ref.ec)]
        tally.check("user scores depend on dedup", not torch.equal(*sightings))
        want = {n: t.export() for n, t in ref.kv_tables().items() if n in PLAIN}
        want["user"] = user_ref.ec.kv_tables()["user"].export()
        want = {n: sort_by_id(rows) for n, rows in want.items()}
        shardings = {n: sharding for n in FEATURES}
        ec.compare_tables(tally, ec.merged_exports(dedup.module.ec), want, shardings)
        return tally.result()

    return run


def looked_up(dmp: DistributedModelParallel) -> int:
    """Ids the KV tables of all ranks looked up (hits and misses)."""
    metrics = dmp.module.ec.metrics().values()
    count = torch.tensor(sum(m["hits"] + m["misses"] for m in metrics))
    dist.all_reduce(count)
    return int(count)


def sort_by_id(rows: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    order = torch.argsort(rows["ids"])
    return {k: v[order] for k, v in rows.items()}


SCENARIOS: dict[str, Callable[[], dict]] = {
    "sequence_row_wise": sequence_scenario(ec.RW),
    "sequence_table_wise": sequence_scenario(ec.TW),
}


def main() -> None:
    with gloo_job():
        run_scenarios(sys.argv[1], SCENARIOS)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
