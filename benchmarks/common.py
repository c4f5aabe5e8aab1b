"""Helpers shared by the benchmarks: ids, timing, tables, markdown, profiles.

* ``ZipfIds``: bounded Zipf ids with hot ids scattered over the id range;
  ``UniformIds``: a flat stream; ``spread_ids`` maps them one-to-one into a
  large (2**40) raw id space.
* ``time_interleaved``: warm-up, then ``repeats`` timed blocks of ``steps``
  calls per system, systems taking turns block by block, so that every system
  sees the same machine noise; the figure is the median block (per step).
* ``format_table`` / ``markdown_table`` / ``write_markdown``: result tables;
  ``format_ratio``: a ratio as the tables print it.
* ``drop_cache``: a file (or a directory's files) out of the page cache, so
  that a timed read goes to the disk.
* ``profile_functions`` / ``profile_ops``: where a step's time goes, by
  Python function of a package (stack-based, exact) and by torch op.
* ``add_config_flags`` / ``config_from_args`` / ``command_line``: the
  benchmarks' command lines (one flag per field of a config dataclass).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

#: Odd multiplier of ``spread_ids`` (the 64-bit golden ratio): odd, so the map
#: is a bijection of the integers modulo 2**bits.
_SPREAD_MULT = 0x9E3779B97F4A7C15 - (1 << 64)


def set_threads(threads: int | None) -> int:
    """Set torch's intra-op threads (``None``: the machine's cores); returns the old value."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads or os.cpu_count() or 1)
    return previous


class IdSampler(Protocol):
    """Draws ids: ``sample(n)`` returns ``n`` int64 ids."""

    def sample(self, n: int) -> torch.Tensor: ...


class ZipfIds:
    """Bounded Zipf ids in ``[0, rows)``: rank ``k`` (1-based) has probability
    proportional to ``1 / k**alpha``; ranks map to ids by a fixed random
    permutation, so hot ids are scattered over the table, not packed at row 0
    (``scatter=False``: id ``k - 1`` for rank ``k``, the hot ids packed at row 0).

    Holds an exact CDF (8 bytes per row). Example::

        ids = ZipfIds(rows=1_000_000, alpha=1.05, seed=0).sample(81_920)
    """

    def __init__(self, rows: int, alpha: float, seed: int = 0, scatter: bool = True) -> None:
        if rows <= 0:
            raise ValueError(f"rows must be > 0, got {rows}")
        self.rows = rows
        self.alpha = alpha
        self._generator = torch.Generator().manual_seed(seed)
        weights = torch.arange(1, rows + 1, dtype=torch.float64).pow_(-alpha)
        cdf = torch.cumsum(weights, 0)
        self._cdf = cdf / cdf[-1]
        # Drawn in both cases, so that the samples of one seed use the same draws.
        rank_to_id = torch.randperm(rows, generator=self._generator)
        self._rank_to_id = rank_to_id if scatter else None

    def sample(self, n: int) -> torch.Tensor:
        """``n`` ids, int64, drawn independently."""
        u = torch.rand(n, generator=self._generator, dtype=torch.float64)
        ranks = torch.searchsorted(self._cdf, u, right=True).clamp_(max=self.rows - 1)
        return ranks if self._rank_to_id is None else self._rank_to_id[ranks]


class UniformIds:
    """Ids drawn uniformly from ``[0, id_range)``: a flat stream, no hot ids. Example::

    ids = UniformIds(id_range=100_000_000, seed=0).sample(81_920)
    """

    def __init__(self, id_range: int, seed: int = 0) -> None:
        if id_range <= 0:
            raise ValueError(f"id_range must be > 0, got {id_range}")
        self.rows = id_range
        self._generator = torch.Generator().manual_seed(seed)

    def sample(self, n: int) -> torch.Tensor:
        """``n`` ids, int64, drawn independently."""
        return torch.randint(self.rows, (n,), generator=self._generator, dtype=torch.int64)


def spread_ids(ids: torch.Tensor, bits: int = 40) -> torch.Tensor:
    """A fixed one-to-one map of ids in ``[0, 2**bits)`` onto ``[0, 2**bits)`` that
    scatters small ids over the whole range (multiplication by an odd constant)."""
    if not 1 <= bits <= 62:
        raise ValueError(f"bits must be in [1, 62], got {bits}")
    # int64 multiplication wraps modulo 2**64; the mask keeps the low ``bits``.
    return (ids.to(torch.int64) * _SPREAD_MULT) & ((1 << bits) - 1)


@dataclass(frozen=True)
class Timing:
    """Seconds per call: the median and the best of the timed blocks."""

    median_s: float
    best_s: float
    samples: tuple[float, ...]

    @classmethod
    def from_samples(cls, samples: Sequence[float]) -> Timing:
        return cls(statistics.median(samples), min(samples), tuple(samples))


def time_interleaved(
    steps: Mapping[str, Callable[[int], object]],
    steps_per_block: int,
    repeats: int,
    warmup: int = 1,
    sync: Callable[[], object] | None = None,
) -> dict[str, Timing]:
    """Time several step functions taking turns.

    Each function is called with its own call counter ``0, 1, 2, ...`` (so every
    system can be fed the same batch sequence): first ``warmup`` calls untimed,
    then ``repeats`` blocks of ``steps_per_block`` calls, the systems
    alternating block by block. Returns per-call timings by name.

    ``sync`` (e.g. ``torch.cuda.synchronize``) runs before a block's clock
    starts and before it stops, so asynchronous device work is counted.
    """
    if steps_per_block < 1 or repeats < 1:
        raise ValueError("steps_per_block and repeats must be >= 1")
    calls = dict.fromkeys(steps, 0)

    def run(name: str, n: int) -> float:
        fn, start = steps[name], calls[name]
        gc.collect()
        if sync is not None:
            sync()
        begin = time.perf_counter()
        for i in range(start, start + n):
            fn(i)
        if sync is not None:
            sync()
        elapsed = time.perf_counter() - begin
        calls[name] += n
        return elapsed

    for name in steps:
        if warmup:
            run(name, warmup)
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name in steps:
            samples[name].append(run(name, steps_per_block) / steps_per_block)
    return {name: Timing.from_samples(s) for name, s in samples.items()}


def time_steps(
    step: Callable[[int], object],
    steps_per_block: int,
    repeats: int,
    warmup: int = 1,
    sync: Callable[[], object] | None = None,
) -> Timing:
    """``time_interleaved`` for one step function."""
    return time_interleaved({"step": step}, steps_per_block, repeats, warmup, sync)["step"]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain-text table: first column left-aligned, the others right-aligned."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def line(row: list[str]) -> str:
        parts = [
            row[i].ljust(widths[i]) if i == 0 else row[i].rjust(widths[i]) for i in range(len(row))
        ]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(cells[0]), rule] + [line(r) for r in cells[1:]])


def format_ratio(value: float) -> str:
    """``value`` as ``"1.23x"``, floored to the hundredth; ``"n/a"`` for NaN.

    Why floor: a ratio printed as "3.00x" must not be one that missed ">= 3.0x".
    """
    if math.isnan(value):
        return "n/a"
    return f"{math.floor(100 * value) / 100:.2f}x"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table (first column left-aligned, the others right)."""
    head = "| " + " | ".join(str(h) for h in headers) + " |"
    align = "|" + "|".join(":---" if i == 0 else "---:" for i in range(len(headers))) + "|"
    body = ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join([head, align] + body)


def write_markdown(path: str | Path, title: str, sections: Sequence[str]) -> Path:
    """Write ``# title`` and the sections (separated by blank lines) to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = f"# {title}\n\n" + "\n\n".join(s.strip() for s in sections) + "\n"
    path.write_text(text)
    return path


def drop_cache(path: str | Path) -> None:
    """Drop ``path`` (a file, or every file under a directory) from the page cache."""
    path = Path(path)
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    for file in files:
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def load_average() -> float:
    """The 1-minute load average (-1 where the OS does not report one)."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return -1.0


def machine_summary() -> str:
    """One line: CPU, cores, threads in use, torch version."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} "
        f"with {torch.get_num_threads()} threads"
    )


def machine_line(load: tuple[float, float]) -> str:
    """``machine_summary()`` and the load average at the start and end of a run."""
    start, end = load
    return f"{machine_summary()}; load average {start:.2f} at start, {end:.2f} at end"


def profile_functions(
    fn: Callable[[int], object], calls: int, package: str, limit: int = 25
) -> str:
    """Where ``calls`` calls of ``fn(i)`` spend their time, by Python function of
    ``package`` (a path fragment, e.g. ``"torchrec_kvemb"``), per call:

    * ``excl ms``: every moment is charged to the innermost function of the
      package on the Python stack, so the torch ops and library code a function
      calls count for it; the column sums to the wall time of the calls
      (``outside <package>``: time with no package function on the stack);
    * ``cum ms``: from the function's call to its return.

    Uses ``sys.setprofile`` (about a microsecond per Python call, included).
    """
    outside = ("", 0, f"outside {package}")
    excl: dict[tuple, float] = {outside: 0.0}
    cum: dict[tuple, float] = {}
    ncalls: dict[tuple, int] = {}
    owners: list[tuple] = [outside]  # per live frame: innermost package function
    starts: list[float | None] = []  # per live frame: call time if it is ours
    last = time.perf_counter()

    def hook(frame, event, arg) -> None:
        nonlocal last
        if event not in ("call", "return"):
            return
        now = time.perf_counter()
        excl[owners[-1]] = excl.get(owners[-1], 0.0) + now - last
        last = now
        if event == "call":
            code = frame.f_code
            if package in code.co_filename.replace(os.sep, "/"):
                key = (code.co_filename, code.co_firstlineno, code.co_name)
                ncalls[key] = ncalls.get(key, 0) + 1
                owners.append(key)
                starts.append(now)
            else:
                owners.append(owners[-1])
                starts.append(None)
        elif len(owners) > 1:  # a return of a frame entered while profiling
            key, start = owners.pop(), starts.pop()
            if start is not None:
                cum[key] = cum.get(key, 0.0) + now - start

    sys.setprofile(hook)
    try:
        for i in range(calls):
            fn(i)
    finally:
        sys.setprofile(None)
    excl[owners[-1]] = excl.get(owners[-1], 0.0) + time.perf_counter() - last
    total = sum(excl.values())
    ranked = sorted(excl, key=excl.get, reverse=True)

    def label(key: tuple) -> str:
        if key == outside:
            return key[2]
        path = Path(key[0])
        return f"{path.parent.name}/{path.name}:{key[1]} {key[2]}"

    table = [
        (
            label(key),
            f"{ncalls.get(key, 0) / calls:.0f}",
            f"{1e3 * excl[key] / calls:.2f}",
            f"{1e3 * cum.get(key, 0.0) / calls:.2f}",
            f"{100 * excl[key] / total:.1f}",
        )
        for key in ranked[:limit]
    ]
    table.append(("total", "", f"{1e3 * total / calls:.2f}", "", "100.0"))
    return format_table(("function", "calls", "excl ms", "cum ms", "%"), table)


def profile_ops(fn: Callable[[int], object], calls: int, limit: int = 25) -> str:
    """torch.profiler over ``calls`` calls of ``fn(i)``: the top ops by self CPU
    time, in ms per call."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for i in range(calls):
            fn(i)
    return ops_table(prof, calls, limit)


def ops_table(prof: object, calls: int, limit: int = 25) -> str:
    """The top ops of a finished ``torch.profiler.profile`` over ``calls`` calls, by
    self CPU time, in ms per call (``profile_ops``' table)."""
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in events)
    rows = [
        (
            e.key[:70],
            f"{e.count / calls:.0f}",
            f"{e.self_cpu_time_total / 1e3 / calls:.2f}",
            f"{100 * e.self_cpu_time_total / total:.1f}",
        )
        for e in events[:limit]
    ]
    rows.append(("total", "", f"{total / 1e3 / calls:.2f}", "100.0"))
    return format_table(("op", "calls", "self ms", "%"), rows)


# --------------------------------------------------------------- command lines
def add_config_flags(
    parser: argparse.ArgumentParser, config_type: type, skip: Sequence[str] = ()
) -> list[str]:
    """Add ``--field-name`` (int, or float where the default is one; default
    ``None``: not given) for each field of the dataclass ``config_type``;
    returns the field names."""
    names = []
    for f in dataclasses.fields(config_type):
        if f.name in skip:
            continue
        kind = float if isinstance(f.default, float) else int
        parser.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=None)
        names.append(f.name)
    return names


def config_from_args(args: argparse.Namespace, base: object, names: Sequence[str]):
    """``base`` with the fields among ``names`` that were given on the command line."""
    given = {n: getattr(args, n) for n in names if getattr(args, n) is not None}
    return dataclasses.replace(base, **given)


def command_line(module: str, argv: Sequence[str] | None) -> str:
    """``python -m <module> <args>``, the way a report names the run."""
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join(["python -m", module, *args])
