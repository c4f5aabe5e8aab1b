"""The whole benchmark suite in one command: one table of ratios, a markdown file, plots.

Runs, in turn, each benchmark module's ``main``:

* ``ebc``: KV EBC train/eval vs FBGEMM's TBE and TorchRec's MCH (``benchmarks.ebc_train``);
* ``matrix``: KV EBC train/eval vs FBGEMM's TBE on four id streams (Zipf 1.05,
  Zipf 1.2, uniform over 100M ids, tables at capacity evicting every step), each
  KV step profiled (``benchmarks.matrix --profile``): ``bench_matrix.md``,
  ``plots/matrix.png``, and ``plots/step_breakdown.png`` (the Zipf 1.05 step by
  part beside ``benchmarks/data/breakdown_before.json``, ``benchmarks.breakdown``);
* ``ec``: KV sequence lookups (``KVEmbeddingCollection``) train/eval vs TorchRec's
  ``EmbeddingCollection`` and FBGEMM's sequence TBE (``benchmarks.ec_train``);
* ``precision``: KV EBC training with float16 / bfloat16 rows vs float32 rows, and
  the bytes per row (``benchmarks.precision``);
* ``dist``: distributed train step, KV row-wise vs stock table-wise
  (``benchmarks.dist_train``, which launches its own ``torchrun`` job);
* ``dist_plans``: KV column-wise (2 ranks) and table-row-wise (4 processes as
  2 nodes x 2) vs the stock tables under the same plans (``benchmarks.dist_cw``,
  ``benchmarks.dist_twrw``, each a ``torchrun`` job);
* ``ssd``: a tenth of the ids in memory with the SSD tier vs all in memory
  (``benchmarks.ssd_tier``; and for 4 such tables, each system timed on its own:
  ``--tables 4 --sequential``);
* ``host``: a tenth of the ids in the table over a host-memory tier vs all in
  memory, and the same over a bounded host tier over an SSD tier
  (``benchmarks.host_tier``);
* ``growth``: the growth phase of tables that start at 1/64 of their capacity vs
  tables built at capacity, same batches, and the memory at the end
  (``benchmarks.growth``);
* ``checkpoint``: checkpoint save/load vs the disk's sequential rates, and
  training steps with an asynchronous save in flight vs none (unpaced, and its
  writes capped at 50 MB/s) (``benchmarks.checkpoint``);
* ``soak``: a table at capacity over an SSD tier under constant churn, at the
  short setting (``benchmarks.soak --quick``; its full setting is 20,000
  steps): RSS, slab size, load factors, zero rows lost; ``plots/soak.png``.

It collects each one's headline ratios and targets into one table, prints it
at the end, and writes ``<out-dir>/benchmark-results.md`` (the table, the
machine, the date, the command) and bar plots in ``<out-dir>/plots/``.

Run from the repository root::

    python -m benchmarks.run                       # full sizes, writes docs/
    python -m benchmarks.run --quick --out-dir /tmp/bench
    python -m benchmarks.run --only ebc,ssd

``--gpu`` runs the GPU part instead (``benchmarks.gpu_kernels``, ``make bench-gpu``):
the Triton kernels and the KV EBC against torch's ``EmbeddingBag`` and a stock
``EmbeddingBagCollection`` on the device (and FBGEMM's fused tables where they
run), ids/s and GB/s against the device's copy bandwidth, named with the device.
It writes ``<out-dir>/benchmark-results-gpu.md`` and ``plots/gpu_*.png``, and
needs a CUDA device (exit status 2 otherwise).
``--gpu --device cpu`` (with ``TRITON_INTERPRET=1``) is the harness's smoke test.
"""

from __future__ import annotations

import argparse
import datetime
import math
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from benchmarks.common import format_ratio, format_table, machine_summary, markdown_table

#: Tables of the SSD tier's several-table figure (``ssd_tier --tables 4 --sequential``).
SSD_TABLES = 4
BENCHMARKS = (
    "ebc", "matrix", "ec", "precision", "dist", "dist_plans", "ssd", "host", "growth",
    "checkpoint", "soak",
)  # fmt: skip
RESULTS_FILE = "benchmark-results.md"
MATRIX_FILE = "bench_matrix.md"
#: The float16 / bfloat16 rows' train target, over float32 rows.
PRECISION_TARGET = 1.0
GPU_RESULTS_FILE = "benchmark-results-gpu.md"
HEADERS = ("benchmark", "ratio", "KV", "baseline", "value", "target", "")


@dataclass(frozen=True)
class Row:
    """One headline ratio: ``kv`` over ``baseline`` (both in ``unit``), and its target."""

    benchmark: str
    what: str
    kv: float
    baseline: float
    unit: str
    target: float | None  # None: reported, no target

    @property
    def ratio(self) -> float:
        return self.kv / self.baseline if self.baseline > 0 else float("nan")

    @property
    def verdict(self) -> str:
        if self.target is None:
            return ""
        return "met" if self.ratio >= self.target else "MISSED"

    def cells(self) -> tuple[str, ...]:
        return (
            self.benchmark,
            self.what,
            _amount(self.kv, self.unit),
            _amount(self.baseline, self.unit),
            format_ratio(self.ratio),
            "-" if self.target is None else f">= {self.target:g}x",
            self.verdict,
        )


def _amount(value: float, unit: str) -> str:
    return f"{value:.3f} {unit}" if value < 0.1 else f"{value:.2f} {unit}"


# ------------------------------------------------------------ the benchmarks
def run_ebc(quick: bool, extra: Sequence[str] = ()) -> tuple[list[Row], object]:
    from benchmarks import ebc_train

    result = ebc_train.main([*(["--quick"] if quick else []), "--no-spread", *extra])
    rows = []
    for target in ebc_train.TARGETS:
        kv = result.get(ebc_train.KV, target.mode).ids_per_s / 1e6
        base = result.get(target.baseline, target.mode).ids_per_s / 1e6
        what = f"KV / {target.baseline} {target.mode}"
        rows.append(Row("ebc", what, kv, base, "M ids/s", target.minimum))
    return rows, result


def run_matrix(quick: bool) -> tuple[list[Row], object]:
    from benchmarks import ebc_train, matrix

    results = matrix.main([*(["--quick"] if quick else []), "--profile"])
    rows = []
    for r in results:
        for mode in ("train", "eval"):
            kv, tbe = r.get(ebc_train.KV, mode), r.get(ebc_train.TBE, mode)
            rows.append(
                Row("matrix", f"{r.stream.name}: KV / TBE {mode}", kv.ids_per_s / 1e6,
                    tbe.ids_per_s / 1e6, "M ids/s", r.target(mode))
            )  # fmt: skip
    return rows, results


def run_ec(quick: bool) -> tuple[list[Row], object]:
    from benchmarks import ec_train

    result = ec_train.main(["--quick"] if quick else [])
    rows = []
    for target in ec_train.TARGETS + ec_train.REPORTED:
        kv = result.ids_per_s(ec_train.KV, target.mode) / 1e6
        base = result.ids_per_s(target.baseline, target.mode) / 1e6
        what = f"KV / {target.baseline} {target.mode}"
        rows.append(Row("ec", what, kv, base, "M ids/s", target.minimum or None))
    return rows, result


def run_precision(quick: bool) -> tuple[list[Row], object]:
    from benchmarks import precision

    result = precision.main(["--quick"] if quick else [])
    rows = []
    for name in ("float16", "bfloat16"):
        kv = result.ids_per_s(name) / 1e6
        base = result.ids_per_s("float32") / 1e6
        rows.append(
            Row("precision", f"KV {name} / float32 train", kv, base, "M ids/s", PRECISION_TARGET)
        )
        per_row = f"KV {name} / float32 bytes per row"
        rows.append(
            Row("precision", per_row, result.bytes_per_row[name],
                result.bytes_per_row["float32"], "B", None)
        )  # fmt: skip
    return rows, result


def run_dist(quick: bool) -> tuple[list[Row], object]:
    from benchmarks import dist_train

    result = dist_train.main(["--quick"] if quick else [])
    base = result.get(dist_train.TBE).ids_per_s / 1e6
    rows = [
        Row(
            "dist",
            f"{dist_train.KV} / {dist_train.TBE}",
            result.get(dist_train.KV).ids_per_s / 1e6,
            base,
            "M ids/s",
            dist_train.TARGET,
        ),
        Row(
            "dist",
            f"{dist_train.KV_TW} / {dist_train.TBE}",
            result.get(dist_train.KV_TW).ids_per_s / 1e6,
            base,
            "M ids/s",
            None,
        ),
        Row(
            "dist",
            f"{dist_train.KV_DEDUP} / {dist_train.KV}",
            result.get(dist_train.KV_DEDUP).ids_per_s / 1e6,
            result.get(dist_train.KV).ids_per_s / 1e6,
            "M ids/s",
            None,
        ),
    ]
    return rows, result


def run_dist_plans(quick: bool) -> tuple[list[Row], object]:
    """Column-wise (2 ranks) and table-row-wise (4 processes as 2 nodes x 2) KV
    tables against the stock tables under the same plans (no target)."""
    from benchmarks import dist_cw, dist_twrw

    flags = ["--quick"] if quick else []
    results = {"cw": dist_cw.main(flags), "twrw": dist_twrw.main(flags)}
    rows = [
        Row(
            "dist",
            f"{module.KV} / {module.TBE}",
            results[key].get(module.KV).ids_per_s / 1e6,
            results[key].get(module.TBE).ids_per_s / 1e6,
            "M ids/s",
            None,
        )
        for key, module in (("cw", dist_cw), ("twrw", dist_twrw))
    ]
    return rows, results


def run_ssd(quick: bool) -> tuple[list[Row], object]:
    from benchmarks import ssd_tier

    result = ssd_tier.main(["--quick"] if quick else [])
    rates = {r.system: r.ids_per_s / 1e6 for r in result.train}
    full = rates[ssd_tier.FULL]
    rows = [
        Row("ssd", f"{ssd_tier.SSD} / {ssd_tier.FULL}", rates[ssd_tier.SSD], full, "M ids/s",
            ssd_tier.TARGET),
    ]  # fmt: skip
    if ssd_tier.NO_SSD in rates:
        rows.append(
            Row("ssd", f"{ssd_tier.NO_SSD} / {ssd_tier.FULL}", rates[ssd_tier.NO_SSD], full,
                "M ids/s", None)
        )  # fmt: skip
    # Several tables with SSD tiers (one group), each system timed on its own.
    config = replace(ssd_tier.QUICK if quick else ssd_tier.BenchConfig(), tables=SSD_TABLES)
    ms = ssd_tier.sequential(config)
    ids = config.ids_per_step / 1e3  # M ids per ms
    rows.append(
        Row("ssd", f"{SSD_TABLES} tables: {ssd_tier.SSD} / {ssd_tier.FULL}, sequential",
            ids / ms[ssd_tier.SSD], ids / ms[ssd_tier.FULL], "M ids/s", None)
    )  # fmt: skip
    return rows, result


def run_checkpoint(quick: bool) -> tuple[list[Row], object]:
    from benchmarks import checkpoint

    result = checkpoint.main(["--quick"] if quick else [])
    rows = [
        Row("checkpoint", f"{what} / {disk}", result.rate(what), result.rate(disk), "GB/s",
            checkpoint.TARGETS[what])
        for what, disk in (("save", "disk write"), ("load", "disk read"))
    ]  # fmt: skip
    rows.append(
        Row("checkpoint", "train steps: async save in flight / none",
            result.steps_per_s("in flight"), result.steps_per_s("none"), "steps/s",
            checkpoint.ASYNC_TARGET)
    )  # fmt: skip
    if "paced" in result.steps:
        rows.append(
            Row("checkpoint",
                f"train steps: async save at {result.config.async_rate:g} MB/s in flight / none",
                result.steps_per_s("paced"), result.steps_per_s("none (paced)"), "steps/s",
                checkpoint.ASYNC_TARGET)
        )  # fmt: skip
    return rows, result


def run_host(quick: bool) -> tuple[list[Row], object]:
    from benchmarks import host_tier

    result = host_tier.main(["--quick"] if quick else [])
    rates = {r.system: r.ids_per_s / 1e6 for r in result.train}
    full = rates[host_tier.FULL]
    rows = [
        Row("host", f"{host_tier.HOST} / {host_tier.FULL} train", rates[host_tier.HOST], full,
            "M ids/s", host_tier.TARGET),
        Row("host", f"{host_tier.HOST_SSD} / {host_tier.FULL} train", rates[host_tier.HOST_SSD],
            full, "M ids/s", None),
    ]  # fmt: skip
    return rows, result


def run_growth(quick: bool) -> tuple[list[Row], object]:
    from benchmarks import growth

    result = growth.main(["--quick"] if quick else [])
    fixed, grown = growth.FIXED, growth.GROWN
    rows = [
        Row("growth", f"{grown} / {fixed} train", result.ids_per_s(grown) / 1e6,
            result.ids_per_s(fixed) / 1e6, "M ids/s", growth.TARGET),
        Row("growth", f"{grown} / {fixed} memory at end", result.memory_end[grown] / 1e6,
            result.memory_end[fixed] / 1e6, "MB", None),
    ]  # fmt: skip
    return rows, result


def run_soak(quick: bool) -> tuple[list[Row], object]:
    from benchmarks import soak

    result = soak.main(["--quick", *(["--steps", "300"] if quick else [])])
    warm = [
        s
        for s in result.samples
        if s["step"] >= result.config.warmup_fraction * result.config.steps
    ]
    slab = max(s["slab_mb"] for s in result.samples)
    rows = [
        Row("soak", "RSS at end / after warm-up", warm[-1]["rss_mb"], warm[0]["rss_mb"], "MiB",
            None),
        Row("soak", "slab file max / bound", slab, result.slab_bound_bytes / 2**20, "MiB", None),
    ]  # fmt: skip
    failed = [name for name, (passed, _) in result.checks.items() if not passed]
    print(f"soak checks: {'all met' if not failed else 'MISSED ' + ', '.join(failed)}")
    return rows, result


def run_gpu(quick: bool, device: str) -> tuple[list[Row], object]:
    from benchmarks import gpu_kernels

    result = gpu_kernels.main(["--device", device, *(["--quick"] if quick else [])])
    rows = [
        Row("gpu", r.what, r.kv.items_per_s / 1e6, r.baseline.items_per_s / 1e6, "M ids/s",
            r.target)
        for r in gpu_kernels.ratios(result)
    ]  # fmt: skip
    copy = result.copy.gb_per_s
    rows += [
        Row("gpu", f"{name} / copy", result.get("kernels", name, gpu_kernels.KV).gb_per_s, copy,
            "GB/s", None)
        for name in gpu_kernels.KERNELS
    ]  # fmt: skip
    return rows, result


RUNNERS: dict[str, Callable[[bool], tuple[list[Row], object]]] = {
    "ebc": run_ebc,
    "matrix": run_matrix,
    "ec": run_ec,
    "precision": run_precision,
    "dist": run_dist,
    "dist_plans": run_dist_plans,
    "ssd": run_ssd,
    "host": run_host,
    "growth": run_growth,
    "checkpoint": run_checkpoint,
    "soak": run_soak,
}


# ------------------------------------------------------------------- plots
def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_ratios(rows: Sequence[Row], path: Path) -> Path:
    """A bar per ratio, the target as a marker line across its bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {
        "ebc": "tab:blue",
        "matrix": "tab:cyan",
        "ec": "tab:olive",
        "precision": "tab:pink",
        "dist": "tab:orange",
        "ssd": "tab:green",
        "checkpoint": "tab:red",
        "soak": "tab:brown",
        "gpu": "tab:purple",
    }
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(rows) + 2), 4.5))
    xs = range(len(rows))
    values = [0.0 if math.isnan(r.ratio) else r.ratio for r in rows]
    ax.bar(xs, values, color=[colors.get(r.benchmark, "tab:gray") for r in rows])
    labelled = False
    for x, row in zip(xs, rows, strict=True):
        if row.target is not None:
            ax.hlines(row.target, x - 0.45, x + 0.45, colors="black", linestyles="--",
                      label=None if labelled else "target")  # fmt: skip
            labelled = True
        ax.text(x, values[x], format_ratio(row.ratio), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"{r.benchmark}\n{r.what}" for r in rows], rotation=30, ha="right",
                       fontsize=7)  # fmt: skip
    ax.set_ylabel("KV / baseline (x)")
    ax.set_title("Headline ratios (bar) and targets (dashed)")
    if labelled:
        ax.legend(loc="upper right")
    return _save(fig, path)


def plot_ebc_throughput(result, path: Path) -> Path:
    """M ids/s per system, train and eval side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = list(dict.fromkeys(r.system for r in result.results))
    modes = ("train", "eval")
    width = 0.38
    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    for i, mode in enumerate(modes):
        values = [result.get(s, mode).ids_per_s / 1e6 for s in systems]
        xs = [k + (i - 0.5) * width for k in range(len(systems))]
        bars = ax.bar(xs, values, width, label=mode)
        ax.bar_label(bars, fmt="%.2f", fontsize=8)
    ax.set_xticks(range(len(systems)))
    ax.set_xticklabels(systems)
    ax.set_ylabel("M ids/s")
    ax.set_title("EBC throughput per system")
    ax.legend()
    return _save(fig, path)


def matrix_outputs(results, out_dir: Path, command: str) -> list[Path]:
    """The matrix's markdown report and its plots (``matrix.plots``)."""
    from benchmarks import matrix

    matrix.write_report(results, str(out_dir / MATRIX_FILE), f"{command} (its matrix part)")
    return matrix.plots(results, out_dir / "plots")


def plot_gpu_bandwidth(result, path: Path) -> Path:
    """GB/s per Triton kernel, the device's copy bandwidth as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from benchmarks import gpu_kernels

    names = list(gpu_kernels.KERNELS)
    values = [result.get("kernels", n, gpu_kernels.KV).gb_per_s for n in names]
    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    bars = ax.bar(range(len(names)), values, color="tab:purple")
    ax.bar_label(bars, fmt="%.3g", fontsize=8)
    ax.axhline(result.copy.gb_per_s, color="black", linestyle="--", label="copy bandwidth")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=20, ha="right")
    ax.set_ylabel("GB/s (bytes moved at least)")
    ax.set_title(f"Triton kernels on {result.device.split(' (')[0]}", fontsize=9)
    ax.legend(loc="upper right")
    return _save(fig, path)


# ------------------------------------------------------------------ report
def write_results(
    rows: Sequence[Row],
    out_dir: Path,
    command: str,
    plots: Sequence[Path],
    seconds: float,
    machine: str | None = None,
    filename: str = RESULTS_FILE,
    reports: Sequence[str] = (),
) -> Path:
    """The results markdown: the table, the machine, the command, links to the
    detailed ``reports`` (file names in ``out_dir``) and the plots."""
    path = out_dir / filename
    path.parent.mkdir(parents=True, exist_ok=True)
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Benchmark results" + (" (GPU)" if filename == GPU_RESULTS_FILE else ""),
        "",
        f"Generated by `{command}` on {date} ({seconds:.0f} s).  ",
        f"Machine: {machine or machine_summary()}.",
        "",
        markdown_table(HEADERS, [r.cells() for r in rows]),
        "",
        "Ratio = KV's figure over the baseline's, from one run (systems take turns on "
        "the same inputs; compare ratios, not absolute figures, across machines).",
    ]
    if reports:
        lines += ["", "Detailed reports: " + ", ".join(f"[{r}]({r})" for r in reports) + "."]
    if plots:
        lines += ["", "## Plots", ""]
        lines += [f"![{p.stem}](plots/{p.name})" for p in plots]
    path.write_text("\n".join(lines) + "\n")
    return path


# --------------------------------------------------------------------- CLI
def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke-test sizes")
    parser.add_argument(
        "--only",
        default=",".join(BENCHMARKS),
        help=f"comma-separated subset of {','.join(BENCHMARKS)}",
    )
    parser.add_argument("--out-dir", default="docs", help="where the markdown and plots go")
    parser.add_argument(
        "--gpu",
        action="store_true",
        help="the GPU part instead: Triton kernels and KV EBC vs torch's on the device",
    )
    parser.add_argument(
        "--device",
        default="cuda",
        help="with --gpu: cuda (default), or cpu with TRITON_INTERPRET=1 for a smoke test",
    )
    args = parser.parse_args(argv)
    chosen = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(BENCHMARKS))
    if unknown or not chosen:
        parser.error(f"--only: unknown benchmark(s) {unknown}; choose from {BENCHMARKS}")
    args.only = [name for name in BENCHMARKS if name in chosen]
    return args


def main(argv: Sequence[str] | None = None) -> list[Row]:
    args = parse_args(argv)
    argv_list = list(sys.argv[1:] if argv is None else argv)
    command = " ".join(["python -m benchmarks.run", *argv_list])
    out_dir = Path(args.out_dir)
    if args.gpu:
        return main_gpu(args, command, out_dir)

    start = time.perf_counter()
    rows: list[Row] = []
    results: dict[str, object] = {}
    for name in args.only:
        print(f"\n=== {name} ===", flush=True)
        new_rows, result = RUNNERS[name](args.quick)
        rows += new_rows
        results[name] = result
    seconds = time.perf_counter() - start

    plots = [plot_ratios(rows, out_dir / "plots" / "ratios.png")]
    if "ebc" in results:
        plots.append(plot_ebc_throughput(results["ebc"], out_dir / "plots" / "ebc_throughput.png"))
    if "matrix" in results:
        plots += matrix_outputs(results["matrix"], out_dir, command)
    if "soak" in results:
        from benchmarks import soak

        plots.append(Path(soak.plot(results["soak"], str(out_dir / "plots" / "soak.png"))))
    reports = [MATRIX_FILE] if "matrix" in results else []
    path = write_results(rows, out_dir, command, plots, seconds, reports=reports)

    print(f"\n=== summary ({seconds:.0f} s) ===")
    print(machine_summary())
    print(format_table(HEADERS, [r.cells() for r in rows]))
    print(f"\nwrote {path} and {', '.join(str(p) for p in plots)}")
    return rows


def main_gpu(args: argparse.Namespace, command: str, out_dir: Path) -> list[Row]:
    """``--gpu``: the GPU part alone, its own results file and plots."""
    from benchmarks import gpu_kernels

    gpu_kernels.check_device(args.device)  # exit 2 before anything is written
    start = time.perf_counter()
    print("\n=== gpu ===", flush=True)
    rows, result = run_gpu(args.quick, args.device)
    seconds = time.perf_counter() - start
    plots = [
        plot_ratios(rows, out_dir / "plots" / "gpu_ratios.png"),
        plot_gpu_bandwidth(result, out_dir / "plots" / "gpu_bandwidth.png"),
    ]
    machine = f"{result.device}; copy bandwidth {result.copy.gb_per_s:.1f} GB/s"
    path = write_results(rows, out_dir, command, plots, seconds, machine, GPU_RESULTS_FILE)
    print(f"\n=== summary ({seconds:.0f} s) ===")
    print(machine)
    print(format_table(HEADERS, [r.cells() for r in rows]))
    print(f"\nwrote {path} and {', '.join(str(p) for p in plots)}")
    return rows


if __name__ == "__main__":
    main()
