"""GPU mode: the Triton kernels and the KV EBC against what a CUDA machine has
without FBGEMM's CUDA build, one device.

Three parts, in one process on one device:

* ``copy``: the device's copy bandwidth, ``dst.copy_(src)`` over a large
  buffer, counted as bytes read + bytes written per second: the roofline every
  kernel's GB/s is compared with.
* ``kernels``: each Triton launcher of the grouped hot path alone, on a full
  group of ``tables`` tables (every bucket of every table holds ``WAYS``
  ids): ``probe`` (``group_lookup_eval_triton``), ``find+insert``
  (``group_lookup_train_triton``: the batch's stored ids update their score,
  one id in 8 is new and takes a row by eviction), ``pooled fwd``
  (``group_pooled_forward_triton``) and ``fused bwd``
  (``group_fused_backward_triton``: per-row gradient reduction and row-wise
  Adagrad update in one launch). Ids/s and GB/s, where GB/s counts the bytes a
  launcher must read and write at least (``kernel_bytes``), and that figure
  over the copy bandwidth. Side by side, torch's ``nn.EmbeddingBag`` over the
  same rows (the group's rows, indexed by slot): its forward against the pooled
  forward, and its forward + sparse backward + ``torch.optim.Adagrad`` step
  (element-wise Adagrad: torch has no row-wise one) against pooled forward +
  fused backward. The run stops (``RuntimeError``) unless their pooled rows agree.
* ``ebc``: ``KVEmbeddingBagCollection`` on the device (Triton backend: the
  same launchers, fused row-wise Adagrad in backward) against a stock TorchRec
  ``EmbeddingBagCollection`` on the device (torch's ``EmbeddingBag``, sparse
  gradients, ``torch.optim.Adagrad``) on the same Zipf batches, train and eval
  steps, as ``benchmarks.ebc_train`` does on CPU. The stock tables start from
  the KV tables' initial rows, and the run stops unless the first batch pools
  the same rows in both.

FBGEMM's fused tables (``SplitTableBatchedEmbeddingBagsCodegen``) join both
parts as a further baseline where they run on the device (FBGEMM's CUDA build;
on CPU its CPU build): against the pooled forward and forward + fused backward,
and against the KV EBC with the targets below; their pooled rows and first
update must agree too. Where they do not run, the report says why.

Run on a machine with a CUDA GPU (``make bench-gpu``; docs/gpu.md)::

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
#: Baselines: torch's EmbeddingBag (kernels), a stock TorchRec EBC (ebc), FBGEMM's
#: fused tables (both parts, where they run).
BAG = "EmbeddingBag"
EBC = "stock EBC"
TBE = "TBE"
#: Launcher names, in the order they are reported.
KERNELS = ("probe", "find+insert", "pooled fwd", "fused bwd")
#: One id in this many of a ``find+insert`` batch is new (takes a row by eviction).
NEW_EVERY = 8
#: Ids whose initial rows are made at a time when FBGEMM's tables copy the KV ones.
INIT_CHUNK = 1 << 18
#: KV EBC over FBGEMM's fused tables, in ids/s (the same targets as on CPU); the
#: torch baselines have none.
EBC_TARGETS = {"train": 0.7, "eval": 0.7}


@dataclass(frozen=True)
class GpuConfig:
    """Sizes and timing of one run."""

    tables: int = 4
    dim: int = 128
    batch: int = 16_384
    bag: int = 16
    rows: int = 2_000_000  # per table: TBE size, id range, KV capacity (whole buckets)
    alpha: float = 1.05  # Zipf exponent of the ids
    kernel_ids: int = 1 << 20  # ids per launcher call, over all tables
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
    dim=12,  # FBGEMM's fused tables need a multiple of 4
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
    system: str  # KV, BAG, EBC or TBE ("" for copy)
    items: int
    nbytes: int
    seconds: float
    rows: int = 0  # kernels: distinct rows (table, id) the call touches
    inserted: int = 0  # kernels: rows a find+insert call creates

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
    notes: tuple[str, ...] = ()  # e.g. why FBGEMM's fused tables did not run

    def has(self, part: str, name: str, system: str) -> bool:
        return any((r.part, r.name, r.system) == (part, name, system) for r in self.rates)

    def get(self, part: str, name: str, system: str) -> Rate:
        for r in self.rates:
            if (r.part, r.name, r.system) == (part, name, system):
                return r
        raise KeyError(f"no rate for {part} / {name} / {system}")

    @property
    def copy(self) -> Rate:
        return self.get("copy", "copy", "")


# -------------------------------------------------------------- byte counts
def kernel_bytes(
    kernel: str, ids: int, bags: int, rows: int, dim: int, state_dim: int = 1, inserted: int = 0
) -> int:
    """Bytes a launcher must read and write at least, for ``ids`` ids in ``bags``
    bags touching ``rows`` distinct rows (distinct (table, id) pairs) of ``dim``
    fp32 values and ``state_dim`` fp32 of optimizer state, ``inserted`` of them
    new (int64 ids, table indices and slots, a ``WAYS``-way bucket of int64 keys
    per lookup):

    * ``probe``: id and table in, its bucket's keys, slot out;
    * ``find+insert``: id and table in, slot out per id; per distinct id its
      bucket's keys and its score (a stored id's read and written, a new id's
      key and score written); per new row its initial values and zero state;
    * ``pooled fwd``: slot and row per id, offsets, one pooled row out per bag;
    * ``fused bwd`` (row-wise Adagrad): slot and the bag's gradient row per id;
      per distinct row the row and its state read and written.
    """
    bucket = WAYS * 8
    row = dim * 4
    state = state_dim * 4
    if kernel == "probe":
        return ids * (8 + 8 + bucket + 8)
    if kernel == "find+insert":
        return ids * (8 + 8 + 8) + rows * (bucket + 16) + inserted * (row + state)
    if kernel == "pooled fwd":
        return ids * (8 + row) + (bags + 1) * 8 + bags * row
    if kernel == "fused bwd":
        return ids * (8 + row) + rows * (2 * row + 2 * state)
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


# ------------------------------------------------------------------- TBE
class BaselineUnavailableError(RuntimeError):
    """A baseline that does not run on this device (the reason is its message)."""


def build_tbe(config: GpuConfig, device: torch.device, tables: int):
    """FBGEMM's fused tables on ``device`` (row-wise Adagrad); ``BaselineUnavailableError``
    where they do not run (FBGEMM's CPU build on a CUDA machine: docs/gpu.md)."""
    try:
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
        tbe = SplitTableBatchedEmbeddingBagsCodegen(
            embedding_specs=[(config.rows, config.dim, *where)] * tables,
            optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            learning_rate=config.learning_rate,
            eps=config.eps,
            pooling_mode=PoolingMode.SUM,
            device=device,
        )
        # One tiny lookup: a CPU-only build constructs but cannot run on CUDA.
        tbe(
            torch.zeros(tables, dtype=torch.int64, device=device),
            torch.arange(tables + 1, dtype=torch.int64, device=device),
        )
        return tbe
    except Exception as exc:  # noqa: BLE001 - any failure means: this baseline does not run
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise BaselineUnavailableError(
            f"FBGEMM's fused tables do not run on {device} ({type(exc).__name__}: {first[:160]})"
        ) from exc


def check_agree(what: str, kv: torch.Tensor, other: torch.Tensor, system: str) -> None:
    """Raise unless the KV result matches the baseline's (float tolerance): a
    benchmark of two systems that compute different things measures nothing."""
    if kv.shape != other.shape:
        raise RuntimeError(
            f"{what}: the Triton kernels and {system} disagree (shapes {tuple(kv.shape)} "
            f"and {tuple(other.shape)})"
        )
    if not torch.allclose(kv, other.to(kv.dtype), rtol=1e-4, atol=1e-5):
        worst = (kv - other.to(kv.dtype)).abs().max().item()
        raise RuntimeError(
            f"{what}: the Triton kernels and {system} disagree (max diff {worst:.3g})"
        )


# ----------------------------------------------------------------- kernels
#: Ids offered per slot when filling a group: with 3 a bucket of 16 ways gets
#: fewer than 16 with probability ~1e-7 (Poisson, mean 48).
FILL = 3


def full_group(config: GpuConfig, device: torch.device):
    """A group of ``config.tables`` tables of ``config.rows`` rows (whole buckets) and
    row-wise Adagrad, every bucket full (three ids offered per slot, loaded as a
    checkpoint is), small random rows; and each table's stored ids."""
    from torchrec_kvemb.group import KVTableGroup
    from torchrec_kvemb.optimizer import FusedOptimConfig, OptimKind
    from torchrec_kvemb.options import KVTableOptions

    capacity = config.rows // WAYS * WAYS
    group = KVTableGroup(
        [f"t{t}" for t in range(config.tables)],
        [KVTableOptions(capacity=capacity, seed=config.seed + t) for t in range(config.tables)],
        config.dim,
        FusedOptimConfig(
            kind=OptimKind.ROWWISE_ADAGRAD, learning_rate=config.learning_rate, eps=config.eps
        ),
        device,
    )
    gen = torch.Generator().manual_seed(config.seed)
    stored = []
    for table in group.tables:
        offered = spread_ids(torch.randperm(FILL * capacity, generator=gen)).to(device)
        rows = torch.zeros(1, config.dim, device=device).expand(offered.numel(), -1)
        table.load_rows(offered, rows, None, torch.zeros_like(offered))
        stored.append(table.index.ids_at(table.index.live_slots()))
    group.weights.normal_(0.0, 0.01, generator=torch.Generator(device).manual_seed(config.seed))
    return group, stored


def measure_kernels(config: GpuConfig, device: torch.device) -> tuple[list[Rate], list[str]]:
    """Every Triton launcher alone on a full group, then torch's EmbeddingBag (and
    FBGEMM's fused tables, where they run) on the same rows; the rates, and why a
    baseline did not run."""
    from torchrec_kvemb.contracts import Bags
    from torchrec_kvemb.kernels.group_lookup import (
        group_lookup_eval_triton,
        group_lookup_train_triton,
    )
    from torchrec_kvemb.kernels.group_pooled import (
        group_fused_backward_triton,
        group_pooled_forward_triton,
    )
    from torchrec_kvemb.optimizer import OptimKind

    group, stored = full_group(config, device)
    T = config.tables
    capacity = group.tables[0].capacity
    s = group.storage
    gen = torch.Generator().manual_seed(config.seed + 1)

    # One batch of Zipf ids over each table's stored ids, table after table, in
    # bags of ``bag`` (a table's bags are consecutive, as a collection's features).
    per_table = max(1, config.kernel_ids // (T * config.bag))
    bags = T * per_table
    n = bags * config.bag
    parts = []
    for t in range(T):
        ranks = ZipfIds(stored[t].numel(), config.alpha, config.seed + t).sample(
            per_table * config.bag
        )
        parts.append(stored[t][ranks.to(device)])
    ids = torch.cat(parts)
    table_idx = torch.arange(T, device=device).repeat_interleave(per_table * config.bag)
    offsets = torch.arange(0, n + 1, config.bag, dtype=torch.int64, device=device)
    pooled_bags = Bags.build(offsets, n)
    bag_list = torch.arange(bags, device=device)
    grad_out = torch.randn(bags, config.dim, generator=gen).to(device)

    def probe(i: int) -> torch.Tensor:
        return group_lookup_eval_triton(group.layout, s.keys, ids, table_idx, group.metrics)

    slots = probe(0)
    if not bool((slots >= 0).all()):
        raise RuntimeError("a stored id of the benchmark batch was not found")
    slot_table = table_idx  # the table of each id, hence of its slot
    rows = torch.unique(slots).numel()
    lrs = torch.tensor(group.learning_rates(), dtype=torch.float32, device=device)
    ones = torch.ones(T, device=device)

    # ``find+insert``: the batch with one id in NEW_EVERY replaced by an id never
    # seen, a fresh set per call (new ids evict the least recently used).
    new_at = torch.arange(0, n, NEW_EVERY, device=device)
    first_new = FILL * capacity

    def train_batch(call: int) -> torch.Tensor:
        fresh = first_new + call * new_at.numel() + torch.arange(new_at.numel())
        return ids.index_copy(0, new_at, spread_ids(fresh).to(device))

    def find_insert(call: int) -> None:
        group_lookup_train_triton(
            group.layout, s.keys, s.scores, s.weights, s.state, s.counter_keys,
            s.counter_scores, s.counts, train_batch(call), table_idx, group.clocks[0].add_(1),
            group.metrics,
        )  # fmt: skip

    def pooled_fwd(i: int) -> torch.Tensor:
        return group_pooled_forward_triton(
            group.layout, group.weights, slots, ids, table_idx, pooled_bags, bag_list, False
        )

    optim = group.optim

    def fused_bwd(i: int) -> None:
        group_fused_backward_triton(
            group.weights, group.state, grad_out, slots, slot_table, pooled_bags,
            OptimKind.ROWWISE_ADAGRAD.code, lrs, ones, ones, optim.eps, optim.beta1,
            optim.beta2, optim.weight_decay, False, False, False, optim.max_gradient,
        )  # fmt: skip

    # One untimed call counts what a training lookup does (inserts, from the metrics).
    batch = train_batch(0)
    uniques = torch.unique(batch + table_idx * (1 << 41)).numel()  # ids < 2**40
    before = group.metrics[:, 2].sum()
    find_insert(0)
    inserted = int(group.metrics[:, 2].sum() - before)
    seconds = _median_s(
        device,
        {
            "probe": probe,
            "find+insert": lambda i: find_insert(i + 1),
            "pooled fwd": pooled_fwd,
            "fused bwd": fused_bwd,
        },
        config,
    )
    state_dim = group.state.shape[1]
    touched = {name: uniques if name == "find+insert" else rows for name in KERNELS}
    created = {name: inserted if name == "find+insert" else 0 for name in KERNELS}
    rates = [
        Rate(
            "kernels",
            name,
            KV,
            n,
            kernel_bytes(name, n, bags, touched[name], config.dim, state_dim, created[name]),
            seconds[name],
            touched[name],
            created[name],
        )
        for name in KERNELS
    ]

    # torch's EmbeddingBag over the same rows (the group's rows by global slot),
    # from the same weights: both must pool the same rows.
    row_copy = group.weights.detach().clone()
    bag = torch.nn.EmbeddingBag.from_pretrained(
        row_copy, freeze=False, mode="sum", sparse=True, include_last_offset=True
    )
    bag_optim = torch.optim.Adagrad(bag.parameters(), lr=config.learning_rate, eps=config.eps)

    def bag_fwd(i: int) -> None:
        with torch.no_grad():
            bag(slots, offsets)

    def bag_train(i: int) -> None:
        bag(slots, offsets).backward(grad_out)
        bag_optim.step()
        bag_optim.zero_grad(set_to_none=True)

    def kv_train(i: int) -> None:
        pooled_fwd(i)
        fused_bwd(i)

    check_agree("pooled forward", pooled_fwd(0), bag(slots, offsets).detach(), BAG)
    steps = {"kv": kv_train, "bag": bag_train, "bag fwd": bag_fwd}

    # FBGEMM's fused tables over the same rows (indices = each table's KV slots),
    # from the same weights: the same pooled rows and the same first update.
    # FBGEMM pools [batch, tables * dim]; the group [tables * batch, dim].
    try:
        tbe = build_tbe(config, device, tables=T)
    except BaselineUnavailableError as exc:
        tbe, notes = None, [str(exc)]
    else:
        notes = []
        tbe_weights = tbe.split_embedding_weights()
        with torch.no_grad():
            for t, table in enumerate(group.tables):
                tbe_weights[t][:capacity].copy_(table.weights)
        group.state.zero_()  # as FBGEMM's new optimizer state (the timed updates filled it)
        row_offsets = torch.tensor(group.row_offsets, device=device)
        tbe_ids = slots - row_offsets[table_idx]

        def as_tbe(pooled: torch.Tensor) -> torch.Tensor:
            return pooled.view(T, per_table, config.dim).transpose(0, 1).reshape(per_table, -1)

        tbe_grad = as_tbe(grad_out).contiguous()

        def tbe_train(i: int) -> None:
            tbe(tbe_ids, offsets).backward(tbe_grad)

        def tbe_fwd(i: int) -> None:
            with torch.no_grad():
                tbe(tbe_ids, offsets)

        check_agree("pooled forward", as_tbe(pooled_fwd(0)), tbe(tbe_ids, offsets).detach(), TBE)
        kv_train(0)
        tbe_train(0)
        for t, table in enumerate(group.tables):
            check_agree(f"table {t}'s rows after one update", table.weights,
                        tbe_weights[t][:capacity], TBE)  # fmt: skip
        steps.update({"tbe": tbe_train, "tbe fwd": tbe_fwd})
    seconds = _median_s(device, steps, config)
    fwd_bytes = kernel_bytes("pooled fwd", n, bags, rows, config.dim)
    train_bytes = fwd_bytes + kernel_bytes("fused bwd", n, bags, rows, config.dim, state_dim)
    rates += [
        Rate("kernels", "fwd", BAG, n, fwd_bytes, seconds["bag fwd"]),
        Rate("kernels", "fwd+bwd+update", KV, n, train_bytes, seconds["kv"]),
        Rate("kernels", "fwd+bwd+update", BAG, n, train_bytes, seconds["bag"]),
    ]
    if tbe is not None:
        rates += [
            Rate("kernels", "fwd", TBE, n, fwd_bytes, seconds["tbe fwd"]),
            Rate("kernels", "fwd+bwd+update", TBE, n, train_bytes, seconds["tbe"]),
        ]
    return rates, notes


# --------------------------------------------------------------------- EBC
def draw_batches(config: GpuConfig, device: torch.device, seed: int, count: int) -> list:
    """``count`` KJTs of ``config.batch`` Zipf bags per table on ``device``, their
    offsets computed on the CPU (TorchRec computes a KJT's offsets with an fbgemm
    op that FBGEMM's CPU build has no CUDA kernel of)."""
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    samplers = [ZipfIds(config.rows, config.alpha, seed + t) for t in range(config.tables)]
    keys = [f"f{t}" for t in range(config.tables)]
    lengths = torch.full((config.tables * config.batch,), config.bag, dtype=torch.int64)
    per_table = config.batch * config.bag
    out = []
    for _ in range(count):
        values = torch.cat([s.sample(per_table) for s in samplers])
        kjt = KeyedJaggedTensor.from_lengths_sync(keys=keys, values=values, lengths=lengths)
        kjt.offsets()
        out.append(kjt.to(device))
    return out


def measure_ebc(config: GpuConfig, device: torch.device) -> tuple[list[Rate], list[str]]:
    """KV EBC vs a stock TorchRec EBC (and FBGEMM's fused tables where they run):
    train and eval steps on the same batches, once the first batch pools the same
    rows in each (``RuntimeError`` otherwise)."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec import EmbeddingBagCollection
    from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType

    from torchrec_kvemb import KVEmbeddingBagCollection, KVTableOptions

    timed = config.warmup + config.steps * config.repeats
    prime = draw_batches(config, device, config.seed, config.prime)
    train_batches = draw_batches(config, device, config.seed + 100, timed)
    held_out = draw_batches(config, device, config.seed + 200, timed)
    grad = torch.randn(config.batch, config.tables * config.dim).to(device)
    configs = [
        EmbeddingBagConfig(
            name=f"t{t}",
            embedding_dim=config.dim,
            num_embeddings=config.rows,
            feature_names=[f"f{t}"],
            pooling=PoolingType.SUM,
        )
        for t in range(config.tables)
    ]
    kv = KVEmbeddingBagCollection(
        configs,
        KVTableOptions(capacity=config.rows, seed=config.seed),
        device=device,
        fused_params={
            "optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
            "learning_rate": config.learning_rate,
            "eps": config.eps,
        },
    )
    # The stock EBC starts from the KV tables' initial rows (an id is a row of the
    # stock table); sparse gradients and torch's Adagrad, as one trains it without
    # FBGEMM's fused tables.
    stock = EmbeddingBagCollection(configs, device=device)
    for t, bag in enumerate(stock.embedding_bags.values()):
        copy_initial_rows(kv.table(f"t{t}"), bag.weight, config.rows)
        bag.sparse = True
    stock_optim = torch.optim.Adagrad(stock.parameters(), lr=config.learning_rate, eps=config.eps)
    notes = []
    try:
        tbe = build_tbe(config, device, tables=config.tables)
    except BaselineUnavailableError as exc:
        tbe = None
        notes.append(str(exc))
    else:
        for t, weights in enumerate(tbe.split_embedding_weights()):
            copy_initial_rows(kv.table(f"t{t}"), weights, config.rows)

    def kv_train(batches):
        return lambda i: kv(batches[i % len(batches)]).values().backward(grad)

    def stock_train(batches):
        def step(i: int) -> None:
            stock(batches[i % len(batches)]).values().backward(grad)
            stock_optim.step()
            stock_optim.zero_grad(set_to_none=True)

        return step

    def tbe_train(batches):
        def step(i: int) -> None:
            kjt = batches[i % len(batches)]
            tbe(kjt.values(), kjt.offsets()).backward(grad)

        return step

    # The first batch: every system pools the same rows; FBGEMM's (row-wise Adagrad
    # too) then makes the same update (torch's Adagrad is element-wise: not compared).
    first = prime[0]
    kv_out = kv(first).values()
    check_agree("EBC pooled rows", kv_out.detach(), stock(first).values().detach(), EBC)
    trainers = {KV: kv_train, EBC: stock_train}
    evaluate = {KV: kv, EBC: stock}
    if tbe is not None:
        tbe_out = tbe(first.values(), first.offsets())
        check_agree("EBC pooled rows", kv_out.detach(), tbe_out.detach(), TBE)
        tbe_out.backward(grad)
        trainers[TBE] = tbe_train
        evaluate[TBE] = lambda kjt: tbe(kjt.values(), kjt.offsets())
    kv_out.backward(grad)
    stock_train(prime)(0)
    if tbe is not None:
        for t, weights in enumerate(tbe.split_embedding_weights()):
            ids = torch.unique(first[f"f{t}"].values())
            rows, _ = kv.table(f"t{t}").find(ids)
            check_agree(f"EBC table t{t}'s rows after one step", rows, weights[ids], TBE)
    for i in range(1, config.prime):  # the first prime batch was the agreement check
        for make in trainers.values():
            make(prime)(i)
    trained = _median_s(device, {name: make(train_batches) for name, make in trainers.items()},
                        config)  # fmt: skip

    kv.eval()
    stock.eval()

    def eval_step(model) -> Callable[[int], None]:
        def step(i: int) -> None:
            with torch.no_grad():
                model(held_out[i % len(held_out)])

        return step

    evaluated = _median_s(device, {name: eval_step(m) for name, m in evaluate.items()}, config)
    row_bytes = config.ids_per_step * config.dim * 4
    rates = [
        Rate("ebc", mode, system, config.ids_per_step, row_bytes, seconds[system])
        for mode, seconds in (("train", trained), ("eval", evaluated))
        for system in seconds
    ]
    return rates, notes


def copy_initial_rows(table, weights: torch.Tensor, rows: int) -> None:
    """Rows ``0 .. rows - 1`` of a baseline's ``weights``: the KV ``table``'s initial
    rows of those ids."""
    with torch.no_grad():
        for lo in range(0, rows, INIT_CHUNK):
            ids = torch.arange(lo, min(lo + INIT_CHUNK, rows), device=weights.device)
            weights[lo : lo + ids.numel()].copy_(table.initial_rows(ids))


# ------------------------------------------------------------------- run
def run(config: GpuConfig, device: torch.device, verbose: bool = True) -> GpuResult:
    """All three parts on ``device`` with the Triton backend forced."""
    previous = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = "triton"
    # The torch baselines' sparse gradients: no invariant checks (torch's default,
    # said explicitly so that torch does not warn about it on every step).
    torch.sparse.check_sparse_tensor_invariants.disable()
    begin = time.perf_counter()
    notes: list[str] = []
    try:
        rates = [measure_copy(config, device)]
        _log(f"copy bandwidth measured ({time.perf_counter() - begin:.0f}s)", verbose)
        kernel_rates, kernel_notes = measure_kernels(config, device)
        _log(f"kernels timed ({time.perf_counter() - begin:.0f}s)", verbose)
        ebc_rates, ebc_notes = measure_ebc(config, device)
        _log(f"EBC steps timed ({time.perf_counter() - begin:.0f}s)", verbose)
    finally:
        if previous is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = previous
    for note in kernel_notes + ebc_notes:
        if note not in notes:
            notes.append(note)
    rates += kernel_rates + ebc_rates
    return GpuResult(config, device_name(device), tuple(rates), tuple(notes))


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


#: Ratios in ids/s, KV over each baseline that ran: (what, part, KV's name, the
#: baseline's name, its system, target).
RATIOS = (
    ("KV EBC / stock EBC train", "ebc", "train", "train", EBC, None),
    ("KV EBC / stock EBC eval", "ebc", "eval", "eval", EBC, None),
    ("pooled fwd kernel / EmbeddingBag fwd", "kernels", "pooled fwd", "fwd", BAG, None),
    ("fwd+bwd+update kernels / EmbeddingBag fwd+bwd+Adagrad", "kernels", "fwd+bwd+update",
     "fwd+bwd+update", BAG, None),
    ("KV EBC / TBE train", "ebc", "train", "train", TBE, EBC_TARGETS["train"]),
    ("KV EBC / TBE eval", "ebc", "eval", "eval", TBE, EBC_TARGETS["eval"]),
    ("pooled fwd kernel / TBE fwd", "kernels", "pooled fwd", "fwd", TBE, None),
    ("fwd+bwd+update kernels / TBE fwd+bwd", "kernels", "fwd+bwd+update", "fwd+bwd+update",
     TBE, None),
)  # fmt: skip


def ratios(result: GpuResult) -> list[Ratio]:
    """KV over each baseline that ran, in ids/s: whole EBC steps and lookup kernels
    (targets against FBGEMM's fused tables only)."""
    return [
        Ratio(what, result.get(part, kv_name, KV), result.get(part, name, system), target)
        for what, part, kv_name, name, system, target in RATIOS
        if result.has(part, name, system)
    ]


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
        f"kernels: a full group of {config.tables} tables x {config.rows:,} slots x dim "
        f"{config.dim}, {config.kernel_ids:,} Zipf ids (alpha {config.alpha}) a call in bags "
        f"of {config.bag}, one in {NEW_EVERY} new in find+insert; "
        f"EBC: {config.tables} tables, batch {config.batch}, {config.ids_per_step:,} ids/step; "
        f"median of {config.repeats} blocks x {config.steps} calls; "
        f"copy buffer {config.copy_mb} MiB"
    )


def report(result: GpuResult) -> str:
    parts = [
        f"device: {result.device}\n{describe(result.config)}",
        f"copy bandwidth: {result.copy.gb_per_s:.1f} GB/s (read + write)",
        format_table(RATE_HEADERS, rate_rows(result)),
        format_table(RATIO_HEADERS, ratio_rows(result)),
    ]
    return "\n\n".join(parts + [f"not run: {note}" for note in result.notes])


def write_report(result: GpuResult, path: str, command: str) -> None:
    write_markdown(
        path,
        "Triton kernels and KV EBC vs torch's EmbeddingBag, a stock EBC (and FBGEMM) (GPU)",
        [
            f"`{command}`",
            f"Device: {result.device}.  \n{describe(result.config)}.  \n"
            f"Copy bandwidth: {result.copy.gb_per_s:.1f} GB/s (bytes read + written).",
            markdown_table(RATE_HEADERS, rate_rows(result)),
            markdown_table(RATIO_HEADERS, ratio_rows(result)),
            "GB/s counts the bytes each kernel must move at least "
            "(`benchmarks.gpu_kernels.kernel_bytes`); `of copy` is that over the copy "
            "bandwidth. EBC GB/s counts one pass over the rows a step's ids touch. "
            "The torch baselines train with `torch.optim.Adagrad` (element-wise state: "
            "more bytes than the row-wise Adagrad of KV and FBGEMM, counted as theirs).",
            *[f"Not run: {note}." for note in result.notes],
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
    if config.rows < WAYS:
        parser.error(f"--rows must be at least {WAYS} (one bucket), got {config.rows}")
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
