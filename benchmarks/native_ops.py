"""Native group kernels vs the per-table torch path: id -> slot and fused backward.

One process, the same batches for both sides:

* ``torch``: T ``KVTable``s, one call per table: ``lookup_train`` (find-or-
  insert), ``lookup_eval`` (find), the torch fused backward (row-wise
  Adagrad; fbgemm's CPU TBE backward does the reduction and update there).
* ``native``: the same tables as one group (``ops.native``), one call for all
  tables: ``lookup_train_group``, ``lookup_eval_group``,
  ``fused_backward_group``, with ``torch.get_num_threads()`` threads;
  ``native 1 thread`` the same calls on one thread (find-or-insert on a group
  of its own, so that each side meets every batch's new ids itself).

Both sides are primed with the same training batches. Find-or-insert is timed
on fresh batches (new ids arrive, rows are evicted once the tables fill),
find on held-out batches, backward on the output gradient of one batch
(``[batch, tables * dim]``, a KeyedTensor's layout) over that batch's slots.
GB/s counts the bytes an op must move at least: ids read and slots written
(16 B an id), plus per unique id its bucket's keys (128 B; find-or-insert
also reads and writes the scores: 384 B); for backward, a gradient row per
id and a read and write of each unique row with its optimizer state.

Run from the repository root::

    python -m benchmarks.native_ops                          # about 2 min on 2 cores
    python -m benchmarks.native_ops --id-range 4000000       # 4x more ids than rows: churn
    python -m benchmarks.native_ops --out docs/bench_native_ops.md
    python -m benchmarks.native_ops --quick                  # smoke-test sizes
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from benchmarks.common import (
    ZipfIds,
    add_config_flags,
    command_line,
    config_from_args,
    format_table,
    load_average,
    machine_line,
    markdown_table,
    set_threads,
    time_interleaved,
    write_markdown,
)
from torchrec_kvemb import native_lib
from torchrec_kvemb.contracts import Bags, GroupLayout, init_spec
from torchrec_kvemb.ops import native
from torchrec_kvemb.ops.pooled_lookup import pooled_backward_update_torch
from torchrec_kvemb.optimizer import FusedOptimConfig, OptimKind
from torchrec_kvemb.options import WAYS, KVTableOptions
from torchrec_kvemb.table import KVTable, resolve_capacity

TORCH = "torch"
NATIVE = "native"
NATIVE_1 = "native 1 thread"
OPS = ("find-or-insert", "find", "backward")


@dataclass(frozen=True)
class BenchConfig:
    """Sizes and timing of one run."""

    tables: int = 4
    rows: int = 1_000_000  # capacity per table
    id_range: int | None = None  # Zipf ids per table in [0, id_range); None: rows
    dim: int = 64
    batch: int = 4096
    bag: int = 20
    alpha: float = 1.05  # Zipf exponent of the ids
    steps: int = 3  # steps per timed block
    repeats: int = 5  # timed blocks per system (the median is reported)
    warmup: int = 1
    prime: int = 8  # training steps before anything is timed
    threads: int | None = None  # torch threads and native threads; None: the machine's cores
    learning_rate: float = 0.01
    seed: int = 0

    @property
    def ids_per_table(self) -> int:
        return self.batch * self.bag

    @property
    def ids_per_step(self) -> int:
        return self.tables * self.ids_per_table


#: ``--quick``: a smoke test that runs in seconds.
QUICK = BenchConfig(
    tables=2, rows=20_000, dim=8, batch=64, bag=5, steps=1, repeats=2, warmup=1, prime=2
)


@dataclass(frozen=True)
class OpResult:
    """One op on one side."""

    op: str
    system: str
    ms_per_step: float  # median over the timed blocks
    best_ms: float
    ids_per_s: float
    gb_per_s: float


@dataclass(frozen=True)
class BenchResult:
    config: BenchConfig
    results: tuple[OpResult, ...]
    uniques_per_step: float  # unique (table, id) pairs of a batch
    new_rows_per_step: float  # inserts of a timed find-or-insert step (native's metrics)
    load: tuple[float, float] = (-1.0, -1.0)

    def get(self, op: str, system: str) -> OpResult:
        for r in self.results:
            if r.op == op and r.system == system:
                return r
        raise KeyError(f"no result for {op} / {system}")

    def ratio(self, op: str, system: str = NATIVE) -> float:
        """``system``'s ids/s over the torch path's, for ``op``."""
        return self.get(op, system).ids_per_s / self.get(op, TORCH).ids_per_s


# ------------------------------------------------------------------ inputs
def make_batches(config: BenchConfig, count: int, seed: int) -> list[list[torch.Tensor]]:
    """``count`` batches, each a list of per-table Zipf ids."""
    id_range = config.id_range or config.rows
    samplers = [ZipfIds(id_range, config.alpha, seed + t) for t in range(config.tables)]
    return [[s.sample(config.ids_per_table) for s in samplers] for _ in range(count)]


def optim_config(config: BenchConfig) -> FusedOptimConfig:
    return FusedOptimConfig(kind=OptimKind.ROWWISE_ADAGRAD, learning_rate=config.learning_rate)


def table_options(config: BenchConfig, t: int) -> KVTableOptions:
    """Table t of either side: LRU, uniform initial rows, its own seed."""
    return KVTableOptions(capacity=config.rows, seed=config.seed + t)


# ----------------------------------------------------------------- systems
class TorchSide:
    """T KV tables, one call each (the per-table torch path)."""

    def __init__(self, config: BenchConfig) -> None:
        optim = optim_config(config)
        self.tables = [
            KVTable(f"t{t}", config.dim, table_options(config, t), optim)
            for t in range(config.tables)
        ]
        self.bags = Bags.build(
            torch.arange(0, config.ids_per_table + 1, config.bag), config.ids_per_table
        )
        self.dim = config.dim

    def train(self, batch: list[torch.Tensor]) -> list[torch.Tensor]:
        return [table.lookup_train(ids) for table, ids in zip(self.tables, batch)]

    def eval(self, batch: list[torch.Tensor]) -> list[torch.Tensor]:
        return [table.lookup_eval(ids) for table, ids in zip(self.tables, batch)]

    def backward(self, grad: torch.Tensor, slots: list[torch.Tensor]) -> None:
        for t, table in enumerate(self.tables):
            g = grad[:, t * self.dim : (t + 1) * self.dim]
            table.optim_step += 1
            pooled_backward_update_torch(
                table.weights, table.state, g, slots[t], self.bags, table.optim, table.optim_step
            )


class NativeSide:
    """The same tables as one group: one native call for all of them."""

    def __init__(self, config: BenchConfig) -> None:
        options = [table_options(config, t) for t in range(config.tables)]
        state_dim = optim_config(config).state_dim(config.dim)
        self.layout = GroupLayout.of(
            [resolve_capacity(o, config.dim, state_dim) // WAYS for o in options],
            [o.eviction for o in options],
            [init_spec(o) for o in options],
        )
        nb = self.layout.total_buckets
        self.keys = torch.full((nb, WAYS), -1, dtype=torch.int64)
        self.scores = torch.zeros_like(self.keys)
        self.weights = torch.zeros(nb * WAYS, config.dim)
        self.state = torch.zeros(nb * WAYS, state_dim)
        self.table_idx = torch.arange(config.tables).repeat_interleave(config.ids_per_table)
        self.offsets = torch.arange(0, config.ids_per_step + 1, config.bag)
        self.step = [0] * config.tables
        self.optim_step = [0] * config.tables
        self.config = config
        self.workspace = native.Workspace()

    def train(self, batch: list[torch.Tensor], threads: int) -> native.TrainLookup:
        self.step = [s + 1 for s in self.step]
        return native.lookup_train_group(
            self.layout, self.keys, self.scores, self.weights, self.state,
            torch.cat(batch), self.table_idx, self.step,
            num_threads=threads, workspace=self.workspace,
        )  # fmt: skip

    def eval(self, batch: list[torch.Tensor], threads: int) -> torch.Tensor:
        return native.lookup_eval_group(
            self.keys, self.layout.bucket_offset, self.layout.num_buckets,
            torch.cat(batch), self.table_idx, threads,
        )[0]  # fmt: skip

    def backward(self, grad: torch.Tensor, lookup: native.TrainLookup, threads: int) -> None:
        T, dim = self.config.tables, self.config.dim
        self.optim_step = [s + 1 for s in self.optim_step]
        by_table = grad.view(-1, T, dim).transpose(0, 1)  # [T, batch, dim] view, no copy
        native.fused_backward_group(
            self.weights, self.state, by_table, self.offsets,
            lookup.unique_index, lookup.unique_slots, lookup.unique_table,
            optim_config(self.config), [self.config.learning_rate] * T, self.optim_step,
            num_threads=threads, workspace=self.workspace,
        )  # fmt: skip


# --------------------------------------------------------------------- run
def _log(message: str, verbose: bool) -> None:
    if verbose:
        print(message, file=sys.stderr, flush=True)


def run(config: BenchConfig, verbose: bool = True) -> BenchResult:
    """Build both sides, prime them, time every op; threads as in ``config``."""
    previous = set_threads(config.threads)
    try:
        return _run(config, verbose)
    finally:
        torch.set_num_threads(previous)


def _run(config: BenchConfig, verbose: bool) -> BenchResult:
    if not native_lib.available():
        raise RuntimeError(f"native kernels unavailable: {native_lib.unavailable_reason()}")
    begin = time.perf_counter()
    load_at_start = load_average()
    threads = torch.get_num_threads()
    timed_count = config.warmup + config.steps * config.repeats
    prime = make_batches(config, config.prime, config.seed)
    fresh = make_batches(config, timed_count, config.seed + 1000)
    held_out = make_batches(config, timed_count, config.seed + 2000)
    grad = torch.randn(
        config.batch, config.tables * config.dim, generator=torch.Generator().manual_seed(1)
    )
    # Each find-or-insert system has its own tables (why: on shared tables the
    # second to run a batch finds the ids the first inserted).
    torch_side = TorchSide(config)
    native_side, native_1_side = NativeSide(config), NativeSide(config)
    _log(f"built inputs and tables in {time.perf_counter() - begin:.1f}s", verbose)
    for batch in prime:
        torch_side.train(batch)
        native_side.train(batch, threads)
        native_1_side.train(batch, 1)
    _log(f"primed with {config.prime} batches ({time.perf_counter() - begin:.0f}s)", verbose)

    inserts: list[int] = []

    def native_train(side: NativeSide, t: int) -> Callable[[int], object]:
        def step(i: int) -> None:
            out = side.train(fresh[i % len(fresh)], t)
            inserts.append(int(out.metrics[:, 2].sum()))

        return step

    timings = {
        "find-or-insert": time_interleaved(
            {
                TORCH: lambda i: torch_side.train(fresh[i % len(fresh)]),
                NATIVE: native_train(native_side, threads),
                NATIVE_1: native_train(native_1_side, 1),
            },
            config.steps,
            config.repeats,
            config.warmup,
        ),
        "find": time_interleaved(
            {
                TORCH: lambda i: torch_side.eval(held_out[i % len(held_out)]),
                NATIVE: lambda i: native_side.eval(held_out[i % len(held_out)], threads),
                NATIVE_1: lambda i: native_side.eval(held_out[i % len(held_out)], 1),
            },
            config.steps,
            config.repeats,
            config.warmup,
        ),
    }
    _log(f"timed lookups ({time.perf_counter() - begin:.0f}s so far)", verbose)
    del native_1_side  # find and backward: one group (read-only / one fixed lookup)
    last = held_out[0]
    torch_slots = torch_side.train(last)
    lookup = native_side.train(last, threads)
    timings["backward"] = time_interleaved(
        {
            TORCH: lambda i: torch_side.backward(grad, torch_slots),
            NATIVE: lambda i: native_side.backward(grad, lookup, threads),
            NATIVE_1: lambda i: native_side.backward(grad, lookup, 1),
        },
        config.steps,
        config.repeats,
        config.warmup,
    )
    _log(f"timed backward ({time.perf_counter() - begin:.0f}s in all)", verbose)

    uniques = lookup.unique_ids.numel()
    state_dim = native_side.state.shape[1]
    n = config.ids_per_step
    min_bytes = {
        "find-or-insert": n * 16 + uniques * 384,
        "find": n * 16 + uniques * 128,
        "backward": n * config.dim * 4 + uniques * (config.dim + state_dim) * 4 * 2,
    }
    results = []
    for op, by_system in timings.items():
        for system, timing in by_system.items():
            results.append(
                OpResult(
                    op=op,
                    system=system,
                    ms_per_step=1e3 * timing.median_s,
                    best_ms=1e3 * timing.best_s,
                    ids_per_s=n / timing.median_s,
                    gb_per_s=min_bytes[op] / timing.median_s / 1e9,
                )
            )
    return BenchResult(
        config=config,
        results=tuple(results),
        uniques_per_step=float(uniques),
        new_rows_per_step=sum(inserts) / max(1, len(inserts)),
        load=(load_at_start, load_average()),
    )


# ------------------------------------------------------------------ report
HEADERS = ("op", "system", "ms/step", "best ms", "M ids/s", "GB/s", "vs torch")


def result_rows(result: BenchResult) -> list[tuple]:
    rows = []
    for op in OPS:
        for system in (TORCH, NATIVE, NATIVE_1):
            r = result.get(op, system)
            rows.append(
                (
                    op,
                    system,
                    f"{r.ms_per_step:.2f}",
                    f"{r.best_ms:.2f}",
                    f"{r.ids_per_s / 1e6:.1f}",
                    f"{r.gb_per_s:.2f}",
                    f"{result.ratio(op, system):.2f}x",
                )
            )
    return rows


def summary(result: BenchResult) -> str:
    c = result.config
    return (
        f"{c.tables} tables x {c.rows:,} rows x dim {c.dim}, {c.ids_per_step:,} Zipf({c.alpha}) "
        f"ids a step over [0, {c.id_range or c.rows:,}) per table "
        f"({result.uniques_per_step:,.0f} unique, {result.new_rows_per_step:,.0f} new rows a "
        f"find-or-insert step); row-wise Adagrad; {torch.get_num_threads()} threads; "
        f"native build: {native_lib.variant()}"
    )


def report(result: BenchResult) -> str:
    table = format_table(HEADERS, result_rows(result))
    return "\n".join([summary(result), "", table, "", machine_line(result.load)])


def write_report(result: BenchResult, path: str, command: str) -> None:
    write_markdown(
        path,
        "Native group kernels vs the per-table torch path",
        [
            f"`{command}`",
            summary(result),
            markdown_table(HEADERS, result_rows(result)),
            machine_line(result.load),
        ],
    )


def parse_args(argv: Sequence[str] | None) -> tuple[BenchConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke-test sizes")
    parser.add_argument("--out", help="also write a markdown report here")
    names = add_config_flags(parser, BenchConfig)
    args = parser.parse_args(argv)
    base = QUICK if args.quick else BenchConfig()
    return config_from_args(args, base, names), args


def main(argv: Sequence[str] | None = None) -> BenchResult:
    """Run the benchmark and print the table; returns the result."""
    config, args = parse_args(argv)
    result = run(config)
    print(report(result))
    if args.out:
        write_report(result, args.out, command_line("benchmarks.native_ops", argv))
        print(f"\nwrote {args.out}")
    return result


if __name__ == "__main__":
    main()
