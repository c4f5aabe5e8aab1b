"""Tables that grow: the growth phase from 1/64 of capacity vs tables built at capacity (CPU).

Two KV EBCs with the same tables, the same options and the same batches: one
built at its capacity, one with ``initial_capacity = capacity / 64`` that grows
(doubling its buckets) as new ids arrive. Each trains (fused row-wise Adagrad)
from empty over the same ``steps`` batches of fresh, uniformly drawn ids (spread
over 2**40), enough to fill the tables to their capacity and evict: the whole
growth phase. The phase runs ``repeats`` times on newly built models, the two
models taking turns; the median is reported. Reports ms per phase, ids/s, the
grown model's throughput as a ratio of the fixed one's (target >= 0.8x), the
growths, and the memory (``KVTable.memory_bytes()``, all tables) at the start
and the end.

Run from the repository root::

    python -m benchmarks.growth            # about 1 min on 2 cores
    python -m benchmarks.growth --quick    # smoke-test sizes
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from benchmarks.common import (
    add_config_flags,
    config_from_args,
    format_ratio,
    format_table,
    load_average,
    machine_line,
    set_threads,
    spread_ids,
)
from torchrec_kvemb import KVEmbeddingBagCollection, KVTableOptions

#: The grown model's throughput over the fixed one's, at least.
TARGET = 0.8
FIXED = "built at capacity"
GROWN = "grown from 1/64"


@dataclass(frozen=True)
class BenchConfig:
    """Sizes and timing of one run."""

    tables: int = 2
    dim: int = 64
    batch: int = 1024
    bag: int = 20
    capacity: int = 131_072  # rows per table at most
    start_fraction: int = 64  # the grown tables start at capacity / start_fraction
    id_range: int = 393_216  # fresh ids are drawn uniformly below this (then spread)
    steps: int = 24  # training steps of the phase
    repeats: int = 3  # phases per model (the median is reported)
    threads: int | None = None
    seed: int = 0

    @property
    def ids_per_phase(self) -> int:
        return self.tables * self.batch * self.bag * self.steps


#: ``--quick``: a smoke test that runs in seconds.
QUICK = BenchConfig(
    dim=16, batch=64, bag=4, capacity=4096, id_range=12_288, steps=8, repeats=1
)  # fmt: skip


@dataclass(frozen=True)
class GrowthResult:
    config: BenchConfig
    ms_per_phase: dict[str, float]  # median
    memory_start: dict[str, int]  # bytes of every KV table when built
    memory_end: dict[str, int]  # and after the phase
    capacity_end: dict[str, int]  # rows of capacity after the phase, all tables
    growths: int  # growths of the grown model's tables in one phase
    evictions: int  # evictions of the fixed model in one phase
    machine: str  # the machine, threads and load (``machine_line``)

    def ids_per_s(self, system: str) -> float:
        return self.config.ids_per_phase / (self.ms_per_phase[system] / 1e3)

    @property
    def ratio(self) -> float:
        """The grown model's ids/s over the fixed model's."""
        return self.ids_per_s(GROWN) / self.ids_per_s(FIXED)


def build(config: BenchConfig, grown: bool) -> KVEmbeddingBagCollection:
    tables = [
        EmbeddingBagConfig(
            name=f"t{t}",
            embedding_dim=config.dim,
            num_embeddings=config.id_range,
            feature_names=[f"f{t}"],
            pooling=PoolingType.SUM,
        )
        for t in range(config.tables)
    ]
    initial = config.capacity // config.start_fraction if grown else None
    return KVEmbeddingBagCollection(
        tables,
        KVTableOptions(capacity=config.capacity, initial_capacity=initial, seed=config.seed),
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.01},
    )


def make_batches(config: BenchConfig) -> list[KeyedJaggedTensor]:
    gen = torch.Generator().manual_seed(config.seed)
    keys = [f"f{t}" for t in range(config.tables)]
    lengths = torch.full((config.tables * config.batch,), config.bag, dtype=torch.int64)
    n = int(lengths.sum())
    return [
        KeyedJaggedTensor.from_lengths_sync(
            keys=keys,
            values=spread_ids(torch.randint(0, config.id_range, (n,), generator=gen)),
            lengths=lengths,
        )
        for _ in range(config.steps)
    ]


def _memory(model: KVEmbeddingBagCollection) -> int:
    return sum(t.memory_bytes() for t in model.kv_tables().values())


def run(config: BenchConfig) -> GrowthResult:
    previous = set_threads(config.threads)
    try:
        load_at_start = load_average()
        batches = make_batches(config)
        grad = torch.ones(config.batch, config.tables * config.dim)
        seconds: dict[str, list[float]] = {FIXED: [], GROWN: []}
        start, end, capacity = {}, {}, {}
        growths = evictions = 0
        for repeat in range(config.repeats):
            models = {system: build(config, grown=system == GROWN) for system in (FIXED, GROWN)}
            start = {system: _memory(model) for system, model in models.items()}
            phase = dict.fromkeys(models, 0.0)
            # why step by step, taking turns: a phase lasts seconds, and the load of a
            # shared machine drifts more over seconds than between two steps
            for i, kjt in enumerate(batches):
                for system in (FIXED, GROWN) if i % 2 == 0 else (GROWN, FIXED):
                    began = time.perf_counter()
                    models[system](kjt).values().backward(grad)
                    phase[system] += time.perf_counter() - began
            for system, model in models.items():
                seconds[system].append(phase[system])
                end[system] = _memory(model)
                capacity[system] = sum(t.capacity for t in model.kv_tables().values())
            metrics = models[GROWN].metrics().values()
            growths = sum(int(m["growths"]) for m in metrics)
            evictions = sum(int(m["evictions"]) for m in models[FIXED].metrics().values())
            del models
            print(f"phase {repeat + 1}/{config.repeats}", file=sys.stderr, flush=True)
        ms = {system: 1e3 * statistics.median(s) for system, s in seconds.items()}
        machine = machine_line((load_at_start, load_average()))  # while the threads are set
        return GrowthResult(config, ms, start, end, capacity, growths, evictions, machine)
    finally:
        torch.set_num_threads(previous)


HEADERS = ("tables", "ms / phase", "M ids/s", "vs fixed", "MB at start", "MB at end", "rows")


def rows(result: GrowthResult) -> list[tuple]:
    return [
        (
            system,
            f"{result.ms_per_phase[system]:.0f}",
            f"{result.ids_per_s(system) / 1e6:.2f}",
            format_ratio(result.ids_per_s(system) / result.ids_per_s(FIXED)),
            f"{result.memory_start[system] / 1e6:.1f}",
            f"{result.memory_end[system] / 1e6:.1f}",
            f"{result.capacity_end[system]:,}",
        )
        for system in (FIXED, GROWN)
    ]


def main(argv: Sequence[str] | None = None) -> GrowthResult:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    names = add_config_flags(parser, BenchConfig)
    args = parser.parse_args(argv)
    config = config_from_args(args, QUICK if args.quick else BenchConfig(), names)
    result = run(config)
    c = result.config
    print(
        f"{c.tables} tables x {c.capacity:,} rows x dim {c.dim}, batch {c.batch}, {c.bag} ids/bag, "
        f"{c.steps} steps of fresh ids below {c.id_range:,}; row-wise Adagrad\n"
        f"{result.machine}\n"
    )
    print(format_table(HEADERS, rows(result)))
    print(
        f"\ngrown / fixed: {format_ratio(result.ratio)} (target >= {TARGET}x); "
        f"{result.growths} growths, {result.evictions} evictions (fixed) per phase"
    )
    return result


if __name__ == "__main__":
    main()
