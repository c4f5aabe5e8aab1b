"""Train and eval throughput: KV EBC vs FBGEMM's CPU TBE vs TorchRec's MCH EBC.

One process, the same batches for every system:

* ``KV``: ``KVEmbeddingBagCollection`` (fused EXACT_ROWWISE_ADAGRAD in
  backward), primed with training steps so its tables hold ids like a running
  job; ``KV (2^40 ids)`` is the same on the same ids mapped one-to-one into a
  2**40 raw id space (the KV path does not care how large ids are).
* ``TBE``: fbgemm's ``SplitTableBatchedEmbeddingBagsCodegen`` on the host
  (EXACT_ROWWISE_ADAGRAD, fused in backward): the stock fixed-size path.
* ``MCH``: TorchRec's ``ManagedCollisionEmbeddingBagCollection`` with an LRU
  ``MCHManagedCollisionModule`` per table (eviction interval 1, so new ids get
  a row in the step they arrive, as in KV) over an ``EmbeddingBagCollection``
  made sparse-gradient and trained with ``torch.optim.Adagrad``: the stock
  zero-collision path on CPU.

Train = forward + backward (+ optimizer step) on the train batches; eval =
forward under ``torch.no_grad()`` (``.eval()`` for KV and MCH) on held-out
batches from the same distribution (so some ids were never trained). Figures are the median of
timed blocks, systems taking turns (see ``common.time_interleaved``). GB/s
counts one pass over the rows the ids touch: ``ids * dim * 4`` bytes a step.

Run from the repository root::

    python -m benchmarks.ebc_train                                  # about 2-3 min on 2 cores
    python -m benchmarks.ebc_train --out docs/bench_ebc_train.md    # also write markdown
    python -m benchmarks.ebc_train --quick                          # smoke-test sizes
    python -m benchmarks.ebc_train --profile                        # KV train step breakdown
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.modules.embedding_modules import EmbeddingBagCollection
from torchrec.modules.mc_embedding_modules import ManagedCollisionEmbeddingBagCollection
from torchrec.modules.mc_modules import (
    LRU_EvictionPolicy,
    ManagedCollisionCollection,
    MCHManagedCollisionModule,
)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from benchmarks.common import (
    IdSampler,
    ZipfIds,
    add_config_flags,
    command_line,
    config_from_args,
    format_ratio,
    format_table,
    load_average,
    machine_line,
    machine_summary,
    markdown_table,
    profile_functions,
    profile_ops,
    set_threads,
    spread_ids,
    time_interleaved,
    write_markdown,
)
from torchrec_kvemb import KVEmbeddingBagCollection, KVTableOptions

KV = "KV"
KV_SPREAD = "KV (2^40 ids)"
TBE = "TBE"
MCH = "MCH"
SPREAD_BITS = 40


@dataclass(frozen=True)
class BenchConfig:
    """Sizes and timing of one run."""

    tables: int = 4
    dim: int = 64
    batch: int = 4096
    bag: int = 20
    rows: int = 1_000_000  # per table: TBE/MCH size, id range, and KV capacity
    alpha: float = 1.05  # Zipf exponent of the ids
    steps: int = 5  # steps per timed block
    repeats: int = 7  # timed blocks per system and mode (the median is reported)
    warmup: int = 2  # untimed steps per system and mode before the blocks
    prime: int = 16  # training steps on separate batches before anything is timed
    threads: int | None = None  # torch threads; None: the machine's cores
    spread: bool = True  # also run KV on ids spread over 2**40
    mch_eviction_interval: int = 1
    learning_rate: float = 0.01
    eps: float = 1e-8
    seed: int = 0

    @property
    def ids_per_step(self) -> int:
        return self.tables * self.batch * self.bag

    @property
    def bytes_per_step(self) -> int:
        """Bytes of rows one pass over a step's ids reads (fp32 rows)."""
        return self.ids_per_step * self.dim * 4

    @property
    def timed_batches(self) -> int:
        return self.warmup + self.steps * self.repeats


#: ``--quick``: a smoke test that runs in seconds.
QUICK = BenchConfig(
    tables=2, dim=16, batch=64, bag=4, rows=10_000, steps=2, repeats=2, warmup=1, prime=2
)


@dataclass(frozen=True)
class SystemResult:
    """Throughput of one system in one mode (``train`` or ``eval``)."""

    system: str
    mode: str
    ms_per_step: float  # median over the timed blocks
    best_ms: float
    ids_per_s: float
    gb_per_s: float


@dataclass(frozen=True)
class Target:
    """KV must reach ``minimum`` times ``baseline``'s ids/s in ``mode``."""

    mode: str
    baseline: str
    minimum: float


TARGETS = (Target("train", TBE, 0.8), Target("train", MCH, 3.0), Target("eval", TBE, 1.0))


@dataclass(frozen=True)
class BenchResult:
    """All systems' results, plus what the KV tables did during the timed train steps."""

    config: BenchConfig
    results: tuple[SystemResult, ...]
    kv_steady: dict[str, float] = field(default_factory=dict)
    #: 1-minute load average at the start and the end of the run: above the
    #: number of cores, other processes took CPU time and the figures are noisy.
    load: tuple[float, float] = (-1.0, -1.0)

    def get(self, system: str, mode: str) -> SystemResult:
        for r in self.results:
            if r.system == system and r.mode == mode:
                return r
        raise KeyError(f"no result for {system} / {mode}")

    def ratio(self, system: str, baseline: str, mode: str) -> float:
        """``system``'s ids/s over ``baseline``'s, in ``mode``."""
        return self.get(system, mode).ids_per_s / self.get(baseline, mode).ids_per_s


# ------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class Batches:
    """Batch sequences shared by all systems: ``prime`` and ``timed`` train
    batches, ``held_out`` eval batches (fresh draws: some ids were never
    trained on); the ``*_spread`` twins hold the same ids spread over 2**40."""

    prime: list[KeyedJaggedTensor]
    timed: list[KeyedJaggedTensor]
    held_out: list[KeyedJaggedTensor]
    prime_spread: list[KeyedJaggedTensor]
    timed_spread: list[KeyedJaggedTensor]
    held_out_spread: list[KeyedJaggedTensor]
    grad: torch.Tensor  # [batch, tables * dim], the output gradient of every train step


def feature_names(config: BenchConfig) -> list[str]:
    return [f"f{t}" for t in range(config.tables)]


def make_batches(config: BenchConfig, samplers: Sequence[IdSampler] | None = None) -> Batches:
    """The batches of a run; ``samplers`` (one per table, default: Zipf ``config.alpha``
    over ``config.rows`` ids) draw each table's ids."""
    if samplers is None:
        samplers = [
            ZipfIds(config.rows, config.alpha, config.seed + t) for t in range(config.tables)
        ]
    keys = feature_names(config)
    lengths = torch.full((config.tables * config.batch,), config.bag, dtype=torch.int64)
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=offsets[1:])
    per_table = config.batch * config.bag

    def kjt(values: torch.Tensor) -> KeyedJaggedTensor:
        return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, offsets=offsets)

    def draw(n: int) -> tuple[list[KeyedJaggedTensor], list[KeyedJaggedTensor]]:
        plain, spread = [], []
        for _ in range(n):
            values = torch.cat([s.sample(per_table) for s in samplers])
            plain.append(kjt(values))
            if config.spread:
                spread.append(kjt(spread_ids(values, SPREAD_BITS)))
        return plain, spread

    prime, prime_spread = draw(config.prime)
    timed, timed_spread = draw(config.timed_batches)
    held_out, held_out_spread = draw(config.timed_batches)
    grad = torch.randn(
        config.batch, config.tables * config.dim, generator=torch.Generator().manual_seed(1)
    )
    return Batches(prime, timed, held_out, prime_spread, timed_spread, held_out_spread, grad)


# ------------------------------------------------------------------ systems
def table_configs(config: BenchConfig, num_embeddings: int) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=f"t{t}",
            embedding_dim=config.dim,
            num_embeddings=num_embeddings,
            feature_names=[f"f{t}"],
            pooling=PoolingType.SUM,
        )
        for t in range(config.tables)
    ]


def build_kv(config: BenchConfig, num_embeddings: int) -> KVEmbeddingBagCollection:
    return KVEmbeddingBagCollection(
        table_configs(config, num_embeddings),
        KVTableOptions(capacity=config.rows, seed=config.seed),
        fused_params={
            "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            "learning_rate": config.learning_rate,
            "eps": config.eps,
        },
    )


def build_tbe(config: BenchConfig) -> SplitTableBatchedEmbeddingBagsCodegen:
    spec = (config.rows, config.dim, EmbeddingLocation.HOST, ComputeDevice.CPU)
    return SplitTableBatchedEmbeddingBagsCodegen(
        embedding_specs=[spec] * config.tables,
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
        learning_rate=config.learning_rate,
        eps=config.eps,
        pooling_mode=PoolingMode.SUM,
    )


def build_mch(
    config: BenchConfig,
) -> tuple[ManagedCollisionEmbeddingBagCollection, torch.optim.Optimizer]:
    tables = table_configs(config, config.rows)
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
    # why sparse: a dense gradient of 4 x 1M x 64 floats makes every step cost
    # O(table size); sparse gradients + Adagrad is torch's standard CPU way.
    for bag in ebc.embedding_bags.values():
        bag.sparse = True
    modules = {
        t.name: MCHManagedCollisionModule(
            zch_size=config.rows,
            device=torch.device("cpu"),
            eviction_policy=LRU_EvictionPolicy(),
            eviction_interval=config.mch_eviction_interval,
            input_hash_size=config.rows,
        )
        for t in tables
    }
    mch = ManagedCollisionEmbeddingBagCollection(
        ebc,
        ManagedCollisionCollection(managed_collision_modules=modules, embedding_configs=tables),
        return_remapped_features=False,
    )
    optimizer = torch.optim.Adagrad(ebc.parameters(), lr=config.learning_rate, eps=config.eps)
    # Adagrad builds its sparse update without invariant checks and says so once.
    warnings.filterwarnings("ignore", message="Sparse invariant checks are implicitly disabled")
    return mch, optimizer


def kv_train(ebc: KVEmbeddingBagCollection, batches: list, grad: torch.Tensor) -> Callable:
    def step(i: int) -> None:
        ebc(batches[i % len(batches)]).values().backward(grad)

    return step


def kv_eval(ebc: KVEmbeddingBagCollection, batches: list) -> Callable:
    def step(i: int) -> None:
        with torch.no_grad():
            ebc(batches[i % len(batches)])

    return step


def tbe_train(tbe: SplitTableBatchedEmbeddingBagsCodegen, batches: list, grad: torch.Tensor):
    def step(i: int) -> None:
        kjt = batches[i % len(batches)]
        tbe(kjt.values(), kjt.offsets()).backward(grad)

    return step


def tbe_eval(tbe: SplitTableBatchedEmbeddingBagsCodegen, batches: list) -> Callable:
    def step(i: int) -> None:
        kjt = batches[i % len(batches)]
        with torch.no_grad():
            tbe(kjt.values(), kjt.offsets())

    return step


def mch_train(mch, optimizer: torch.optim.Optimizer, batches: list, grad: torch.Tensor):
    def step(i: int) -> None:
        pooled, _ = mch(batches[i % len(batches)])
        pooled.values().backward(grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def mch_eval(mch, batches: list) -> Callable:
    def step(i: int) -> None:
        with torch.no_grad():
            mch(batches[i % len(batches)])

    return step


# -------------------------------------------------------------------- run
def _kv_counters(ebc: KVEmbeddingBagCollection) -> dict[str, float]:
    totals: dict[str, float] = {}
    for metrics in ebc.metrics().values():
        for k, v in metrics.items():
            totals[k] = totals.get(k, 0.0) + v
    return totals


def _log(message: str, verbose: bool) -> None:
    if verbose:
        print(message, file=sys.stderr, flush=True)


def run(config: BenchConfig, verbose: bool = True) -> BenchResult:
    """Build every system, prime, time train then eval; threads as in ``config``."""
    previous_threads = set_threads(config.threads)
    try:
        return _run(config, verbose)
    finally:
        torch.set_num_threads(previous_threads)


def _run(config: BenchConfig, verbose: bool) -> BenchResult:
    begin = time.perf_counter()
    load_at_start = load_average()
    batches = make_batches(config)
    kv = build_kv(config, config.rows)
    kv_spread = build_kv(config, 1 << SPREAD_BITS) if config.spread else None
    tbe = build_tbe(config)
    mch, mch_optimizer = build_mch(config)
    _log(f"built inputs and systems in {time.perf_counter() - begin:.1f}s", verbose)

    train_steps = {KV: kv_train(kv, batches.timed, batches.grad)}
    prime_steps = {KV: kv_train(kv, batches.prime, batches.grad)}
    if kv_spread is not None:
        train_steps[KV_SPREAD] = kv_train(kv_spread, batches.timed_spread, batches.grad)
        prime_steps[KV_SPREAD] = kv_train(kv_spread, batches.prime_spread, batches.grad)
    train_steps[TBE] = tbe_train(tbe, batches.timed, batches.grad)
    prime_steps[TBE] = tbe_train(tbe, batches.prime, batches.grad)
    train_steps[MCH] = mch_train(mch, mch_optimizer, batches.timed, batches.grad)
    prime_steps[MCH] = mch_train(mch, mch_optimizer, batches.prime, batches.grad)

    for name, step in prime_steps.items():
        start = time.perf_counter()
        for i in range(config.prime):
            step(i)
        _log(
            f"primed {name} with {config.prime} train steps in {time.perf_counter() - start:.1f}s",
            verbose,
        )

    before = _kv_counters(kv)
    train = time_interleaved(train_steps, config.steps, config.repeats, config.warmup)
    after = _kv_counters(kv)
    _log(f"timed train steps ({time.perf_counter() - begin:.0f}s so far)", verbose)

    kv.eval()
    mch.eval()
    eval_steps = {KV: kv_eval(kv, batches.held_out)}
    if kv_spread is not None:
        kv_spread.eval()
        eval_steps[KV_SPREAD] = kv_eval(kv_spread, batches.held_out_spread)
    eval_steps[TBE] = tbe_eval(tbe, batches.held_out)
    eval_steps[MCH] = mch_eval(mch, batches.held_out)
    eval_before = _kv_counters(kv)
    evaluation = time_interleaved(eval_steps, config.steps, config.repeats, config.warmup)
    eval_after = _kv_counters(kv)
    _log(f"timed eval steps ({time.perf_counter() - begin:.0f}s in all)", verbose)

    results = []
    for mode, timings in (("train", train), ("eval", evaluation)):
        for name, timing in timings.items():
            ids_per_s = config.ids_per_step / timing.median_s
            results.append(
                SystemResult(
                    system=name,
                    mode=mode,
                    ms_per_step=1e3 * timing.median_s,
                    best_ms=1e3 * timing.best_s,
                    ids_per_s=ids_per_s,
                    gb_per_s=ids_per_s * config.dim * 4 / 1e9,
                )
            )
    steady = steady_counters(before, after, eval_before, eval_after, config.timed_batches)
    return BenchResult(config, tuple(results), steady, (load_at_start, load_average()))


def steady_counters(
    before: dict[str, float],
    after: dict[str, float],
    eval_before: dict[str, float],
    eval_after: dict[str, float],
    train_steps: int,
) -> dict[str, float]:
    """What the KV tables did over ``train_steps`` timed train steps (``_kv_counters``
    before and after them) and over the eval steps: new ids and evictions per step,
    hit rates, load factor at the end of training."""
    seen = after["hits"] + after["misses"] - before["hits"] - before["misses"]
    eval_seen = sum(eval_after[k] - eval_before[k] for k in ("hits", "misses"))
    return {
        "new_ids_per_step": (after["inserts"] - before["inserts"]) / train_steps,
        "evictions_per_step": (after["evictions"] - before["evictions"]) / train_steps,
        "hit_rate": (after["hits"] - before["hits"]) / max(seen, 1),
        "load_factor": after["size"] / after["capacity"],
        "eval_hit_rate": (eval_after["hits"] - eval_before["hits"]) / max(1, eval_seen),
    }


# ----------------------------------------------------------------- report
def describe(config: BenchConfig) -> str:
    return (
        f"{config.tables} tables x {config.rows:,} rows x dim {config.dim}, batch {config.batch}, "
        f"{config.bag} ids/bag (SUM), Zipf alpha {config.alpha}; "
        f"{config.ids_per_step:,} ids/step ({config.bytes_per_step / 1e6:.1f} MB of rows/pass); "
        f"median of {config.repeats} blocks x {config.steps} steps "
        f"after {config.prime} priming steps"
    )


def result_rows(result: BenchResult) -> list[tuple]:
    return [
        (
            r.system,
            r.mode,
            f"{r.ms_per_step:.1f}",
            f"{r.best_ms:.1f}",
            f"{r.ids_per_s / 1e6:.2f}",
            f"{r.gb_per_s:.2f}",
        )
        for r in result.results
    ]


RESULT_HEADERS = ("system", "mode", "ms/step", "best ms", "M ids/s", "GB/s")
RATIO_HEADERS = ("ratio (ids/s)", "value", "target", "")


def ratio_rows(result: BenchResult) -> list[tuple]:
    rows = []
    for target in TARGETS:
        value = result.ratio(KV, target.baseline, target.mode)
        rows.append(
            (
                f"{KV}/{target.baseline} {target.mode}",
                format_ratio(value),
                f">= {target.minimum:.1f}x",
                "met" if value >= target.minimum else "MISSED",
            )
        )
    if result.config.spread:
        for target in TARGETS:
            value = result.ratio(KV_SPREAD, target.baseline, target.mode)
            rows.append(
                (
                    f"{KV_SPREAD}/{target.baseline} {target.mode}",
                    format_ratio(value),
                    f"(>= {target.minimum:.1f}x)",
                    "",
                )
            )
    return rows


def steady_line(result: BenchResult) -> str:
    s = result.kv_steady
    return (
        f"KV tables during the timed train steps (all tables): "
        f"{s['new_ids_per_step']:,.0f} new ids/step, {s['evictions_per_step']:,.0f} "
        f"evictions/step, hit rate {100 * s['hit_rate']:.1f}%, load factor {s['load_factor']:.3f}; "
        f"eval hit rate {100 * s['eval_hit_rate']:.1f}%"
    )


def report(result: BenchResult) -> str:
    return "\n\n".join(
        [
            describe(result.config) + "\n" + machine_line(result.load),
            format_table(RESULT_HEADERS, result_rows(result)),
            format_table(RATIO_HEADERS, ratio_rows(result)),
            steady_line(result),
        ]
    )


def write_report(result: BenchResult, path: str, command: str) -> None:
    write_markdown(
        path,
        "KV EBC train/eval vs FBGEMM TBE and TorchRec MCH (CPU)",
        [
            f"`{command}`",
            describe(result.config) + ".  \n" + machine_line(result.load) + ".",
            markdown_table(RESULT_HEADERS, result_rows(result)),
            markdown_table(RATIO_HEADERS, ratio_rows(result)),
            steady_line(result) + ".",
            "Train: forward + backward with the optimizer (fused EXACT_ROWWISE_ADAGRAD for KV "
            "and TBE; sparse gradients + `torch.optim.Adagrad` for MCH, whose LRU "
            f"`MCHManagedCollisionModule` evicts every {result.config.mch_eviction_interval} "
            "step(s)). Eval: forward under `torch.no_grad()`, `.eval()` for KV and MCH, on "
            "held-out batches (fresh draws from the same distribution). "
            "GB/s counts one pass over the rows the ids touch (ids x dim x 4 bytes). "
            "Systems take turns block by block on the same batches, so machine noise "
            "hits them alike; compare ratios within a run. A load average above the "
            "core count means other processes took CPU time: such runs are noisy, and the "
            "KV path (hundreds of small ops a step) suffers more than TBE (two large ones).",
        ],
    )


# ---------------------------------------------------------------- profile
def profile_kv(config: BenchConfig, calls: int = 3) -> str:
    """Prime a KV EBC as ``run`` does, then break down its train step."""
    previous_threads = set_threads(config.threads)
    try:
        batches = make_batches(replace(config, spread=False, repeats=2 * calls, steps=1))
        kv = build_kv(config, config.rows)
        prime = kv_train(kv, batches.prime, batches.grad)
        for i in range(config.prime):
            prime(i)
        step = kv_train(kv, batches.timed, batches.grad)
        for i in range(config.warmup):
            step(i)
        functions = profile_functions(lambda i: step(config.warmup + i), calls, "torchrec_kvemb")
        ops = profile_ops(lambda i: step(config.warmup + calls + i), calls)
        return (
            f"KV train step, {describe(config)}\n{machine_summary()}\n\n"
            f"By torchrec_kvemb function (innermost on the stack, per step):\n{functions}\n\n"
            f"By torch op (torch.profiler, per step):\n{ops}"
        )
    finally:
        torch.set_num_threads(previous_threads)


# -------------------------------------------------------------------- CLI
def parse_args(argv: Sequence[str] | None) -> tuple[BenchConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    parser.add_argument("--out", help="also write a markdown report to this path")
    parser.add_argument("--profile", action="store_true", help="profile the KV train step only")
    parser.add_argument("--no-spread", action="store_true", help="skip the 2**40-id KV run")
    names = add_config_flags(parser, BenchConfig, skip=("spread",))
    args = parser.parse_args(argv)
    config = config_from_args(args, QUICK if args.quick else BenchConfig(), names)
    if args.no_spread:
        config = replace(config, spread=False)
    return config, args


def main(argv: Sequence[str] | None = None) -> BenchResult | None:
    """Run the benchmark (or ``--profile``), print the tables; returns the result."""
    config, args = parse_args(argv)
    if args.profile:
        print(profile_kv(config))
        return None
    result = run(config)
    print(report(result))
    if args.out:
        write_report(result, args.out, command_line("benchmarks.ebc_train", argv))
        print(f"\nwrote {args.out}")
    return result


if __name__ == "__main__":
    main()
