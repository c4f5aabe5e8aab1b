"""Where a KV EBC step's time goes: lookup, pooled forward, fused backward, the rest.

A KV train step is one id -> slot call for the group (``kvemb::lookup_train_group``:
find-or-insert), one pooled forward (``kvemb::pooled_forward``) and one fused
backward with the optimizer (``kvemb::fused_backward``); an eval step is one probe
(``kvemb::lookup_eval_group``) and one pooled forward. ``kernel_times`` charges the
outermost ``kvemb::`` ops of a step to those parts from ``torch.profiler`` (each
op with everything it calls); ``StepBreakdown.other_ms`` is the rest of the
same profiled steps' wall time: Python, input checks, bag bookkeeping,
autograd (and the profiler's own cost, a few microseconds an op). The ratio to
TBE's whole step comes from the interleaved timing of the same run.

``plot`` draws the parts as stacked bars, train and eval, this run beside a
run kept as JSON (``benchmarks/data/breakdown_before.json``: the code at commit
dc59116, before the work of issue 24), each with its TBE step.

Run from the repository root (the Zipf 1.05 stream of ``benchmarks.matrix``)::

    python -m benchmarks.breakdown                       # prints the breakdown, writes the plot
    python -m benchmarks.breakdown --json out.json       # also keeps this run's figures
    python -m benchmarks.breakdown --locality            # also stock eval, packed vs scattered
    python -m benchmarks.breakdown --quick --plot /tmp/b.png

The kept "before" run is this ``benchmarks/`` against an older package: copy
``benchmarks/`` to a directory of its own and run it there with that package
first on ``PYTHONPATH`` (docs/benchmarks.md gives the commands).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from benchmarks.common import (
    ZipfIds,
    format_ratio,
    format_table,
    load_average,
    machine_summary,
    ops_table,
    set_threads,
    time_interleaved,
)

#: The parts of a step, in the order the plot stacks them. ``probe + pool``: an op
#: that probes and pools in one pass (``kvemb::pooled_eval_group``), not split.
PARTS = ("lookup", "probe + pool", "pooled forward", "fused backward", "other")
BEFORE_JSON = Path(__file__).parent / "data" / "breakdown_before.json"
PLOT = Path("docs/plots/step_breakdown.png")


def op_part(name: str) -> str | None:
    """The part a ``kvemb::`` op's time belongs to (None: not a ``kvemb::`` op)."""
    if not name.startswith("kvemb::"):
        return None
    op = name.removeprefix("kvemb::")
    if "backward" in op:
        return "fused backward"
    if "forward" in op:
        return "pooled forward"
    if "pooled" in op:
        return "probe + pool"
    if any(word in op for word in ("lookup", "probe", "insert", "place")):
        return "lookup"
    return "other"


@dataclass(frozen=True)
class StepBreakdown:
    """One KV step (``mode``: train or eval) split into its parts, ms per step.

    ``total_ms`` / ``tbe_ms``: the KV and TBE steps' median wall time in the
    interleaved timing (no profiler); ``profiled_ms``: the wall time of the
    profiled KV steps the parts come from (0: ``total_ms``); ``fused_ms``: probe
    and pool in one op (then ``lookup_ms`` and ``forward_ms`` hold none of it)."""

    mode: str
    total_ms: float
    lookup_ms: float
    forward_ms: float
    backward_ms: float
    tbe_ms: float
    fused_ms: float = 0.0
    profiled_ms: float = 0.0

    @property
    def step_ms(self) -> float:
        """The step the parts add up to: the profiled one."""
        return self.profiled_ms or self.total_ms

    @property
    def other_ms(self) -> float:
        kernels = self.lookup_ms + self.fused_ms + self.forward_ms + self.backward_ms
        return max(0.0, self.step_ms - kernels)

    def parts(self) -> dict[str, float]:
        values = (self.lookup_ms, self.fused_ms, self.forward_ms, self.backward_ms, self.other_ms)
        return dict(zip(PARTS, values, strict=True))

    @property
    def ratio(self) -> float:
        """KV's speed over TBE's (TBE's step time over KV's)."""
        return self.tbe_ms / self.total_ms

    def to_json(self) -> dict[str, float | str]:
        return {**asdict(self), "other_ms": self.other_ms}

    @classmethod
    def from_json(cls, data: Mapping[str, object]) -> StepBreakdown:
        fields = ("mode", "total_ms", "lookup_ms", "forward_ms", "backward_ms", "tbe_ms")
        extra = {k: data.get(k, 0.0) for k in ("fused_ms", "profiled_ms")}
        return cls(**{k: data[k] for k in fields}, **extra)


def profile_step(
    fn: Callable[[int], object], calls: int, limit: int = 25
) -> tuple[dict[str, float], float, str]:
    """``calls`` calls of ``fn(i)`` under ``torch.profiler``: ms per call by part
    (outermost ``kvemb::`` ops only, so nothing counts twice; ``other`` holds
    ``kvemb::`` ops of no part), the calls' wall ms per call, and the op table
    (``common.ops_table``)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        begin = time.perf_counter()
        for i in range(calls):
            fn(i)
        wall_ms = 1e3 * (time.perf_counter() - begin) / calls
    parts = dict.fromkeys(PARTS, 0.0)
    for event in prof.events():
        part = op_part(event.name)
        if part is None:
            continue
        parent, nested = event.cpu_parent, False
        while parent is not None:
            if op_part(parent.name) is not None:
                nested = True
                break
            parent = parent.cpu_parent
        if not nested:
            parts[part] += event.cpu_time_total / 1e3 / calls
    return parts, wall_ms, ops_table(prof, calls, limit)


def breakdown(
    mode: str, parts: Mapping[str, float], profiled_ms: float, total_ms: float, tbe_ms: float
) -> StepBreakdown:
    """A ``StepBreakdown`` from ``profile_step``'s parts and wall time and the timed steps."""
    return StepBreakdown(
        mode, total_ms, parts["lookup"], parts["pooled forward"], parts["fused backward"], tbe_ms,
        parts["probe + pool"], profiled_ms,
    )  # fmt: skip


def table(steps: Sequence[StepBreakdown]) -> tuple[tuple[str, ...], list[tuple]]:
    """Headers and rows: one row per step, ms per part, the profiled KV step, the timed
    KV and TBE steps, the ratio."""
    headers = ("KV step", *PARTS, "KV profiled", "KV timed", "TBE timed", "KV / TBE")
    rows = [
        (
            s.mode,
            *(f"{v:.1f}" for v in s.parts().values()),
            f"{s.step_ms:.1f}",
            f"{s.total_ms:.1f}",
            f"{s.tbe_ms:.1f}",
            format_ratio(s.ratio),
        )
        for s in steps
    ]
    return headers, rows


# -------------------------------------------------------------------- runs
def record(
    steps: Sequence[StepBreakdown], describe: str, load: tuple[float, float], label: str
) -> dict:
    """A run's breakdown as JSON data (what ``plot`` reads back)."""
    return {
        "label": label,
        "commit": _commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine_summary(),
        "load": list(load),
        "config": describe,
        "steps": [s.to_json() for s in steps],
    }


def _commit() -> str:
    """The commit of the ``torchrec_kvemb`` that runs (``git describe``; "" if unknown)."""
    import subprocess

    import torchrec_kvemb

    root = Path(torchrec_kvemb.__file__).resolve().parent.parent
    try:
        out = subprocess.run(
            ["git", "-C", str(root), "describe", "--always", "--dirty"],
            capture_output=True, text=True, timeout=10, check=False,
        )  # fmt: skip
    except OSError:
        return ""
    return out.stdout.strip()


def load_record(path: str | Path) -> dict:
    data = json.loads(Path(path).read_text())
    data["steps"] = [StepBreakdown.from_json(s) for s in data["steps"]]
    return data


def plot(runs: Sequence[Mapping], path: str | Path) -> Path:
    """Stacked bars of the KV step's parts per run and mode, TBE's step beside each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    palette = ("tab:blue", "tab:purple", "tab:orange", "tab:green", "tab:gray")
    colors = dict(zip(PARTS, palette, strict=True))
    fig, axes = plt.subplots(1, 2, figsize=(max(7.0, 2.6 * len(runs) + 3.0), 4.5))
    drawn: set[str] = set()
    for ax, mode in zip(axes, ("train", "eval"), strict=True):
        x, ticks, labels = 0.0, [], []
        for run in runs:
            step = next((s for s in run["steps"] if s.mode == mode), None)
            if step is None:
                continue
            bottom = 0.0
            for part, value in step.parts().items():
                if value <= 0:
                    continue
                ax.bar(x, value, 0.8, bottom=bottom, color=colors[part],
                       label=None if part in drawn else part)  # fmt: skip
                drawn.add(part)
                bottom += value
            ax.text(x, bottom, f"{step.step_ms:.1f}\n{format_ratio(step.ratio)}",
                    ha="center", va="bottom", fontsize=7)  # fmt: skip
            ax.bar(x + 0.85, step.tbe_ms, 0.8, color="tab:red",
                   label=None if "TBE" in drawn else "TBE whole step")  # fmt: skip
            drawn.add("TBE")
            ax.text(x + 0.85, step.tbe_ms, f"{step.tbe_ms:.1f}", ha="center", va="bottom",
                    fontsize=7)  # fmt: skip
            ticks += [x, x + 0.85]
            labels += ["KV", "TBE"]
            ax.text(x + 0.425, -0.1, run["label"].replace(" (", "\n("), ha="center", va="top",
                    fontsize=7, transform=ax.get_xaxis_transform())  # fmt: skip
            x += 2.2
        ax.set_xticks(ticks)
        ax.set_xticklabels(labels, fontsize=7)
        ax.set_ylabel("ms per step")
        ax.set_title(f"{mode} step", fontsize=9)
        ax.margins(y=0.15)
    fig.suptitle(
        "KV EBC step by part vs TBE's step, Zipf 1.05 (labels: KV ms, KV/TBE speed)", fontsize=9
    )
    handles = [h for ax in axes for h in ax.get_legend_handles_labels()[0]]
    names = [n for ax in axes for n in ax.get_legend_handles_labels()[1]]
    fig.legend(handles, names, fontsize=7, loc="upper right")
    fig.tight_layout(rect=(0, 0.04, 0.86, 0.95))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ---------------------------------------------------------- eval locality
def locality(config, calls_per_block: int = 5, repeats: int = 7) -> dict[str, float]:
    """Eval ms/step of the stock tables on Zipf ids whose ranks are scattered over
    the table (as every benchmark draws them) and packed at row 0 (id = rank - 1),
    all taking turns: TBE (pooled) and TorchRec's ``EmbeddingCollection`` (a
    gather of rows, the sequence eval's stock system). Keys ``"TBE scattered"``,
    ``"TBE packed"``, ``"EC scattered"``, ``"EC packed"``."""
    from torchrec.modules.embedding_configs import EmbeddingConfig
    from torchrec.modules.embedding_modules import EmbeddingCollection

    from benchmarks import ebc_train

    previous = set_threads(config.threads)
    try:
        tbe = ebc_train.build_tbe(config)
        ec = EmbeddingCollection(
            [
                EmbeddingConfig(name=f"t{t}", embedding_dim=config.dim,
                                num_embeddings=config.rows, feature_names=[f"f{t}"])
                for t in range(config.tables)
            ],
            device=torch.device("cpu"),
        )  # fmt: skip
        timed = replace(config, spread=False, prime=0, warmup=1, steps=calls_per_block,
                        repeats=repeats)  # fmt: skip
        steps = {}
        for name, scatter in (("scattered", True), ("packed", False)):
            samplers = [
                ZipfIds(config.rows, config.alpha, config.seed + t, scatter=scatter)
                for t in range(config.tables)
            ]
            held_out = ebc_train.make_batches(timed, samplers).held_out
            steps[f"TBE {name}"] = ebc_train.tbe_eval(tbe, held_out)
            steps[f"EC {name}"] = _ec_eval(ec, held_out)
        timings = time_interleaved(steps, calls_per_block, repeats)
        return {name: 1e3 * t.median_s for name, t in timings.items()}
    finally:
        torch.set_num_threads(previous)


def _ec_eval(ec, batches: list) -> Callable[[int], None]:
    def step(i: int) -> None:
        with torch.no_grad():
            ec(batches[i % len(batches)])

    return step


# --------------------------------------------------------------------- CLI
def main(argv: Sequence[str] | None = None) -> list[StepBreakdown]:
    """Run the Zipf 1.05 stream with the breakdown, print it, plot it beside ``--before``."""
    from benchmarks import ebc_train, matrix

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--json", help="write this run's breakdown here")
    parser.add_argument("--label", default="after", help="this run's name in the plot")
    parser.add_argument("--before", default=str(BEFORE_JSON), help="a kept run to plot beside")
    parser.add_argument("--plot", default=str(PLOT), help="the plot's path ('' for none)")
    parser.add_argument(
        "--locality", action="store_true", help="also stock eval on packed / scattered ranks"
    )
    args = parser.parse_args(argv)
    config = ebc_train.QUICK if args.quick else ebc_train.BenchConfig()
    result = matrix.run_stream(matrix.STREAMS["zipf1.05"], config, profile=True)
    steps = list(result.breakdowns)
    headers, rows = table(steps)
    print(format_table(headers, rows))
    this = record(steps, matrix.describe_stream(result), result.load, args.label)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(this, indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        runs = [load_record(args.before)] if args.before and Path(args.before).exists() else []
        this["steps"] = steps
        print(f"wrote {plot([*runs, this], args.plot)}")
    if args.locality:
        ms = locality(replace(config, spread=False))
        print(
            f"Stock eval, ms/step, Zipf {config.alpha} ranks scattered over the table / "
            "packed at row 0 (load average "
            f"{load_average():.2f}):\n"
            + "\n".join(f"  {name}: {value:.2f}" for name, value in ms.items())
        )
    return steps


if __name__ == "__main__":
    main(sys.argv[1:])
