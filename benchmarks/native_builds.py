"""KV EBC train and eval steps on several builds of the native library, taking turns.

Two builds of ``csrc/`` (e.g. before and after a kernel change) compared in one
process on the same batches as ``benchmarks.ebc_train`` (4 tables x 1M rows x
dim 64, batch 4096, bags of 20, Zipf 1.05), with FBGEMM's CPU TBE beside them:
every KV step runs on the build named for it, the systems alternating block by
block, so the machine's load hits them alike. A build of another ABI version
loads too (its missing entry points are not called by the eval and train
steps). Ratios are TBE's time over each build's (above 1: faster than TBE).

Run from the repository root (built libraries, e.g. an old commit built in a
directory of its own with ``python setup.py build_ext --inplace``)::

    python -m benchmarks.native_builds \\
        old=/tmp/old/torchrec_kvemb/_kvemb_native_avx2.cpython-311-x86_64-linux-gnu.so \\
        new=torchrec_kvemb/_kvemb_native_avx2.cpython-311-x86_64-linux-gnu.so \\
        [--repeats 9] [--threads 2] [--no-train] [--small-pages]

``--small-pages`` adds a KV collection built with ``TORCHREC_KVEMB_HUGE_PAGES=0``
(its arrays on 4 KB pages), run on the first build: the huge pages' share.
"""

from __future__ import annotations

import argparse
import ctypes
import os
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks import ebc_train as eb
from benchmarks.common import format_table, load_average, set_threads, time_interleaved
from torchrec_kvemb import native_lib


class _LenientLibrary(ctypes.CDLL):
    """A CDLL whose missing ``kv_pool_*`` entry points (builds before ABI 9) are no-ops."""

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if not name.startswith("kv_pool"):
                raise
            stub = ctypes.CFUNCTYPE(ctypes.c_int)(lambda *args: 0)
            setattr(self, name, stub)
            return stub


def load_build(path: str) -> ctypes.CDLL:
    """The library at ``path``, set up as ``native_lib.load_variant`` sets up the package's."""
    version = ctypes.CDLL(path).kv_abi_version()
    saved = native_lib.library_path, native_lib.ABI_VERSION, ctypes.CDLL
    native_lib.library_path = lambda variant="portable": Path(path)
    native_lib.ABI_VERSION = version
    ctypes.CDLL = _LenientLibrary
    native_lib.load_variant.cache_clear()
    try:
        lib, why = native_lib.load_variant("portable")
        if lib is None:
            raise RuntimeError(f"{path}: {why}")
        return lib
    finally:
        native_lib.library_path, native_lib.ABI_VERSION, ctypes.CDLL = saved
        native_lib.load_variant.cache_clear()


SMALL = "4 KB pages"


def build_on_small_pages(config: eb.BenchConfig):
    """A KV collection whose arrays are not asked for huge pages (docs/native.md)."""
    saved = os.environ.get("TORCHREC_KVEMB_HUGE_PAGES")
    os.environ["TORCHREC_KVEMB_HUGE_PAGES"] = "0"
    try:
        return eb.build_kv(config, config.rows)
    finally:
        if saved is None:
            del os.environ["TORCHREC_KVEMB_HUGE_PAGES"]
        else:
            os.environ["TORCHREC_KVEMB_HUGE_PAGES"] = saved


def on_build(lib: ctypes.CDLL, step: Callable[[int], None]) -> Callable[[int], None]:
    def run(i: int) -> None:
        native_lib.load = lambda: (lib, None)
        step(i)

    return run


def rows(timings: dict, mode: str) -> list[tuple]:
    tbe = timings[eb.TBE].median_s
    return [
        (mode, name, f"{1e3 * t.median_s:.2f}", f"{1e3 * t.best_s:.2f}", f"{tbe / t.median_s:.2f}x")
        for name, t in timings.items()
    ]


def main(argv: Sequence[str] | None = None) -> list[tuple]:
    """Time the builds, print the table; returns its rows (mode, system, ms, best, ratio)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("builds", nargs="+", help="NAME=PATH of a built library")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-train", action="store_true", help="time eval steps only")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument(
        "--small-pages",
        action="store_true",
        help="also time a second KV collection built with TORCHREC_KVEMB_HUGE_PAGES=0 "
        "(on the first build)",
    )
    args = parser.parse_args(argv)
    builds = {}
    for spec in args.builds:
        name, _, path = spec.partition("=")
        builds[name] = load_build(path)
    base = eb.QUICK if args.quick else eb.BenchConfig()
    config = replace(base, spread=False, repeats=args.repeats, threads=args.threads)
    previous, package_load = set_threads(config.threads), native_lib.load
    load_at_start = load_average()
    try:
        batches = eb.make_batches(config)
        kv, tbe = eb.build_kv(config, config.rows), eb.build_tbe(config)
        first = next(iter(builds.values()))
        small = build_on_small_pages(config) if args.small_pages else None
        native_lib.load = lambda: (first, None)
        primes = [eb.kv_train(kv, batches.prime, batches.grad),
                  eb.tbe_train(tbe, batches.prime, batches.grad)]  # fmt: skip
        if small is not None:
            primes.append(eb.kv_train(small, batches.prime, batches.grad))
        for prime in primes:
            for i in range(config.prime):
                prime(i)
        table = []
        if not args.no_train:
            steps = {n: on_build(b, eb.kv_train(kv, batches.timed, batches.grad))
                     for n, b in builds.items()}  # fmt: skip
            if small is not None:
                steps[SMALL] = on_build(first, eb.kv_train(small, batches.timed, batches.grad))
            steps[eb.TBE] = eb.tbe_train(tbe, batches.timed, batches.grad)
            table += rows(
                time_interleaved(steps, config.steps, config.repeats, config.warmup), "train"
            )
        kv.eval()
        steps = {n: on_build(b, eb.kv_eval(kv, batches.held_out)) for n, b in builds.items()}
        if small is not None:
            small.eval()
            steps[SMALL] = on_build(first, eb.kv_eval(small, batches.held_out))
        steps[eb.TBE] = eb.tbe_eval(tbe, batches.held_out)
        table += rows(time_interleaved(steps, config.steps, config.repeats, config.warmup), "eval")
    finally:
        threads = torch.get_num_threads()
        torch.set_num_threads(previous)
        native_lib.load = package_load
    print(f"{eb.describe(config)}; {threads} threads")
    print(f"load average {load_at_start:.1f} at start, {load_average():.1f} at end")
    print(format_table(("mode", "system", "median ms", "best ms", "TBE / system"), table))
    return table


if __name__ == "__main__":
    main()
