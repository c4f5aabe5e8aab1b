"""Row precision: KV EBC training with float32, float16 and bfloat16 rows (CPU).

One process, the same Zipf batches as ``benchmarks.ebc_train``, one KV EBC per
row dtype (fused EXACT_ROWWISE_ADAGRAD), primed, then timed taking turns.
Reports train ms/step and ids/s, each half-precision dtype's throughput as a
ratio of float32's, and the bytes one row of capacity costs
(``KVTable.memory_bytes() / capacity``: weights, optimizer state, index).

On the CPU the native kernels serve every row dtype (a half-precision row is
read to float32, updated in float32, stored rounded to nearest even); the
Triton kernels do the same on a GPU.

Run from the repository root::

    python -m benchmarks.precision            # about 2 min on 2 cores
    python -m benchmarks.precision --quick    # smoke-test sizes
    python -m benchmarks.precision --kernels  # the native kernels alone (below)

``--kernels``: the native pooled forward and fused backward alone on one group
of ``tables x rows`` rows of each dtype (the same Zipf ids as slots, bags of
``bag`` ids, row-wise Adagrad), float16 also with its F16C conversions turned
off (``native_lib.set_f16c``), taking turns; ms per call and the ratio over
float32.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType

from benchmarks.common import (
    ZipfIds,
    add_config_flags,
    config_from_args,
    format_ratio,
    format_table,
    load_average,
    machine_line,
    set_threads,
    time_interleaved,
)
from benchmarks.ebc_train import QUICK, BenchConfig, kv_train, make_batches, table_configs
from torchrec_kvemb import KVEmbeddingBagCollection, KVTableOptions, native_lib
from torchrec_kvemb.ops import native
from torchrec_kvemb.optimizer import FusedOptimConfig, OptimKind

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(frozen=True)
class PrecisionResult:
    config: BenchConfig
    ms_per_step: dict[str, float]
    bytes_per_row: dict[str, float]
    load: tuple[float, float]

    def ids_per_s(self, dtype: str) -> float:
        return self.config.ids_per_step / (self.ms_per_step[dtype] / 1e3)

    def ratio(self, dtype: str) -> float:
        """``dtype``'s train ids/s over float32's."""
        return self.ids_per_s(dtype) / self.ids_per_s("float32")


def build(config: BenchConfig, dtype: torch.dtype) -> KVEmbeddingBagCollection:
    return KVEmbeddingBagCollection(
        table_configs(config, config.rows),
        KVTableOptions(capacity=config.rows, seed=config.seed, weights_dtype=dtype),
        fused_params={
            "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            "learning_rate": config.learning_rate,
            "eps": config.eps,
        },
    )


def run(config: BenchConfig) -> PrecisionResult:
    previous = set_threads(config.threads)
    try:
        load_at_start = load_average()
        batches = make_batches(replace(config, spread=False))
        models = {name: build(config, dtype) for name, dtype in DTYPES.items()}
        for name, model in models.items():
            prime = kv_train(model, batches.prime, batches.grad)
            for i in range(config.prime):
                prime(i)
            print(f"primed {name}", file=sys.stderr, flush=True)
        timings = time_interleaved(
            {n: kv_train(m, batches.timed, batches.grad) for n, m in models.items()},
            config.steps,
            config.repeats,
            config.warmup,
        )
        per_row = {
            name: sum(t.memory_bytes() for t in m.kv_tables().values())
            / sum(t.capacity for t in m.kv_tables().values())
            for name, m in models.items()
        }
        ms = {name: 1e3 * t.median_s for name, t in timings.items()}
        return PrecisionResult(config, ms, per_row, (load_at_start, load_average()))
    finally:
        torch.set_num_threads(previous)


KERNEL_ROWS = (*DTYPES, "float16, no F16C")


def kernels(config: BenchConfig) -> dict[str, dict[str, float]]:
    """Median ms per call of the native pooled forward and fused backward, by
    ``KERNEL_ROWS`` entry (see the module's docstring)."""
    c = config
    previous = set_threads(c.threads)
    try:
        rows = c.tables * c.rows
        order = torch.randperm(rows, generator=torch.Generator().manual_seed(c.seed))
        slots = order[
            torch.cat([ZipfIds(c.rows, c.alpha, c.seed + t).sample(c.batch * c.bag) + t * c.rows
                       for t in range(c.tables)])
        ]  # fmt: skip
        offsets = torch.arange(0, slots.numel() + 1, c.bag)
        unique_slots, unique_index = torch.unique(slots, return_inverse=True)
        unique_table = torch.div(unique_slots, c.rows, rounding_mode="floor")
        wide = torch.rand(rows, c.dim, generator=torch.Generator().manual_seed(c.seed)) - 0.5
        weights = {name: wide.to(DTYPES.get(name, torch.float16)) for name in KERNEL_ROWS}
        state = torch.zeros(rows, 1)
        grad = torch.randn(c.tables * c.batch, c.dim) * 1e-3
        optim = FusedOptimConfig(kind=OptimKind.ROWWISE_ADAGRAD, eps=c.eps)
        workspace = native_lib.Workspace()
        lib = native_lib.library()

        def forward(w: torch.Tensor) -> None:
            native.pooled_forward(w, slots, offsets)

        def backward(w: torch.Tensor) -> None:
            native.fused_backward_group(
                w, state, grad, offsets, unique_index, unique_slots, unique_table, optim,
                [c.learning_rate] * c.tables, [1] * c.tables, workspace=workspace,
            )  # fmt: skip

        def call(op, name: str):
            def step(i: int) -> None:
                native_lib.set_f16c(name != "float16, no F16C", lib)
                try:
                    op(weights[name])
                finally:
                    native_lib.set_f16c(True, lib)

            return step

        out = {}
        for op_name, op in (("pooled forward", forward), ("backward", backward)):
            timings = time_interleaved(
                {name: call(op, name) for name in KERNEL_ROWS}, c.steps, c.repeats, c.warmup
            )
            out[op_name] = {name: 1e3 * t.median_s for name, t in timings.items()}
        return out
    finally:
        torch.set_num_threads(previous)


HEADERS = ("rows", "train ms/step", "M ids/s", "vs float32", "bytes/row")


def rows(result: PrecisionResult) -> list[tuple]:
    return [
        (
            name,
            f"{result.ms_per_step[name]:.1f}",
            f"{result.ids_per_s(name) / 1e6:.2f}",
            format_ratio(result.ratio(name)),
            f"{result.bytes_per_row[name]:.0f}",
        )
        for name in DTYPES
    ]


def main(argv: Sequence[str] | None = None) -> PrecisionResult | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--kernels", action="store_true", help="the native kernels alone")
    names = add_config_flags(parser, BenchConfig, skip=("spread",))
    args = parser.parse_args(argv)
    config = config_from_args(args, QUICK if args.quick else BenchConfig(), names)
    if args.kernels:
        load = load_average()
        ms = kernels(config)
        print(f"{machine_line((load, load_average()))}\n")
        table = [
            (op, name, f"{ms[op][name]:.2f}", format_ratio(ms[op]["float32"] / ms[op][name]))
            for op in ms
            for name in KERNEL_ROWS
        ]
        print(format_table(("kernel", "rows", "ms/call", "vs float32"), table))
        return None
    result = run(config)
    c = result.config
    print(
        f"{c.tables} tables x {c.rows:,} rows x dim {c.dim}, batch {c.batch}, {c.bag} ids/bag, "
        f"Zipf {c.alpha}; row-wise Adagrad\n{machine_line(result.load)}\n"
    )
    print(format_table(HEADERS, rows(result)))
    return result


if __name__ == "__main__":
    main()
