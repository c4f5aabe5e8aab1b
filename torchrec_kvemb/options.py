"""Per-table options of a KV (key-value, zero-collision) embedding table."""

from __future__ import annotations

import enum
import functools
import inspect
import math
import os
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import torch

#: Uniform range -/+ of a table built without a config and without init_low / high.
DEFAULT_INIT_RANGE = 0.01

#: Slots per index bucket. 16 int64 keys are two cache lines: one probe reads
#: them in one go (why 16: at 8 ways a uniformly filled table starts evicting
#: at ~60% load, at 16 ways at ~75%).
WAYS = 16


class EvictionPolicy(enum.Enum):
    """What a full bucket does when a new id arrives.

    * ``LRU``: evict the entry used longest ago (score = last training step seen).
    * ``LFU``: evict the entry seen least often (score = number of sightings).
    * ``CUSTOM_SCORE``: evict the lowest score supplied by the caller per id.
    * ``NONE``: never evict; the new id is not stored and is counted in
      ``metrics()["insert_failures"]``.
    """

    LRU = "lru"
    LFU = "lfu"
    CUSTOM_SCORE = "custom_score"
    NONE = "none"


class Initializer(enum.Enum):
    """Distribution of a new row's values (a pure function of id, seed, column).

    * ``UNIFORM``: on ``[init_low, init_high)`` (``init_low == init_high``: that
      constant, exactly).
    * ``NORMAL``: ``N(init_mean, init_std)``.
    * ``TRUNC_NORMAL``: ``N(init_mean, init_std)`` truncated to ``[init_low,
      init_high]`` (absolute bounds, as ``torch.nn.init.trunc_normal_``'s ``a``, ``b``).
    """

    UNIFORM = "uniform"
    NORMAL = "normal"
    TRUNC_NORMAL = "trunc_normal"


@dataclass(frozen=True)
class SSDOptions:
    """Options of the on-disk tier under a KV table (see docs/ssd-tier.md).

    The in-memory table becomes a cache over files in ``path``
    (``<path>/<table>.rank<r>.slab`` and ``.index``): a row the memory evicts is
    written there, and comes back when its id is looked up again.

    Example::

        SSDOptions(path="/mnt/ssd/kv", capacity=10_000_000)
    """

    #: Directory of the tier's files (created if missing; one pair per table and rank).
    path: str
    #: Rows the SSD tier keeps; ``None``: as many as come (its index grows).
    capacity: int | None = None
    #: Which rows the SSD tier drops when full: ``LRU`` (least recently used in
    #: memory for an LRU table, else demoted longest ago), ``LFU`` (LFU tables
    #: only: lowest count), ``CUSTOM_SCORE`` (CUSTOM_SCORE tables only: lowest
    #: score) or ``NONE`` (keep stored rows, drop the new one).
    eviction: EvictionPolicy = EvictionPolicy.LRU
    #: Threads that read records of a large batch (a queue for the disk when
    #: the pages are not cached).
    io_threads: int = 16
    #: Load the rows of a previous run found in ``path`` (as of its last flush);
    #: ``False`` starts empty and overwrites them.
    resume: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)) or not os.fspath(self.path):
            raise ValueError(f"SSDOptions: path must be a directory path, got {self.path!r}")
        object.__setattr__(self, "path", os.fspath(self.path))
        if self.capacity is not None and self.capacity <= 0:
            raise ValueError(f"SSDOptions: capacity must be > 0 or None, got {self.capacity}")
        if not isinstance(self.eviction, EvictionPolicy):
            raise TypeError(
                f"SSDOptions: eviction must be an EvictionPolicy, got {self.eviction!r}"
            )
        if self.io_threads < 1:
            raise ValueError(f"SSDOptions: io_threads must be >= 1, got {self.io_threads}")


@dataclass(frozen=True)
class HostTierOptions:
    """Options of the host-memory tier under a KV table (see docs/tiers.md).

    The table's own rows (on its device) become a cache over rows kept in host
    memory by the native CPU kernels; a row the table evicts moves there, and
    comes back when its id is looked up again. With ``KVTableOptions.ssd`` too,
    the host tier sits between them: the rows it evicts move to the SSD tier.
    Give ``capacity`` (rows), ``memory_budget_bytes`` (the rows that fit, index
    included), or neither (it keeps every row it is given, growing).

    Example::

        HostTierOptions(capacity=10_000_000, eviction=EvictionPolicy.LRU)
    """

    #: Rows the host tier keeps; ``None`` with no budget: as many as come (it grows).
    capacity: int | None = None
    #: Bytes of host memory the tier's rows and index may take (instead of ``capacity``).
    memory_budget_bytes: int | None = None
    #: Which rows the host tier moves down (to the SSD tier, else drops) when full:
    #: ``LRU`` (least recently used in the table for an LRU table, else moved down
    #: longest ago), ``LFU`` (LFU tables only: lowest count), ``CUSTOM_SCORE``
    #: (CUSTOM_SCORE tables only: lowest score) or ``NONE`` (keep held rows, pass
    #: the new one down).
    eviction: EvictionPolicy = EvictionPolicy.LRU
    #: Rows in page-locked memory when the table is on CUDA (faster, asynchronous
    #: copies to and from the device); ignored on the CPU.
    pin_memory: bool = True

    def __post_init__(self) -> None:
        if self.capacity is not None and self.memory_budget_bytes is not None:
            raise ValueError("HostTierOptions: give at most one of capacity or memory_budget_bytes")
        if self.capacity is not None and self.capacity <= 0:
            raise ValueError(f"HostTierOptions: capacity must be > 0 or None, got {self.capacity}")
        if self.memory_budget_bytes is not None and self.memory_budget_bytes <= 0:
            raise ValueError(
                "HostTierOptions: memory_budget_bytes must be > 0 or None, got "
                f"{self.memory_budget_bytes}"
            )
        if not isinstance(self.eviction, EvictionPolicy):
            raise TypeError(
                f"HostTierOptions: eviction must be an EvictionPolicy, got {self.eviction!r}"
            )


@dataclass(frozen=True)
class TTLOptions:
    """Time to live of a KV table's rows (see docs/kv-table.md, "TTL and pruning").

    A row not looked up in training for ``steps`` training steps, or for ``seconds``
    of wall time (``eviction_ttl_mins``: TorchRec's name, in minutes), is freed: its
    id leaves the index and its slot takes new ids. A sweep frees them: after each
    training lookup it reads ``sweep_buckets_per_step`` index buckets at a cursor
    that walks the table (cost: the rows swept, not the table), so a row is freed
    at the first sweep of its bucket once its TTL has passed; a lookup before that
    keeps it. Capacity eviction (LRU, LFU, custom scores, NONE) applies as ever.

    Example::

        KVTableOptions(capacity=1_000_000, eviction=EvictionPolicy.LFU,
                       ttl=TTLOptions(steps=10_000))
    """

    #: Training steps a row lives without a lookup.
    steps: int | None = None
    #: Seconds of wall time a row lives without a lookup (each step's time is read
    #: from ``clock`` when its lookup ends).
    seconds: float | None = None
    #: Minutes, as TorchRec's ``eviction_ttl_mins`` (the same as ``seconds=60 * m``).
    eviction_ttl_mins: int | None = None
    #: Index buckets (16 rows each) the sweep reads per training step. ``None``: the
    #: whole table once every ``steps`` steps (``steps`` TTL), or every
    #: ``SWEEP_STEPS`` steps (wall-time TTL). A value at or above the table's
    #: buckets sweeps it all every step: rows are freed exactly at their TTL.
    sweep_buckets_per_step: int | None = None
    #: The wall clock of a wall-time TTL (seconds; injectable for tests).
    clock: Callable[[], float] = field(default=time.time, compare=False, repr=False)

    #: Steps of a whole sweep of a wall-time TTL table by default.
    SWEEP_STEPS: ClassVar[int] = 64

    def __post_init__(self) -> None:
        given = [v is not None for v in (self.steps, self.seconds, self.eviction_ttl_mins)]
        if sum(given) != 1:
            raise ValueError(
                "TTLOptions: give exactly one of steps, seconds or eviction_ttl_mins, got "
                f"steps={self.steps}, seconds={self.seconds}, "
                f"eviction_ttl_mins={self.eviction_ttl_mins}"
            )
        if self.steps is not None and (not isinstance(self.steps, int) or self.steps < 1):
            raise ValueError(f"TTLOptions: steps must be an int >= 1, got {self.steps!r}")
        if self.seconds is not None and not (self.seconds > 0 and math.isfinite(self.seconds)):
            raise ValueError(f"TTLOptions: seconds must be > 0 and finite, got {self.seconds}")
        if self.eviction_ttl_mins is not None and not self.eviction_ttl_mins > 0:
            raise ValueError(
                f"TTLOptions: eviction_ttl_mins must be > 0, got {self.eviction_ttl_mins} "
                "(a table without TTL takes ttl=None)"
            )
        if self.sweep_buckets_per_step is not None and self.sweep_buckets_per_step < 1:
            raise ValueError(
                "TTLOptions: sweep_buckets_per_step must be >= 1 or None, got "
                f"{self.sweep_buckets_per_step}"
            )
        if not callable(self.clock):
            raise TypeError(f"TTLOptions: clock must be callable, got {self.clock!r}")

    @property
    def wall_seconds(self) -> float | None:
        """The wall-time TTL in seconds (None for a TTL in steps)."""
        if self.eviction_ttl_mins is not None:
            return 60.0 * self.eviction_ttl_mins
        return self.seconds


#: The largest finite float32 (TRUNC_NORMAL's parameters are float32).
FLOAT32_MAX = 3.4028234663852886e38

#: The row dtypes a table can store.
ROW_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class KVTableOptions:
    """Options of one KV table (or of every table, when shared).

    Give either ``capacity`` (rows kept in memory) or ``memory_budget_bytes``
    (capacity is then the number of rows that fit, see
    :func:`torchrec_kvemb.table.bytes_per_row`).

    Example::

        KVTableOptions(capacity=1_000_000, eviction=EvictionPolicy.LFU,
                       admission_threshold=2, seed=7)
    """

    capacity: int | None = None
    memory_budget_bytes: int | None = None
    eviction: EvictionPolicy = EvictionPolicy.LRU
    #: An id gets a row after this many sightings (occurrences in training
    #: batches); 1 admits every id on first sight.
    admission_threshold: int = 1
    #: Ids whose sightings are counted while they wait for admission (an LRU
    #: index of its own); ``None``: the table's capacity.
    admission_counter_capacity: int | None = None
    initializer: Initializer = Initializer.UNIFORM
    #: UNIFORM draws from [init_low, init_high); NORMAL from N(init_mean, init_std);
    #: TRUNC_NORMAL from N(init_mean, init_std) truncated to [init_low, init_high].
    #: ``None`` (both, UNIFORM): the table's config decides (its ``init_fn``, or
    #: TorchRec's range as the stock module and sharder use it: ``weight_init_min``
    #: / ``weight_init_max``, else -/+ sqrt(1 / num_embeddings); see
    #: :func:`with_config_init` and docs/initial-rows.md); a ``KVTable`` made
    #: without a config takes -/+ ``DEFAULT_INIT_RANGE``.
    init_low: float | None = None
    init_high: float | None = None
    init_mean: float = 0.0
    init_std: float = 0.01
    seed: int = 0
    #: Routing buckets of the id space for sharding (fixed for the model's life).
    #: 8! = 2^7 3^2 5 7 splits evenly over world sizes 1-10, 12, 16, 24, 32, 64, 128, ...
    total_num_buckets: int = 40320
    ssd: SSDOptions | None = None
    #: A host-memory tier under the table's rows (over the SSD tier when both are given).
    host_tier: HostTierOptions | None = None
    #: How rows are stored: ``torch.float32``, ``torch.float16`` or ``torch.bfloat16``
    #: (docs/precision.md). Lookups pool and updates compute in float32 either way;
    #: optimizer state stays float32.
    weights_dtype: torch.dtype = torch.float32
    #: Rows the table starts with (rounded as ``capacity`` is); it grows (doubling
    #: its index buckets) when an insert would otherwise evict or fail, up to
    #: ``capacity`` (or what ``memory_budget_bytes`` holds), and evicts only there
    #: (docs/kv-table.md, "Tables that grow"). ``None``: start at the maximum.
    initial_capacity: int | None = None
    #: Rows freed once not looked up for a while (``TTLOptions``); ``None``: rows
    #: leave only by capacity eviction.
    ttl: TTLOptions | None = None
    #: Count each row's sightings (occurrences in training batches since it was
    #: stored, or since a load) for pruning at publish by ``min_count``
    #: (``torchrec_kvemb.prune``): 16 bytes a row. An LFU table's scores count
    #: them already (nothing more is kept).
    count_sightings: bool = False
    #: The table's first column in the initial-row streams (rows are a function of
    #: (id, seed, column)): a column shard of a wider table, ``dim`` columns from
    #: ``column_offset`` on, draws exactly that table's columns. 0 but for the
    #: column shards COLUMN_WISE sharding builds.
    column_offset: int = 0

    @property
    def tiered(self) -> bool:
        """Whether the table has a lower tier (host memory, SSD or both)."""
        return self.ssd is not None or self.host_tier is not None

    def _check_ttl(self) -> None:
        if self.count_sightings and self.eviction != EvictionPolicy.LFU:
            if self.tiered:
                raise ValueError(
                    "KVTableOptions: count_sightings with a lower tier (ssd / host_tier) is "
                    "not supported: the counts belong to the table's memory rows and would "
                    "not go down to a tier and back with a row. Use "
                    "eviction=EvictionPolicy.LFU (its scores are the rows' sightings and "
                    "move with them; prune_export(min_count=...) reads them), or drop the "
                    "tier"
                )
        if self.ttl is None:
            return
        if not isinstance(self.ttl, TTLOptions):
            raise TypeError(f"KVTableOptions: ttl must be a TTLOptions, got {self.ttl!r}")
        if self.tiered and self.eviction != EvictionPolicy.LRU:
            raise ValueError(
                "KVTableOptions: ttl with a lower tier (ssd / host_tier) needs "
                "eviction=LRU, whose scores are the rows' last steps and move with them "
                f"between the tiers; got {self.eviction.name}"
            )
        if self.ssd is not None and self.ssd.eviction != EvictionPolicy.LRU:
            raise ValueError(
                "KVTableOptions: ttl with an SSD tier needs SSDOptions(eviction=LRU), "
                "whose index keeps the rows' last steps for the sweep; got "
                f"{self.ssd.eviction.name}"
            )

    def __post_init__(self) -> None:
        if not isinstance(self.column_offset, int) or self.column_offset < 0:
            raise ValueError(
                f"KVTableOptions: column_offset must be an int >= 0, got {self.column_offset!r}"
            )
        if self.weights_dtype not in ROW_DTYPES:
            raise ValueError(
                f"KVTableOptions: weights_dtype must be one of "
                f"{', '.join(str(d) for d in ROW_DTYPES)}, got {self.weights_dtype!r}"
            )
        if (self.capacity is None) == (self.memory_budget_bytes is None):
            raise ValueError("KVTableOptions: give exactly one of capacity or memory_budget_bytes")
        if self.capacity is not None and self.capacity <= 0:
            raise ValueError(f"KVTableOptions: capacity must be > 0, got {self.capacity}")
        if self.memory_budget_bytes is not None and self.memory_budget_bytes <= 0:
            raise ValueError(
                f"KVTableOptions: memory_budget_bytes must be > 0, got {self.memory_budget_bytes}"
            )
        if self.initial_capacity is not None:
            if self.initial_capacity <= 0:
                raise ValueError(
                    f"KVTableOptions: initial_capacity must be > 0, got {self.initial_capacity}"
                )
            if self.capacity is not None and self.initial_capacity > self.capacity:
                raise ValueError(
                    f"KVTableOptions: initial_capacity {self.initial_capacity} is above "
                    f"capacity {self.capacity} (the most the table grows to)"
                )
        self._check_ttl()
        if self.host_tier is not None and not isinstance(self.host_tier, HostTierOptions):
            raise TypeError(
                f"KVTableOptions: host_tier must be a HostTierOptions, got {self.host_tier!r}"
            )
        if self.admission_threshold < 1:
            raise ValueError(
                f"KVTableOptions: admission_threshold must be >= 1, got {self.admission_threshold}"
            )
        if self.total_num_buckets < 1:
            raise ValueError("KVTableOptions: total_num_buckets must be >= 1")
        if not isinstance(self.eviction, EvictionPolicy):
            raise TypeError(
                f"KVTableOptions: eviction must be an EvictionPolicy, got {self.eviction!r}"
            )
        if (self.init_low is None) != (self.init_high is None):
            raise ValueError("KVTableOptions: give both init_low and init_high, or neither")
        if self.init_low is not None and not self.init_low <= self.init_high:
            raise ValueError(
                f"KVTableOptions: init_low {self.init_low} is above init_high {self.init_high}"
            )
        if not isinstance(self.initializer, Initializer):
            raise TypeError(
                f"KVTableOptions: initializer must be an Initializer, got {self.initializer!r}"
            )
        if self.initializer != Initializer.UNIFORM:
            if not (math.isfinite(self.init_mean) and math.isfinite(self.init_std)):
                raise ValueError(
                    f"KVTableOptions: init_mean and init_std must be finite, got "
                    f"{self.init_mean}, {self.init_std}"
                )
            if self.init_std < 0:
                raise ValueError(f"KVTableOptions: init_std must be >= 0, got {self.init_std}")
        if self.initializer == Initializer.TRUNC_NORMAL:
            if self.init_low is None:
                raise ValueError(
                    "KVTableOptions: a TRUNC_NORMAL initializer needs its bounds "
                    "init_low and init_high (absolute, as trunc_normal_'s a and b)"
                )
            if not self.init_std > 0:
                raise ValueError(
                    f"KVTableOptions: a TRUNC_NORMAL initializer needs init_std > 0, "
                    f"got {self.init_std}"
                )
            for value in (self.init_mean, self.init_std, self.init_low, self.init_high):
                if not abs(value) < FLOAT32_MAX:
                    raise ValueError(
                        f"KVTableOptions: TRUNC_NORMAL parameters must be finite float32 "
                        f"values, got {value}"
                    )


#: A default initial range below this bound is said out loud (``with_config_init``):
#: TorchRec's +/-sqrt(1 / num_embeddings) of a KV table over a whole id space.
TINY_INIT_BOUND = 1e-4

_INIT = torch.nn.init
#: The ``torch.nn.init`` functions a KV table honours as an ``init_fn``.
INIT_FNS = (
    _INIT.uniform_,
    _INIT.normal_,
    _INIT.trunc_normal_,
    _INIT.constant_,
    _INIT.zeros_,
    _INIT.ones_,
)


def _refuse_init_fn(name: str, why: str = "") -> ValueError:
    return ValueError(
        f"table {name!r}: its config has an init_fn of its own, which a KV table "
        f"cannot call (rows are made per id from (id, seed, column)){why}; use one of "
        "torch.nn.init.uniform_, normal_, trunc_normal_, constant_, zeros_, ones_ "
        "(plain or as functools.partial), or drop init_fn and give weight_init_min / "
        "weight_init_max, or KVTableOptions(init_low=..., init_high=...) / "
        "initializer=Initializer.NORMAL"
    )


def init_fn_distribution(fn: Callable[..., Any], name: str) -> dict[str, Any]:
    """The ``KVTableOptions`` fields (``initializer``, ``init_low`` / ``init_high``,
    ``init_mean`` / ``init_std``) that draw, per id, the distribution the
    ``torch.nn.init`` function ``fn`` fills a weight with (plain, or a
    ``functools.partial`` with keyword or positional arguments; torch's defaults
    for the others). Any other callable is refused with a ``ValueError`` naming
    table ``name`` (docs/initial-rows.md has the mapping).

    Example::

        init_fn_distribution(partial(torch.nn.init.normal_, std=0.02), "t")
        # {'initializer': Initializer.NORMAL, 'init_mean': 0.0, 'init_std': 0.02}
    """
    func, args, kwargs = fn, (), {}
    if isinstance(fn, functools.partial):
        func, args, kwargs = fn.func, fn.args, dict(fn.keywords)
    if not any(func is known for known in INIT_FNS):
        raise _refuse_init_fn(name)
    weight = object()  # what the table's weight would be bound to
    try:
        bound = inspect.signature(func).bind(*args, weight, **kwargs)
    except TypeError as error:
        why = f" and {func.__name__} refuses its arguments: {error}"
        raise _refuse_init_fn(name, why) from None
    bound.apply_defaults()
    params = dict(bound.arguments)
    if params.pop("tensor") is not weight:
        raise _refuse_init_fn(
            name, f": its positional arguments take {func.__name__}'s tensor argument"
        )
    if params.pop("generator", None) is not None:
        raise ValueError(
            f"table {name!r}: init_fn {func.__name__} with a generator: a KV table draws "
            "its rows from (id, seed, column), not from a generator; drop it and set "
            "KVTableOptions(seed=...)"
        )
    try:
        params = {key: float(value) for key, value in params.items()}
    except (TypeError, ValueError) as error:
        why = f" and {func.__name__}'s arguments are not numbers: {error}"
        raise _refuse_init_fn(name, why) from None
    if func is _INIT.uniform_:
        low, high = params["a"], params["b"]
        return {"initializer": Initializer.UNIFORM, "init_low": low, "init_high": high}
    if func is _INIT.normal_:
        return {
            "initializer": Initializer.NORMAL,
            "init_mean": params["mean"],
            "init_std": params["std"],
        }
    if func is _INIT.trunc_normal_:
        return {
            "initializer": Initializer.TRUNC_NORMAL,
            "init_mean": params["mean"],
            "init_std": params["std"],
            "init_low": params["a"],
            "init_high": params["b"],
        }
    value = {_INIT.zeros_: 0.0, _INIT.ones_: 1.0}.get(func, params.get("val"))
    return {"initializer": Initializer.UNIFORM, "init_low": value, "init_high": value}


def torchrec_init_range(config: Any) -> tuple[float, float]:
    """The uniform range TorchRec initialises a table of ``config`` with when its
    ``init_fn`` is the config's own default: ``weight_init_min`` /
    ``weight_init_max``, else -/+ sqrt(1 / num_embeddings)."""
    low = config.weight_init_min
    high = config.weight_init_max
    bound = math.sqrt(1 / config.num_embeddings)
    return (-bound if low is None else float(low), bound if high is None else float(high))


def _is_default_init_fn(fn: Any, config: Any) -> bool:
    """``fn`` is the uniform draw a TorchRec config makes of its range when no
    ``init_fn`` is given (or there is none)."""
    if fn is None:
        return True
    if not (isinstance(fn, functools.partial) and fn.func is _INIT.uniform_ and not fn.args):
        return False
    low, high = torchrec_init_range(config)
    return dict(fn.keywords) == {"a": low, "b": high}


def _distribution(options: KVTableOptions) -> dict[str, Any]:
    """The fields of ``options`` that say how rows are drawn (those ``init_fn_distribution``
    gives for the same distribution)."""
    out: dict[str, Any] = {"initializer": options.initializer}
    if options.initializer != Initializer.UNIFORM:
        out.update(init_mean=options.init_mean, init_std=options.init_std)
    if options.initializer != Initializer.NORMAL:
        out.update(init_low=options.init_low, init_high=options.init_high)
    return out


def with_config_init(options: KVTableOptions, config: Any) -> KVTableOptions:
    """``options`` with the initial-row distribution the table's TorchRec config
    gives (an ``EmbeddingBagConfig``, ``EmbeddingConfig`` or sharded table).

    A config ``init_fn`` among ``torch.nn.init.uniform_``, ``normal_``,
    ``trunc_normal_``, ``constant_``, ``zeros_``, ``ones_`` gives its distribution
    (:func:`init_fn_distribution`), drawn per id; any other ``init_fn`` is refused
    (a KV row is a function of (id, seed, column): no function of a whole weight
    can make it). Without one of its own (the config's default uniform draw),
    and without ``init_low`` / ``init_high`` (UNIFORM), the table draws from
    TorchRec's range (:func:`torchrec_init_range`). Options and config that
    disagree are refused with a ``ValueError`` naming the table: explicit options
    (a range, or another initializer than UNIFORM) against the config's
    ``init_fn`` or explicit ``weight_init_min`` / ``max``; options that draw the
    same distribution as the ``init_fn`` are accepted."""
    name = config.name
    fn = getattr(config, "init_fn", None)
    if not _is_default_init_fn(fn, config):
        wanted = init_fn_distribution(fn, name)
        given = options.initializer != Initializer.UNIFORM or options.init_low is not None
        if given and _distribution(options) != wanted:
            raise ValueError(
                f"table {name!r}: KVTableOptions' initial rows {_distribution(options)} "
                f"differ from the config's init_fn {wanted}; keep one of them"
            )
        return replace(options, **wanted)
    torchrec = torchrec_init_range(config)
    explicit = config.weight_init_min is not None or config.weight_init_max is not None
    if options.initializer != Initializer.UNIFORM:
        if explicit:
            raise ValueError(
                f"table {name!r}: KVTableOptions asks for a {options.initializer.name} "
                f"initializer but the config gives the uniform range {list(torchrec)}; "
                "keep one of them"
            )
        return options
    if options.init_low is None:
        if not explicit and torchrec[1] < TINY_INIT_BOUND:
            warnings.warn(
                f"table {name!r}: no initial range given, so its rows draw from TorchRec's "
                f"default +/-sqrt(1 / num_embeddings) = +/-{torchrec[1]:.1e} "
                f"(num_embeddings={config.num_embeddings}), as a stock table would: rows "
                "start at nearly zero. Give weight_init_min / weight_init_max on the "
                "config, or KVTableOptions(init_low=..., init_high=...)",
                stacklevel=3,
            )
        return replace(options, init_low=torchrec[0], init_high=torchrec[1])
    if explicit and (options.init_low, options.init_high) != torchrec:
        raise ValueError(
            f"table {name!r}: KVTableOptions' init range [{options.init_low}, "
            f"{options.init_high}] differs from the config's weight_init_min / max "
            f"{list(torchrec)}; keep one of them"
        )
    return options
