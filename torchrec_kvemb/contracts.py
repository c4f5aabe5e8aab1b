"""Op contracts: what every backend of an op takes and gives, and the rules they share.

Each op has a vectorized torch path (``torchrec_kvemb/ops/<op>.py``: the readable
reference), a Triton kernel (``kernels/<op>.py``) and, for the id -> slot work, a
native CPU kernel (``csrc/``). All of them import their result types and shared
conventions from here, never from one another; ``dispatch.py`` picks one.

**The index.** A bucketed index is ``keys [num_buckets, WAYS]`` int64 (-1: empty
way) with ``scores`` of the same shape. An id lives only in its own bucket
(``index_bucket``), at ``slot = bucket * WAYS + way``; row arrays are addressed
by slot.

**The ranking rule** of a find-or-insert over unique ids with per-id score
``values`` (``InsertResult``):

1. Each id is probed in its bucket. A hit updates its score: ``score += value``
   when ``accumulate`` (LFU counts), else ``score = value`` (LRU steps, custom
   scores).
2. Per bucket, the stored entries (scores already updated) and the bucket's new
   ids compete for the bucket's ``WAYS`` ways. Candidates are ranked: protected
   stored entries first (those hit by this batch, so an id in use never loses its
   row mid-batch; with ``keep_existing`` every stored entry), then by score
   (higher first), then new before stored (a new id replaces a stored one of
   equal score, so LFU keeps admitting), then id (smaller first). The first
   ``WAYS`` stay.
3. Stored entries that lose are evicted. Winning new ids take the freed and
   empty ways, in ascending way order, in rank order.

The outcome depends only on the index and the batch, never on thread timing.

**Initial rows** depend only on (id, seed, column): see ``InitSpec`` and
``ops.hashing.init_rows``.

**Groups.** The tables of a group share one index and one row array, as
FBGEMM's TBE does with table offsets (``GroupLayout``): table ``t`` owns
buckets ``[bucket_offset[t], bucket_offset[t] + num_buckets[t])`` and an id
of table ``t`` lives in bucket ``bucket_offset[t] + index_bucket(id,
num_buckets[t])``. A grouped op gives, table by table, exactly what the
per-table ops give.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, NamedTuple

import torch

from torchrec_kvemb import huge_pages
from torchrec_kvemb.optimizer import FusedOptimConfig
from torchrec_kvemb.options import DEFAULT_INIT_RANGE, WAYS, EvictionPolicy, Initializer

#: The 64-bit multipliers of MurmurHash3's finalizer (``fmix64``).
FMIX_M1 = 0xFF51AFD7ED558CCD
FMIX_M2 = 0xC4CEB9FE1A85EC53
#: The 64-bit golden ratio: column stride of the initial-value streams.
GOLDEN = 0x9E3779B97F4A7C15
#: Salts that make the index hash, the routing hash and the seed mix differ.
INDEX_SALT = 0x1B873593A5A5A5A5
ROUTE_SALT = 0x2545F4914F6CDD1D
SEED_SALT = 0x5851F42D4C957F2D
INT64_MAX = (1 << 63) - 1

#: Counters every table keeps (``KVTable.metrics()``; a tiered table adds its
#: tier's). The first ``KERNEL_METRICS`` are the columns the grouped lookups add
#: to (``KvMetric`` in csrc/kvemb_native.h, checked against this list by a test).
METRIC_NAMES = (
    "hits",
    "misses",
    "inserts",
    "evictions",
    "admission_rejects",
    "insert_failures",
    "ssd_hits",
    "ssd_misses",
    "promotions",
    "demotions",
    "growths",
    "ttl_evictions",
)
KERNEL_METRICS = 6
_U64 = (1 << 64) - 1


def to_signed(value: int) -> int:
    """The int64 with the same 64 bits as the unsigned ``value``."""
    value &= _U64
    return value - (1 << 64) if value >= 1 << 63 else value


def fmix64_int(value: int) -> int:
    """``fmix64`` of one Python int, as an int64."""
    x = value & _U64
    x ^= x >> 33
    x = (x * FMIX_M1) & _U64
    x ^= x >> 33
    x = (x * FMIX_M2) & _U64
    x ^= x >> 33
    return to_signed(x)


def seed_mix(seed: int) -> int:
    """The per-table constant that the seed contributes to every initial value."""
    return fmix64_int(seed ^ SEED_SALT)


class InsertResult(NamedTuple):
    """What a find-or-insert did, per input id and per evicted entry."""

    slots: torch.Tensor  # [n] int64, -1 where the id holds no row after the call
    hit: torch.Tensor  # [n] bool, the id was stored before the call
    inserted: torch.Tensor  # [n] bool, the id got a new row in this call
    evicted_ids: torch.Tensor  # [e] int64
    evicted_slots: torch.Tensor  # [e] int64, now reused by inserted ids


class InitSpec(NamedTuple):
    """How a table makes a row for an id that has none (see ``ops.hashing.init_rows``),
    by ``normal``, the kind of draw (``INIT_UNIFORM``, ``INIT_NORMAL`` or
    ``INIT_TRUNC_NORMAL``; ``False`` / ``True`` are the first two):

    * uniform on ``[a, b)`` (``a == b``: exactly that constant);
    * normal with mean ``a`` and standard deviation ``b``;
    * truncated normal: ``a`` and ``b`` each carry two float32 values
      (:func:`pack_float32_pair`): ``a`` the mean and standard deviation, ``b`` the
      bounds; build it with :meth:`trunc_normal`.

    why packed: the layout's per-table tensors are every grouped op's schema and
    every kernel's arguments; two float64 slots hold the four float32 parameters.

    Example::

        InitSpec.trunc_normal(seed=3, mean=0.0, std=1.0, low=-2.0, high=2.0)
    """

    seed: int
    normal: int
    a: float
    b: float
    #: The table's first column in the initial-value streams: a column shard of a
    #: wider table draws that table's columns ``[first_col, first_col + dim)``.
    first_col: int = 0

    @classmethod
    def trunc_normal(
        cls, seed: int, mean: float, std: float, low: float, high: float, first_col: int = 0
    ) -> InitSpec:
        """The spec of N(mean, std) truncated to [low, high] (float32 parameters)."""
        return cls(
            seed,
            INIT_TRUNC_NORMAL,
            pack_float32_pair(mean, std),
            pack_float32_pair(low, high),
            first_col,
        )

    @property
    def trunc_normal_params(self) -> tuple[float, float, float, float]:
        """``(mean, std, low, high)`` of a truncated normal spec (float32 values)."""
        return (*unpack_float32_pair(self.a), *unpack_float32_pair(self.b))


#: Kinds of initial draw (``InitSpec.normal``, ``GroupLayout.init_normal``).
INIT_UNIFORM = 0
INIT_NORMAL = 1
INIT_TRUNC_NORMAL = 2


def pack_float32_pair(first: float, second: float) -> float:
    """The float64 whose 64 bits are float32 ``first`` (low half) and ``second``
    (high half); finite values never make a NaN."""
    return struct.unpack("<d", struct.pack("<ff", first, second))[0]


def unpack_float32_pair(value: float) -> tuple[float, float]:
    """The two float32 values ``pack_float32_pair`` put in ``value``."""
    first, second = struct.unpack("<ff", struct.pack("<d", value))
    return first, second


class BucketizeResult(NamedTuple):
    """Outputs of ``block_bucketize_2d``.

    * ``lengths``: ``[world_size * num_bags]``, rank-major, dtype of the input lengths.
    * ``indices``: ``[N]``, the new ids grouped by rank then bag, dtype of the input ids.
    * ``weights``: ``[N]`` or ``[N, k]``, rows permuted like ``indices``; ``None`` without weights.
    * ``pos``: ``[N]``, each output id's position inside its original bag; ``None``
      unless ``bucketize_pos``.
    * ``unbucketize_permute``: ``[N]``, the output position of each input id
      (``out[unbucketize_permute[i]]`` came from input ``i``).
    """

    lengths: torch.Tensor
    indices: torch.Tensor
    weights: torch.Tensor | None
    pos: torch.Tensor | None
    unbucketize_permute: torch.Tensor


class BucketizeInputs(NamedTuple):
    """Validated, normalized inputs of ``block_bucketize_2d`` (``ops.block_bucketize.
    prepare_inputs``), shared by every backend.

    ``block_sizes`` and ``num_blocks`` (blocks of each feature over all ranks) are int64
    ``[T]``; ``feature_ends`` is the int64 ``[T]`` inclusive prefix sum of the per-feature
    batch sizes (bag ``b`` belongs to the first feature ``t`` with ``b < feature_ends[t]``);
    ``lengths``, ``indices`` and ``weights`` are contiguous.
    """

    lengths: torch.Tensor
    indices: torch.Tensor
    block_sizes: torch.Tensor
    num_blocks: torch.Tensor
    feature_ends: torch.Tensor
    world_size: int
    weights: torch.Tensor | None
    bucketize_pos: bool
    keep_orig_idx: bool


def stable_argsort(values: torch.Tensor, descending: bool = False) -> torch.Tensor:
    """The stable sort permutation of ``values`` (the ranking sorts rely on stability)."""
    return torch.sort(values, stable=True, descending=descending).indices


class TableStorage(NamedTuple):
    """The arrays of a table: its index, rows and admission counter. A group of
    tables (``torchrec_kvemb.group``) allocates one set and gives each table views.

    Example::

        storage = TableStorage.allocate(rows=64, dim=8, state_dim=1, counter_ids=0)
        table = KVTable("t", 8, KVTableOptions(capacity=64), storage=storage)
    """

    keys: torch.Tensor  # [rows / WAYS, WAYS] int64, -1: empty
    scores: torch.Tensor  # [rows / WAYS, WAYS] int64
    weights: torch.Tensor  # [rows, dim] float32, float16 or bfloat16
    state: torch.Tensor  # [rows, state_dim] float32
    counter_keys: torch.Tensor  # [counter_ids / WAYS, WAYS] int64
    counter_scores: torch.Tensor  # [counter_ids / WAYS, WAYS] int64
    counts: torch.Tensor  # [counter_ids] int64

    @classmethod
    def allocate(
        cls,
        rows: int,
        dim: int,
        state_dim: int,
        counter_ids: int,
        device: torch.device | str | None = None,
        weights_dtype: torch.dtype = torch.float32,
    ) -> TableStorage:
        """Empty arrays for ``rows`` rows (of ``weights_dtype``) and ``counter_ids``
        admission entries (both multiples of ``WAYS``). The index and rows of a
        large table are asked for 2 MB pages on the host (``huge_pages``)."""
        keys = huge_pages.full((rows // WAYS, WAYS), -1, torch.int64, device)
        counter_keys = torch.full((counter_ids // WAYS, WAYS), -1, dtype=torch.int64, device=device)
        return cls(
            keys,
            huge_pages.zeros(tuple(keys.shape), torch.int64, device),
            huge_pages.zeros((rows, dim), weights_dtype, device),
            huge_pages.zeros((rows, state_dim), torch.float32, device),
            counter_keys,
            torch.zeros_like(counter_keys),
            torch.zeros(counter_ids, dtype=torch.int64, device=device),
        )

    def part(self, rows: tuple[int, int], counter_ids: tuple[int, int]) -> TableStorage:
        """Views of rows ``[lo, hi)`` and admission entries ``[lo, hi)`` (multiples of
        ``WAYS``): one table's share of a group's arrays."""
        (r0, r1), (c0, c1) = rows, counter_ids
        return TableStorage(
            self.keys[r0 // WAYS : r1 // WAYS],
            self.scores[r0 // WAYS : r1 // WAYS],
            self.weights[r0:r1],
            self.state[r0:r1],
            self.counter_keys[c0 // WAYS : c1 // WAYS],
            self.counter_scores[c0 // WAYS : c1 // WAYS],
            self.counts[c0:c1],
        )


#: Eviction policy codes of ``GroupLayout.policy`` (kernels branch on them).
POLICY_CODES = {
    EvictionPolicy.LRU: 0,
    EvictionPolicy.LFU: 1,
    EvictionPolicy.CUSTOM_SCORE: 2,
    EvictionPolicy.NONE: 3,
}


@dataclass(frozen=True)
class GroupLayout:
    """Per-table layout and settings of a group of tables, ``[T]`` tensors on the
    group's device (built once, read by every grouped op).

    Tables own consecutive bucket ranges of the group index in their order, and
    admission tables consecutive ranges of the counter index.

    Example::

        layout = GroupLayout.of(
            num_buckets=[64, 3],
            policies=[EvictionPolicy.LRU, EvictionPolicy.LFU],
            init=[InitSpec(0, False, -0.01, 0.01), InitSpec(1, True, 0.0, 0.01)],
            admission_thresholds=[1, 2],
            counter_num_buckets=[0, 3],
        )
    """

    bucket_offset: torch.Tensor  # [T] int64
    num_buckets: torch.Tensor  # [T] int64
    policy: torch.Tensor  # [T] int64, POLICY_CODES
    admission_threshold: torch.Tensor  # [T] int64
    counter_bucket_offset: torch.Tensor  # [T] int64
    counter_num_buckets: torch.Tensor  # [T] int64 (0 without admission)
    seed: torch.Tensor  # [T] int64: the tables' seeds
    seed_mix: torch.Tensor  # [T] int64: ``seed_mix(seed)``
    init_normal: torch.Tensor  # [T] int64: the kind of draw, INIT_UNIFORM / NORMAL / TRUNC_NORMAL
    init_a: torch.Tensor  # [T] float64: InitSpec.a (low, mean, or packed mean and std)
    init_b: torch.Tensor  # [T] float64: InitSpec.b (high, std, or packed bounds)
    init_col: torch.Tensor  # [T] int64: InitSpec.first_col (0 but for column shards)
    has_admission: bool  # some table admits ids after several sightings
    #: some table draws its initial rows otherwise than uniformly from column 0 (the
    #: native kernels draw those; the others' new rows are drawn by the torch path)
    has_normal: bool

    #: The tensor fields in the order the grouped ops take them (``tensors()``).
    TENSORS = (
        "bucket_offset",
        "num_buckets",
        "policy",
        "admission_threshold",
        "counter_bucket_offset",
        "counter_num_buckets",
        "seed",
        "seed_mix",
        "init_normal",
        "init_a",
        "init_b",
        "init_col",
    )

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The layout's tensors, in ``TENSORS`` order: what a registered op takes."""
        return tuple(getattr(self, name) for name in self.TENSORS)

    @classmethod
    def from_tensors(
        cls, tensors: Sequence[torch.Tensor], has_admission: bool, has_normal: bool
    ) -> GroupLayout:
        """The layout of an op's arguments (``tensors()``, then the two flags)."""
        return cls(**dict(zip(cls.TENSORS, tensors, strict=True)), has_admission=has_admission,
                   has_normal=has_normal)  # fmt: skip

    @property
    def init_specs(self) -> tuple[InitSpec, ...]:
        """Each table's ``InitSpec`` (read from the tensors: a host copy on a GPU)."""
        rows = zip(
            self.seed.tolist(),
            self.init_normal.tolist(),
            self.init_a.tolist(),
            self.init_b.tolist(),
            self.init_col.tolist(),
            strict=True,
        )
        return tuple(InitSpec(s, int(normal), a, b, col) for s, normal, a, b, col in rows)

    @classmethod
    def of(
        cls,
        num_buckets: Sequence[int],
        policies: Sequence[EvictionPolicy],
        init: Sequence[InitSpec],
        admission_thresholds: Sequence[int] | None = None,
        counter_num_buckets: Sequence[int] | None = None,
        device: torch.device | str | None = None,
    ) -> GroupLayout:
        """The layout of tables of these bucket counts, eviction policies, initial
        rows and admission (thresholds, counter buckets; default: none)."""
        T = len(num_buckets)
        thresholds = list(admission_thresholds or [1] * T)
        counters = list(counter_num_buckets or [0] * T)
        if not (len(policies) == len(init) == len(thresholds) == len(counters) == T):
            raise ValueError("GroupLayout: one entry per table in every argument")
        if any(int(b) < 1 for b in num_buckets):
            raise ValueError(f"GroupLayout: num_buckets must be >= 1, got {list(num_buckets)}")
        for t in range(T):
            if thresholds[t] > 1 and counters[t] < 1:
                raise ValueError(f"GroupLayout: table {t} admits: it needs counter buckets")
            if thresholds[t] <= 1:
                counters[t] = 0

        def ints(values: Sequence[int]) -> torch.Tensor:
            return torch.tensor([int(v) for v in values], dtype=torch.int64, device=device)

        def floats(values: Sequence[float]) -> torch.Tensor:
            return torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)

        def offsets(sizes: Sequence[int]) -> torch.Tensor:
            t = ints(sizes)
            return torch.cumsum(t, 0) - t

        return cls(
            bucket_offset=offsets(num_buckets),
            num_buckets=ints(num_buckets),
            policy=ints([POLICY_CODES[p] for p in policies]),
            admission_threshold=ints(thresholds),
            counter_bucket_offset=offsets(counters),
            counter_num_buckets=ints(counters),
            seed=ints([s.seed for s in init]),
            seed_mix=ints([seed_mix(s.seed) for s in init]),
            init_normal=ints([int(s.normal) for s in init]),
            init_a=floats([s.a for s in init]),
            init_b=floats([s.b for s in init]),
            init_col=ints([s.first_col for s in init]),
            has_admission=any(t > 1 for t in thresholds),
            has_normal=any(int(s.normal) != INIT_UNIFORM or s.first_col for s in init),
        )

    @classmethod
    def build(
        cls,
        num_buckets: Sequence[int],
        counter_num_buckets: Sequence[int],
        options: Sequence[Any],
        device: torch.device | str | None = None,
    ) -> GroupLayout:
        """The layout of tables with these bucket counts and ``KVTableOptions``."""
        return cls.of(
            num_buckets,
            [o.eviction for o in options],
            [init_spec(o) for o in options],
            [o.admission_threshold for o in options],
            counter_num_buckets,
            device,
        )

    @property
    def num_tables(self) -> int:
        return self.num_buckets.numel()

    @property
    def total_buckets(self) -> int:
        """Buckets of the group index the tables own (rows: ``WAYS`` times that)."""
        return int(self.num_buckets.sum())

    @property
    def total_counter_buckets(self) -> int:
        return int(self.counter_num_buckets.sum())

    def to(self, device: torch.device | str) -> GroupLayout:
        """The same layout with its tensors on ``device``."""
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }
        return replace(self, **moved)


def init_spec(options: Any) -> InitSpec:
    """The ``InitSpec`` of a table built from ``KVTableOptions``."""
    col = options.column_offset
    if options.initializer == Initializer.NORMAL:
        return InitSpec(options.seed, INIT_NORMAL, options.init_mean, options.init_std, col)
    if options.initializer == Initializer.TRUNC_NORMAL:
        return InitSpec.trunc_normal(
            options.seed,
            options.init_mean,
            options.init_std,
            options.init_low,
            options.init_high,
            col,
        )
    if options.init_low is None:  # made without a config: the plain default
        low, high = -DEFAULT_INIT_RANGE, DEFAULT_INIT_RANGE
    else:
        low, high = options.init_low, options.init_high
    return InitSpec(options.seed, INIT_UNIFORM, low, high, col)


def run_of_each(lengths: torch.Tensor, n: int) -> torch.Tensor:
    """The run of each of ``n`` positions cut into runs of ``lengths`` (non-negative,
    summing to ``n``): ``[n]`` int64.

    why ``repeat_interleave`` with ``output_size``: given the size, a GPU does not
    sync; on the CPU 0.6 ms against 2.8 ms for a binary search of each position among
    the runs' ends (327k ids in 16k runs, 2 threads)."""
    runs = torch.arange(lengths.numel(), device=lengths.device)
    return torch.repeat_interleave(runs, lengths, output_size=n)


class Bags(NamedTuple):
    """A batch's bags for a pooled lookup: ``offsets [B + 1]`` (the ids of bag ``b``
    are ``[offsets[b], offsets[b + 1])``), the bag of every id ``bag_of [n]``, and
    every id's multiplier ``scale [n]`` (its per-sample weight, divided by the bag
    length where the table pools by MEAN; None: every id counts 1).

    Example::

        bags = Bags.build(torch.tensor([0, 2, 2, 5]), n=5, mean=True)
        bags.bag_of   # tensor([0, 0, 2, 2, 2])
        bags.scale    # tensor([0.5, 0.5, 0.3333, 0.3333, 0.3333])
    """

    offsets: torch.Tensor
    bag_of: torch.Tensor
    scale: torch.Tensor | None

    @classmethod
    def build(
        cls,
        offsets: torch.Tensor,
        n: int,
        per_sample_weights: torch.Tensor | None = None,
        mean: bool | torch.Tensor = False,
    ) -> Bags:
        """The bags of ``n`` ids cut by ``offsets`` (``offsets[-1] == n``); ``mean``:
        every bag pools by MEAN, or a bool per bag."""
        offsets = offsets.to(torch.int64)
        lengths = offsets[1:] - offsets[:-1]
        bag_of = run_of_each(lengths, n)
        scale = per_sample_weights.to(torch.float32) if per_sample_weights is not None else None
        if isinstance(mean, torch.Tensor) or mean:
            divisor = lengths.clamp(min=1).to(torch.float32)
            if isinstance(mean, torch.Tensor):
                divisor = torch.where(mean, divisor, 1.0)
            base = scale if scale is not None else torch.ones(n, device=offsets.device)
            # why divide (not multiply by 1/len): MEAN pooling divides, bit for bit.
            scale = base / divisor[bag_of]
        return cls(offsets, bag_of, scale)


class GroupOptimizer(NamedTuple):
    """What a grouped backward needs of the group's optimizers: per table, its
    config, its learning rate and its optimizer steps so far (``[T]`` tensors on the
    group's device; the backward advances ``steps``), and its rows' slot range."""

    configs: tuple[FusedOptimConfig, ...]
    learning_rates: torch.Tensor  # [T] float64
    steps: torch.Tensor  # [T] int64
    row_offsets: tuple[int, ...]
    rows: tuple[int, ...]
    row_ends: torch.Tensor  # [T] int64 on the device: row_offsets + rows
    #: The table of each scratch row after the last table's rows (a group of tables
    #: with SSD tiers, ``ssd/scratch.py``), else None.
    pad_tables: torch.Tensor | None = None

    @property
    def config(self) -> FusedOptimConfig:
        """The group's optimizer (the tables differ only in learning rate)."""
        return self.configs[0]

    def table_of(self, slots: torch.Tensor) -> torch.Tensor:
        """The table of each global slot (-1 and beyond: clamped into a table;
        scratch rows: their table)."""
        table = torch.searchsorted(self.row_ends, slots.clamp(min=0), right=True)
        if self.pad_tables is not None and self.pad_tables.numel():
            beyond = slots - self.row_ends[-1]
            pad = self.pad_tables[beyond.clamp(0, self.pad_tables.numel() - 1)]
            table = torch.where(beyond >= 0, pad, table)
        return table.clamp(max=len(self.rows) - 1)


class GroupLookup(NamedTuple):
    """What a grouped training lookup hands its backward: the global slot of every
    id (-1: no row), and what the backend that made it needs to reduce gradients
    (e.g. the unique rows and each id's unique; None where it needs nothing)."""

    slots: torch.Tensor
    unique_index: torch.Tensor | None = None  # [n] the unique of each id
    unique_slots: torch.Tensor | None = None  # [U] global slot of each unique (-1: none)
    unique_table: torch.Tensor | None = None  # [U] table of each unique
