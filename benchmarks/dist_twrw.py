"""Distributed train step, table-row-wise: KV tables vs stock TorchRec tables, same plan
(CPU, gloo).

A 4-process ``torchrun`` job on this machine standing for 2 nodes x 2 local
ranks (every worker sets ``LOCAL_WORLD_SIZE=2`` before the process group
starts). Both systems get the same plan, table ``t`` on node ``t % 2``
(``construct_module_sharding_plan`` with ``table_row_wise(host_index)``), and
the same batches (each rank its own):

* ``KV table-row-wise``: the tables have ``KVTableOptions`` (capacity =
  ``rows``, so ``rows / 2`` per shard), sharded by
  ``KVEmbeddingBagCollectionSharder``: ids are routed by bucket to the local rank
  owning them, pooled partial sums come back by TorchRec's table-row-wise output
  dist (reduce-scatter inside the node, all-to-all across nodes).
* ``TBE table-row-wise``: the same collection with TorchRec's
  ``EmbeddingBagCollectionSharder`` and the FUSED kernel (fbgemm's TBE), rows
  split by row range over the node's ranks. The stock sharder does not offer
  table-row-wise on CPU to the planner, but runs it when the plan says so.

Both train with a fused EXACT_ROWWISE_ADAGRAD. Ids/s counts the ids of all
ranks; the figure is the median timed block, each block's time the slowest
rank's, systems taking turns (``common.time_interleaved``).

Run from the repository root::

    python -m benchmarks.dist_twrw            # under a minute on 2 cores
    python -m benchmarks.dist_twrw --quick    # smoke-test sizes
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_row_wise
from torchrec.distributed.types import ShardingPlan

from benchmarks.common import (
    add_config_flags,
    config_from_args,
    load_average,
    machine_summary,
    time_interleaved,
)
from benchmarks.dist_train import (
    DistBenchConfig,
    SystemResult,
    _batches,
    _configs,
    _Model,
    _train_step,
    results_table,
    run_job,
    slowest_rank_results,
)
from torchrec_kvemb import KVEmbeddingBagCollectionSharder, KVTableOptions

KV = "KV table-row-wise"
TBE = "TBE table-row-wise"
#: Ranks per node the job stands for.
LOCAL = 2
WORLD = 4

#: Default sizes: the 4 processes share 2 cores, so a step is a quarter of
#: ``dist_train``'s (one table per node and two per rank's batch would leave a node idle).
DEFAULT = DistBenchConfig(
    world_size=WORLD,
    tables=4,
    dim=32,
    batch=1024,
    bag=10,
    rows=200_000,
    batches=3,
    steps=2,
    repeats=5,
    prime=4,
)
#: ``--quick``: a smoke test that runs in seconds.
QUICK = replace(DEFAULT, tables=2, dim=8, batch=64, bag=4, rows=5_000, repeats=2, prime=2)


@dataclass(frozen=True)
class TwRwBenchResult:
    config: DistBenchConfig
    results: tuple[SystemResult, ...]
    machine: str
    load: tuple[float, float]

    def get(self, system: str) -> SystemResult:
        return next(r for r in self.results if r.system == system)

    @property
    def ratio(self) -> float:
        """KV ids/s over the stock tables' ids/s, same plan and batches."""
        return self.get(KV).ids_per_s / self.get(TBE).ids_per_s


# ------------------------------------------------------------------ worker
def _sharded(config: DistBenchConfig, system: str) -> DistributedModelParallel:
    fused = {
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        "learning_rate": config.learning_rate,
    }
    names = [c.name for c in _configs(config)]
    if system == KV:
        options = KVTableOptions(capacity=config.rows)
        sharder = KVEmbeddingBagCollectionSharder(dict.fromkeys(names, options), fused)
        kernel = "customized_kernel"
    else:
        sharder = EmbeddingBagCollectionSharder(fused_params=fused)
        kernel = "fused"
    model = _Model(config)
    module_plan = construct_module_sharding_plan(
        model.ebc,
        {name: table_row_wise(host_index=t % (WORLD // LOCAL)) for t, name in enumerate(names)},
        sharder,
        local_size=LOCAL,
        world_size=config.world_size,
        device_type="cpu",
    )
    for sharding in module_plan.values():
        sharding.compute_kernel = kernel
    return DistributedModelParallel(
        model,
        device=torch.device("cpu"),
        plan=ShardingPlan({"ebc": module_plan}),
        sharders=[sharder],
    )


def worker(config: DistBenchConfig, out_path: str) -> None:
    """One rank of the job; rank 0 writes the result to ``out_path`` (JSON)."""
    os.environ["LOCAL_WORLD_SIZE"] = str(LOCAL)  # why: TorchRec reads it for its node groups
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)  # why: 4 processes share this machine's cores
    dist.init_process_group("gloo")
    payload = _measure(replace(config, world_size=dist.get_world_size()))
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(payload, f)
    gc.collect()  # why: free the sharded models (they hold the process group) first
    dist.barrier()
    dist.destroy_process_group()


def _measure(config: DistBenchConfig) -> dict:
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
def launch(config: DistBenchConfig, timeout_s: float = 600) -> TwRwBenchResult:
    """Run the job with ``torchrun`` (4 processes); returns rank 0's result."""
    data = run_job("benchmarks.dist_twrw", config, WORLD, timeout_s)
    return TwRwBenchResult(
        config=DistBenchConfig(**data["config"]),
        results=tuple(SystemResult(**r) for r in data["results"]),
        machine=data["machine"],
        load=tuple(data["load"]),
    )


def report(result: TwRwBenchResult) -> str:
    c = result.config
    head = (
        f"{c.world_size} ranks as {c.world_size // LOCAL} nodes x {LOCAL} (gloo, 1 thread each), "
        f"{c.tables} tables x {c.rows:,} rows x dim {c.dim}, table t on node t % 2, batch "
        f"{c.batch} per rank, {c.bag} ids/bag, Zipf alpha {c.alpha}; {c.ids_per_step:,} ids/step "
        f"over all ranks; median of {c.repeats} blocks x {c.steps} steps after {c.prime} "
        f"priming steps.\n{result.machine}; load average {result.load[0]:.2f} at start, "
        f"{result.load[1]:.2f} at end."
    )
    table = results_table(result.results)
    ratio = f"{KV} / {TBE} (ids/s): {result.ratio:.2f}x"
    return "\n\n".join([head, table, ratio])


def parse_args(argv: Sequence[str] | None) -> tuple[DistBenchConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--worker", metavar="RESULT_JSON", help=argparse.SUPPRESS)
    names = add_config_flags(parser, DistBenchConfig)
    args = parser.parse_args(argv)
    return config_from_args(args, QUICK if args.quick else DEFAULT, names), args


def main(argv: Sequence[str] | None = None) -> TwRwBenchResult | None:
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
