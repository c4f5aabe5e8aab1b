"""Sequence (unpooled) lookups, train and eval: KV EmbeddingCollection vs TorchRec's
stock EmbeddingCollection and FBGEMM's sequence TBE, on CPU.

One process, the same batches (Zipf ids, as ``benchmarks.ebc_train``) for every
system:

* ``KV``: ``KVEmbeddingCollection`` (fused EXACT_ROWWISE_ADAGRAD in backward),
  primed with training steps so its tables hold ids like a running job.
* ``EC``: TorchRec's ``EmbeddingCollection`` (fixed-size tables, ids below
  ``rows``) with sparse gradients and ``torch.optim.Adagrad``: the stock
  unsharded module as a CPU user trains it.
* ``seq TBE``: FBGEMM's ``SplitTableBatchedEmbeddingBagsCodegen`` on the host in
  sequence mode (``PoolingMode.NONE``, EXACT_ROWWISE_ADAGRAD fused in
  backward): what TorchRec's sharded ``EmbeddingCollection`` runs per rank.

Train = forward + backward (+ optimizer) with one output gradient per id; eval =
forward under ``torch.no_grad()`` on held-out batches.

Run from the repository root::

    python -m benchmarks.ec_train            # about 2 min on 2 cores
    python -m benchmarks.ec_train --quick    # smoke-test sizes
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection

from benchmarks.common import (
    add_config_flags,
    command_line,
    config_from_args,
    format_ratio,
    format_table,
    load_average,
    machine_line,
    markdown_table,
    set_threads,
    time_interleaved,
    write_markdown,
)
from benchmarks.ebc_train import BenchConfig as BagConfig
from benchmarks.ebc_train import make_batches
from torchrec_kvemb import KVEmbeddingCollection, KVTableOptions

KV = "KV"
EC = "EC"
TBE = "seq TBE"
SYSTEMS = (KV, EC, TBE)


@dataclass(frozen=True)
class Target:
    """KV must reach ``minimum`` times ``baseline``'s ids/s in ``mode``."""

    mode: str
    baseline: str
    minimum: float


TARGETS = (Target("train", EC, 0.8), Target("eval", EC, 0.8))
#: Reported beside the targets, without one.
REPORTED = (Target("train", TBE, 0.0), Target("eval", TBE, 0.0))

#: Default sizes: the bag benchmark's, with half the batch (a sequence output
#: holds every id's row: 4 x 2048 x 20 ids x 64 floats = 42 MB a step).
DEFAULT = BagConfig(batch=2048, spread=False)
QUICK = BagConfig(
    tables=2, dim=16, batch=64, bag=4, rows=10_000, steps=2, repeats=2, warmup=1, prime=2,
    spread=False,
)  # fmt: skip


@dataclass(frozen=True)
class SeqResult:
    config: BagConfig
    ms_per_step: dict[tuple[str, str], float]  # (system, mode) -> median ms
    load: tuple[float, float]

    def ids_per_s(self, system: str, mode: str) -> float:
        return self.config.ids_per_step / (self.ms_per_step[(system, mode)] / 1e3)

    def ratio(self, system: str, baseline: str, mode: str) -> float:
        return self.ids_per_s(system, mode) / self.ids_per_s(baseline, mode)


def table_configs(config: BagConfig) -> list[EmbeddingConfig]:
    return [
        EmbeddingConfig(
            name=f"t{t}", embedding_dim=config.dim, num_embeddings=config.rows,
            feature_names=[f"f{t}"],
        )
        for t in range(config.tables)
    ]  # fmt: skip


def build_systems(config: BagConfig) -> dict[str, tuple[Callable, Callable]]:
    """Per system: ``(train(kjt, grad), eval(kjt))``."""
    fused = {
        "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        "learning_rate": config.learning_rate,
        "eps": config.eps,
    }
    kv = KVEmbeddingCollection(
        table_configs(config), KVTableOptions(capacity=config.rows, seed=config.seed),
        fused_params=fused,
    )  # fmt: skip
    ec = EmbeddingCollection(table_configs(config), device=torch.device("cpu"))
    for emb in ec.embeddings.values():
        emb.sparse = True
    adagrad = torch.optim.Adagrad(ec.parameters(), lr=config.learning_rate, eps=config.eps)
    warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")
    spec = (config.rows, config.dim, EmbeddingLocation.HOST, ComputeDevice.CPU)
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[spec] * config.tables,
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=config.learning_rate,
        eps=config.eps,
        pooling_mode=PoolingMode.NONE,
    )

    def rows_of(out: dict) -> torch.Tensor:
        return torch.cat([jt.values() for jt in out.values()])

    def kv_train(kjt, grad) -> None:
        rows_of(kv(kjt)).backward(grad)

    def ec_train(kjt, grad) -> None:
        rows_of(ec(kjt)).backward(grad)
        adagrad.step()
        adagrad.zero_grad(set_to_none=True)

    def tbe_train(kjt, grad) -> None:
        tbe(kjt.values(), kjt.offsets()).backward(grad)

    def no_grad(fn: Callable) -> Callable:
        def run(kjt) -> None:
            with torch.no_grad():
                fn(kjt)

        return run

    return {
        KV: (kv_train, no_grad(lambda kjt: kv(kjt)), kv),
        EC: (ec_train, no_grad(lambda kjt: ec(kjt)), ec),
        TBE: (tbe_train, no_grad(lambda kjt: tbe(kjt.values(), kjt.offsets())), tbe),
    }


def run(config: BagConfig, verbose: bool = True) -> SeqResult:
    previous = set_threads(config.threads)
    try:
        load_at_start = load_average()
        batches = make_batches(config)
        grad = torch.randn(
            config.ids_per_step, config.dim, generator=torch.Generator().manual_seed(1)
        )
        systems = build_systems(config)
        for name, (train, _, _) in systems.items():
            start = time.perf_counter()
            for kjt in batches.prime:
                train(kjt, grad)
            if verbose:
                print(f"primed {name} in {time.perf_counter() - start:.1f}s", file=sys.stderr)

        def stepper(fn: Callable, source: list, with_grad: bool) -> Callable[[int], None]:
            if with_grad:
                return lambda i: fn(source[i % len(source)], grad)
            return lambda i: fn(source[i % len(source)])

        train = time_interleaved(
            {n: stepper(s[0], batches.timed, True) for n, s in systems.items()},
            config.steps, config.repeats, config.warmup,
        )  # fmt: skip
        for _, _, module in systems.values():
            module.eval() if hasattr(module, "eval") else None
        evaluation = time_interleaved(
            {n: stepper(s[1], batches.held_out, False) for n, s in systems.items()},
            config.steps, config.repeats, config.warmup,
        )  # fmt: skip
        ms = {}
        for mode, timings in (("train", train), ("eval", evaluation)):
            for name, timing in timings.items():
                ms[(name, mode)] = 1e3 * timing.median_s
        return SeqResult(config, ms, (load_at_start, load_average()))
    finally:
        torch.set_num_threads(previous)


def describe(config: BagConfig) -> str:
    return (
        f"{config.tables} tables x {config.rows:,} rows x dim {config.dim}, batch "
        f"{config.batch}, {config.bag} ids per sequence, Zipf alpha {config.alpha}; "
        f"{config.ids_per_step:,} ids/step; median of {config.repeats} blocks x "
        f"{config.steps} steps after {config.prime} priming steps"
    )


HEADERS = ("system", "train ms/step", "train M ids/s", "eval ms/step", "eval M ids/s")


def result_rows(result: SeqResult) -> list[tuple]:
    return [
        (
            name,
            f"{result.ms_per_step[(name, 'train')]:.1f}",
            f"{result.ids_per_s(name, 'train') / 1e6:.2f}",
            f"{result.ms_per_step[(name, 'eval')]:.1f}",
            f"{result.ids_per_s(name, 'eval') / 1e6:.2f}",
        )
        for name in SYSTEMS
    ]


def ratio_rows(result: SeqResult) -> list[tuple]:
    rows = []
    for target in TARGETS + REPORTED:
        value = result.ratio(KV, target.baseline, target.mode)
        met = "met" if value >= target.minimum else "MISSED"
        rows.append(
            (
                f"{KV}/{target.baseline} {target.mode}",
                format_ratio(value),
                f">= {target.minimum:.1f}x" if target.minimum else "-",
                met if target.minimum else "",
            )
        )
    return rows


RATIO_HEADERS = ("ratio (ids/s)", "value", "target", "")


def report(result: SeqResult) -> str:
    return "\n\n".join(
        [
            describe(result.config) + "\n" + machine_line(result.load),
            format_table(HEADERS, result_rows(result)),
            format_table(RATIO_HEADERS, ratio_rows(result)),
        ]
    )


def parse_args(argv: Sequence[str] | None) -> tuple[BagConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--out", help="also write a markdown report to this path")
    names = add_config_flags(parser, BagConfig, skip=("spread",))
    args = parser.parse_args(argv)
    return config_from_args(args, QUICK if args.quick else DEFAULT, names), args


def main(argv: Sequence[str] | None = None) -> SeqResult:
    """Run the benchmark and print its tables; returns the result."""
    config, args = parse_args(argv)
    result = run(replace(config, spread=False))
    print(report(result))
    if args.out:
        write_markdown(
            args.out,
            "Sequence lookups: KV EmbeddingCollection vs stock EmbeddingCollection (CPU)",
            [
                f"`{command_line('benchmarks.ec_train', argv)}`",
                describe(result.config) + ".  \n" + machine_line(result.load) + ".",
                markdown_table(HEADERS, result_rows(result)),
                markdown_table(RATIO_HEADERS, ratio_rows(result)),
            ],
        )
        print(f"\nwrote {args.out}")
    return result


if __name__ == "__main__":
    main()
