"""The benchmark matrix: KV EBC vs FBGEMM's CPU TBE, train and eval, on several id streams.

Each stream is one run: a KV EBC (``ebc_train.build_kv``, fused
EXACT_ROWWISE_ADAGRAD) and a TBE (``ebc_train.build_tbe``) of the same sizes take
turns on the same batches (``common.time_interleaved``), train then eval on
held-out batches of the same stream:

* ``zipf1.05``: Zipf 1.05 over ``rows`` ids (``ebc_train``'s stream); KV capacity
  and TBE rows ``rows``.
* ``zipf1.2``: a heavier skew, Zipf 1.2, otherwise the same.
* ``uniform100m``: ids uniform over 100,000,000 into KV tables of capacity
  ``rows``: a flat stream with a low hit rate. TBE has ``rows`` rows and gets the
  ids a stock user would give it: hashed into its rows, ``id % rows``.
* ``capacity``: Zipf 1.05 over ``rows`` ids into KV tables of a tenth of that
  capacity, primed until full, so that the tables evict every step; TBE has as
  many rows as KV's capacity and gets ``id % rows`` (the same memory).

KV tables of the evicting streams (``uniform100m``, ``capacity``) are primed with
training steps until the last one evicted; the report gives, from the KV
tables' metrics, the train hit rate, new ids and evictions per step, the load
factor and the eval hit rate, so each stream shows the property it is named for.
``--profile`` adds where the KV step's time goes: by part (``benchmarks.breakdown``:
lookup, pooled forward, fused backward, other), by Python function and by op.

Run from the repository root::

    python -m benchmarks.matrix                                  # minutes (docs/benchmarks.md)
    python -m benchmarks.matrix --profile --out docs/bench_matrix.md --plots docs/plots
    python -m benchmarks.matrix --streams zipf1.2,capacity --quick
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from benchmarks import breakdown as bd
from benchmarks.common import (
    IdSampler,
    UniformIds,
    ZipfIds,
    add_config_flags,
    command_line,
    config_from_args,
    format_ratio,
    format_table,
    load_average,
    machine_line,
    markdown_table,
    profile_functions,
    set_threads,
    time_interleaved,
    write_markdown,
)
from benchmarks.ebc_train import (
    KV,
    QUICK,
    TBE,
    BenchConfig,
    SystemResult,
    _kv_counters,
    build_kv,
    build_tbe,
    kv_eval,
    kv_train,
    make_batches,
    steady_counters,
    tbe_eval,
    tbe_train,
)
from torchrec_kvemb.backend import implementation

#: Profiled calls per mode (functions, then parts and ops).
PROFILE_CALLS = 4
#: Most priming steps of an evicting stream (it stops at the first step that evicts
#: with the tables at least ``FULL`` full).
MAX_FILL_STEPS = 400
FULL = 0.9
#: Untimed train steps on fresh draws after the timed ones, each checked for evictions.
CHECK_STEPS = 4


@dataclass(frozen=True)
class Stream:
    """One id stream of the matrix and its targets (KV ids/s over TBE's)."""

    name: str
    what: str  # one line for the report
    alpha: float | None  # Zipf exponent; None: uniform
    id_range: int | None  # distinct ids drawn from; None: the config's rows
    capacity_divisor: int  # KV capacity and TBE rows: the config's rows / this
    train_target: float
    eval_target: float | None  # None: reported, no target
    fill: bool = False  # prime the KV tables until they evict
    repeats: int | None = None  # timed blocks (None: the config's)

    def ids(self, config: BenchConfig) -> int:
        return self.id_range or config.rows

    def capacity(self, config: BenchConfig) -> int:
        return max(1, config.rows // self.capacity_divisor)

    def hashed(self, config: BenchConfig) -> bool:
        """Whether TBE gets ``id % rows`` (more distinct ids than its rows)."""
        return self.ids(config) > self.capacity(config)

    def samplers(self, config: BenchConfig) -> list[IdSampler]:
        n = self.ids(config)
        if self.alpha is None:
            return [UniformIds(n, config.seed + t) for t in range(config.tables)]
        return [ZipfIds(n, self.alpha, config.seed + t) for t in range(config.tables)]


STREAMS: dict[str, Stream] = {
    s.name: s
    for s in (
        Stream("zipf1.05", "Zipf 1.05 over the table's rows", 1.05, None, 1, 0.8, 1.0),
        Stream("zipf1.2", "Zipf 1.2 over the table's rows", 1.2, None, 1, 0.7, None, repeats=5),
        Stream(
            "uniform100m",
            "uniform over 100,000,000 ids, KV capacity = TBE rows (TBE: id % rows)",
            None,
            100_000_000,
            1,
            0.7,
            None,
            fill=True,
            repeats=5,
        ),
        Stream(
            "capacity",
            "Zipf 1.05 over 10x the KV capacity, tables full (TBE: capacity rows, id % rows)",
            1.05,
            None,
            10,
            0.7,
            None,
            fill=True,
            repeats=5,
        ),
    )
}


@dataclass(frozen=True)
class StreamResult:
    """KV and TBE on one stream: timings, what the KV tables did, the profile."""

    stream: Stream
    config: BenchConfig  # rows = the KV capacity and TBE rows of this stream
    distinct_ids: int  # the id range the stream draws from
    tbe_hashed: bool  # TBE got id % rows
    results: tuple[SystemResult, ...]
    kv_steady: dict[str, float]
    prime_steps: int
    kv_path: str  # what ran the KV ops (``backend.implementation``): native or torch
    load: tuple[float, float]
    seconds: float
    breakdowns: tuple[bd.StepBreakdown, ...] = ()
    profiles: dict[str, str] = field(default_factory=dict)  # mode -> function + op tables

    def get(self, system: str, mode: str) -> SystemResult:
        for r in self.results:
            if r.system == system and r.mode == mode:
                return r
        raise KeyError(f"no result for {system} / {mode}")

    def ratio(self, mode: str) -> float:
        """KV's ids/s over TBE's in ``mode``."""
        return self.get(KV, mode).ids_per_s / self.get(TBE, mode).ids_per_s

    def target(self, mode: str) -> float | None:
        return self.stream.train_target if mode == "train" else self.stream.eval_target


# ------------------------------------------------------------------- run
def _hashed(batches: list[KeyedJaggedTensor], rows: int) -> list[KeyedJaggedTensor]:
    return [
        KeyedJaggedTensor(
            keys=b.keys(), values=b.values() % rows, lengths=b.lengths(), offsets=b.offsets()
        )
        for b in batches
    ]


def _fresh(config: BenchConfig, samplers: Sequence[IdSampler]) -> list[KeyedJaggedTensor]:
    """One batch of fresh draws from ``samplers``."""
    return make_batches(replace(config, prime=1, warmup=0, steps=0), samplers).prime


def _log(message: str, verbose: bool) -> None:
    if verbose:
        print(message, file=sys.stderr, flush=True)


def _profile(step: Callable[[int], object], start: int) -> tuple[dict, float, str]:
    """Function table, then parts, wall ms and op table, of ``PROFILE_CALLS`` calls each."""
    functions = profile_functions(lambda i: step(start + i), PROFILE_CALLS, "torchrec_kvemb")
    parts, wall_ms, ops = bd.profile_step(lambda i: step(start + PROFILE_CALLS + i), PROFILE_CALLS)
    text = (
        f"By torchrec_kvemb function (innermost on the stack, per step):\n{functions}\n\n"
        f"By torch op (torch.profiler, per step):\n{ops}"
    )
    return parts, wall_ms, text


def run_stream(
    stream: Stream, base: BenchConfig, profile: bool = False, verbose: bool = True
) -> StreamResult:
    """Build KV and TBE for ``stream`` at ``base``'s sizes, prime, time train then eval."""
    config = replace(
        base,
        rows=stream.capacity(base),
        spread=False,
        repeats=min(stream.repeats or base.repeats, base.repeats),
    )
    previous = set_threads(config.threads)
    try:
        return _run_stream(stream, base, config, profile, verbose)
    finally:
        torch.set_num_threads(previous)


def _run_stream(
    stream: Stream, base: BenchConfig, config: BenchConfig, profile: bool, verbose: bool
) -> StreamResult:
    begin = time.perf_counter()
    load_at_start = load_average()
    kv_path = implementation("cpu")
    samplers = stream.samplers(base)
    kv_batches = make_batches(config, samplers)
    tbe_batches = kv_batches
    if stream.hashed(base):
        tbe_batches = replace(
            kv_batches,
            prime=_hashed(kv_batches.prime, config.rows),
            timed=_hashed(kv_batches.timed, config.rows),
            held_out=_hashed(kv_batches.held_out, config.rows),
        )
    kv = build_kv(config, stream.ids(base))
    tbe = build_tbe(config)
    _log(f"[{stream.name}] built inputs and systems in {time.perf_counter() - begin:.1f}s", verbose)

    prime_kv = kv_train(kv, kv_batches.prime, kv_batches.grad)
    prime_tbe = tbe_train(tbe, tbe_batches.prime, tbe_batches.grad)
    for i in range(config.prime):
        prime_kv(i)
        prime_tbe(i)
    primed = config.prime
    if stream.fill:
        # Fill the tables: each step's ids are fresh draws (new ids keep arriving).
        while primed < MAX_FILL_STEPS:
            before = _kv_counters(kv)
            kv_train(kv, _fresh(config, samplers), kv_batches.grad)(0)
            primed += 1
            after = _kv_counters(kv)
            full = after["size"] >= FULL * after["capacity"]
            if full and after["evictions"] > before["evictions"]:
                break
    _log(f"[{stream.name}] primed with {primed} train steps", verbose)

    train_steps = {
        KV: kv_train(kv, kv_batches.timed, kv_batches.grad),
        TBE: tbe_train(tbe, tbe_batches.timed, tbe_batches.grad),
    }
    before = _kv_counters(kv)
    train = time_interleaved(train_steps, config.steps, config.repeats, config.warmup)
    after = _kv_counters(kv)
    train_start = config.warmup + config.steps * config.repeats
    evicting = 0
    for _ in range(CHECK_STEPS):
        check = _kv_counters(kv)["evictions"]
        kv_train(kv, _fresh(config, samplers), kv_batches.grad)(0)
        evicting += _kv_counters(kv)["evictions"] > check

    kv.eval()
    eval_steps = {KV: kv_eval(kv, kv_batches.held_out), TBE: tbe_eval(tbe, tbe_batches.held_out)}
    eval_before = _kv_counters(kv)
    evaluation = time_interleaved(eval_steps, config.steps, config.repeats, config.warmup)
    eval_after = _kv_counters(kv)
    steady = steady_counters(before, after, eval_before, eval_after, config.timed_batches)
    steady["evicting_steps"] = evicting
    _log(f"[{stream.name}] timed train and eval ({time.perf_counter() - begin:.0f}s)", verbose)

    results = []
    for mode, timings in (("train", train), ("eval", evaluation)):
        for name, timing in timings.items():
            ids_per_s = config.ids_per_step / timing.median_s
            results.append(
                SystemResult(
                    name, mode, 1e3 * timing.median_s, 1e3 * timing.best_s, ids_per_s,
                    ids_per_s * config.dim * 4 / 1e9,
                )
            )  # fmt: skip

    breakdowns, profiles = [], {}
    if profile:
        modes = (("train", train_steps, train), ("eval", eval_steps, evaluation))
        for mode, steps, timings in modes:
            kv.train(mode == "train")
            parts, wall_ms, profiles[mode] = _profile(steps[KV], train_start)
            kv_ms, tbe_ms = 1e3 * timings[KV].median_s, 1e3 * timings[TBE].median_s
            breakdowns.append(bd.breakdown(mode, parts, wall_ms, kv_ms, tbe_ms))
    return StreamResult(
        stream, config, stream.ids(base), stream.hashed(base), tuple(results), steady, primed,
        kv_path, (load_at_start, load_average()),
        time.perf_counter() - begin, tuple(breakdowns), profiles,
    )  # fmt: skip


def run(
    streams: Sequence[str], config: BenchConfig, profile: bool = False, verbose: bool = True
) -> list[StreamResult]:
    """Each stream in turn (tables built and freed one stream at a time)."""
    return [run_stream(STREAMS[name], config, profile, verbose) for name in streams]


# ---------------------------------------------------------------- report
def describe_stream(result: StreamResult) -> str:
    c, s = result.config, result.stream
    tbe_ids = "id % rows" if result.tbe_hashed else "ids"
    return (
        f"{s.name}: {s.what}; {c.tables} tables x dim {c.dim}, KV capacity {c.rows:,} per "
        f"table, ids from {result.distinct_ids:,}, "
        f"TBE {c.rows:,} rows ({tbe_ids}); batch {c.batch} x {c.bag} ids/bag (SUM), "
        f"{c.ids_per_step:,} ids/step; median of {c.repeats} blocks x {c.steps} steps "
        f"after {result.prime_steps} priming steps; KV ops: {result.kv_path}"
    )


RATIO_HEADERS = (
    "stream", "mode", "KV ms/step", "TBE ms/step", "KV M ids/s", "TBE M ids/s", "KV / TBE",
    "target", "",
)  # fmt: skip
STREAM_HEADERS = (
    "stream", "KV capacity", "distinct ids", "TBE ids", "train hit rate", "new ids/step",
    "evictions/step", "evicting steps", "load factor", "eval hit rate", "primed",
)  # fmt: skip


def ratio_rows(results: Sequence[StreamResult]) -> list[tuple]:
    rows = []
    for r in results:
        for mode in ("train", "eval"):
            kv, tbe, target = r.get(KV, mode), r.get(TBE, mode), r.target(mode)
            value = r.ratio(mode)
            verdict = "" if target is None else ("met" if value >= target else "MISSED")
            rows.append(
                (
                    r.stream.name, mode, f"{kv.ms_per_step:.1f}", f"{tbe.ms_per_step:.1f}",
                    f"{kv.ids_per_s / 1e6:.2f}", f"{tbe.ids_per_s / 1e6:.2f}",
                    format_ratio(value), "-" if target is None else f">= {target:g}x", verdict,
                )
            )  # fmt: skip
    return rows


def stream_rows(results: Sequence[StreamResult]) -> list[tuple]:
    rows = []
    for r in results:
        s = r.kv_steady
        rows.append(
            (
                r.stream.name, f"{r.config.rows:,}", f"{r.distinct_ids:,}",
                "id % rows" if r.tbe_hashed else "ids",
                f"{100 * s['hit_rate']:.1f}%", f"{s['new_ids_per_step']:,.0f}",
                f"{s['evictions_per_step']:,.0f}", f"{s['evicting_steps']:.0f}/{CHECK_STEPS}",
                f"{s['load_factor']:.3f}",
                f"{100 * s['eval_hit_rate']:.1f}%", str(r.prime_steps),
            )
        )  # fmt: skip
    return rows


def _loads(results: Sequence[StreamResult]) -> tuple[float, float]:
    return results[0].load[0], results[-1].load[1]


def report(results: Sequence[StreamResult]) -> str:
    parts = [
        machine_line(_loads(results)),
        "\n".join(describe_stream(r) for r in results),
        format_table(RATIO_HEADERS, ratio_rows(results)),
        "KV tables (all tables, per timed train step; evicting steps: of the untimed fresh "
        "steps after them):\n" + format_table(STREAM_HEADERS, stream_rows(results)),
    ]
    for r in results:
        if r.breakdowns:
            parts.append(
                f"[{r.stream.name}] KV step by part (ms):\n" + format_table(*bd.table(r.breakdowns))
            )
            parts += [
                f"[{r.stream.name}] KV {mode} step\n{text}" for mode, text in r.profiles.items()
            ]
    return "\n\n".join(parts)


def write_report(results: Sequence[StreamResult], path: str, command: str) -> None:
    sections = [
        f"`{command}`",
        machine_line(_loads(results)) + ".",
        "\n".join(f"* {describe_stream(r)}." for r in results),
        markdown_table(RATIO_HEADERS, ratio_rows(results)),
        "What the KV tables did (all tables; per timed train step; `evicting steps`: how "
        f"many of {CHECK_STEPS} untimed train steps on fresh draws after the timed ones "
        "evicted):",
        markdown_table(STREAM_HEADERS, stream_rows(results)),
        "Train: forward + backward with fused EXACT_ROWWISE_ADAGRAD (both systems). Eval: "
        "forward under `torch.no_grad()` (KV in `.eval()`) on held-out batches of the same "
        "stream. KV and TBE take turns block by block on the same batches; compare ratios "
        "within a run.",
    ]
    for r in results:
        if not r.breakdowns:
            continue
        headers, rows = bd.table(r.breakdowns)
        sections.append(f"## Where the KV step's time goes: {r.stream.name}")
        sections.append(
            "Parts from `torch.profiler` (each `kvemb::` op with what it calls); `other` is "
            "the rest of the step's wall time (Python, checks, bookkeeping, autograd):"
        )
        sections.append(markdown_table(headers, rows))
        for mode, text in r.profiles.items():
            sections.append(f"KV {mode} step:\n\n```\n{text}\n```")
    write_markdown(path, "Benchmark matrix: KV EBC vs FBGEMM TBE (CPU)", sections)


# ------------------------------------------------------------------ plots
def plot(results: Sequence[StreamResult], path: str | Path) -> Path:
    """KV / TBE per stream, train and eval side by side, targets as dashed marks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = 0.38
    fig, ax = plt.subplots(figsize=(7.0, 4.0))
    labelled = False
    for i, mode in enumerate(("train", "eval")):
        xs = [k + (i - 0.5) * width for k in range(len(results))]
        values = [r.ratio(mode) for r in results]
        bars = ax.bar(xs, values, width, label=mode)
        ax.bar_label(bars, labels=[format_ratio(v) for v in values], fontsize=8)
        for x, r in zip(xs, results, strict=True):
            target = r.target(mode)
            if target is not None:
                ax.hlines(target, x - width / 2, x + width / 2, colors="black", linestyles="--",
                          label=None if labelled else "target")  # fmt: skip
                labelled = True
    ax.set_xticks(range(len(results)))
    ax.set_xticklabels([r.stream.name for r in results])
    ax.set_ylabel("KV / TBE (ids/s)")
    ax.set_title("Benchmark matrix: KV EBC over FBGEMM TBE per id stream")
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plots(results: Sequence[StreamResult], plot_dir: str | Path) -> list[Path]:
    """``matrix.png`` and, where the Zipf 1.05 stream ran with ``profile``,
    ``step_breakdown.png``: its KV steps by part beside the kept "before" run
    (``breakdown.BEFORE_JSON``)."""
    plot_dir = Path(plot_dir)
    paths = [plot(results, plot_dir / "matrix.png")]
    zipf = next((r for r in results if r.stream.name == "zipf1.05" and r.breakdowns), None)
    if zipf is not None:
        after = bd.record(zipf.breakdowns, describe_stream(zipf), zipf.load, "after")
        after["steps"] = list(zipf.breakdowns)
        runs = [after]
        if bd.BEFORE_JSON.exists():
            runs.insert(0, bd.load_record(bd.BEFORE_JSON))
        paths.append(bd.plot(runs, plot_dir / "step_breakdown.png"))
    return paths


# -------------------------------------------------------------------- CLI
def parse_args(argv: Sequence[str] | None) -> tuple[BenchConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--streams", default=",".join(STREAMS), help="comma-separated streams")
    parser.add_argument("--profile", action="store_true", help="also profile each KV step")
    parser.add_argument("--out", help="also write a markdown report to this path")
    parser.add_argument("--plots", help="also write matrix.png (and step_breakdown.png) here")
    names = add_config_flags(parser, BenchConfig, skip=("spread", "alpha", "mch_eviction_interval"))
    args = parser.parse_args(argv)
    chosen = [s.strip() for s in args.streams.split(",") if s.strip()]
    unknown = sorted(set(chosen) - set(STREAMS))
    if unknown or not chosen:
        parser.error(f"--streams: unknown {unknown}; choose from {','.join(STREAMS)}")
    args.streams = chosen
    config = config_from_args(args, QUICK if args.quick else BenchConfig(), names)
    return config, args


def main(argv: Sequence[str] | None = None) -> list[StreamResult]:
    """Run the chosen streams, print the tables; returns the results."""
    config, args = parse_args(argv)
    results = run(args.streams, config, args.profile)
    print(report(results))
    if args.out:
        write_report(results, args.out, command_line("benchmarks.matrix", argv))
        print(f"\nwrote {args.out}")
    if args.plots:
        print(f"wrote {', '.join(str(p) for p in plots(results, args.plots))}")
    return results


if __name__ == "__main__":
    main()
