"""One shard of one KV table in memory: a bucketed id index over value rows.

Memory per row of capacity: see ``torchrec_kvemb.memory``. With
``options.ssd`` the constructor builds a ``TieredKVTable``
(``torchrec_kvemb/tiered.py``): the same table over a lower tier on disk.

Why one file of some 550 lines: it is one class, ``KVTable``, whose public
methods are the table's whole contract (lookups, rows, whole-content loads and
exports); the index, the tier, the grouped path and the memory arithmetic
already live in modules of their own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, ClassVar

import torch

from torchrec_kvemb import dispatch, huge_pages
from torchrec_kvemb.contracts import (
    METRIC_NAMES,
    GroupLookup,
    InitSpec,
    InsertResult,
    TableStorage,
    init_spec,
    seed_mix,
)
from torchrec_kvemb.index import BucketIndex
from torchrec_kvemb.memory import bytes_per_row, memory_at, resolve_capacity, table_memory
from torchrec_kvemb.optimizer import FusedOptimConfig
from torchrec_kvemb.options import WAYS, EvictionPolicy, KVTableOptions
from torchrec_kvemb.tier import TIER_METRICS, LowerTier
from torchrec_kvemb.ttl import TableTTL, has_row_stats
from torchrec_kvemb.validation import KVInputError, check_ids, check_rows

__all__ = ["KVTable", "TableStorage", "bytes_per_row", "resolve_capacity"]


def max_per_unique(
    scores: torch.Tensor | None, inverse: torch.Tensor, num_unique: int
) -> torch.Tensor | None:
    """The largest of each unique id's per-occurrence ``scores`` (None stays None)."""
    if scores is None:
        return None
    out = torch.full((num_unique,), torch.iinfo(torch.int64).min, device=inverse.device)
    return out.scatter_reduce_(0, inverse, scores.to(torch.int64), reduce="amax")


def grown_storage(rows: int, weights: torch.Tensor, state: torch.Tensor) -> TableStorage:
    """An empty index of ``rows`` slots, zero rows like ``weights`` and ``state``
    (why zeros: a lookup may read an empty slot's row and mask it by
    multiplication, which garbage NaNs would survive), no admission counter: what
    a table grows into. Large arrays are asked for 2 MB pages once filled
    (``huge_pages.advise``): their memory is faulted in on 4 KB pages, and the
    kernel's khugepaged merges it into 2 MB pages in the background (why not
    before the fill, as ``TableStorage.allocate`` does: the growth runs inside a
    training step, and on the 2-core VM 64 MB faulted in on 2 MB pages took
    53-256 ms against 28-41 ms; docs/benchmarks.md, Growth)."""
    device = weights.device
    keys = torch.full((rows // WAYS, WAYS), -1, dtype=torch.int64, device=device)
    arrays = (
        keys,
        torch.zeros_like(keys),
        weights.new_zeros(rows, weights.shape[1]),
        state.new_zeros(rows, state.shape[1]),
    )
    for array in arrays:
        huge_pages.advise(array)
    empty = keys.new_empty(0)
    return TableStorage(*arrays, empty.view(0, WAYS), empty.view(0, WAYS), empty)


class KVTable:
    """A key-value, zero-collision embedding table (one shard).

    Ids are int64 >= 0 of any size; two ids never share a row. Rows live in
    ``weights [capacity, dim]`` and ``state [capacity, state_dim]``, addressed by
    the slot the index (``index``, a :class:`~torchrec_kvemb.index.BucketIndex`)
    gives an id.

    Example::

        table = KVTable("user", dim=8, options=KVTableOptions(capacity=1000))
        table.insert(torch.tensor([7, 2**40]), torch.ones(2, 8))
        rows, found = table.find(torch.tensor([7, 3]))   # found == [True, False]

    With ``options.ssd`` this builds a ``TieredKVTable`` (files
    ``<path>/<name>.rank<rank>.*``; ``rank`` defaults to the process's rank in
    torch.distributed, else 0)::

        table = KVTable("user", 8, KVTableOptions(capacity=1000, ssd=SSDOptions("/mnt/ssd")))
        table.prefetch(next_ids)   # optional: read the next batch's SSD rows ahead
        table.flush()              # every row durable; reopening the path restores them
        table.close()

    **Growth.** With ``options.initial_capacity`` the table starts with fewer
    buckets and grows (``make_room``, ``grow``: doubling, rows rehashed with their
    state and scores) before a lookup or insert would evict or fail, up to
    ``max_capacity``; it behaves as a table built at ``max_capacity``
    (docs/kv-table.md, "Tables that grow")::

        table = KVTable("user", 8, KVTableOptions(capacity=1 << 20, initial_capacity=1 << 14))
        table.capacity, table.max_capacity   # (16384, 1048576), until it grows

    **Clocks.** ``clock [2]`` int64 holds the training lookups so far (``step``: the
    LRU clock, a new row's score) and the optimizer steps so far (``optim_step``:
    Adam's bias correction). Who advances them:

    * the step: ``torch.ops.kvemb.lookup_train_group`` inside the op (a group's
      native and Triton lookups: every table's column of ``KVTableGroup.clocks``);
      everywhere else :meth:`advance_step`, once per training batch: the torch-path
      lookups (``lookup_train``, ``TieredKVTable.lookup_train``) and the tiered
      lookup (``tiered_lookup``);
    * the optimizer step: the group's fused backward (the registered
      ``fused_backward`` op, or its torch path in ``dispatch``).

    Restores and loads set ``step`` and ``optim_step``; nothing else in the package
    writes them.
    """

    #: The subclass that serves ``options.ssd`` (set by ``torchrec_kvemb.tiered``).
    _tiered_class: ClassVar[type[KVTable] | None] = None

    def __init_subclass__(cls, serves_ssd: bool = False, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if serves_ssd:
            KVTable._tiered_class = cls

    def __new__(cls, name: str, dim: int, options: KVTableOptions, *args: Any, **kwargs: Any):
        if cls is KVTable and getattr(options, "tiered", False):
            if KVTable._tiered_class is None:
                raise RuntimeError("an SSD tier needs torchrec_kvemb.tiered: import it first")
            return super().__new__(KVTable._tiered_class)
        return super().__new__(cls)

    def __init__(
        self,
        name: str,
        dim: int,
        options: KVTableOptions,
        optim: FusedOptimConfig | None = None,
        device: torch.device | str | None = None,
        rank: int | None = None,
        storage: TableStorage | None = None,
    ) -> None:
        """``storage``: arrays to use (views of a group's), instead of new ones."""
        if dim <= 0:
            raise ValueError(f"table {name!r}: dim must be > 0, got {dim}")
        self.name = name
        self.dim = dim
        self.options = options
        self._optim = optim or FusedOptimConfig()
        self._param_group: dict[str, Any] = {"lr": self._optim.learning_rate}
        self.device = torch.device(device or "cpu")
        self._memory = table_memory(options, dim, self._optim)
        self.state_dim = self._memory.state_dim
        #: Rows in memory now: ``max_capacity``, or less while a table built with
        #: ``initial_capacity`` grows (``grow``).
        self.capacity = self._memory.initial_rows
        counted = self._memory.counter_ids
        if storage is None:
            storage = TableStorage.allocate(
                self.capacity, dim, self.state_dim, counted, self.device, options.weights_dtype
            )
        elif (
            storage.weights.shape != (self.capacity, dim)
            or storage.counts.numel() != counted
            or storage.weights.dtype != options.weights_dtype
        ):
            raise ValueError(
                f"table {name!r}: storage for {storage.weights.shape[0]} {storage.weights.dtype} "
                f"rows of dim {storage.weights.shape[1]} and {storage.counts.numel()} admission "
                f"entries; the options need {self.capacity} {options.weights_dtype} rows of dim "
                f"{dim} and {counted} entries"
            )
        self.index = BucketIndex(storage.keys, storage.scores)
        self.weights = storage.weights
        self.state = storage.state
        self.counter = (
            BucketIndex(storage.counter_keys, storage.counter_scores) if counted else None
        )
        self.counts = storage.counts if counted else None
        #: Who reallocates the arrays when the table grows: ``None`` (the table
        #: itself), or its group (``KVTableGroup``), called with the table and the
        #: new row count.
        self.regrow: Callable[[KVTable, int], None] | None = None
        #: The table's clocks ``[2]`` int64: training lookups so far (the LRU clock) and
        #: optimizer steps so far (Adam's bias correction). The one place they live: a
        #: group's tables hold views of the group's ``clocks [2, T]``, which its ops
        #: advance (``KVTableGroup``); ``step`` and ``optim_step`` read and set them.
        self.clock = torch.zeros(2, dtype=torch.int64, device=self.device)
        self._metrics = dict.fromkeys(METRIC_NAMES, 0)
        #: Counters a grouped lookup adds on the device (``METRIC_NAMES`` order), or None.
        self.device_metrics: torch.Tensor | None = None
        #: The rows' time to live (``options.ttl``) and sightings (``options.count_sightings``;
        #: ``torchrec_kvemb.ttl``), or None.
        self.ttl = TableTTL(self) if has_row_stats(options) else None

    # ----------------------------------------------------------------- clocks
    @property
    def step(self) -> int:
        """Training lookups so far: the LRU clock, a new row's score (0 on ``meta``,
        where a table holds nothing and looks nothing up)."""
        return 0 if self.clock.is_meta else int(self.clock[0])

    @step.setter
    def step(self, value: int) -> None:
        self.clock[0] = int(value)

    @property
    def optim_step(self) -> int:
        """Optimizer steps so far (Adam's bias correction; 0 on ``meta``)."""
        return 0 if self.clock.is_meta else int(self.clock[1])

    @optim_step.setter
    def optim_step(self, value: int) -> None:
        self.clock[1] = int(value)

    def advance_step(self) -> None:
        """A training batch begins: the step clock advances by one, in place (so a
        group's ``clocks`` see it; no host sync)."""
        self.clock[0] += 1

    # ----------------------------------------------------------------- views
    @property
    def keys(self) -> torch.Tensor:
        """The index's keys ``[buckets, WAYS]``, -1 where empty (read-only use)."""
        return self.index.keys

    @property
    def scores(self) -> torch.Tensor:
        """Eviction scores ``[buckets, WAYS]`` beside ``keys``."""
        return self.index.scores

    @property
    def size(self) -> int:
        """Ids stored."""
        return self.index.size

    @property
    def total_size(self) -> int:
        """Ids stored in every tier."""
        return self.size

    def room(self) -> int | None:
        """Rows the table can hold at most in all its tiers (None: no bound); a
        growing table's maximum."""
        return self.max_capacity

    @property
    def init_spec(self) -> InitSpec:
        return init_spec(self.options)

    @property
    def seed_mix(self) -> int:
        return seed_mix(self.options.seed)

    @property
    def ssd(self) -> Any:
        """The lower tier under the in-memory rows (``TieredKVTable``), else None."""
        return None

    @property
    def tier(self) -> LowerTier | None:
        """The lower tier through its contract (``torchrec_kvemb.tier``), else None."""
        return None

    def memory_bytes(self) -> int:
        """Bytes of memory the table holds now (rows, index, admission counter): at
        ``max_capacity`` the planner's figure (``sharding.planner.kv_table_bytes``),
        less while the table grows."""
        return memory_at(self._memory, self.capacity)

    def initial_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows ``ids`` get when they are first stored."""
        return dispatch.init_rows(ids, self.dim, self.init_spec)

    # ------------------------------------------------------------- optimizer
    @property
    def optim(self) -> FusedOptimConfig:
        """The fused optimizer, with the table's current learning rate."""
        lr = float(self._param_group["lr"])
        if lr != self._optim.learning_rate:
            self._optim = replace(self._optim, learning_rate=lr)
        return self._optim

    @optim.setter
    def optim(self, config: FusedOptimConfig) -> None:
        if config.state_names() != self._optim.state_names():
            raise ValueError(
                f"table {self.name!r}: the optimizer keeps state {self._optim.state_names()}; "
                f"a table cannot change to one keeping {config.state_names()}"
            )
        self._optim = config
        self._param_group["lr"] = config.learning_rate

    @property
    def learning_rate(self) -> float:
        """The learning rate of the next update: ``lr`` of the table's param group (its
        own, or that of the fused optimizer the table was given to)."""
        return float(self._param_group["lr"])

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        self._param_group["lr"] = float(value)

    def use_param_group(self, group: dict[str, Any]) -> None:
        """Read the learning rate from ``group["lr"]`` from now on (a fused optimizer's
        param group, which the user may change between steps)."""
        self._param_group = group

    # ------------------------------------------------------------ public API
    def find(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Read-only lookup: ``(rows [n, dim] float32, found [n])``; missing rows are zeros."""
        ids = check_ids(self.name, ids).to(self.device)
        slots = self.index.probe(ids)
        found = slots >= 0
        rows = self.weights.index_select(0, slots.clamp(min=0)).to(torch.float32)
        rows = rows * found.unsqueeze(1)
        return rows, found

    def insert(
        self,
        ids: torch.Tensor,
        weights: torch.Tensor,
        state: torch.Tensor | None = None,
        scores: torch.Tensor | None = None,
        *,
        exact_scores: bool = False,
    ) -> torch.Tensor:
        """Store rows for unique ``ids`` (overwriting stored ones); returns their slots.

        The eviction policy applies when a bucket is full; an id that finds no
        room gets slot -1 and is counted in ``insert_failures`` (with an SSD tier,
        its row goes there).

        ``scores`` are custom scores, used by ``CUSTOM_SCORE`` tables only (LRU
        rows get the current step; LFU adds a count of 1). With ``exact_scores``
        they are the rows' eviction scores as given, whatever the policy (LRU
        steps, LFU counts, custom scores): they rank the rows for memory and are
        stored as they are, in whichever tier a row lands (as a checkpoint load
        restores saved scores).
        """
        ids, values = self._checked_insert(ids, weights, state, scores, exact_scores)
        self.make_room(ids)
        result = self.insert_ids(ids, values)
        if self.ttl is not None:
            self.ttl.mark(result.slots)
        stored = result.slots >= 0
        slots = result.slots[stored]
        if exact_scores:  # an LFU hit added its value to the stored count
            self.index.set_scores(slots, values[stored])
        self.weights.index_copy_(0, slots, weights.to(self.weights)[stored.to(weights.device)])
        if state is not None:
            self.state.index_copy_(0, slots, state.to(self.state)[stored.to(state.device)])
        elif self.state_dim:
            self.state.index_fill_(0, slots, 0.0)
        return result.slots

    def _checked_insert(
        self,
        ids: torch.Tensor,
        weights: torch.Tensor,
        state: torch.Tensor | None,
        scores: torch.Tensor | None,
        exact_scores: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``insert``'s checks: the ids (int64, on the device) and their score values."""
        ids = check_ids(self.name, ids).to(self.device)
        check_rows(self.name, weights, ids.numel(), self.dim)
        if state is not None:
            check_rows(self.name, state, ids.numel(), self.state_dim, what="state")
        if exact_scores and (
            scores is None or tuple(scores.shape) != (ids.numel(),) or scores.is_floating_point()
        ):
            raise KVInputError(
                f"table {self.name!r}: exact_scores needs an integer scores tensor of "
                f"{ids.numel()} entries"
            )
        if ids.numel() != torch.unique(ids).numel():
            raise KVInputError(f"table {self.name!r}: insert needs unique ids")
        if exact_scores:
            return ids, scores.to(device=self.device, dtype=torch.int64)
        return ids, self.score_values(ids, torch.ones_like(ids), scores)

    def export(self, route_buckets: int | None = None) -> dict[str, torch.Tensor]:
        """Every stored id with its row, score and optimizer state, sorted by id (or,
        with ``route_buckets = G``, by routing bucket among ``G``, then id: the
        order of a checkpoint)."""
        ids, slots = self.export_order(route_buckets)
        return {"ids": ids, **self.rows_of_slots(slots)}

    def export_order(self, route_buckets: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids, slots)`` of every id stored in memory, in ``export``'s order."""
        if route_buckets is not None:
            ids, slots, _ = self.checkpoint_order(route_buckets)
            return ids, slots
        slots = self.index.live_slots()
        ids, order = torch.sort(self.index.ids_at(slots))
        return ids, slots.index_select(0, order)

    def checkpoint_order(
        self, route_buckets: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(ids, slots, counts)``: the ids stored in memory sorted by routing bucket
        among ``route_buckets``, then id (a checkpoint's order), their slots, and ids
        per routing bucket."""
        return dispatch.export_order(self.index.keys, route_buckets)

    def rows_of_slots(self, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """``weights``, ``scores`` and the optimizer state by name of ``slots``."""
        return {name: array.index_select(0, slots) for name, array in self.row_arrays().items()}

    def row_arrays(self) -> dict[str, torch.Tensor]:
        """The in-memory arrays (views, one row per slot) whose rows at ``slots`` are
        :meth:`rows_of_slots`: ``weights``, ``scores``, the optimizer state by name."""
        arrays = {"weights": self.weights, "scores": self.index.scores.view(-1)}
        arrays.update(self.optim.split_state(self.state, self.dim))
        return arrays

    def metrics(self) -> dict[str, float]:
        """Counters since creation (``growths``: times the table grew), plus ``size``,
        ``capacity``, ``max_capacity`` and ``load_factor`` (of the in-memory tier) and
        ``ssd_size`` (see docs/ssd-tier.md for the SSD ones)."""
        out: dict[str, float] = dict(self._metrics)
        if self.device_metrics is not None:
            for name, value in zip(METRIC_NAMES, self.device_metrics.tolist(), strict=True):
                out[name] += value
        out.update(self.tier_metrics())
        size = self.size
        out.update(
            size=size,
            capacity=self.capacity,
            max_capacity=self.max_capacity,
            load_factor=size / self.capacity,
        )
        return out

    def tier_metrics(self) -> dict[str, float]:
        """The lower tier's metrics (``tier.TIER_METRICS``; zeros without one)."""
        return dict.fromkeys(TIER_METRICS, 0)

    def count(self, metric: str, n: int) -> None:
        """Add ``n`` to the counter ``metric`` (one of ``METRIC_NAMES``)."""
        self._metrics[metric] += n

    # ----------------------------------------------------------------- growth
    @property
    def max_capacity(self) -> int:
        """Rows the table holds at most (``capacity`` once grown, or without
        ``initial_capacity``)."""
        return self._memory.rows

    def make_room(self, ids: torch.Tensor, counts: torch.Tensor | None = None) -> None:
        """Grow the table (doubling its buckets, ``grow``) until storing the unique
        ``ids`` it does not hold evicts nothing and fails nothing, or it is at
        ``max_capacity``. ``counts``: the ids' sightings in a training batch, so that
        only those admission lets in count (None: every absent id counts).

        why a probe before the lookup: a table that grows before any bucket would
        overflow holds, bucket by bucket, what a table built at its maximum holds
        (memory.py, "Growth"), so it looks up, trains and evicts as that one."""
        rows = self.rows_needed(ids, counts)
        if rows != self.capacity:
            self.grow(rows)

    def rows_needed(self, ids: torch.Tensor, counts: torch.Tensor | None = None) -> int:
        """The capacity ``make_room`` grows the table to for ``ids`` (its capacity
        now when nothing would overflow, or at ``max_capacity``)."""
        if self.capacity >= self.max_capacity or ids.numel() == 0:
            return self.capacity
        absent = self.index.probe(ids) < 0
        new = ids[absent]
        if counts is not None and self.counter is not None and new.numel():
            where = self.counter.probe(new)
            seen = torch.where(where >= 0, self.counts[where.clamp(min=0)], 0)
            new = new[seen + counts[absent] >= self.options.admission_threshold]
        if new.numel() == 0:
            return self.capacity
        return self._rows_holding(new, stored=True)

    def fit(self, ids: torch.Tensor) -> None:
        """Grow the table so that unique ``ids`` alone (a content that replaces the
        table's, as a checkpoint load stages it) would fit its buckets, up to
        ``max_capacity``; the content it holds stays (rehashed)."""
        if self.capacity < self.max_capacity and ids.numel():
            rows = self._rows_holding(ids.to(self.device), stored=False)
            if rows != self.capacity:
                self.grow(rows)

    def _rows_holding(self, new: torch.Tensor, stored: bool) -> int:
        """The least capacity (the current one doubled as often as needed, at most
        ``max_capacity``) whose buckets hold ``new`` ids, with the stored ids when
        ``stored``, without overflowing."""
        target = self.index.num_buckets
        most = self.max_capacity // WAYS
        held = self.index.ids_at(self.index.live_slots()) if stored else new[:0]
        while target < most:
            load = torch.bincount(dispatch.index_bucket(new, target), minlength=target)
            if held.numel():
                load += torch.bincount(dispatch.index_bucket(held, target), minlength=target)
            if int(load.max()) <= WAYS:
                break
            target *= 2
        return target * WAYS

    def grow(self, rows: int) -> None:
        """Rehash into ``rows`` rows of capacity (``capacity`` times a power of two, at
        most ``max_capacity``): every stored id moves to its bucket among the new ones
        with its row, optimizer state and score; the admission counter stays."""
        if rows == self.capacity:
            return
        if rows < self.capacity or self.max_capacity % rows or rows % self.capacity:
            raise ValueError(
                f"table {self.name!r}: cannot grow from {self.capacity} to {rows} rows "
                f"(a power-of-two multiple, at most {self.max_capacity})"
            )
        if self.regrow is not None:
            self.regrow(self, rows)
            return
        self.rehash_into(grown_storage(rows, self.weights, self.state))
        self.count("growths", 1)

    def rehash_into(self, storage: TableStorage) -> None:
        """Move every stored id, with its row, optimizer state and score, into the
        empty index and rows of ``storage`` (more buckets), and use them from now on."""
        slots = self.index.live_slots()
        index = BucketIndex(storage.keys, storage.scores)
        src, moved = index.bulk_load(self.index.ids_at(slots), self.index.scores_at(slots))
        if src is not None and src.numel() != slots.numel():
            raise RuntimeError(f"table {self.name!r}: a rehash lost rows (a bucket overflowed)")
        if src is not None:
            slots = slots.index_select(0, src)
        storage.weights.index_copy_(0, moved, self.weights.index_select(0, slots))
        if self.state_dim:
            storage.state.index_copy_(0, moved, self.state.index_select(0, slots))
        if self.ttl is not None:  # last steps and sightings move with their rows
            self.ttl.rehashed(slots, moved, storage.weights.shape[0])
        self.use_rows(storage)

    def use_rows(self, storage: TableStorage) -> None:
        """Take the index and rows of ``storage`` (views of a group's reallocated
        arrays, or the table's own); ``capacity`` follows them."""
        self.index = BucketIndex(storage.keys, storage.scores)
        self.weights = storage.weights
        self.state = storage.state
        self.capacity = storage.weights.shape[0]

    # ------------------------------------------------- tier-free operations
    def prefetch(self, ids: torch.Tensor) -> None:
        """Start reading a coming batch's rows from the lower tier (a no-op without one)."""

    def flush(self) -> None:
        """Make every row durable in the lower tier (a no-op without one)."""

    def close(self) -> None:
        """Flush and close the lower tier (a no-op without one)."""

    def reserve(self, n: int) -> None:
        """Room in the lower tier for ``n`` rows before anything changes (a no-op
        without one)."""

    def settle(self) -> None:
        """Write what waits for the lower tier from the last batch (its scratch rows,
        trained by its backward since) before a batch begins (a no-op without one)."""

    # ------------------------------------------------------- training lookups
    def lookup_train(self, ids: torch.Tensor, custom_scores: torch.Tensor | None = None):
        """Slots for a training batch, inserting new ids (admission and eviction apply).

        Returns ``slots [n]``: -1 for ids that hold no row (not yet admitted, or no
        room); they pool their initial value and their gradient is dropped.
        """
        self.advance_step()
        uniq, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
        self.make_room(uniq, counts)
        custom = max_per_unique(custom_scores, inverse, uniq.numel())
        values = self.score_values(uniq, counts, custom)
        slots_u, hit_u, inserted_u, _, _ = self.compete(uniq, counts, values)
        self.init_rows_at(slots_u[inserted_u], uniq[inserted_u])
        if self.ttl is not None:
            self.ttl.after_lookup(slots_u, counts)
        self.count_hits(ids.numel(), counts, hit_u)
        return slots_u[inverse]

    def lookup_train_rows(
        self, ids: torch.Tensor, custom_scores: torch.Tensor | None = None
    ) -> GroupLookup:
        """``lookup_train`` as a group of this table alone hands it to its backward:
        the slots, and (where the lookup made them) each id's unique row, for the
        native fused backward."""
        return GroupLookup(self.lookup_train(ids, custom_scores))

    def lookup_backend(self, device: torch.device | str) -> str:
        """What runs this table's own lookups (``lookup_train``, ``lookup_eval``): the
        torch path, table by table (a group of tables runs the registered ops)."""
        return "torch"

    def lookup_eval(self, ids: torch.Tensor) -> torch.Tensor:
        """Slots for an evaluation batch (read-only); -1 for ids not stored."""
        slots = self.index.probe(ids)
        hits = int((slots >= 0).sum())
        self.count("hits", hits)
        self.count("misses", ids.numel() - hits)
        return slots

    # --------------------------------------------- steps of a training lookup
    def score_values(
        self, ids: torch.Tensor, counts: torch.Tensor, custom: torch.Tensor | None
    ) -> torch.Tensor:
        """The eviction score values a batch's unique ``ids`` bring (``counts``: their
        occurrences; ``custom``: their custom scores, if given)."""
        policy = self.options.eviction
        if policy == EvictionPolicy.LFU:
            return counts.to(torch.int64)
        if policy == EvictionPolicy.CUSTOM_SCORE and custom is not None:
            return custom.to(device=ids.device, dtype=torch.int64)
        return torch.full_like(ids, self.step)

    def compete(
        self,
        uniq: torch.Tensor,
        counts: torch.Tensor,
        values: torch.Tensor,
        stored: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, InsertResult, torch.Tensor]:
        """Admission, then find-or-insert of a batch's unique ids: ``(slots, hit,
        inserted, result, no_room)`` per unique id (slot -1: not admitted or no
        room; ``no_room``: admitted, or stored, but no memory row).
        ``stored``: which ids hold a row (default: those the index holds)."""
        if self.counter is None:
            # why: every id is a candidate; skipping the masks saves ~2 ms per 80k ids.
            result = self.insert_ids(uniq, values)
            no_room = ~result.hit & ~result.inserted
            return result.slots, result.hit, result.inserted, result, no_room
        candidates = self.admit(uniq, counts, stored)
        cand_idx = candidates.nonzero().squeeze(1)
        result = self.insert_ids(uniq[cand_idx], values[cand_idx])
        slots = torch.full_like(uniq, -1).index_copy_(0, cand_idx, result.slots)
        hit = torch.zeros_like(candidates).index_copy_(0, cand_idx, result.hit)
        inserted = torch.zeros_like(candidates).index_copy_(0, cand_idx, result.inserted)
        self.count("admission_rejects", uniq.numel() - cand_idx.numel())
        no_room = torch.zeros_like(candidates).index_copy_(
            0, cand_idx, ~result.hit & ~result.inserted
        )
        return slots, hit, inserted, result, no_room

    def insert_ids(self, ids: torch.Tensor, values: torch.Tensor) -> InsertResult:
        """Find-or-insert unique ``ids`` by the table's eviction policy (rows untouched)."""
        policy = self.options.eviction
        result = self.index.insert(
            ids,
            values,
            accumulate=policy == EvictionPolicy.LFU,
            keep_existing=policy == EvictionPolicy.NONE,
        )
        self.count("inserts", int(result.inserted.sum()))
        self.count("evictions", result.evicted_ids.numel())
        self.count("insert_failures", int((~result.hit & ~result.inserted).sum()))
        return result

    def admit(
        self, uniq: torch.Tensor, counts: torch.Tensor, stored: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Which of ``uniq`` may take a row: stored already (in memory, or where
        ``stored`` says), or seen often enough (counted in the admission counter)."""
        if stored is None:
            stored = self.index.probe(uniq) >= 0
        waiting = (~stored).nonzero().squeeze(1)
        if waiting.numel() == 0:
            return stored
        ids = uniq[waiting]
        result = self.counter.insert(ids, torch.full_like(ids, self.step))
        seen = counts[waiting].clone()
        counted = result.slots >= 0
        slots = result.slots[counted]
        # A slot new to this id (inserted, or reused after evicting another id) starts at 0.
        previous = torch.where(result.inserted[counted], 0, self.counts[slots])
        seen[counted] += previous
        self.counts[slots] = seen[counted]
        admitted = seen >= self.options.admission_threshold
        done = result.slots[admitted & counted]
        if done.numel():
            self.counter.remove(done)
            self.counts[done] = 0
        stored[waiting[admitted]] = True
        return stored

    def init_rows_at(self, slots: torch.Tensor, ids: torch.Tensor) -> None:
        """New rows: ``ids``' initial rows at ``slots``, optimizer state zero."""
        if slots.numel():
            rows = self.initial_rows(ids).to(self.weights.dtype)
            dispatch.scatter_rows(self.weights, slots, rows)  # native for float32 on the CPU
            if self.state_dim:
                self.state.index_fill_(0, slots, 0.0)

    def count_hits(self, n: int, counts: torch.Tensor, hit: torch.Tensor) -> None:
        """Count a batch of ``n`` ids whose unique ids (``counts`` occurrences) hit or not."""
        hits = int((counts * hit).sum())  # why not dot: CUDA has no int64 dot
        self.count("hits", hits)
        self.count("misses", n - hits)

    # ------------------------------------------------------------------ rows
    def batch_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``(weights, state)`` arrays the slots of a lookup address: the table's
        rows, and with an SSD tier its scratch rows after them (docs/ssd-tier.md)."""
        return self.weights, self.state

    def storage(self) -> TableStorage:
        """The table's arrays as one ``TableStorage`` (its rows: ``batch_rows()``; no
        admission counter: empty arrays)."""
        weights, state = self.batch_rows()
        counter = self.counter
        return TableStorage(
            self.keys,
            self.scores,
            weights,
            state,
            counter.keys if counter is not None else self.keys[:0],
            counter.scores if counter is not None else self.scores[:0],
            self.counts if self.counts is not None else self.keys.new_empty(0),
        )

    def rows_at(self, slots: torch.Tensor) -> torch.Tensor:
        """Weights and state of ``slots`` side by side: ``[n, dim + state_dim]``."""
        return torch.cat(
            [self.weights.index_select(0, slots), self.state.index_select(0, slots)], dim=1
        )

    def set_rows(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Write ``[n, dim + state_dim]`` rows (weights, then state) at ``slots``."""
        dispatch.scatter_rows(self.weights, slots, rows[:, : self.dim].to(self.weights.dtype))
        if self.state_dim:
            dispatch.scatter_rows(self.state, slots, rows[:, self.dim :])

    # ------------------------------------------------ whole-content operations
    def clear(self) -> None:
        """Remove every id, and the admission counts."""
        self.index.clear()
        if self.counter is not None:
            self.counter.clear()
            self.counts.zero_()
        if self.ttl is not None:
            self.ttl.cleared()

    def load_rows(
        self,
        ids: torch.Tensor,
        weights: torch.Tensor,
        state: torch.Tensor | None,
        scores: torch.Tensor | None,
        step: tuple[int, int] | None = None,
        last_seen: torch.Tensor | None = None,
    ) -> int:
        """Store unique ``ids`` with their rows, optimizer state (None: zero) and
        scores (None: the current step) in the EMPTY table, then take the step
        counters ``step`` (training lookups, optimizer steps; None: keep them) and,
        for a TTL table that keeps ``last_seen``, the rows' ``last_seen`` steps (None:
        seen at the restored step). Returns how many rows found no room (a bucket
        given more than ``WAYS`` ids keeps those of the highest scores, then smallest
        ids, as an insert would)."""
        lost = self._bulk_load(ids, weights, state, scores)
        if step is not None:
            self.step, self.optim_step = step
        if self.ttl is not None:
            self.ttl.restore(ids, last_seen)
        return lost

    def _bulk_load(
        self,
        ids: torch.Tensor,
        weights: torch.Tensor,
        state: torch.Tensor | None,
        scores: torch.Tensor | None,
    ) -> int:
        ids = ids.to(self.device)
        self.make_room(ids)
        if scores is None:
            scores = torch.full_like(ids, self.step)
        src, slots = self.index.bulk_load(ids, scores.to(self.device, torch.int64))
        weights = weights.to(self.device, self.weights.dtype)
        state = None if state is None else state.to(self.device, torch.float32)
        if src is not None:
            weights = weights.index_select(0, src)
            state = None if state is None else state.index_select(0, src)
        self.weights.index_copy_(0, slots, weights)
        if state is not None:
            self.state.index_copy_(0, slots, state)
        elif self.state_dim:
            self.state.index_fill_(0, slots, 0.0)
        return 0 if src is None else ids.numel() - src.numel()

    def admission_entries(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(ids, sightings, counter scores)`` of the ids waiting for admission, by slot
        (empty without admission)."""
        if self.counter is None:
            empty = torch.empty(0, dtype=torch.int64)
            return empty, empty, empty
        slots = self.counter.live_slots()
        return self.counter.ids_at(slots), self.counts[slots], self.counter.scores_at(slots)

    def load_admission(self, ids: torch.Tensor, counts: torch.Tensor, scores: torch.Tensor) -> None:
        """Put ids waiting for admission, with their sightings and counter scores, into
        the counter (a no-op without admission)."""
        if self.counter is None or ids.numel() == 0:
            return
        result = self.counter.insert(ids.to(self.device), scores.to(self.device))
        kept = result.slots >= 0
        self.counts[result.slots[kept]] = counts.to(self.device)[kept]
