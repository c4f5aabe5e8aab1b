"""Distributed train step: KV tables sharded row-wise vs stock TorchRec table-wise (CPU, gloo).

A 2-process ``torchrun`` job on this machine; both systems are sharded by
``DistributedModelParallel`` and fed the same batches (each rank its own):

* ``KV row-wise``: an ``EmbeddingBagCollection`` on ``meta`` whose tables all
  have ``KVTableOptions`` (capacity = ``rows`` per table, so ``rows / W`` per
  shard), sharded by ``KVEmbeddingBagCollectionSharder``, ROW_WISE: ids are
  routed by bucket to their owner rank, pooled partial sums come back by
  reduce-scatter.
* ``KV row-wise dedup``: ``KV row-wise`` with ``use_index_dedup=True``: each
  rank sends each (table, id) of its batch once, rows come back by sequence
  all-to-all and bags pool on the rank that formed them (docs/sharding.md).
* ``KV table-wise``: the same KV tables sharded TABLE_WISE (stock input and
  output dists, whole tables): shows what routing and reduce-scatter cost.
* ``TBE table-wise``: the same collection with TorchRec's
  ``EmbeddingBagCollectionSharder``, TABLE_WISE with the FUSED kernel (fbgemm's
  TBE): whole tables on one rank, ids and pooled rows moved by all-to-all.

Both train with a fused EXACT_ROWWISE_ADAGRAD. A step is forward (input dist,
lookup, output dist) + backward (with the optimizer). Ids/s counts the ids of
all ranks; the figure is the median timed block, each block's time the slowest
rank's, systems taking turns (``common.time_interleaved``).

Run from the repository root::

    python -m benchmarks.dist_train            # about a minute on 2 cores
    python -m benchmarks.dist_train --quick    # smoke-test sizes
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, fields, replace

import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from benchmarks.common import (
    Timing,
    ZipfIds,
    add_config_flags,
    config_from_args,
    format_table,
    load_average,
    machine_summary,
    time_interleaved,
)
from torchrec_kvemb import KVEmbeddingBagCollectionSharder, KVTableOptions

KV = "KV row-wise"
KV_DEDUP = "KV row-wise dedup"
KV_TW = "KV table-wise"
TBE = "TBE table-wise"
#: KV must reach this fraction of the stock path's ids/s.
TARGET = 0.7


@dataclass(frozen=True)
class DistBenchConfig:
    """Sizes and timing of one run (``batch`` is per rank)."""

    world_size: int = 2
    tables: int = 4
    dim: int = 64
    batch: int = 4096
    bag: int = 20
    rows: int = 1_000_000  # per table: TBE size, id range and KV capacity
    alpha: float = 1.05  # Zipf exponent of the ids
    batches: int = 6  # distinct batches per rank, cycled
    steps: int = 3  # steps per timed block
    repeats: int = 5  # timed blocks per system (the median is reported)
    warmup: int = 1
    prime: int = 8  # untimed training steps before any timing
    learning_rate: float = 0.01
    seed: int = 0

    @property
    def ids_per_step(self) -> int:
        """Ids of one step over all ranks."""
        return self.world_size * self.tables * self.batch * self.bag


#: ``--quick``: a smoke test that runs in seconds.
QUICK = DistBenchConfig(
    tables=2, dim=16, batch=64, bag=4, rows=10_000, batches=2, steps=2, repeats=2, prime=2
)


@dataclass(frozen=True)
class SystemResult:
    system: str
    ms_per_step: float  # median over the timed blocks
    best_ms: float
    ids_per_s: float
    gb_per_s: float


@dataclass(frozen=True)
class DistBenchResult:
    config: DistBenchConfig
    results: tuple[SystemResult, ...]
    kv_metrics: dict[str, float]  # rank 0's KV shards after the run, summed over tables
    machine: str
    load: tuple[float, float]

    def get(self, system: str) -> SystemResult:
        return next(r for r in self.results if r.system == system)

    @property
    def ratio(self) -> float:
        return self.get(KV).ids_per_s / self.get(TBE).ids_per_s


# ------------------------------------------------------------------ worker
def _configs(config: DistBenchConfig) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=f"t{t}",
            embedding_dim=config.dim,
            num_embeddings=config.rows,
            feature_names=[f"f{t}"],
        )
        for t in range(config.tables)
    ]


def _batches(config: DistBenchConfig, rank: int) -> list[KeyedJaggedTensor]:
    samplers = [
        ZipfIds(config.rows, config.alpha, config.seed + 1000 * rank + t)
        for t in range(config.tables)
    ]
    keys = [f"f{t}" for t in range(config.tables)]
    lengths = torch.full((config.tables * config.batch,), config.bag, dtype=torch.int64)
    per_table = config.batch * config.bag
    return [
        KeyedJaggedTensor.from_lengths_sync(
            keys=keys, values=torch.cat([s.sample(per_table) for s in samplers]), lengths=lengths
        )
        for _ in range(config.batches)
    ]


class _Model(nn.Module):
    def __init__(self, config: DistBenchConfig) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(_configs(config), device=torch.device("meta"))

    def forward(self, kjt: KeyedJaggedTensor) -> torch.Tensor:
        return self.ebc(kjt).values()


def _sharded(config: DistBenchConfig, system: str) -> DistributedModelParallel:
    fused = {
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        "learning_rate": config.learning_rate,
    }
    names = [c.name for c in _configs(config)]
    if system in (KV, KV_DEDUP, KV_TW):
        options = KVTableOptions(capacity=config.rows)
        sharder = KVEmbeddingBagCollectionSharder(
            dict.fromkeys(names, options), fused, use_index_dedup=system == KV_DEDUP
        )
        sharding = "table_wise" if system == KV_TW else "row_wise"
        constraint = ParameterConstraints(sharding_types=[sharding])
    else:
        sharder = EmbeddingBagCollectionSharder(fused_params=fused)
        constraint = ParameterConstraints(sharding_types=["table_wise"], compute_kernels=["fused"])
    model = _Model(config)
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=config.world_size, compute_device="cpu"),
        constraints=dict.fromkeys(names, constraint),
    )
    plan = planner.collective_plan(model, [sharder], dist.GroupMember.WORLD)
    return DistributedModelParallel(
        model, device=torch.device("cpu"), plan=plan, sharders=[sharder]
    )


def _train_step(
    model: nn.Module, batches: list[KeyedJaggedTensor], grad: torch.Tensor
) -> Callable[[int], None]:
    def step(i: int) -> None:
        model(batches[i % len(batches)]).backward(grad)

    return step


def worker(config: DistBenchConfig, out_path: str) -> None:
    """One rank of the job; rank 0 writes the result to ``out_path`` (JSON)."""
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)  # why: W processes share this machine's cores
    dist.init_process_group("gloo")
    payload = _measure(replace(config, world_size=dist.get_world_size()))
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(payload, f)
    # why: free the sharded models (they hold the process group) before destroying it.
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def _measure(config: DistBenchConfig) -> dict:
    """Time both systems on this rank's batches; every rank returns the same figures."""
    load_start = load_average()
    batches = _batches(config, dist.get_rank())
    grad = torch.randn(config.batch, config.tables * config.dim)
    models = {system: _sharded(config, system) for system in (KV, KV_DEDUP, KV_TW, TBE)}
    steps = {system: _train_step(m, batches, grad) for system, m in models.items()}
    for system in steps:
        for i in range(config.prime):
            steps[system](i)
    timings = time_interleaved(steps, config.steps, config.repeats, config.warmup)
    # A step ends for all ranks together: a block takes its slowest rank's time.
    metrics: dict[str, float] = {}
    for table_metrics in models[KV].module.ebc.metrics().values():
        for key, value in table_metrics.items():
            metrics[key] = metrics.get(key, 0.0) + value
    results = slowest_rank_results(timings, config.world_size, config.ids_per_step, config.dim)
    return {
        "config": asdict(config),
        "results": [asdict(r) for r in results],
        "kv_metrics": metrics,
        "machine": machine_summary(),
        "load": [load_start, load_average()],
    }


# ------------------------------------------------ shared by the distributed benchmarks
def slowest_rank_results(
    timings: dict[str, Timing], world_size: int, ids_per_step: int, dim: int
) -> list[SystemResult]:
    """Each system's figures over every rank (a collective): a step ends for all
    ranks together, so a timed block takes its slowest rank's time."""
    samples: list = [None] * world_size
    dist.all_gather_object(samples, {s: t.samples for s, t in timings.items()})
    slowest = {
        s: Timing.from_samples([max(block) for block in zip(*(p[s] for p in samples))])
        for s in timings
    }
    return [
        SystemResult(
            system=s,
            ms_per_step=1e3 * t.median_s,
            best_ms=1e3 * t.best_s,
            ids_per_s=ids_per_step / t.median_s,
            gb_per_s=ids_per_step * dim * 4 / t.median_s / 1e9,
        )
        for s, t in slowest.items()
    ]


def run_job(module: str, config: object, processes: int, timeout_s: float) -> dict:
    """Run ``python -m <module> --worker <json>`` with ``config``'s fields as flags on
    ``processes`` torchrun processes (one thread each); rank 0's JSON result."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        overrides = [
            f"--{f.name.replace('_', '-')}={getattr(config, f.name)}" for f in fields(config)
        ]
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={processes}", "-m", module, "--worker", out, *overrides,
        ]  # fmt: skip
        env = dict(os.environ, OMP_NUM_THREADS="1")
        job = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, env=env)
        if job.returncode != 0 or not os.path.exists(out):
            raise RuntimeError(f"benchmark job failed ({job.returncode}):\n{job.stderr[-4000:]}")
        with open(out) as f:
            return json.load(f)


def results_table(results: Sequence[SystemResult]) -> str:
    """The systems' figures as a text table."""
    rows = [
        (r.system, f"{r.ms_per_step:.1f}", f"{r.best_ms:.1f}", f"{r.ids_per_s / 1e6:.2f}",
         f"{r.gb_per_s:.2f}")
        for r in results
    ]  # fmt: skip
    return format_table(("system", "ms/step", "best ms", "M ids/s", "GB/s"), rows)


# ---------------------------------------------------------------- launcher
def launch(config: DistBenchConfig, timeout_s: float = 600) -> DistBenchResult:
    """Run the job with ``torchrun`` (``config.world_size`` processes); returns rank 0's result."""
    data = run_job("benchmarks.dist_train", config, config.world_size, timeout_s)
    return DistBenchResult(
        config=DistBenchConfig(**data["config"]),
        results=tuple(SystemResult(**r) for r in data["results"]),
        kv_metrics=data["kv_metrics"],
        machine=data["machine"],
        load=tuple(data["load"]),
    )


def report(result: DistBenchResult) -> str:
    c = result.config
    head = (
        f"{c.world_size} ranks (gloo, 1 thread each), {c.tables} tables x {c.rows:,} rows x "
        f"dim {c.dim}, batch {c.batch} per rank, {c.bag} ids/bag, Zipf alpha {c.alpha}; "
        f"{c.ids_per_step:,} ids/step over all ranks; median of {c.repeats} blocks x "
        f"{c.steps} steps after {c.prime} priming steps.\n{result.machine}; load average "
        f"{result.load[0]:.2f} at start, {result.load[1]:.2f} at end."
    )
    table = results_table(result.results)
    verdict = "met" if result.ratio >= TARGET else "MISSED"
    ratio = f"{KV} / {TBE} (ids/s): {result.ratio:.2f}x (target >= {TARGET}x: {verdict})"
    tw = result.get(KV_TW).ids_per_s / result.get(TBE).ids_per_s
    ratio += f"\n{KV_TW} / {TBE} (ids/s): {tw:.2f}x"
    dedup = result.get(KV_DEDUP).ids_per_s / result.get(KV).ids_per_s
    ratio += f"\n{KV_DEDUP} / {KV} (ids/s): {dedup:.2f}x"
    m = result.kv_metrics
    lookups = m.get("hits", 0) + m.get("misses", 0)
    steady = (
        f"KV shards on rank 0 after the run: {int(m.get('size', 0)):,} ids stored, "
        f"hit rate {m.get('hits', 0) / max(lookups, 1):.1%}, "
        f"{int(m.get('evictions', 0)):,} evictions"
    )
    return "\n\n".join([head, table, ratio, steady])


def parse_args(argv: Sequence[str] | None) -> tuple[DistBenchConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--worker", metavar="RESULT_JSON", help=argparse.SUPPRESS)
    names = add_config_flags(parser, DistBenchConfig)
    args = parser.parse_args(argv)
    return config_from_args(args, QUICK if args.quick else DistBenchConfig(), names), args


def main(argv: Sequence[str] | None = None) -> DistBenchResult | None:
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
