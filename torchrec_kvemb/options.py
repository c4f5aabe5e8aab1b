"""Per-table options of a KV (key-value, zero-collision) embedding table."""

from __future__ import annotations

import enum
import functools
import math
import os
import warnings
from dataclasses import dataclass, replace
from typing import Any

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
    """Distribution of a new row's values (a pure function of id, seed, column)."""

    UNIFORM = "uniform"
    NORMAL = "normal"


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
    #: UNIFORM draws from [init_low, init_high); NORMAL from N(init_mean, init_std).
    #: ``None`` (both): TorchRec's range for the table's config, as the stock
    #: module and sharder use it: ``weight_init_min`` / ``weight_init_max``, else
    #: -/+ sqrt(1 / num_embeddings) (see :func:`with_config_init`); a ``KVTable``
    #: made without a config takes -/+ ``DEFAULT_INIT_RANGE``.
    init_low: float | None = None
    init_high: float | None = None
    init_mean: float = 0.0
    init_std: float = 0.01
    seed: int = 0
    #: Routing buckets of the id space for sharding (fixed for the model's life).
    #: 8! = 2^7 3^2 5 7 splits evenly over world sizes 1-10, 12, 16, 24, 32, 64, 128, ...
    total_num_buckets: int = 40320
    ssd: SSDOptions | None = None
    #: How rows are stored: ``torch.float32``, ``torch.float16`` or ``torch.bfloat16``
    #: (docs/precision.md). Lookups pool and updates compute in float32 either way;
    #: optimizer state stays float32.
    weights_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
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


#: A default initial range below this bound is said out loud (``with_config_init``):
#: TorchRec's +/-sqrt(1 / num_embeddings) of a KV table over a whole id space.
TINY_INIT_BOUND = 1e-4


def torchrec_init_range(config: Any, init_fn: bool = True) -> tuple[float, float] | None:
    """The uniform range TorchRec initialises a table of ``config`` with
    (``weight_init_min`` / ``weight_init_max``, else -/+ sqrt(1 / num_embeddings)),
    or None when the config has an ``init_fn`` of its own (not a uniform draw) and
    ``init_fn`` says it counts (the unsharded modules call it; sharded tables,
    fbgemm's, draw from the range and ignore it)."""
    fn = getattr(config, "init_fn", None) if init_fn else None
    if fn is not None and not (
        isinstance(fn, functools.partial) and fn.func is torch.nn.init.uniform_
    ):
        return None
    low = config.weight_init_min
    high = config.weight_init_max
    bound = math.sqrt(1 / config.num_embeddings)
    return (-bound if low is None else float(low), bound if high is None else float(high))


def with_config_init(options: KVTableOptions, config: Any, init_fn: bool = True) -> KVTableOptions:
    """``options`` with the initial-row distribution the table's TorchRec config
    gives (an ``EmbeddingBagConfig``, ``EmbeddingConfig`` or sharded table).

    Without ``init_low`` / ``init_high`` (UNIFORM), the table draws from TorchRec's
    range (:func:`torchrec_init_range`). Options and config that disagree are
    refused with a ``ValueError`` naming the table: an explicit range or NORMAL
    initializer against the config's explicit ``weight_init_min`` / ``max``, or a
    config ``init_fn`` of its own (a KV row is a function of (id, seed, column):
    no function of a whole weight can make it; ``init_fn=False``: a sharded table,
    whose stock kernel ignores ``init_fn`` too)."""
    name = config.name
    torchrec = torchrec_init_range(config, init_fn)
    if torchrec is None:
        raise ValueError(
            f"table {name!r}: its config has an init_fn of its own, which a KV table "
            "cannot call (rows are made per id from (id, seed, column)); drop init_fn "
            "and give weight_init_min / weight_init_max, or KVTableOptions(init_low=..., "
            "init_high=...) / initializer=Initializer.NORMAL"
        )
    explicit = config.weight_init_min is not None or config.weight_init_max is not None
    if options.initializer == Initializer.NORMAL:
        if explicit:
            raise ValueError(
                f"table {name!r}: KVTableOptions asks for a NORMAL initializer but the "
                f"config gives the uniform range {list(torchrec)}; keep one of them"
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
