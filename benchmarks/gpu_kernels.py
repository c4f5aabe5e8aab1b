"""GPU mode: the Triton kernels and the KV EBC against FBGEMM's fused tables, one device.

Three parts, in one process on one device:

* ``copy``: the device's copy bandwidth, ``dst.copy_(src)`` over a large
  buffer, counted as bytes read + bytes written per second: the roofline every
  kernel's GB/s is compared with.
* ``kernels``: each Triton kernel alone on one table: ``probe``, ``find`` (the
  find-or-insert kernel on stored ids: score update, no insert), ``insert``
  (new ids into a full table: ranking and eviction), ``pooled fwd``, ``pooled
  bwd`` (per-row gradient reduction) and ``optimizer`` (row-wise Adagrad
  update). Ids/s and GB/s, where GB/s counts the bytes a kernel must read and
  write at least (``kernel_bytes``), and that figure over the copy bandwidth.
  Side by side, FBGEMM's fused table (``SplitTableBatchedEmbeddingBagsCodegen``
  in device memory) on the same rows: its forward against the pooled forward
  kernel, its forward + fused backward against the three lookup kernels. Both
  start from the same weights, and the run stops (``RuntimeError``) unless
  their pooled rows and first update agree.
* ``ebc``: ``KVEmbeddingBagCollection`` on the device (Triton backend: probe,
  find-or-insert, pooling, fused row-wise Adagrad in backward) against FBGEMM's
  fused tables on the same Zipf batches, train and eval steps, as
  ``benchmarks.ebc_train`` does on CPU.

Run on a machine with a CUDA GPU and fbgemm-gpu built for CUDA::

    python -m benchmarks.gpu_kernels                  # a few minutes
    python -m benchmarks.gpu_kernels --out docs/bench_gpu.md
    python -m benchmarks.run --gpu                    # the same, in the suite's table

``--device cpu`` runs everything on CPU with the Triton kernels in Triton's
interpreter (``TRITON_INTERPRET=1`` must be set before start): a smoke test of
the harness at ``--quick`` sizes, whose figures mean nothing.
"""

from __future__ import annotations

import argparse
import os
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
    format_ratio,
    format_table,
    machine_summary,
    markdown_table,
    spread_ids,
    time_interleaved,
    write_markdown,
)
from torchrec_kvemb.backend import ENV_VAR
from torchrec_kvemb.options import WAYS

KV = "KV"
TBE = "TBE"
#: Kernel names, in the order they are reported.
KERNELS = ("probe", "find", "insert", "pooled fwd", "pooled bwd", "optimizer")
#: KV EBC over FBGEMM's fused tables, in ids/s (the same targets as on CPU).
EBC_TARGETS = {"train": 0.7, "eval": 0.7}


@dataclass(frozen=True)
class GpuConfig:
    """Sizes and timing of one run."""

    tables: int = 4
    dim: int = 128
    batch: int = 16_384
    bag: int = 16
    rows: int = 2_000_000  # per table: TBE size, id range, KV capacity
    alpha: float = 1.05  # Zipf exponent of the ids
    kernel_ids: int = 1 << 20  # ids per kernel call
    copy_mb: int = 1024  # buffer of the copy-bandwidth measure
    steps: int = 10  # calls per timed block
    repeats: int = 5  # timed blocks (the median is reported)
    warmup: int = 3  # untimed calls before the blocks
    prime: int = 8  # KV EBC training steps before anything is timed
    learning_rate: float = 0.01
    eps: float = 1e-8
    seed: int = 0

    @property
    def ids_per_step(self) -> int:
        return self.tables * self.batch * self.bag


#: ``--quick``: odd tiny sizes, seconds in Triton's interpreter.
QUICK = GpuConfig(
    tables=2,
    dim=12,  # FBGEMM's tables need a multiple of 4
    batch=7,
    bag=3,
    rows=199,
    kernel_ids=61,
    copy_mb=1,
    steps=1,
    repeats=2,
    warmup=1,
    prime=2,
)


@dataclass(frozen=True)
class Rate:
    """One timed thing: ``items`` (ids or rows) and ``nbytes`` per call, median seconds."""

    part: str  # "copy", "kernels" or "ebc"
    name: str
    system: str  # KV or TBE ("" for copy)
    items: int
    nbytes: int
    seconds: float

    @property
    def items_per_s(self) -> float:
        return self.items / self.seconds

    @property
    def gb_per_s(self) -> float:
        return self.nbytes / self.seconds / 1e9


@dataclass(frozen=True)
class GpuResult:
    config: GpuConfig
    device: str
    rates: tuple[Rate, ...]

    def get(self, part: str, name: str, system: str) -> Rate:
        for r in self.rates:
            if (r.part, r.name, r.system) == (part, name, system):
                return r
        raise KeyError(f"no rate for {part} / {name} / {system}")

    @property
    def copy(self) -> Rate:
        return self.get("copy", "copy", "")


# -------------------------------------------------------------- byte counts
def kernel_bytes(kernel: str, ids: int, bags: int, rows: int, dim: int) -> int:
    """Bytes a kernel must read and write at least, for ``ids`` ids in ``bags``
    bags touching ``rows`` distinct rows of ``dim`` fp32 values (int64 ids and
    slots, a ``WAYS``-way bucket of int64 keys per lookup):

    * ``probe``: id in, its bucket's keys, slot out;
    * ``find``: id and score in, bucket keys, score read and written, slot out;
    * ``insert``: as ``find``, plus the new key and score written;
    * ``pooled fwd``: slot, id and row per id, offsets, one pooled row out per bag;
    * ``pooled bwd``: slot and the bag's gradient row per id, one gradient row
      and slot out per distinct row;
    * ``optimizer`` (row-wise Adagrad): per distinct row its slot, gradient,
      row read and written, state read and written.
    """
    bucket = WAYS * 8
    row = dim * 4
    if kernel == "probe":
        return ids * (8 + bucket + 8)
    if kernel == "find":
        return ids * (8 + 8 + bucket + 16 + 8)
    if kernel == "insert":
        return ids * (8 + 8 + bucket + 16 + 8 + 16)
    if kernel == "pooled fwd":
        return ids * (8 + 8 + row) + (bags + 1) * 8 + bags * row
    if kernel == "pooled bwd":
        return ids * (8 + row) + rows * (row + 8)
    if kernel == "optimizer":
        return rows * (8 + row + 2 * row + 2 * 4)
    raise ValueError(f"unknown kernel {kernel!r}; expected one of {KERNELS}")


# ------------------------------------------------------------------ device
def check_device(name: str) -> torch.device:
    """The device to run on; exit 2 with one line on stderr when it cannot be used."""
    try:
        device = torch.device(name)
    except RuntimeError:
        _refuse(f"unsupported device {name!r} (cuda, or cpu with TRITON_INTERPRET=1)")
    if device.type == "cuda" and not torch.cuda.is_available():
        _refuse("a CUDA device is required (none found)")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        _refuse("--device cpu runs the Triton kernels in the interpreter: set TRITON_INTERPRET=1")
    if device.type not in ("cuda", "cpu"):
        _refuse(f"unsupported device {name!r} (cuda, or cpu with TRITON_INTERPRET=1)")
    return device


def _refuse(message: str) -> None:
    print(f"benchmarks.gpu_kernels: {message}", file=sys.stderr)
    raise SystemExit(2)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{props.name} ({props.total_memory / 2**30:.0f} GiB), torch {torch.__version__}"
    return f"CPU with Triton's interpreter (smoke test: figures mean nothing); {machine_summary()}"


def _sync(device: torch.device) -> Callable[[], object] | None:
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None


def _median_s(
    device: torch.device, steps: dict[str, Callable[[int], object]], config: GpuConfig
) -> dict[str, float]:
    timings = time_interleaved(
        steps, config.steps, config.repeats, config.warmup, sync=_sync(device)
    )
    return {name: t.median_s for name, t in timings.items()}


# -------------------------------------------------------------------- copy
def measure_copy(config: GpuConfig, device: torch.device) -> Rate:
    n = config.copy_mb * (1 << 20) // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    seconds = _median_s(device, {"copy": lambda i: dst.copy_(src)}, config)["copy"]
    return Rate("copy", "copy", "", n, 2 * 4 * n, seconds)


# ----------------------------------------------------------------- kernels
def _build_tbe(config: GpuConfig, device: torch.device, tables: int):
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        EmbeddingLocation,
        PoolingMode,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
        ComputeDevice,
        SplitTableBatchedEmbeddingBagsCodegen,
    )

    if device.type == "cuda":
        where = (EmbeddingLocation.DEVICE, ComputeDevice.CUDA)
    else:
        where = (EmbeddingLocation.HOST, ComputeDevice.CPU)
    try:
        return SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(config.rows, config.dim, *where)] * tables,
            optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            learning_rate=config.learning_rate,
            eps=config.eps,
            pooling_mode=PoolingMode.SUM,
            device=device,
        )
    except Exception as exc:  # noqa: BLE001 - any failure means: no stock baseline here
        hint = "; install fbgemm-gpu built for this CUDA" if device.type == "cuda" else ""
        _refuse(f"FBGEMM's fused tables do not run on {device} ({type(exc).__name__}: {exc}){hint}")
        raise  # unreachable: _refuse exits


def measure_kernels(config: GpuConfig, device: torch.device) -> list[Rate]:
    """Every Triton kernel alone on one table of ``config.rows`` slots, then
    FBGEMM's fused table on the same rows."""
    from torchrec_kvemb.kernels.insert import insert_triton
    from torchrec_kvemb.kernels.optimizer_update import optimizer_update_triton
    from torchrec_kvemb.kernels.pooled_lookup import pooled_backward_triton, pooled_forward_triton
    from torchrec_kvemb.kernels.probe import probe_triton
    from torchrec_kvemb.ops.pooled_lookup import InitSpec
    from torchrec_kvemb.optimizer import FusedOptimConfig

    gen = torch.Generator().manual_seed(config.seed)
    buckets = max(1, config.rows // WAYS)
    capacity = buckets * WAYS
    keys = torch.full((buckets, WAYS), -1, dtype=torch.int64, device=device)
    scores = torch.zeros_like(keys)

    # Fill to three quarters with ids spread over 2**40 (a few bucket overflows evict).
    universe = max(1, 3 * capacity // 4)
    stored_ids = spread_ids(torch.randperm(universe, generator=gen)).to(device)
    chunk = max(1, config.kernel_ids)
    for lo in range(0, universe, chunk):
        part = stored_ids[lo : lo + chunk]
        insert_triton(keys, scores, part, torch.ones_like(part), False, False)
    stored_ids = stored_ids[probe_triton(keys, stored_ids) >= 0]  # every lookup hits
    universe = stored_ids.numel()

    # One batch of Zipf ids over the stored ids, in bags of ``bag``.
    n = max(config.bag, config.kernel_ids // config.bag * config.bag)
    bags = n // config.bag
    ranks = ZipfIds(universe, config.alpha, config.seed).sample(n)
    ids = stored_ids[ranks.to(device)]
    uniq = torch.unique(ids)
    offsets = torch.arange(0, n + 1, config.bag, dtype=torch.int64, device=device)
    weights = torch.randn(capacity, config.dim, generator=gen).mul_(0.01).to(device)
    state = torch.zeros(capacity, 1, device=device)
    grad_out = torch.randn(bags, config.dim, generator=gen).to(device)
    init = InitSpec(config.seed, False, -0.01, 0.01)
    optim = FusedOptimConfig(learning_rate=config.learning_rate, eps=config.eps)
    slots = probe_triton(keys, ids)
    upd_slots, upd_grads = pooled_backward_triton(grad_out, slots, offsets, None, False)
    rows = upd_slots.numel()

    # ``insert`` writes new ids into its own copy of the index, a fresh set per call.
    new_keys, new_scores = keys.clone(), scores.clone()
    fresh = spread_ids(torch.arange(uniq.numel()) + universe).to(device)

    def insert_new(i: int) -> None:
        batch = fresh + (i + 1) * uniq.numel()
        insert_triton(new_keys, new_scores, batch, torch.full_like(batch, i + 2), False, False)

    def optimizer(i: int) -> None:
        optimizer_update_triton(weights, state, upd_slots, upd_grads, optim, i + 1)

    find_values = torch.full_like(uniq, 7)
    kernel_steps = {
        "probe": lambda i: probe_triton(keys, ids),
        "find": lambda i: insert_triton(keys, scores, uniq, find_values, False, False),
        "insert": insert_new,
        "pooled fwd": lambda i: pooled_forward_triton(
            weights, slots, ids, offsets, None, False, init
        ),
        "pooled bwd": lambda i: pooled_backward_triton(grad_out, slots, offsets, None, False),
        "optimizer": optimizer,
    }
    seconds = _median_s(device, kernel_steps, config)
    count = {"find": uniq.numel(), "insert": uniq.numel(), "optimizer": rows}
    rates = [
        Rate(
            "kernels",
            name,
            KV,
            count.get(name, n),
            kernel_bytes(name, count.get(name, n), bags, rows, config.dim),
            seconds[name],
        )
        for name in KERNELS
    ]

    # FBGEMM's fused table over the same rows (indices = the KV slots), from the same
    # weights: both must compute the same pooled rows and the same first update.
    tbe = _build_tbe(config, device, tables=1)
    tbe_ids = slots
    tbe_weights = tbe.split_embedding_weights()[0]
    with torch.no_grad():
        tbe_weights[:capacity].copy_(weights)
    state.zero_()  # as FBGEMM's new optimizer state (the timed updates above filled it)

    def kv_train(i: int) -> None:
        pooled_forward_triton(weights, slots, ids, offsets, None, False, init)
        got_slots, got_grads = pooled_backward_triton(grad_out, slots, offsets, None, False)
        optimizer_update_triton(weights, state, got_slots, got_grads, optim, i + 1)

    def tbe_train(i: int) -> None:
        tbe(tbe_ids, offsets).backward(grad_out)

    def tbe_fwd(i: int) -> None:
        with torch.no_grad():
            tbe(tbe_ids, offsets)

    check_same_as_tbe(
        "pooled forward",
        pooled_forward_triton(weights, slots, ids, offsets, None, False, init),
        tbe(tbe_ids, offsets).detach(),
    )
    kv_train(0)
    tbe_train(0)
    check_same_as_tbe("rows after one update", weights[upd_slots], tbe_weights[upd_slots])
    seconds = _median_s(device, {"kv": kv_train, "tbe": tbe_train, "tbe fwd": tbe_fwd}, config)
    fwd_bytes = kernel_bytes("pooled fwd", n, bags, rows, config.dim)
    train_bytes = sum(
        kernel_bytes(k, rows if k == "optimizer" else n, bags, rows, config.dim)
        for k in ("pooled fwd", "pooled bwd", "optimizer")
    )
    rates += [
        Rate("kernels", "fwd", TBE, n, fwd_bytes, seconds["tbe fwd"]),
        Rate("kernels", "fwd+bwd+update", KV, n, train_bytes, seconds["kv"]),
        Rate("kernels", "fwd+bwd+update", TBE, n, train_bytes, seconds["tbe"]),
    ]
    return rates


def check_same_as_tbe(what: str, kv: torch.Tensor, tbe: torch.Tensor) -> None:
    """Raise unless the Triton kernels' result matches FBGEMM's (float tolerance):
    a benchmark of two systems that compute different things measures nothing."""
    if not torch.allclose(kv, tbe.to(kv.dtype), rtol=1e-4, atol=1e-5):
        worst = (kv - tbe).abs().max().item()
        raise RuntimeError(f"{what}: the Triton kernels and FBGEMM disagree (max diff {worst:.3g})")


# --------------------------------------------------------------------- EBC
def measure_ebc(config: GpuConfig, device: torch.device) -> list[Rate]:
    """KV EBC vs FBGEMM's fused tables: train and eval steps on the same batches."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_kvemb import KVEmbeddingBagCollection, KVTableOptions

    samplers = [ZipfIds(config.rows, config.alpha, config.seed + t) for t in range(config.tables)]
    keys = [f"f{t}" for t in range(config.tables)]
    lengths = torch.full((config.tables * config.batch,), config.bag, dtype=torch.int64)
    per_table = config.batch * config.bag
    timed = config.warmup + config.steps * config.repeats

    def draw(count: int) -> list[KeyedJaggedTensor]:
        out = []
        for _ in range(count):
            values = torch.cat([s.sample(per_table) for s in samplers])
            kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)
            out.append(kjt.to(device))
        return out

    prime, train_batches, held_out = draw(config.prime), draw(timed), draw(timed)
    grad = torch.randn(config.batch, config.tables * config.dim).to(device)
    kv = KVEmbeddingBagCollection(
        [
            EmbeddingBagConfig(
                name=f"t{t}",
                embedding_dim=config.dim,
                num_embeddings=config.rows,
                feature_names=[keys[t]],
                pooling=PoolingType.SUM,
            )
            for t in range(config.tables)
        ],
        KVTableOptions(capacity=config.rows, seed=config.seed),
        device=device,
        fused_params={
            "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            "learning_rate": config.learning_rate,
            "eps": config.eps,
        },
    )
    tbe = _build_tbe(config, device, tables=config.tables)

    def kv_train(batches):
        return lambda i: kv(batches[i % len(batches)]).values().backward(grad)

    def tbe_train(batches):
        def step(i: int) -> None:
            kjt = batches[i % len(batches)]
            tbe(kjt.values(), kjt.offsets()).backward(grad)

        return step

    for i in range(config.prime):
        kv_train(prime)(i)
        tbe_train(prime)(i)
    train = _median_s(device, {KV: kv_train(train_batches), TBE: tbe_train(train_batches)}, config)

    kv.eval()

    def kv_eval(i: int) -> None:
        with torch.no_grad():
            kv(held_out[i % len(held_out)])

    def tbe_eval(i: int) -> None:
        kjt = held_out[i % len(held_out)]
        with torch.no_grad():
            tbe(kjt.values(), kjt.offsets())

    evaluation = _median_s(device, {KV: kv_eval, TBE: tbe_eval}, config)
    row_bytes = config.ids_per_step * config.dim * 4
    return [
        Rate("ebc", mode, system, config.ids_per_step, row_bytes, seconds[system])
        for mode, seconds in (("train", train), ("eval", evaluation))
        for system in (KV, TBE)
    ]


# ------------------------------------------------------------------- run
def run(config: GpuConfig, device: torch.device, verbose: bool = True) -> GpuResult:
    """All three parts on ``device`` with the Triton backend forced."""
    previous = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = "triton"
    begin = time.perf_counter()
    try:
        rates = [measure_copy(config, device)]
        _log(f"copy bandwidth measured ({time.perf_counter() - begin:.0f}s)", verbose)
        rates += measure_kernels(config, device)
        _log(f"kernels timed ({time.perf_counter() - begin:.0f}s)", verbose)
        rates += measure_ebc(config, device)
        _log(f"EBC steps timed ({time.perf_counter() - begin:.0f}s)", verbose)
    finally:
        if previous is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = previous
    return GpuResult(config, device_name(device), tuple(rates))


def _log(message: str, verbose: bool) -> None:
    if verbose:
        print(message, file=sys.stderr, flush=True)


# ----------------------------------------------------------------- report
RATE_HEADERS = ("part", "what", "system", "M items/s", "GB/s", "of copy")


def _figure(value: float) -> str:
    return f"{value:.2f}" if value >= 0.1 else f"{value:.3g}"


def rate_rows(result: GpuResult) -> list[tuple]:
    copy = result.copy.gb_per_s
    return [
        (
            r.part,
            r.name,
            r.system or "-",
            "-" if r.part == "copy" else _figure(r.items_per_s / 1e6),
            _figure(r.gb_per_s),
            format_ratio(r.gb_per_s / copy),
        )
        for r in result.rates
    ]


@dataclass(frozen=True)
class Ratio:
    what: str
    kv: Rate
    baseline: Rate
    target: float | None

    @property
    def value(self) -> float:
        return self.kv.items_per_s / self.baseline.items_per_s


def ratios(result: GpuResult) -> list[Ratio]:
    """KV over FBGEMM in ids/s: whole EBC steps (with targets) and lookup kernels."""
    out = [
        Ratio(f"KV EBC / TBE {mode}", result.get("ebc", mode, KV), result.get("ebc", mode, TBE),
              target)
        for mode, target in EBC_TARGETS.items()
    ]  # fmt: skip
    out.append(
        Ratio("pooled fwd kernel / TBE fwd", result.get("kernels", "pooled fwd", KV),
              result.get("kernels", "fwd", TBE), None)
    )  # fmt: skip
    out.append(
        Ratio("fwd+bwd+update kernels / TBE fwd+bwd",
              result.get("kernels", "fwd+bwd+update", KV),
              result.get("kernels", "fwd+bwd+update", TBE), None)
    )  # fmt: skip
    return out


RATIO_HEADERS = ("ratio (ids/s)", "value", "target", "")


def ratio_rows(result: GpuResult) -> list[tuple]:
    rows = []
    for r in ratios(result):
        verdict = "" if r.target is None else ("met" if r.value >= r.target else "MISSED")
        target = "-" if r.target is None else f">= {r.target:g}x"
        rows.append((r.what, format_ratio(r.value), target, verdict))
    return rows


def describe(config: GpuConfig) -> str:
    return (
        f"kernels: one table of {config.rows:,} slots x dim {config.dim}, "
        f"{config.kernel_ids:,} Zipf ids (alpha {config.alpha}) a call in bags of {config.bag}; "
        f"EBC: {config.tables} tables, batch {config.batch}, {config.ids_per_step:,} ids/step; "
        f"median of {config.repeats} blocks x {config.steps} calls; "
        f"copy buffer {config.copy_mb} MiB"
    )


def report(result: GpuResult) -> str:
    return "\n\n".join(
        [
            f"device: {result.device}\n{describe(result.config)}",
            f"copy bandwidth: {result.copy.gb_per_s:.1f} GB/s (read + write)",
            format_table(RATE_HEADERS, rate_rows(result)),
            format_table(RATIO_HEADERS, ratio_rows(result)),
        ]
    )


def write_report(result: GpuResult, path: str, command: str) -> None:
    write_markdown(
        path,
        "Triton kernels and KV EBC vs FBGEMM fused tables (GPU)",
        [
            f"`{command}`",
            f"Device: {result.device}.  \n{describe(result.config)}.  \n"
            f"Copy bandwidth: {result.copy.gb_per_s:.1f} GB/s (bytes read + written).",
            markdown_table(RATE_HEADERS, rate_rows(result)),
            markdown_table(RATIO_HEADERS, ratio_rows(result)),
            "GB/s counts the bytes each kernel must move at least "
            "(`benchmarks.gpu_kernels.kernel_bytes`); `of copy` is that over the copy "
            "bandwidth. EBC GB/s counts one pass over the rows a step's ids touch.",
        ],
    )


# -------------------------------------------------------------------- CLI
def parse_args(argv: Sequence[str] | None) -> tuple[GpuConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu for a smoke test")
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--out", help="also write a markdown report to this path")
    names = add_config_flags(parser, GpuConfig)
    args = parser.parse_args(argv)
    config = config_from_args(args, QUICK if args.quick else GpuConfig(), names)
    if config.dim % 4:
        parser.error(f"--dim must be a multiple of 4 (FBGEMM's fused tables), got {config.dim}")
    return config, args


def main(argv: Sequence[str] | None = None) -> GpuResult:
    """Check the device, run, print the tables (and write ``--out``); returns the result."""
    config, args = parse_args(argv)
    device = check_device(args.device)
    result = run(config, device)
    print(report(result))
    if args.out:
        write_report(result, args.out, command_line("benchmarks.gpu_kernels", argv))
        print(f"\nwrote {args.out}")
    return result


if __name__ == "__main__":
    main()
