"""Checkpoint save / load throughput of KV tables against the disk's sequential rate.

One process, no process group (``torchrec_kvemb.checkpoint`` without
``torch.distributed``): a ``KVEmbeddingBagCollection`` of ``tables`` KV tables,
``rows`` ids each (raw ids spread over ``[0, 2**40)``), ``dim`` floats per row,
row-wise Adagrad (one float of state per row). Bytes of a checkpoint: per row
``4 * dim`` (weight) + 4 (momentum1) + 8 (id) + 8 (score).

* ``save``: ``checkpoint.save(model, path)`` to a new directory, as a training job
  saves each checkpoint (the one before is removed beforehand, outside the clock,
  as the disk's own file is; replacing a checkpoint at the same path adds its
  removal, about 0.2 s for 1.1 GB here): ``state_dict()`` (placeholders for the
  tables' rows), each table ordered by routing bucket, its rows gathered block
  by block as DCP's files are written, fsync, rename, marker.
* ``load``: ``checkpoint.load(fresh_model, path)`` after the checkpoint's files
  are dropped from the page cache (``posix_fadvise(DONTNEED)``): metadata, the
  ids and scores, checks, then the rows read in blocks, each placed into its
  table as it is read. The fresh model's table memory is
  touched before the clock starts: a new table's zeros are allocated lazily, and
  the first write of every page (``first touch`` in the report) is the model's
  cost, paid by the load or by the first training steps.
* ``async``: a training step (forward, backward, fused row-wise Adagrad; ``batch``
  bags of ``bag`` ids per table, drawn from the stored ids) while an
  asynchronous save (``checkpoint.async_save``) writes, against the same steps
  with nothing in flight, run just before and just after (their mean;
  ``--async-steps`` steps at most, those that start before the save is done).
  The call itself, which copies the state, is reported on its own (``async
  call``; the first save allocates its staging buffers, later ones reuse them),
  and so is how long each save stays in flight (from the call's return to the
  ``COMPLETE`` marker). Target: 0.9x the steps' rate.
  The same with the save's threads at nice 19 instead of ``SCHED_IDLE``
  (``checkpoint/priority.py``; the default before), for comparison.
  With ``--async-rate`` (MB/s, 50 by default; 0 leaves it out) the same with the
  save's writes capped at that rate (``max_write_bytes_per_s``): the writes'
  CPU cost spread over more steps.
  For reference, the same steps beside a plain write of the checkpoint's bytes
  by a thread at the same (lowest) CPU priority, then fsync: what the machine's
  write path alone costs the steps.
* ``disk write`` / ``disk read``: a file of the same size written sequentially
  in 8 MiB blocks then fsynced; dropped from the page cache, read back. Measured
  in the same run, beside the checkpoint, on the same file system.

Each repeat starts with ``os.sync()``: data other jobs (or the benchmarks before
this one in ``make bench``) left dirty is written out first, not during a
measurement.

Throughput is checkpoint bytes per second; the ratio is against the disk's
rate in the same direction (targets: save 0.7x, load 0.5x or better). The figure
is the median of ``repeats`` runs.

Run from the repository root::

    python -m benchmarks.checkpoint                 # about a minute, ~5 GB of memory
    python -m benchmarks.checkpoint --quick         # smoke-test sizes
    python -m benchmarks.checkpoint --dir /mnt/ssd  # the file system to measure
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from benchmarks.common import (
    add_config_flags,
    config_from_args,
    drop_cache,
    format_table,
    load_average,
    machine_summary,
    markdown_table,
)
from torchrec_kvemb import KVEmbeddingBagCollection, KVTableOptions, checkpoint
from torchrec_kvemb.checkpoint import priority
from torchrec_kvemb.checkpoint.asynchronous import lowest_priority
from torchrec_kvemb.checkpoint.save_load import ASYNC_THREADS

#: Checkpoint throughput must reach this fraction of the disk's sequential rate
#: in the same direction.
TARGETS = {"save": 0.7, "load": 0.5}
#: Training steps while an asynchronous save writes, against none in flight.
ASYNC_TARGET = 0.9
#: ``CheckpointBenchResult.steps`` key of each ``step_seconds`` key.
MEASURED = {
    "in flight": "in flight",
    "none": "in flight",
    "nice 19": "nice 19",
    "paced": "paced",
    "plain write": "plain write",
}
BLOCK = 8 << 20


@dataclass(frozen=True)
class CheckpointBenchConfig:
    tables: int = 4
    rows: int = 1_000_000  # ids stored per table
    dim: int = 64
    repeats: int = 5
    threads: int = 2  # torch intra-op threads
    writer_threads: int = 4  # DCP writer threads (files) per rank; the load reads them in parallel
    batch: int = 1024  # bags per table in a training step of the async measurement
    bag: int = 8  # ids per bag
    async_steps: int = 100  # most steps timed per save in flight
    async_repeats: int = 2  # async saves timed (each beside its own steps)
    async_rate: float = 50.0  # MB/s of the paced async save (0: not measured)


QUICK = CheckpointBenchConfig(
    tables=2, rows=20_000, dim=16, repeats=1, batch=64, async_steps=20, async_repeats=1
)


@dataclass(frozen=True)
class CheckpointBenchResult:
    config: CheckpointBenchConfig
    bytes: int
    seconds: dict[str, float]  # median per operation
    samples: dict[str, tuple[float, ...]]
    #: Training steps timed, summed over the repeats: ``"in flight"`` (an async save
    #: writing) and ``"none"`` (the same batches without it); ``"paced"`` and
    #: ``"none (paced)"`` (the save's writes capped at ``async_rate`` MB/s);
    #: ``"plain write"`` (a plain write of the same bytes in flight) and
    #: ``"none (plain write)"``; ``"nice 19"`` and ``"none (nice 19)"`` (the save's
    #: threads at nice 19, not idle). ``steps`` by the first key of each pair.
    step_seconds: dict[str, float]
    steps: dict[str, int]
    #: Seconds each save (or plain write) was in flight, by the key of its steps.
    in_flight: dict[str, tuple[float, ...]]

    def rate(self, what: str) -> float:
        """GB/s (10**9 bytes) of ``what``."""
        return self.bytes / self.seconds[what] / 1e9

    def steps_per_s(self, key: str) -> float:
        """Training steps per second of ``step_seconds[key]``."""
        n = self.steps[MEASURED[key.removeprefix("none (").rstrip(")")]]
        return n / self.step_seconds[key] if self.step_seconds[key] > 0 else float("nan")

    def async_ratio(self) -> float:
        """Training steps per second with an async save in flight / with none."""
        return self.step_seconds["none"] / self.step_seconds["in flight"]

    def plain_write_ratio(self) -> float:
        """The same beside a plain write of the checkpoint's bytes (the reference)."""
        return self.step_seconds["none (plain write)"] / self.step_seconds["plain write"]

    def ratio(self, key: str) -> float:
        """Steps per second beside ``key`` (``in flight``, ``paced``, ``plain write``)
        over those of the same steps without it."""
        none = "none" if key == "in flight" else f"none ({key})"
        return self.step_seconds[none] / self.step_seconds[key] if self.steps[key] else math.nan


# ----------------------------------------------------------------- tables
def build(config: CheckpointBenchConfig) -> KVEmbeddingBagCollection:
    tables = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=config.dim, num_embeddings=2**40, feature_names=[f"f{i}"]
        )
        for i in range(config.tables)
    ]
    # why 2x: a uniformly filled 16-way index starts dropping ids at about 60% load.
    options = KVTableOptions(capacity=2 * config.rows)
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.01}
    return KVEmbeddingBagCollection(tables, options, fused_params=fused)


def fill(model: KVEmbeddingBagCollection, config: CheckpointBenchConfig) -> None:
    """``rows`` distinct ids per table with random rows, state and scores."""
    g = torch.Generator().manual_seed(0)
    for i, table in enumerate(model.kv_tables().values()):
        ids = torch.unique(torch.randint(0, 2**40, (int(config.rows * 1.01),), generator=g))
        ids = ids[torch.randperm(ids.numel(), generator=g)[: config.rows]]
        table.insert(
            ids,
            torch.randn(ids.numel(), config.dim, generator=g),
            torch.rand(ids.numel(), 1, generator=g),
        )
        table.step = table.optim_step = 10 + i
        if table.size < 0.99 * config.rows:
            raise RuntimeError(f"table {table.name}: {table.size} of {config.rows} rows stored")


def checkpoint_bytes(model: KVEmbeddingBagCollection) -> int:
    """Bytes of the rows of a checkpoint: weight, momentum1, id and score per row."""
    return sum(t.size * (4 * t.dim + 4 + 8 + 8) for t in model.kv_tables().values())


# ------------------------------------------------------------------- disk
def disk_write(path: Path, nbytes: int) -> float:
    block = os.urandom(BLOCK)
    start = time.perf_counter()
    with open(path, "wb", buffering=0) as f:
        for offset in range(0, nbytes, BLOCK):
            f.write(block[: min(BLOCK, nbytes - offset)])
        os.fsync(f.fileno())
    return time.perf_counter() - start


def plain_write(path: Path, nbytes: int) -> None:
    """``disk_write`` from a thread at the CPU priority of an asynchronous save's."""
    lowest_priority()
    disk_write(path, nbytes)


def finished(thread: threading.Thread) -> Callable[[], bool]:
    return lambda: not thread.is_alive()


def disk_read(path: Path) -> float:
    drop_cache(path)
    buffer = bytearray(BLOCK)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buffer):
            pass
    return time.perf_counter() - start


# -------------------------------------------------------------------- run
def run(config: CheckpointBenchConfig, directory: Path) -> CheckpointBenchResult:
    previous = torch.get_num_threads()
    torch.set_num_threads(config.threads)
    samples: dict[str, list[float]] = {
        "save": [],
        "load": [],
        "disk write": [],
        "disk read": [],
        "first touch": [],
        "async call": [],
    }
    measured = ("in flight", "nice 19", "paced", "plain write")
    if not config.async_rate:
        measured = tuple(m for m in measured if m != "paced")
    step_seconds = {
        k: 0.0 for m in measured for k in (m, "none" if m == "in flight" else f"none ({m})")
    }
    steps = dict.fromkeys(measured, 0)
    in_flight: dict[str, list[float]] = {m: [] for m in measured}
    work = Path(tempfile.mkdtemp(prefix="kvemb_ckpt_bench_", dir=directory))
    try:
        model = build(config)
        fill(model, config)
        nbytes = checkpoint_bytes(model)
        for repeat in range(config.repeats):
            os.sync()
            disk_file = work / "disk"
            samples["disk write"].append(disk_write(disk_file, nbytes))
            samples["disk read"].append(disk_read(disk_file))
            disk_file.unlink()

            shutil.rmtree(work / f"ckpt{repeat - 1}", ignore_errors=True)
            path = work / f"ckpt{repeat}"
            gc.collect()
            start = time.perf_counter()
            checkpoint.save(model, path, thread_count=config.writer_threads)
            samples["save"].append(time.perf_counter() - start)

            fresh = build(config)
            samples["first touch"].append(touch(fresh))
            drop_cache(path)
            gc.collect()
            start = time.perf_counter()
            checkpoint.load(fresh, path)
            samples["load"].append(time.perf_counter() - start)
            check_same(model, fresh)
            del fresh
        batches = training_batches(model, config)
        train(model, batches[:3])  # warm-up
        for repeat in range(config.async_repeats):
            os.sync()
            shutil.rmtree(work / f"ckpt{config.repeats - 1}", ignore_errors=True)
            shutil.rmtree(work / f"async{repeat - 1}", ignore_errors=True)
            gc.collect()

            def save(repeat: int = repeat) -> tuple[Callable[[], bool], Callable[[], None]]:
                start = time.perf_counter()
                pending = checkpoint.async_save(model, work / f"async{repeat}")
                samples["async call"].append(time.perf_counter() - start)
                return pending.done, pending.result

            def paced(repeat: int = repeat) -> tuple[Callable[[], bool], Callable[[], None]]:
                shutil.rmtree(work / f"async{repeat}", ignore_errors=True)
                rate = config.async_rate * 1e6
                pending = checkpoint.async_save(
                    model, work / f"async{repeat}", max_write_bytes_per_s=rate
                )
                return pending.done, pending.result

            def nice_19(repeat: int = repeat) -> tuple[Callable[[], bool], Callable[[], None]]:
                shutil.rmtree(work / f"async{repeat}", ignore_errors=True)
                priority.USE_IDLE = False
                try:
                    pending = checkpoint.async_save(model, work / f"async{repeat}")
                finally:
                    priority.USE_IDLE = True
                return pending.done, pending.result

            def write() -> tuple[Callable[[], bool], Callable[[], None]]:
                thread = threading.Thread(target=plain_write, args=(work / "plain", nbytes))
                thread.start()
                return finished(thread), thread.join

            begins = {"in flight": save, "nice 19": nice_19, "paced": paced, "plain write": write}
            for key in measured:
                os.sync()
                beside_s, none, n, flight = beside(model, batches, begins[key])
                step_seconds[key] += beside_s
                step_seconds["none" if key == "in flight" else f"none ({key})"] += none
                steps[key] += n
                in_flight[key].append(flight)
            (work / "plain").unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        torch.set_num_threads(previous)
    return CheckpointBenchResult(
        config,
        nbytes,
        {k: statistics.median(v) for k, v in samples.items()},
        {k: tuple(v) for k, v in samples.items()},
        step_seconds,
        steps,
        {k: tuple(v) for k, v in in_flight.items()},
    )


def beside(
    model: KVEmbeddingBagCollection,
    batches: Sequence[KeyedJaggedTensor],
    begin: Callable[[], tuple[Callable[[], bool], Callable[[], None]]],
) -> tuple[float, float, int, float]:
    """``(in flight, none, n, flight)``: seconds of the ``n`` steps that start while
    the work ``begin()`` starts is in flight (``begin`` returns its ``done`` and
    ``wait``), and of the same batches without it: the mean of their steps just
    before and just after (the machine's drift cancels); ``flight``: seconds from
    ``begin()``'s return until the work is done (``wait()`` returns)."""
    before = train(model, batches)
    done, wait = begin()
    started = time.perf_counter()
    in_flight = train(model, batches, until=done)
    wait()
    flight = time.perf_counter() - started
    n = len(in_flight)
    after = train(model, batches[:n])
    return sum(in_flight), (sum(before[:n]) + sum(after)) / 2, n, flight


def training_batches(
    model: KVEmbeddingBagCollection, config: CheckpointBenchConfig
) -> list[KeyedJaggedTensor]:
    """``async_steps`` batches of ``batch`` bags of ``bag`` stored ids per table."""
    g = torch.Generator().manual_seed(1)
    stored = [t.export_order()[0] for t in model.kv_tables().values()]
    n = config.batch * config.bag
    out = []
    for _ in range(config.async_steps):
        values = [ids[torch.randint(0, ids.numel(), (n,), generator=g)] for ids in stored]
        out.append(
            KeyedJaggedTensor.from_lengths_sync(
                keys=[f"f{i}" for i in range(config.tables)],
                values=torch.cat(values),
                lengths=torch.full((config.tables * config.batch,), config.bag),
            )
        )
    return out


def train(
    model: KVEmbeddingBagCollection,
    batches: Sequence[KeyedJaggedTensor],
    until: Callable[[], bool] | None = None,
) -> list[float]:
    """Seconds of each training step over ``batches``; with ``until``, the steps
    (at least one) that start before ``until()`` is true."""
    times = []
    for i, batch in enumerate(batches):
        if i and until is not None and until():
            break
        start = time.perf_counter()
        model(batch).values().sum().backward()
        times.append(time.perf_counter() - start)
    return times


def touch(model: KVEmbeddingBagCollection) -> float:
    """Write every page of the tables' memory once; returns the seconds it took."""
    start = time.perf_counter()
    for table in model.kv_tables().values():
        table.weights.zero_()
        table.state.zero_()
        table.keys.fill_(-1)
        table.scores.zero_()
    return time.perf_counter() - start


def check_same(a: KVEmbeddingBagCollection, b: KVEmbeddingBagCollection) -> None:
    """The loaded tables hold the saved ids, rows and state (a sample of rows)."""
    for name, table in a.kv_tables().items():
        other = b.table(name)
        if other.size != table.size or other.step != table.step:
            raise RuntimeError(f"table {name}: {other.size} rows loaded of {table.size}")
        ids = table.export()["ids"][:: max(1, table.size // 1000)]
        rows, found = other.find(ids)
        want, _ = table.find(ids)
        if not bool(found.all()) or not torch.equal(rows, want):
            raise RuntimeError(f"table {name}: loaded rows differ")


# ----------------------------------------------------------------- report
def describe(config: CheckpointBenchConfig) -> str:
    return (
        f"{config.tables} KV tables x {config.rows:,} rows x dim {config.dim}, row-wise "
        f"Adagrad; {config.repeats} runs (median), {config.threads} torch threads, "
        f"{config.writer_threads} DCP writer thread(s); async: {config.async_repeats} saves "
        f"({ASYNC_THREADS} writer thread), "
        f"steps of {config.batch} bags x {config.bag} ids per table"
    )


def rows_of(result: CheckpointBenchResult) -> list[tuple[str, ...]]:
    out = []
    for what, disk in (("save", "disk write"), ("load", "disk read")):
        ratio = result.rate(what) / result.rate(disk)
        verdict = "met" if ratio >= TARGETS[what] else "missed"
        out.append(
            (
                what,
                f"{result.seconds[what]:.2f}",
                f"{result.rate(what):.2f}",
                f"{result.rate(disk):.2f}",
                f"{ratio:.2f}x (>= {TARGETS[what]}x: {verdict})",
            )
        )
    return out


HEADERS = ("operation", "s", "GB/s", "disk GB/s", "vs disk (target)")
ASYNC_HEADERS = ("training step", "ms/step", "steps", "ratio (target)", "in flight s")


def async_rows(result: CheckpointBenchResult) -> list[tuple[str, ...]]:
    seconds, steps = result.step_seconds, result.steps
    names = {
        "in flight": "async save in flight",
        "nice 19": "async save at nice 19 in flight",
        "paced": f"async save, {result.config.async_rate:g} MB/s, in flight",
        "plain write": "plain write of the bytes in flight",
    }
    out = []
    for key, n in steps.items():
        none = "none" if key == "in flight" else f"none ({key})"
        ratio = result.ratio(key)
        verdict = "met" if ratio >= ASYNC_TARGET else "missed"
        target = (
            f"{ratio:.2f}x (reference)"
            if key in ("plain write", "nice 19")
            else f"{ratio:.2f}x (>= {ASYNC_TARGET}x: {verdict})"
        )
        flight = " ".join(f"{s:.2f}" for s in result.in_flight[key])
        out.append((names[key], f"{1e3 * seconds[key] / max(1, n):.2f}", str(n), target, flight))
        out.append(
            ("none (same batches)", f"{1e3 * seconds[none] / max(1, n):.2f}", str(n), "", "")
        )
    return out


def report(result: CheckpointBenchResult) -> str:
    return (
        f"Checkpoint throughput: {describe(result.config)}\n"
        f"{result.bytes / 1e9:.2f} GB per checkpoint; {machine_summary()}; "
        f"load average {load_average():.1f}\n\n"
        + format_table(HEADERS, rows_of(result))
        + "\n\n"
        + format_table(ASYNC_HEADERS, async_rows(result))
        + f"\nasync_save call (copies the state): {result.seconds['async call']:.2f} s"
        + f"\n\nfirst touch of a fresh model's table memory (not in load): "
        f"{result.seconds['first touch']:.2f} s\n"
        + "samples (s): "
        + ", ".join(f"{k} {' '.join(f'{v:.2f}' for v in vs)}" for k, vs in result.samples.items())
    )


def markdown(result: CheckpointBenchResult) -> str:
    return (
        f"{describe(result.config)}; {result.bytes / 1e9:.2f} GB per checkpoint.\n\n"
        + markdown_table(HEADERS, rows_of(result))
        + "\n\n"
        + markdown_table(ASYNC_HEADERS, async_rows(result))
        + f"\n\nasync_save call (copies the state): {result.seconds['async call']:.2f} s"
    )


# -------------------------------------------------------------------- CLI
def parse_args(argv: Sequence[str] | None) -> tuple[CheckpointBenchConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="file system to measure")
    parser.add_argument("--markdown", action="store_true", help="print a markdown table too")
    names = add_config_flags(parser, CheckpointBenchConfig)
    args = parser.parse_args(argv)
    return config_from_args(args, QUICK if args.quick else CheckpointBenchConfig(), names), args


def main(argv: Sequence[str] | None = None) -> CheckpointBenchResult:
    config, args = parse_args(argv)
    result = run(config, Path(args.dir))
    print(report(result))
    if args.markdown:
        print("\n" + markdown(result))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
