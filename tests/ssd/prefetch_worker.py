"""TorchRec's prefetch pipeline reaching the SSD tier of sharded KV tables, one
torchrun job.

Run by ``tests/ssd/test_sharded_prefetch.py``::

    torchrun --nproc_per_node 2 -m tests.ssd.prefetch_worker RESULT.json DIR

Per scenario (bags row-wise, with and without ``use_index_dedup``; sequences
table-wise), two DMP models of KV tables over SSD tiers, memory too small for
the ids (rows move between memory and disk every step): one trained by
``PrefetchTrainPipelineSparseDist``, one by the plain loop on the same batches.
The pipeline calls the sharded module's ``prefetch`` with the next batch's ids
after its input all-to-all; the tiers' ``ssd_prefetch_hits`` (rows the next
lookup took from what ``prefetch`` read) must be non-zero on every rank and
table with the pipeline, zero without, and outputs and rows (ids, values,
optimizer state) equal.

On CPU the pipeline has no streams: ``CPUPrefetchPipeline`` runs its prefetch
stage on the current thread (the stage TorchRec runs on its prefetch stream:
wait for the input dist, call ``prefetch``, keep the dist input for the
forward).
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
from torchrec.distributed.train_pipeline import PrefetchTrainPipelineSparseDist
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
from torchrec.streamable import Pipelineable

from tests.torchrun_jobs import Tally, gather, scenarios_main
from torchrec_kvemb import (
    KVEmbeddingBagCollectionSharder,
    KVEmbeddingCollectionSharder,
    KVTableOptions,
    SSDOptions,
)

BATCH = 5
STEPS = 5
DIM = 4
TOL = 1e-6
CPU = torch.device("cpu")
META = torch.device("meta")
FEATURES = {"user": ["u"], "item": ["i", "j"]}
KEYS = ["u", "i", "j"]
ADAGRAD = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1}


class CPUPrefetchPipeline(PrefetchTrainPipelineSparseDist):
    """TorchRec's prefetch pipeline with its prefetch stage on the current stream."""

    def _prefetch(self, context) -> None:
        context.module_input_post_prefetch.clear()
        context.module_contexts_post_prefetch.clear()
        for module in self._pipelined_modules:
            name = module.forward._name
            dist_input = context.input_dist_tensors_requests.pop(name).wait()
            module.prefetch(
                ctx=context.module_contexts[name], dist_input=dist_input, forward_stream=None
            )
            context.module_input_post_prefetch[name] = dist_input
            context.module_contexts_post_prefetch[name] = context.module_contexts.pop(name)


class Batch(Pipelineable):
    def __init__(self, kjt: KeyedJaggedTensor) -> None:
        self.kjt = kjt

    def to(self, device: torch.device, non_blocking: bool = False) -> Batch:
        return Batch(self.kjt.to(device))

    def record_stream(self, stream) -> None:
        pass


class LossModel(nn.Module):
    """batch -> (loss, the flat output): a fixed weighting of every output value."""

    def __init__(self, module: nn.Module, pooled: bool) -> None:
        super().__init__()
        self.emb = module
        self.pooled = pooled

    def forward(self, batch: Batch):
        out = self.emb(batch.kjt)
        if self.pooled:
            values = out.values()
        else:
            values = torch.cat([out[k].values() for k in KEYS])
        scale = torch.arange(values.numel(), dtype=values.dtype).view(values.shape) % 7 - 3
        return (values * scale).sum(), values.detach()


def batches(rank: int) -> list[Batch]:
    """Rank ``rank``'s batches: ids from a pool several times the memory capacity."""
    out = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        lengths = torch.randint(1, 4, (len(KEYS) * BATCH,), generator=g)
        values = torch.randint(0, 120, (int(lengths.sum()),), generator=g) * 7919
        out.append(Batch(KeyedJaggedTensor.from_lengths_sync(KEYS, values, lengths)))
    return out


def build(
    pooled: bool, sharding: str, directory: str, dedup: bool = False
) -> DistributedModelParallel:
    options = {
        name: KVTableOptions(capacity=24, seed=7, total_num_buckets=16, ssd=SSDOptions(
            path=os.path.join(directory, name), resume=False))
        for name in FEATURES
    }  # fmt: skip
    if pooled:
        configs = [
            EmbeddingBagConfig(name=n, embedding_dim=DIM, num_embeddings=2**40, feature_names=f)
            for n, f in FEATURES.items()
        ]
        module = EmbeddingBagCollection(configs, device=META)
        sharder = KVEmbeddingBagCollectionSharder(
            options, fused_params=ADAGRAD, use_index_dedup=dedup
        )
    else:
        configs = [
            EmbeddingConfig(name=n, embedding_dim=DIM, num_embeddings=2**40, feature_names=f)
            for n, f in FEATURES.items()
        ]
        module = EmbeddingCollection(configs, device=META)
        sharder = KVEmbeddingCollectionSharder(options, fused_params=ADAGRAD)
    model = LossModel(module, pooled)
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=dist.get_world_size(), compute_device="cpu"),
        constraints={n: ParameterConstraints(sharding_types=[sharding]) for n in FEATURES},
    )
    plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    return DistributedModelParallel(model, device=CPU, plan=plan, sharders=[sharder])


def scenario(pooled: bool, sharding: str, dedup: bool = False) -> Callable[[], dict]:
    def run() -> dict:
        rank = dist.get_rank()
        name = f"{'bags' if pooled else 'seq'}_{sharding}{'_dedup' if dedup else ''}"
        root = os.path.join(sys.argv[2], name)
        piped = build(pooled, sharding, os.path.join(root, "pipeline", f"r{rank}"), dedup)
        plain = build(pooled, sharding, os.path.join(root, "plain", f"r{rank}"), dedup)
        dense = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.0)
        pipeline = CPUPrefetchPipeline(piped, dense, CPU)
        local = batches(rank)
        it = iter(local)
        tally = Tally(TOL)
        for step in range(STEPS):
            got = pipeline.progress(it)
            loss, want = plain(local[step])
            loss.backward()
            tally.diff("outputs", got, want)
        pipelined = [type(m).__name__ for m in pipeline._pipelined_modules]
        tally.check("sharded module pipelined", len(pipelined) == 1)
        tables = piped.module.emb.kv_tables()
        plain_tables = plain.module.emb.kv_tables()
        for name, table in tables.items():
            hits = table.metrics()["ssd_prefetch_hits"]
            tally.check(f"{name}: prefetch hits under the pipeline", hits > 0)
            tally.check(
                f"{name}: no prefetch without it",
                plain_tables[name].metrics()["ssd_prefetch_hits"] == 0,
            )
        tally.check("every batch consumed", next(it, None) is None)
        for name, table in tables.items():
            got_rows, want_rows = sorted_export(table), sorted_export(plain_tables[name])
            tally.check(f"{name}: same ids", torch.equal(got_rows["ids"], want_rows["ids"]))
            if torch.equal(got_rows["ids"], want_rows["ids"]):
                for key in got_rows:
                    if key not in ("ids", "scores"):
                        tally.diff(f"rows ({key})", got_rows[key], want_rows[key])
        tally.check("every rank holds tiered tables", all(gather(len(tables) > 0)))
        return tally.result()

    return run


def sorted_export(table) -> dict[str, torch.Tensor]:
    rows = table.export()
    order = torch.argsort(rows["ids"])
    return {k: v[order] for k, v in rows.items() if isinstance(v, torch.Tensor)}


SCENARIOS: dict[str, Callable[[], dict]] = {
    "bags_row_wise": scenario(True, "row_wise"),
    "sequences_table_wise": scenario(False, "table_wise"),
    "bags_row_wise_dedup": scenario(True, "row_wise", dedup=True),
}


if __name__ == "__main__":
    scenarios_main(SCENARIOS)
