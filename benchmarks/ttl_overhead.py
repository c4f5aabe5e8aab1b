"""What a TTL and sighting counts add to a grouped training lookup (native CPU).

One table of ``--rows`` rows in a ``KVTableGroup``, batches of ``--batch``
uniform ids over three times as many ids as rows (churn). After a few primed
steps, the work the group runs after its lookup (``GroupTTL.after_lookup``:
marking the batch's rows, counting their sightings, the sweep) is timed alone
on a real lookup's slots, beside the lookup itself, for each option set. The
last row sweeps the whole table every step: what the cursor's window avoids.

Run from the repository root::

    python -m benchmarks.ttl_overhead            # about 30 s on 2 cores
    python -m benchmarks.ttl_overhead --quick    # smoke-test sizes
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from torchrec_kvemb import EvictionPolicy, KVTableOptions, TTLOptions
from torchrec_kvemb.group import KVTableGroup


@dataclass(frozen=True)
class Config:
    rows: int = 1 << 20
    batch: int = 65_536
    dim: int = 32
    primed_steps: int = 5
    repeats: int = 20


@dataclass(frozen=True)
class Case:
    name: str
    eviction: EvictionPolicy
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Result:
    name: str
    after_lookup_ms: float
    lookup_ms: float


CASES = (
    Case("LRU, ttl steps=1000", EvictionPolicy.LRU, {"ttl": TTLOptions(steps=1000)}),
    Case("LFU, ttl steps=1000", EvictionPolicy.LFU, {"ttl": TTLOptions(steps=1000)}),
    Case("LRU, count_sightings", EvictionPolicy.LRU, {"count_sightings": True}),
    Case(
        "LRU, ttl + count_sightings",
        EvictionPolicy.LRU,
        {"ttl": TTLOptions(steps=1000), "count_sightings": True},
    ),
    Case(
        "LRU, whole table swept every step",
        EvictionPolicy.LRU,
        {"ttl": TTLOptions(steps=1000, sweep_buckets_per_step=1 << 40)},
    ),
)


def run_case(config: Config, case: Case, gen: torch.Generator) -> Result:
    options = KVTableOptions(capacity=config.rows, eviction=case.eviction, **case.extra)
    group = KVTableGroup(["t"], [options], dim=config.dim)
    table_idx = torch.zeros(config.batch, dtype=torch.int64)
    lookup_s = 0.0
    for _ in range(config.primed_steps):
        ids = torch.randint(0, 3 * config.rows, (config.batch,), generator=gen)
        start = time.perf_counter()
        lookup = group.lookup_train(ids, table_idx)
        lookup_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(config.repeats):
        group.ttl.after_lookup(lookup.slots, table_idx, group.row_offsets)
    after_s = (time.perf_counter() - start) / config.repeats
    return Result(case.name, after_s * 1e3, lookup_s * 1e3)


def main(argv: list[str] | None = None) -> list[Result]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    args = parser.parse_args(argv)
    config = Config(rows=1 << 12, batch=1024, repeats=2) if args.quick else Config()
    gen = torch.Generator().manual_seed(0)
    results = [run_case(config, case, gen) for case in CASES]
    print(f"{config.rows} rows, {config.batch} ids a step, {torch.get_num_threads()} threads")
    print(f"{'options':36s} {'after lookup ms':>16s} {'lookup ms':>10s}")
    for r in results:
        print(f"{r.name:36s} {r.after_lookup_ms:16.2f} {r.lookup_ms:10.1f}")
    return results


if __name__ == "__main__":
    main()
