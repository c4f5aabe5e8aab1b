"""The SSD tier: training with a tenth of the ids in memory, promotion speed, the disk.

One process, three measurements:

* **Training.** ``KVEmbeddingBagCollection`` (fused EXACT_ROWWISE_ADAGRAD) on
  Zipf batches, four systems on the same batch sequence: ``all in memory``
  (capacity for every id), ``10% + SSD`` (memory for a tenth of the distinct
  ids the run touches, an SSD tier under it), the same with ``prefetch`` of the
  next batch, and ``10% no SSD`` (same memory, evicted rows are lost: what the
  evictions themselves cost, without the tier's I/O). All are primed with the
  same training steps, then timed in interleaved blocks (see
  ``common.time_interleaved``). Target: ``10% + SSD`` >= 0.5x ``all in memory``.
* **Promotion.** An SSD tier holding ``promo_rows`` rows (written through the
  tier, synced); ``lookup_train`` of batches of ids that only the SSD tier holds,
  into memory with room: rows/s and MB/s of records, with the slab in the page
  cache (warm) and after ``posix_fadvise(DONTNEED)`` on it (cold).
* **Disk.** Random 4 KiB ``pread``s of a ``disk_file_mb`` file written here,
  dropped from the page cache, at queue depths 1, 16 and 64 (threads): the
  device's random-read rate in the same run, to set the cold figures against.

Run from the repository root::

    python -m benchmarks.ssd_tier                                 # about 2 min on 2 cores
    python -m benchmarks.ssd_tier --out docs/bench_ssd_tier.md    # also write markdown
    python -m benchmarks.ssd_tier --quick                         # smoke-test sizes
    python -m benchmarks.ssd_tier --profile                       # the 10% + SSD step
    python -m benchmarks.ssd_tier --tables 4 --sequential         # systems not interleaved
    python -m benchmarks.ssd_tier --dir /mnt/nvme                 # files on that disk

The files go to a temporary directory (``--dir``, default ``$TMPDIR``): it
must be on the disk to measure, not a tmpfs.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from benchmarks.common import (
    Timing,
    ZipfIds,
    add_config_flags,
    command_line,
    config_from_args,
    drop_cache,
    format_ratio,
    format_table,
    load_average,
    machine_line,
    machine_summary,
    markdown_table,
    profile_functions,
    profile_ops,
    set_threads,
    time_interleaved,
    write_markdown,
)
from torchrec_kvemb import (
    HostTierOptions,
    KVEmbeddingBagCollection,
    KVTable,
    KVTableOptions,
    SSDOptions,
)
from torchrec_kvemb.optimizer import FusedOptimConfig, OptimKind

FULL = "all in memory"
SSD = "10% + SSD"
PREFETCH = "10% + SSD, prefetch"
NO_SSD = "10% no SSD"
TARGET = 0.5


class TrainingSizes:
    """What a config of Zipf training batches derives from its ``batch``, ``bag``,
    ``tables``, ``warmup``, ``steps`` and ``repeats`` (shared with ``host_tier``)."""

    batch: int
    bag: int
    tables: int
    warmup: int
    steps: int
    repeats: int

    @property
    def ids_per_step(self) -> int:
        """Ids of one batch, all tables together."""
        return self.batch * self.bag * self.tables

    @property
    def names(self) -> list[str]:
        """Table names: ``t`` (the one whose counters are reported), ``t1``, ..."""
        return ["t"] + [f"t{i}" for i in range(1, self.tables)]

    @property
    def timed_batches(self) -> int:
        return self.warmup + self.steps * self.repeats


@dataclass(frozen=True)
class BenchConfig(TrainingSizes):
    """Sizes and timing of one run."""

    dim: int = 64
    tables: int = 1  # KV tables (features), each with its own SSD tier
    batch: int = 1024
    bag: int = 20
    rows: int = 2_000_000  # id population (Zipf ranks); the all-in-memory capacity
    alpha: float = 1.05
    memory_fraction: float = 0.1  # of the distinct ids the run touches
    prime: int = 100  # training steps before timing
    steps: int = 5  # per timed block
    repeats: int = 5
    warmup: int = 2
    promo_rows: int = 4_000_000  # rows in the SSD tier of the promotion test
    promo_batch: int = 65_536  # ids per promoting lookup
    promo_trials: int = 3  # per warm / cold
    disk_file_mb: int = 1024
    disk_reads: int = 20_000  # per queue depth
    threads: int | None = None
    learning_rate: float = 0.01
    seed: int = 0


QUICK = BenchConfig(
    dim=16,
    batch=64,
    bag=4,
    rows=20_000,
    prime=5,
    steps=2,
    repeats=2,
    warmup=1,
    promo_rows=20_000,
    promo_batch=2048,
    promo_trials=1,
    disk_file_mb=16,
    disk_reads=500,
)


@dataclass(frozen=True)
class TrainResult:
    system: str
    ms_per_step: float
    best_ms: float
    ids_per_s: float


@dataclass(frozen=True)
class RateResult:
    """A throughput: ``what`` at ``rate`` per second (rows or reads), with MB/s."""

    what: str
    rate: float
    mb_per_s: float


@dataclass(frozen=True)
class BenchResult:
    config: BenchConfig
    distinct_ids: int
    memory_rows: int
    train: tuple[TrainResult, ...]
    cache: dict
    promotion: tuple[RateResult, ...]
    disk: tuple[RateResult, ...]
    load: tuple[float, float]

    def ratio(self, system: str) -> float:
        rates = {r.system: r.ids_per_s for r in self.train}
        return rates[system] / rates[FULL]


# --------------------------------------------------------------- training
def make_batches(config: BenchConfig) -> list[KeyedJaggedTensor]:
    """Batches of one Zipf bag of ``bag`` ids per sample and feature (``f`` of table
    ``t``, ``f1`` of ``t1``, ...)."""
    sampler = ZipfIds(config.rows, config.alpha, config.seed)
    lengths = torch.full((config.batch * config.tables,), config.bag, dtype=torch.int64)
    features = ["f" + name[1:] for name in config.names]
    return [
        KeyedJaggedTensor.from_lengths_sync(features, sampler.sample(config.ids_per_step), lengths)
        for _ in range(config.prime + config.timed_batches)
    ]


def build(
    config: BenchConfig, capacity: int, ssd_path: str | None, host_rows: int | None = None
) -> KVEmbeddingBagCollection:
    """The collection of ``config.tables`` tables of ``capacity`` rows each; with
    ``ssd_path``, each table's SSD tier in a directory of its own under it; with
    ``host_rows`` (0: unbounded), a host-memory tier above that."""
    tables = [
        EmbeddingBagConfig(
            name=name,
            embedding_dim=config.dim,
            num_embeddings=config.rows,
            feature_names=["f" + name[1:]],
            pooling=PoolingType.SUM,
        )
        for name in config.names
    ]
    host = None if host_rows is None else HostTierOptions(capacity=host_rows or None)
    options = {
        name: KVTableOptions(
            capacity=capacity,
            seed=config.seed,
            host_tier=host,
            ssd=SSDOptions(os.path.join(ssd_path, name), resume=False) if ssd_path else None,
        )
        for name in config.names
    }
    return KVEmbeddingBagCollection(
        tables,
        options,
        fused_params={
            "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            "learning_rate": config.learning_rate,
        },
    )


def train_step(ebc, batches, grad, prefetch: bool = False) -> Callable[[int], None]:
    def step(i: int) -> None:
        if prefetch and i + 1 < len(batches):
            ebc.prefetch(batches[i + 1])
        ebc(batches[i]).values().backward(grad)

    return step


def train_results(config: BenchConfig, timings: dict[str, Timing]) -> tuple[TrainResult, ...]:
    """One ``TrainResult`` per timed system, from its ``time_interleaved`` timing."""
    return tuple(
        TrainResult(name, 1e3 * t.median_s, 1e3 * t.best_s, config.ids_per_step / t.median_s)
        for name, t in timings.items()
    )


def memory_rows(config: BenchConfig, batches: list[KeyedJaggedTensor]) -> tuple[int, int]:
    """Distinct ids the run gives table ``t``, and the memory rows of a cached table."""
    distinct = torch.unique(torch.cat([b["f"].values() for b in batches])).numel()
    return distinct, max(16, math.ceil(config.memory_fraction * distinct / 16) * 16)


def run_training(config: BenchConfig, workdir: str, verbose: bool):
    batches = make_batches(config)
    distinct, cache_rows = memory_rows(config, batches)
    grad = torch.randn(
        config.batch, config.tables * config.dim, generator=torch.Generator().manual_seed(1)
    )
    systems = {
        FULL: (build(config, config.rows, None), False),
        SSD: (build(config, cache_rows, os.path.join(workdir, "ssd")), False),
        PREFETCH: (build(config, cache_rows, os.path.join(workdir, "prefetch")), True),
        NO_SSD: (build(config, cache_rows, None), False),
    }
    begin = time.perf_counter()
    for ebc, prefetch in systems.values():
        step = train_step(ebc, batches, grad, prefetch)
        for i in range(config.prime):
            step(i)
    _log(f"primed {len(systems)} systems in {time.perf_counter() - begin:.0f}s", verbose)
    timed = batches[config.prime :]
    cached = systems[SSD][0].table("t")
    before = cached.metrics()
    timings = time_interleaved(
        {name: train_step(ebc, timed, grad, prefetch) for name, (ebc, prefetch) in systems.items()},
        config.steps,
        config.repeats,
        config.warmup,
    )
    after = cached.metrics()
    n = config.timed_batches
    seen = after["hits"] + after["misses"] - before["hits"] - before["misses"]
    cache = {
        "hit_rate": (after["hits"] - before["hits"]) / max(1, seen),
        "promotions_per_step": (after["promotions"] - before["promotions"]) / n,
        "demotions_per_step": (after["demotions"] - before["demotions"]) / n,
        "new_per_step": (after["inserts"] - before["inserts"]) / n,
        "failures_per_step": (after["insert_failures"] - before["insert_failures"]) / n,
        "ssd_rows": after["ssd_size"],
        "prefetch_hits": systems[PREFETCH][0].table("t").metrics()["ssd_prefetch_hits"],
    }
    results = train_results(config, timings)
    for ebc, _ in systems.values():
        for table in ebc.kv_tables().values():
            if table.ssd is not None:
                table.ssd.close()
    return distinct, cache_rows, results, cache


def run_sequential(config: BenchConfig, workdir: str) -> dict[str, float]:
    """Median ms a step of ``all in memory`` and ``10% + SSD``, each built, primed and
    timed on its own, one after the other (no interleaving: neither runs beside the
    other's leftovers)."""
    batches = make_batches(config)
    _, cache_rows = memory_rows(config, batches)
    grad = torch.randn(
        config.batch, config.tables * config.dim, generator=torch.Generator().manual_seed(1)
    )
    out = {}
    for name, rows, ssd in (
        (FULL, config.rows, None),
        (SSD, cache_rows, os.path.join(workdir, "ssd")),
    ):
        ebc = build(config, rows, ssd)
        step = train_step(ebc, batches, grad)
        for i in range(config.prime):
            step(i)
        times = []
        for i in range(config.prime, len(batches)):
            start = time.perf_counter()
            step(i)
            times.append(time.perf_counter() - start)
        out[name] = 1e3 * statistics.median(times)
        for table in ebc.kv_tables().values():
            if table.ssd is not None:
                table.ssd.close()
    return out


def sequential(config: BenchConfig, directory: str | None = None) -> dict[str, float]:
    """``run_sequential`` in a temporary directory under ``directory``, on
    ``config.threads`` threads."""
    previous_threads = set_threads(config.threads)
    workdir = tempfile.mkdtemp(prefix="bench-ssd-", dir=directory)
    try:
        return run_sequential(config, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        torch.set_num_threads(previous_threads)


# -------------------------------------------------------------- promotion
def run_promotion(config: BenchConfig, workdir: str, verbose: bool) -> tuple[RateResult, ...]:
    """``lookup_train`` of ids only the SSD tier holds, into memory with room."""
    begin = time.perf_counter()
    optim = FusedOptimConfig(kind=OptimKind.ROWWISE_ADAGRAD)  # rows carry optimizer state
    capacity = 2 * config.promo_batch * (2 * config.promo_trials + 1)
    options = KVTableOptions(
        capacity=capacity, ssd=SSDOptions(os.path.join(workdir, "promo"), resume=False)
    )
    table = KVTable("promo", config.dim, options, optim)
    tier = table.ssd
    ids = torch.randperm(config.promo_rows, generator=torch.Generator().manual_seed(2)) * 97 + 5
    chunk = 262_144
    width = config.dim + table.state_dim
    for lo in range(0, ids.numel(), chunk):
        part = ids[lo : lo + chunk]
        tier.reserve(part.numel())
        scores = torch.zeros_like(part)
        tier.put(part, scores, scores, torch.rand(part.numel(), width))
    tier.slab.sync()
    record_mb = tier.slab.record_bytes / 1e6
    _log(
        f"wrote {config.promo_rows:,} SSD rows ({config.promo_rows * record_mb:,.0f} MB) "
        f"in {time.perf_counter() - begin:.0f}s",
        verbose,
    )
    results = []
    size = min(config.promo_batch, config.promo_rows // (2 * config.promo_trials))
    picks = iter(ids[torch.randperm(ids.numel())].split(size))
    for state in ("warm", "cold"):
        rates = []
        for _ in range(config.promo_trials):
            batch = next(picks)
            if state == "cold":
                tier.slab.drop_cache()  # posix_fadvise(DONTNEED), after unmapping the pages
            else:
                tier.slab.read(tier.records_of(tier.lookup(batch)))  # into the page cache
            before = table.metrics()["promotions"]
            start = time.perf_counter()
            table.lookup_train(batch)
            elapsed = time.perf_counter() - start
            rates.append((table.metrics()["promotions"] - before) / elapsed)
        rate = sorted(rates)[len(rates) // 2]
        results.append(RateResult(f"promotion, {state}", rate, rate * record_mb))
    tier.close()
    return tuple(results)


# ------------------------------------------------------------------- disk
def run_disk(config: BenchConfig, workdir: str) -> tuple[RateResult, ...]:
    """Random 4 KiB preads of a freshly written file, dropped from the page cache."""
    path = os.path.join(workdir, "random-read.bin")
    block = os.urandom(1 << 20)
    with open(path, "wb") as f:
        for _ in range(config.disk_file_mb):
            f.write(block)
    pages = config.disk_file_mb * 256
    gen = torch.Generator().manual_seed(3)
    results = []
    for depth in (1, 16, 64):
        drop_cache(path)
        offsets = (torch.randint(0, pages, (config.disk_reads,), generator=gen) * 4096).tolist()
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            parts = [offsets[i::depth] for i in range(depth)]

            def reads(part: list[int], fd: int = fd) -> None:
                for offset in part:
                    os.pread(fd, 4096, offset)

            start = time.perf_counter()
            with ThreadPoolExecutor(depth) as pool:
                list(pool.map(reads, parts))
            elapsed = time.perf_counter() - start
        finally:
            os.close(fd)
        rate = config.disk_reads / elapsed
        results.append(RateResult(f"disk 4 KiB random reads, QD {depth}", rate, rate * 4096 / 1e6))
    os.remove(path)
    return tuple(results)


# -------------------------------------------------------------------- run
def _log(message: str, verbose: bool) -> None:
    if verbose:
        print(message, file=sys.stderr, flush=True)


def run(config: BenchConfig, verbose: bool = True, directory: str | None = None) -> BenchResult:
    """All three measurements, in a temporary directory under ``directory`` (the
    disk measured; default: the system's temporary directory)."""
    previous_threads = set_threads(config.threads)
    workdir = tempfile.mkdtemp(prefix="bench-ssd-", dir=directory)
    load_at_start = load_average()
    try:
        distinct, cache_rows, train, cache = run_training(config, workdir, verbose)
        _log("timed training", verbose)
        promotion = run_promotion(config, workdir, verbose)
        _log("timed promotion", verbose)
        disk = run_disk(config, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        torch.set_num_threads(previous_threads)
    return BenchResult(
        config, distinct, cache_rows, train, cache, promotion, disk, (load_at_start, load_average())
    )


# ----------------------------------------------------------------- report
def describe(result: BenchResult) -> str:
    c = result.config
    return (
        f"{c.tables} table(s), dim {c.dim}, batch {c.batch} x {c.bag} ids per table (SUM), "
        f"Zipf alpha {c.alpha} over {c.rows:,} ids; {c.prime} priming + {c.timed_batches} "
        f"timed steps touch {result.distinct_ids:,} distinct ids (per table); the cached "
        f"tables hold {result.memory_rows:,} each "
        f"in memory ({100 * result.memory_rows / result.distinct_ids:.0f}%); median of "
        f"{c.repeats} blocks x {c.steps} steps"
    )


TRAIN_HEADERS = ("system", "ms/step", "best ms", "M ids/s", "vs all in memory")
RATE_HEADERS = ("what", "per s", "MB/s")


def train_rows(result: BenchResult) -> list[tuple]:
    return [
        (
            r.system,
            f"{r.ms_per_step:.1f}",
            f"{r.best_ms:.1f}",
            f"{r.ids_per_s / 1e6:.2f}",
            format_ratio(result.ratio(r.system)),
        )
        for r in result.train
    ]


def rate_rows(result: BenchResult) -> list[tuple]:
    return [
        (r.what, f"{r.rate:,.0f}", f"{r.mb_per_s:,.1f}") for r in result.promotion + result.disk
    ]


def target_line(result: BenchResult) -> str:
    value = result.ratio(SSD)
    verdict = "met" if value >= TARGET else "MISSED"
    return f"{SSD} / {FULL}: {format_ratio(value)} (target >= {TARGET}x: {verdict})"


def cache_line(result: BenchResult) -> str:
    s = result.cache
    return (
        f"{SSD} during the timed steps: memory hit rate {100 * s['hit_rate']:.1f}%, "
        f"{s['promotions_per_step']:,.0f} promotions, {s['demotions_per_step']:,.0f} demotions, "
        f"{s['new_per_step']:,.0f} new ids and {s['failures_per_step']:,.1f} insert failures "
        f"per step; {s['ssd_rows']:,} rows on SSD; prefetch served {s['prefetch_hits']:,} rows"
    )


def promotion_note(result: BenchResult) -> str:
    c = result.config
    return (
        f"Promotion: lookup_train of {c.promo_batch:,} ids held only by an SSD tier of "
        f"{c.promo_rows:,} rows, into memory with room (median of {c.promo_trials}); MB/s "
        "counts whole records. Disk: random 4 KiB preads of a "
        f"{c.disk_file_mb} MiB file, {c.disk_reads:,} per queue depth (threads)."
    )


def report(result: BenchResult) -> str:
    return "\n\n".join(
        [
            describe(result) + "\n" + machine_line(result.load),
            format_table(TRAIN_HEADERS, train_rows(result)),
            target_line(result),
            cache_line(result),
            format_table(RATE_HEADERS, rate_rows(result)),
            promotion_note(result),
        ]
    )


def write_report(result: BenchResult, path: str, command: str) -> None:
    write_markdown(
        path,
        "SSD tier: a tenth of the ids in memory (CPU)",
        [
            f"`{command}`",
            describe(result) + ".  \n" + machine_line(result.load) + ".",
            markdown_table(TRAIN_HEADERS, train_rows(result)),
            target_line(result) + ".",
            cache_line(result) + ".",
            markdown_table(RATE_HEADERS, rate_rows(result)),
            promotion_note(result),
        ],
    )


# ---------------------------------------------------------------- profile
def profile_ssd(config: BenchConfig, calls: int = 3, directory: str | None = None) -> str:
    """Prime a 10% + SSD collection as ``run`` does, then break down its train step."""
    previous_threads = set_threads(config.threads)
    workdir = tempfile.mkdtemp(prefix="bench-ssd-", dir=directory)
    try:
        batches = make_batches(config)
        _, cache_rows = memory_rows(config, batches)
        ebc = build(config, cache_rows, os.path.join(workdir, "ssd"))
        grad = torch.randn(config.batch, config.tables * config.dim)
        step = train_step(ebc, batches, grad)
        for i in range(config.prime):
            step(i)
        base, n = config.prime, len(batches)  # past the last batch: from the first again
        functions = profile_functions(lambda i: step((base + i) % n), calls, "torchrec_kvemb")
        ops = profile_ops(lambda i: step((base + calls + i) % n), calls)
        return (
            f"10% + SSD train step\n{machine_summary()}\n\n"
            f"By torchrec_kvemb function (innermost on the stack, per step):\n{functions}\n\n"
            f"By torch op (torch.profiler, per step):\n{ops}"
        )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        torch.set_num_threads(previous_threads)


# -------------------------------------------------------------------- CLI
def parse_args(argv: Sequence[str] | None) -> tuple[BenchConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--out", help="also write a markdown report to this path")
    parser.add_argument("--profile", action="store_true", help="profile the 10%% + SSD step")
    parser.add_argument(
        "--sequential",
        action="store_true",
        help="time all in memory, then 10%% + SSD, each on its own (no interleaving)",
    )
    parser.add_argument(
        "--dir", help="where the files go: a directory on the disk to measure (default: $TMPDIR)"
    )
    names = add_config_flags(parser, BenchConfig)
    args = parser.parse_args(argv)
    return config_from_args(args, QUICK if args.quick else BenchConfig(), names), args


def main(argv: Sequence[str] | None = None) -> BenchResult | None:
    """Run the benchmark (or ``--profile``), print the tables; returns the result."""
    config, args = parse_args(argv)
    if args.profile:
        print(profile_ssd(config, directory=args.dir))
        return None
    if args.sequential:
        ms = sequential(config, args.dir)
        print(
            f"{config.tables} table(s), each system on its own: all in memory "
            f"{ms[FULL]:.1f} ms a step, 10% + SSD {ms[SSD]:.1f} ms: {ms[FULL] / ms[SSD]:.2f}x"
        )
        return None
    result = run(config, directory=args.dir)
    print(report(result))
    if args.out:
        write_report(result, args.out, command_line("benchmarks.ssd_tier", argv))
        print(f"\nwrote {args.out}")
    return result


if __name__ == "__main__":
    main()
