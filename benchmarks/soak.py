"""Soak: a KV table at capacity over a bounded SSD tier, constant churn, many steps.

One table (row-wise Adagrad layout: ``dim`` weights and one state column),
``memory_rows`` rows in memory over an SSD tier of ``ssd_capacity`` rows
(LRU in both). Each step looks up a training batch with ``lookup_train``:

* ``new`` ids never seen before (every step: the table is always full, so
  every step evicts from memory, demotes to the SSD tier, and the SSD tier
  drops its least recently used rows);
* ``recent`` ids drawn from the new ids of the last ``window`` steps (most of
  them on the SSD tier by then: promotions);
* ``old`` ids drawn from every id so far (mostly dropped long ago: new again).

Then it "trains" the batch's rows: every row it was given (memory or scratch
rows) becomes ``f(id, step)`` (weights and state, exact in float32), as an
optimizer step would change it. ``flush()`` runs every ``flush_every`` steps.

Every ``sample_every`` steps it samples the process's RSS (anonymous and
file-backed), the slab file's size, the slab's free records and the records
waiting for a flush, and the load factors of memory and of the SSD index.

**Checks** at the end (``SoakResult.checks``):

* RSS after warm-up (the first ``warmup_fraction`` of the steps) stays within
  5 % of its value at the end of warm-up;
* the slab file never exceeds ``storage_estimate``'s bound for the options
  (``HEADER + record_bytes * (2 * (ssd_capacity + 2 * memory_rows) + 1024)``,
  docs/ssd-tier.md);
* the SSD index's load factor stays at most 1 and memory's reaches 1;
* zero rows lost: every id the table holds at the end has exactly its last
  trained row ``f(id, last step)`` (none stale), the ids it no longer holds
  are at most the SSD tier's counted drops, and every id trained in the last
  ``recent_check`` steps is held.

Run from the repository root::

    python -m benchmarks.soak                  # full: 20,000 steps
    python -m benchmarks.soak --steps 4000     # a medium setting
    python -m benchmarks.soak --quick          # make bench's short setting
    python -m benchmarks.soak --plot docs/plots/soak.png --out docs/bench_soak.md

Files go to ``--dir`` (default ``$TMPDIR``), on the disk to measure.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from benchmarks.common import (
    add_config_flags,
    command_line,
    config_from_args,
    format_table,
    machine_summary,
    markdown_table,
    set_threads,
    write_markdown,
)
from torchrec_kvemb import KVTable, KVTableOptions, SSDOptions
from torchrec_kvemb.optimizer import FusedOptimConfig, OptimKind
from torchrec_kvemb.ssd import storage_estimate
from torchrec_kvemb.ssd.slab import HEADER_BYTES

#: Odd multiplier mapping the soak's id counter to raw ids (a bijection mod 2**62).
ID_MULT = 0x9E3779B97F4A7C15 & ((1 << 62) - 1)
ID_MASK = (1 << 62) - 1
RSS_TOLERANCE = 0.05


@dataclass(frozen=True)
class SoakConfig:
    """Sizes of one soak run."""

    steps: int = 20_000
    dim: int = 32
    memory_rows: int = 8192
    ssd_capacity: int = 65_536
    new: int = 512  # never-seen ids per step
    recent: int = 512  # ids from the new ids of the last ``window`` steps
    old: int = 128  # ids from every id so far
    window: int = 24
    flush_every: int = 500
    sample_every: int = 100
    warmup_fraction: float = 0.2
    recent_check: int = 8
    threads: int | None = 1  # why 1: batches of ~1k ids; 2 threads on 2 busy cores ran 10x slower
    seed: int = 0


QUICK = SoakConfig(steps=1500, memory_rows=2048, ssd_capacity=16_384, new=128, recent=128,
                   old=32, flush_every=200, sample_every=50)  # fmt: skip


@dataclass
class SoakResult:
    config: SoakConfig
    samples: list[dict[str, float]]
    metrics: dict[str, float]
    slab_bound_bytes: int
    seconds: float
    checks: dict[str, tuple[bool, str]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return all(passed for passed, _ in self.checks.values())


def raw_ids(counters: torch.Tensor) -> torch.Tensor:
    """The raw id of each counter value (a bijection onto [0, 2**62))."""
    return (counters * ID_MULT) & ID_MASK


def counters_of(ids: torch.Tensor) -> torch.Tensor:
    return (ids * pow(ID_MULT, -1, 1 << 62)) & ID_MASK


def trained_rows(ids: torch.Tensor, steps: torch.Tensor, width: int) -> torch.Tensor:
    """``f(id, step)``: the row an id has after training at ``step`` (exact in float32)."""
    base = steps.to(torch.float32) + (ids % 997).to(torch.float32) / 8
    return base.unsqueeze(1) + torch.arange(width, dtype=torch.float32) / 4


def _rss() -> dict[str, float]:
    """Resident memory of this process in MiB: total, anonymous, file-backed."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile"):
                out[key] = int(value.split()[0]) / 1024
    return {"rss_mb": out["VmRSS"], "anon_mb": out["RssAnon"], "file_mb": out["RssFile"]}


def _sample(step: int, table: KVTable, started: float) -> dict[str, float]:
    store = table.ssd
    return {
        "step": step,
        "seconds": time.perf_counter() - started,
        **_rss(),
        "slab_mb": store.slab_path.stat().st_size / 2**20,
        "slab_records": store.slab.records,
        "free_records": store.free_records,
        "waiting_records": store.waiting_records,
        "memory_load": table.size / table.capacity,
        "ssd_load": store.size / store.capacity,
        "ssd_rows": store.size,
    }


def run(config: SoakConfig, directory: str | None = None) -> SoakResult:
    threads = set_threads(config.threads)
    workdir = tempfile.mkdtemp(prefix="kv_soak_", dir=directory)
    try:
        return _run(config, workdir)
    finally:
        torch.set_num_threads(threads)
        shutil.rmtree(workdir, ignore_errors=True)


def _run(config: SoakConfig, workdir: str) -> SoakResult:
    gen = torch.Generator().manual_seed(config.seed)
    options = KVTableOptions(
        capacity=config.memory_rows,
        ssd=SSDOptions(path=workdir, capacity=config.ssd_capacity),
    )
    optim = FusedOptimConfig(kind=OptimKind.ROWWISE_ADAGRAD)
    table = KVTable("soak", config.dim, options, optim)
    estimate = storage_estimate(options, config.dim, optim)
    bound = HEADER_BYTES + estimate["slab_records"] * estimate["record_bytes"]
    width = config.dim + table.state_dim
    total = config.steps * config.new
    last_step = torch.full((total,), -1, dtype=torch.int32)  # allocated before warm-up
    samples = []
    started = time.perf_counter()
    for step in range(config.steps):
        fresh = torch.arange(step * config.new, (step + 1) * config.new)
        lo = max(0, step - config.window) * config.new
        recent = torch.randint(lo, max(lo + 1, step * config.new), (config.recent,), generator=gen)
        old = torch.randint(0, max(1, step * config.new), (config.old,), generator=gen)
        counters = torch.unique(torch.cat([fresh, recent, old] if step else [fresh]))
        ids = raw_ids(counters)
        slots = table.lookup_train(ids)
        held = slots >= 0
        weights, state = table.batch_rows()
        rows = trained_rows(ids[held], torch.full((int(held.sum()),), step), width)
        weights[slots[held]] = rows[:, : config.dim]
        state[slots[held]] = rows[:, config.dim :]
        last_step[counters[held]] = step
        if (step + 1) % config.flush_every == 0:
            table.flush()
        if step % config.sample_every == 0 or step == config.steps - 1:
            samples.append(_sample(step, table, started))
    seconds = time.perf_counter() - started
    exported = table.export()
    result = SoakResult(config, samples, table.metrics(), bound, seconds)
    result.checks = _checks(config, result, exported, last_step)
    table.close()
    return result


def _checks(
    config: SoakConfig, result: SoakResult, exported: dict, last_step: torch.Tensor
) -> dict[str, tuple[bool, str]]:
    samples = result.samples
    warm = [s for s in samples if s["step"] >= config.warmup_fraction * config.steps]
    base = warm[0]["rss_mb"]
    spread = max(abs(s["rss_mb"] - base) for s in warm) / base
    anon = max(abs(s["anon_mb"] - warm[0]["anon_mb"]) for s in warm) / warm[0]["anon_mb"]
    slab_max = max(s["slab_mb"] for s in samples) * 2**20
    ssd_load = max(s["ssd_load"] for s in samples)
    ids = exported["ids"]
    counters = counters_of(ids)
    steps = last_step[counters]
    want = trained_rows(ids, steps, config.dim + 1)
    got = torch.cat([exported["weights"], exported["momentum1"].unsqueeze(1)], dim=1)
    stale = int((~(got == want).all(dim=1)).sum()) + int((steps < 0).sum())
    trained = int((last_step >= 0).sum())
    missing = trained - ids.numel()
    recent_ids = (last_step >= config.steps - config.recent_check).nonzero().squeeze(1)
    recent_missing = int((~torch.isin(raw_ids(recent_ids), ids)).sum())
    m = result.metrics
    return {
        "rss flat": (spread <= RSS_TOLERANCE,
                     f"RSS within {100 * spread:.1f}% of {base:.0f} MiB after warm-up "
                     f"(anonymous: {100 * anon:.1f}%); tolerance 5%"),
        "slab bounded": (slab_max <= result.slab_bound_bytes,
                         f"slab file at most {slab_max / 2**20:.1f} MiB; bound "
                         f"{result.slab_bound_bytes / 2**20:.1f} MiB"),
        "load factor": (ssd_load <= 1.0 and samples[-1]["memory_load"] == 1.0,
                        f"SSD index load at most {ssd_load:.3f} (<= 1), memory "
                        f"{samples[-1]['memory_load']:.3f}"),
        "no stale row": (stale == 0,
                         f"{ids.numel():,} ids held, {stale} without their last trained row"),
        "no row lost": (missing <= m["ssd_evictions"] and recent_missing == 0,
                        f"{missing:,} of {trained:,} trained ids no longer held <= "
                        f"{m['ssd_evictions']:,} SSD drops; {recent_missing} of "
                        f"{recent_ids.numel():,} ids of the last {config.recent_check} "
                        "steps missing"),
    }  # fmt: skip


# ------------------------------------------------------------------ report
SAMPLE_COLUMNS = ("step", "seconds", "rss_mb", "anon_mb", "file_mb", "slab_mb",
                  "free_records", "waiting_records", "memory_load", "ssd_load")  # fmt: skip


def _cells(sample: dict[str, float]) -> list[str]:
    return [f"{sample[c]:.3f}" if "load" in c else f"{sample[c]:,.0f}" if "records" in c
            or c == "step" else f"{sample[c]:.1f}" for c in SAMPLE_COLUMNS]  # fmt: skip


def report(result: SoakResult, markdown: bool = False) -> str:
    c, m = result.config, result.metrics
    table = markdown_table if markdown else format_table
    every = max(1, len(result.samples) // 10)
    picked = result.samples[::every] + ([result.samples[-1]] if len(result.samples) % every != 1
                                        else [])  # fmt: skip
    lines = [
        f"{c.steps:,} steps of {c.new} new + {c.recent} recent + {c.old} old ids; memory "
        f"{c.memory_rows:,} rows, SSD tier {c.ssd_capacity:,} rows (dim {c.dim}); flush every "
        f"{c.flush_every} steps; {result.seconds:.0f} s ({1e3 * result.seconds / c.steps:.2f} "
        "ms/step).",
        f"Per step: {m['promotions'] / c.steps:,.0f} promotions, {m['demotions'] / c.steps:,.0f} "
        f"demotions, {m['ssd_evictions'] / c.steps:,.0f} SSD drops, "
        f"{m['scratch_rows'] / c.steps:.2f} scratch rows; {m['ssd_flushes']:.0f} flushes.",
        "",
        table(SAMPLE_COLUMNS, [_cells(s) for s in dict.fromkeys(map(id, picked)) and picked]),
        "",
    ]
    for name, (passed, text) in result.checks.items():
        lines.append(f"{'- ' if markdown else ''}{name}: {'met' if passed else 'MISSED'} ({text})")
    return "\n".join(lines)


def plot(result: SoakResult, path: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s["step"] for s in result.samples]
    fig, axes = plt.subplots(3, 1, figsize=(7.5, 8.0), sharex=True)
    for key, label in (("rss_mb", "RSS"), ("anon_mb", "anonymous"), ("file_mb", "file-backed")):
        axes[0].plot(steps, [s[key] for s in result.samples], label=label)
    axes[0].set_ylabel("MiB")
    axes[0].set_title("Process memory")
    axes[0].legend(fontsize=8)
    axes[1].plot(steps, [s["slab_mb"] for s in result.samples], label="slab file")
    axes[1].axhline(result.slab_bound_bytes / 2**20, color="black", ls="--", label="bound")
    ax2 = axes[1].twinx()
    ax2.plot(steps, [s["free_records"] for s in result.samples], color="tab:green", lw=0.8,
             label="free records")  # fmt: skip
    ax2.set_ylabel("free records")
    axes[1].set_ylabel("MiB")
    axes[1].set_title("Slab file size and free records")
    axes[1].legend(loc="upper left", fontsize=8)
    ax2.legend(loc="lower right", fontsize=8)
    for key, label in (("memory_load", "memory"), ("ssd_load", "SSD index")):
        axes[2].plot(steps, [s[key] for s in result.samples], label=label)
    axes[2].set_ylim(0, 1.05)
    axes[2].set_ylabel("load factor")
    axes[2].set_xlabel("step")
    axes[2].legend(fontsize=8)
    fig.suptitle(f"Soak: {result.config.steps:,} steps", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# --------------------------------------------------------------------- CLI
def parse_args(argv: Sequence[str] | None) -> tuple[SoakConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="make bench's short setting")
    parser.add_argument("--dir", default=None, help="directory for the files")
    parser.add_argument("--out", default=None, help="also write the report as markdown")
    parser.add_argument("--plot", default=None, help="write the samples' plot (PNG)")
    names = add_config_flags(parser, SoakConfig)
    args = parser.parse_args(argv)
    return config_from_args(args, QUICK if args.quick else SoakConfig(), names), args


def main(argv: Sequence[str] | None = None) -> SoakResult:
    config, args = parse_args(argv)
    result = run(config, directory=args.dir)
    print(report(result))
    if args.plot:
        print(f"wrote {plot(result, args.plot)}")
    if args.out:
        text = report(result, markdown=True)
        machine = (
            f"{machine_summary()} (the soak itself: {config.threads or 'all'} thread(s)); "
            f"`{command_line('benchmarks.soak', argv)}`"
        )
        write_markdown(args.out, "Soak", [machine, text])
        print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
