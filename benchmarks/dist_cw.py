"""Distributed train step, column-wise: KV tables vs stock TorchRec tables, same plan (CPU, gloo).

A 2-process ``torchrun`` job on this machine. Both systems get one plan: every
table column-wise, its columns cut in two halves, one per rank; the same
batches (each rank its own):

* ``KV column-wise``: an ``EmbeddingBagCollection`` on ``meta`` whose tables
  all have ``KVTableOptions`` (capacity = ``rows``), sharded by
  ``KVEmbeddingBagCollectionSharder``: each column shard a ``KVTable`` of half
  the width holding every id (docs/sharding.md, "Column-wise").
* ``TBE column-wise``: the same collection with TorchRec's
  ``EmbeddingBagCollectionSharder`` and the FUSED kernel (fbgemm's TBE).

Every rank receives the ids of all ranks for its column shards (TorchRec's
table-wise input dist) and sends its columns of every bag back (all-to-all).
Both train with a fused EXACT_ROWWISE_ADAGRAD (each shard's state over its
columns, for both). The step, timing and figures are those of
``benchmarks.dist_train`` (median block, each block the slowest rank's).

Run from the repository root::

    python -m benchmarks.dist_cw            # under a minute on 2 cores
    python -m benchmarks.dist_cw --quick    # smoke-test sizes
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import column_wise, construct_module_sharding_plan
from torchrec.distributed.types import ShardingPlan

from benchmarks.common import (
    add_config_flags,
    config_from_args,
    load_average,
    machine_summary,
    time_interleaved,
)
from benchmarks.dist_train import (
    SystemResult,
    _batches,
    _Model,
    _train_step,
    results_table,
    run_job,
    slowest_rank_results,
)
from torchrec_kvemb import KVEmbeddingBagCollectionSharder, KVTableOptions

KV = "KV column-wise"
TBE = "TBE column-wise"
KV_KERNEL = "customized_kernel"


@dataclass(frozen=True)
class CwBenchConfig:
    """Sizes and timing of one run (``batch`` is per rank); the fields
    ``benchmarks.dist_train``'s batches and model read, with its names."""

    world_size: int = 2
    tables: int = 4
    dim: int = 64  # cut in ``world_size`` column shards (multiples of 4: fbgemm)
    batch: int = 2048
    bag: int = 20
    rows: int = 500_000  # per table: TBE size, id range and KV capacity
    alpha: float = 1.05
    batches: int = 4
    steps: int = 3
    repeats: int = 5
    warmup: int = 1
    prime: int = 6
    learning_rate: float = 0.01
    seed: int = 0

    @property
    def ids_per_step(self) -> int:
        """Ids of one step over all ranks (each is looked up by every column shard)."""
        return self.world_size * self.tables * self.batch * self.bag


QUICK = CwBenchConfig(
    tables=2, dim=16, batch=64, bag=4, rows=10_000, batches=2, steps=2, repeats=2, prime=2
)


@dataclass(frozen=True)
class CwBenchResult:
    config: CwBenchConfig
    results: tuple[SystemResult, ...]
    machine: str
    load: tuple[float, float]

    def get(self, system: str) -> SystemResult:
        return next(r for r in self.results if r.system == system)

    @property
    def ratio(self) -> float:
        """KV column-wise ids/s over TBE column-wise ids/s."""
        return self.get(KV).ids_per_s / self.get(TBE).ids_per_s


# ------------------------------------------------------------------ worker
def _sharded(config: CwBenchConfig, system: str) -> DistributedModelParallel:
    fused = {
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        "learning_rate": config.learning_rate,
    }
    model = _Model(config)
    names = [f"t{t}" for t in range(config.tables)]
    if system == KV:
        sharder = KVEmbeddingBagCollectionSharder(
            dict.fromkeys(names, KVTableOptions(capacity=config.rows)), fused
        )
        kernel = KV_KERNEL
    else:
        sharder = EmbeddingBagCollectionSharder(fused_params=fused)
        kernel = "fused"
    ranks = list(range(config.world_size))
    # The same plan for both: shard i of every table on rank i.
    per_table = {
        n: column_wise(
            size_per_rank=[config.dim // config.world_size] * config.world_size,
            compute_kernel=kernel,
        )
        for n in names
    }
    plan = construct_module_sharding_plan(
        model.ebc,
        per_table,
        sharder=sharder,
        local_size=len(ranks),
        world_size=len(ranks),
        device_type="cpu",
    )
    return DistributedModelParallel(
        model,
        device=torch.device("cpu"),
        plan=ShardingPlan({"ebc": plan}),
        sharders=[sharder],
    )


def worker(config: CwBenchConfig, out_path: str) -> None:
    """One rank of the job; rank 0 writes the result to ``out_path`` (JSON)."""
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)  # why: W processes share this machine's cores
    dist.init_process_group("gloo")
    payload = _measure(replace(config, world_size=dist.get_world_size()))
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(payload, f)
    gc.collect()  # why: free the sharded models (they hold the process group)
    dist.barrier()
    dist.destroy_process_group()


def _measure(config: CwBenchConfig) -> dict:
    load_start = load_average()
    batches = _batches(config, dist.get_rank())
    grad = torch.randn(config.batch, config.tables * config.dim)
    models = {system: _sharded(config, system) for system in (KV, TBE)}
    steps = {system: _train_step(m, batches, grad) for system, m in models.items()}
    for system in steps:
        for i in range(config.prime):
            steps[system](i)
    timings = time_interleaved(steps, config.steps, config.repeats, config.warmup)
    results = slowest_rank_results(timings, config.world_size, config.ids_per_step, config.dim)
    return {
        "config": asdict(config),
        "results": [asdict(r) for r in results],
        "machine": machine_summary(),
        "load": [load_start, load_average()],
    }


# ---------------------------------------------------------------- launcher
def launch(config: CwBenchConfig, timeout_s: float = 300) -> CwBenchResult:
    """Run the job with ``torchrun``; returns rank 0's result."""
    data = run_job("benchmarks.dist_cw", config, config.world_size, timeout_s)
    return CwBenchResult(
        config=CwBenchConfig(**data["config"]),
        results=tuple(SystemResult(**r) for r in data["results"]),
        machine=data["machine"],
        load=tuple(data["load"]),
    )


def report(result: CwBenchResult) -> str:
    c = result.config
    head = (
        f"{c.world_size} ranks (gloo, 1 thread each), {c.tables} tables x {c.rows:,} rows x "
        f"dim {c.dim}, column-wise in {c.world_size} shards of {c.dim // c.world_size} "
        f"columns; batch {c.batch} per rank, {c.bag} ids/bag, Zipf alpha {c.alpha}; "
        f"{c.ids_per_step:,} ids/step over all ranks; median of {c.repeats} blocks x "
        f"{c.steps} steps after {c.prime} priming steps.\n{result.machine}; load average "
        f"{result.load[0]:.2f} at start, {result.load[1]:.2f} at end."
    )
    table = results_table(result.results)
    return "\n\n".join([head, table, f"{KV} / {TBE} (ids/s): {result.ratio:.2f}x"])


def parse_args(argv: Sequence[str] | None) -> tuple[CwBenchConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--worker", metavar="RESULT_JSON", help=argparse.SUPPRESS)
    names = add_config_flags(parser, CwBenchConfig)
    args = parser.parse_args(argv)
    return config_from_args(args, QUICK if args.quick else CwBenchConfig(), names), args


def main(argv: Sequence[str] | None = None) -> CwBenchResult | None:
    """Launch the job and print the table (``--worker``: be one of its ranks)."""
    config, args = parse_args(argv)
    if args.worker:
        worker(config, args.worker)
        return None
    result = launch(config)
    print(report(result))
    return result


if __name__ == "__main__":
    main()
