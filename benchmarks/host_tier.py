"""The host-memory tier: training with a tenth of the ids in the table over a host tier.

``KVEmbeddingBagCollection`` (fused EXACT_ROWWISE_ADAGRAD) on Zipf batches,
three systems on the same batch sequence: ``all in memory`` (capacity for every
id), ``10% + host tier`` (the table holds a tenth of the distinct ids the run
touches, a host-memory tier without a bound under it: nothing is lost), and
``10% + host + SSD`` (the same over a host tier holding another fifth, whose
evictions move to an SSD tier). All are primed with the same training steps,
then timed in interleaved blocks (``common.time_interleaved``). Target:
``10% + host tier`` >= 0.7x ``all in memory``. On the CPU both tiers are host
memory: the figure is what the tier's bookkeeping and the row moves cost.

Run from the repository root::

    python -m benchmarks.host_tier                                # about 1 min on 2 cores
    python -m benchmarks.host_tier --out docs/bench_host_tier.md  # also write markdown
    python -m benchmarks.host_tier --quick                        # smoke-test sizes
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from benchmarks.common import (
    add_config_flags,
    command_line,
    config_from_args,
    format_ratio,
    format_table,
    load_average,
    machine_line,
    markdown_table,
    set_threads,
    time_interleaved,
    write_markdown,
)
from benchmarks.ssd_tier import (
    TRAIN_HEADERS,
    TrainingSizes,
    TrainResult,
    build,
    make_batches,
    memory_rows,
    train_results,
    train_rows,
    train_step,
)

FULL = "all in memory"
HOST = "10% + host tier"
HOST_SSD = "10% + host + SSD"
TARGET = 0.7
#: The bounded host tier of ``HOST_SSD`` holds this many times the table's rows.
HOST_ROWS_PER_TABLE_ROW = 2


@dataclass(frozen=True)
class BenchConfig(TrainingSizes):
    """Sizes and timing of one run (the fields ``ssd_tier.make_batches`` and ``build`` read)."""

    dim: int = 64
    tables: int = 1
    batch: int = 1024
    bag: int = 20
    rows: int = 2_000_000  # id population (Zipf ranks); the all-in-memory capacity
    alpha: float = 1.05
    memory_fraction: float = 0.1  # of the distinct ids the run touches
    prime: int = 60  # training steps before timing
    steps: int = 5  # per timed block
    repeats: int = 5
    warmup: int = 2
    threads: int | None = None
    learning_rate: float = 0.01
    seed: int = 0


QUICK = BenchConfig(dim=16, batch=64, bag=4, rows=20_000, prime=5, steps=2, repeats=2, warmup=1)


@dataclass(frozen=True)
class BenchResult:
    config: BenchConfig
    distinct_ids: int
    memory_rows: int
    train: tuple[TrainResult, ...]
    tiers: dict
    load: tuple[float, float]

    def ratio(self, system: str) -> float:
        rates = {r.system: r.ids_per_s for r in self.train}
        return rates[system] / rates[FULL]


def run(config: BenchConfig, directory: str | None = None) -> BenchResult:
    """Build, prime and time the three systems."""
    previous_threads = set_threads(config.threads)
    load_start = load_average()
    workdir = tempfile.mkdtemp(prefix="bench-host-", dir=directory)
    try:
        batches = make_batches(config)
        distinct, cache_rows = memory_rows(config, batches)
        grad = torch.randn(
            config.batch, config.tables * config.dim, generator=torch.Generator().manual_seed(1)
        )
        host_rows = max(16, math.ceil(HOST_ROWS_PER_TABLE_ROW * cache_rows / 16) * 16)
        systems = {
            FULL: build(config, config.rows, None),
            HOST: build(config, cache_rows, None, host_rows=0),
            HOST_SSD: build(config, cache_rows, os.path.join(workdir, "ssd"), host_rows),
        }
        begin = time.perf_counter()
        for ebc in systems.values():
            step = train_step(ebc, batches, grad)
            for i in range(config.prime):
                step(i)
        print(f"primed {len(systems)} systems in {time.perf_counter() - begin:.0f}s")
        timed = batches[config.prime :]
        before = {name: ebc.table("t").metrics() for name, ebc in systems.items()}
        timings = time_interleaved(
            {name: train_step(ebc, timed, grad) for name, ebc in systems.items()},
            config.steps,
            config.repeats,
            config.warmup,
        )
        n = config.timed_batches
        tiers = {}
        for name in (HOST, HOST_SSD):
            now, was = systems[name].table("t").metrics(), before[name]
            tiers[name] = {
                "promotions_per_step": (now["promotions"] - was["promotions"]) / n,
                "demotions_per_step": (now["demotions"] - was["demotions"]) / n,
                "host_rows": now["host_size"],
                "ssd_rows": now["ssd_size"],
                "host_evictions_per_step": (now["host_evictions"] - was["host_evictions"]) / n,
            }
        results = train_results(config, timings)
        for ebc in systems.values():
            for table in ebc.kv_tables().values():
                table.close()
        return BenchResult(
            config, distinct, cache_rows, results, tiers, (load_start, load_average())
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        torch.set_num_threads(previous_threads)


# ----------------------------------------------------------------- report
def describe(result: BenchResult) -> str:
    c = result.config
    return (
        f"dim {c.dim}, batch {c.batch} x bag {c.bag} ids per table, {c.tables} table(s), "
        f"Zipf alpha {c.alpha} over {c.rows:,} ids; {c.prime} priming + {c.timed_batches} "
        f"timed steps touch {result.distinct_ids:,} distinct ids; the cached tables hold "
        f"{result.memory_rows:,} in memory "
        f"({100 * result.memory_rows / result.distinct_ids:.0f}%); median of "
        f"{c.repeats} blocks x {c.steps} steps"
        + (f"; {c.threads} torch thread(s) while timed" if c.threads else "")
    )


def target_line(result: BenchResult) -> str:
    value = result.ratio(HOST)
    verdict = "met" if value >= TARGET else "MISSED"
    return f"{HOST} / {FULL}: {format_ratio(value)} (target >= {TARGET}x: {verdict})"


def tier_line(result: BenchResult) -> str:
    parts = []
    for name, s in result.tiers.items():
        parts.append(
            f"{name}: {s['promotions_per_step']:,.0f} promotions and "
            f"{s['demotions_per_step']:,.0f} demotions per step, "
            f"{s['host_evictions_per_step']:,.0f} host evictions per step, "
            f"{s['host_rows']:,} rows in the host tier, {s['ssd_rows']:,} on SSD"
        )
    return "; ".join(parts)


def report(result: BenchResult) -> str:
    return "\n\n".join(
        [
            describe(result) + "\n" + machine_line(result.load),
            format_table(TRAIN_HEADERS, train_rows(result)),
            target_line(result),
            tier_line(result),
        ]
    )


def write_report(result: BenchResult, path: str, command: str) -> None:
    write_markdown(
        path,
        "Host tier: a tenth of the ids in the table (CPU)",
        [
            f"`{command}`",
            describe(result) + ".  \n" + machine_line(result.load) + ".",
            markdown_table(TRAIN_HEADERS, train_rows(result)),
            target_line(result) + ".",
            tier_line(result) + ".",
        ],
    )


def parse_args(argv: Sequence[str] | None) -> tuple[BenchConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--out", help="also write a markdown report to this path")
    parser.add_argument("--dir", help="where the SSD tier's files go (default: $TMPDIR)")
    names = add_config_flags(parser, BenchConfig)
    args = parser.parse_args(argv)
    return config_from_args(args, QUICK if args.quick else BenchConfig(), names), args


def main(argv: Sequence[str] | None = None) -> BenchResult:
    """Run the benchmark, print the table; returns the result."""
    config, args = parse_args(argv)
    result = run(config, directory=args.dir)
    print(report(result))
    if args.out:
        write_report(result, args.out, command_line("benchmarks.host_tier", argv))
        print(f"\nwrote {args.out}")
    return result


if __name__ == "__main__":
    main()
