"""Time to live of a KV table's rows (``KVTableOptions(ttl=TTLOptions(...))``).

A row not looked up in training for ``steps`` steps (or ``seconds`` of wall
time) is freed by a sweep: after each training lookup, ``TableTTL.sweep`` reads
a window of index buckets at a cursor that walks the table, and empties the
ways whose row is past its TTL (the id leaves the index; its slot takes new
ids). The cost of a step is the rows swept, not the table.

A row's last step seen: an LRU table's eviction score already is it (the kernels
set it on every lookup); any other policy keeps ``last_seen``, one int64 per row
(``TableTTL.bytes``), written after each training lookup over the batch's slots
(O(batch), no host sync).

Wall-time TTL: each training step's time is read from ``TTLOptions.clock`` when
its lookup ends; the step of a row's last lookup then says its time.

Sightings (``KVTableOptions(count_sightings=True)``, a table that is not LFU):
each row's occurrences in training batches since it was stored, for pruning by
``min_count`` (``torchrec_kvemb.prune``). Two int64 per row: the count, and the
id it belongs to (a slot that changed hands since starts again at zero). The
same object (``TableTTL``) keeps them, marked where the last steps are.

Example::

    ttl = TTLOptions(steps=3, sweep_buckets_per_step=4)   # 64 rows: 4 buckets
    table = KVTable("t", 8, KVTableOptions(capacity=64, ttl=ttl))
    table.lookup_train(torch.tensor([1, 2]))      # step 1
    for _ in range(3):
        table.lookup_train(torch.tensor([2]))     # steps 2-4: id 1 freed at step 4
"""

from __future__ import annotations

import math
import warnings
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from torchrec_kvemb.contracts import METRIC_NAMES
from torchrec_kvemb.options import WAYS, EvictionPolicy, KVTableOptions, TTLOptions

#: A ``torchrec_kvemb.table.KVTable`` (not imported: the table imports this module).
KVTable = Any

__all__ = [
    "LAST_SEEN_KEY",
    "GroupTTL",
    "TableTTL",
    "counts_sightings",
    "has_row_stats",
    "last_seen_state",
    "ttl_bytes",
    "uses_last_seen",
    "warn_without_last_seen",
]

#: The metric the sweep adds its freed rows to.
TTL_EVICTIONS = "ttl_evictions"
TTL_COLUMN = METRIC_NAMES.index(TTL_EVICTIONS)


def uses_last_seen(options: KVTableOptions) -> bool:
    """Whether a table of ``options`` keeps a ``last_seen`` array (a TTL table whose
    scores are not its rows' last steps: any policy but LRU)."""
    return options.ttl is not None and options.eviction != EvictionPolicy.LRU


def counts_sightings(options: KVTableOptions) -> bool:
    """Whether a table of ``options`` keeps sighting counts of its own (asked for, and
    not LFU, whose scores are them)."""
    return options.count_sightings and options.eviction != EvictionPolicy.LFU


def has_row_stats(options: KVTableOptions) -> bool:
    """Whether a table of ``options`` has a ``TableTTL`` (a TTL, or sightings)."""
    return options.ttl is not None or counts_sightings(options)


def ttl_bytes(options: KVTableOptions, rows: int) -> int:
    """Memory a table of ``rows`` rows holds for its TTL and sightings: 8 bytes a row
    of ``last_seen`` where :func:`uses_last_seen`, 16 of count and owner where
    :func:`counts_sightings`."""
    per_row = (8 if uses_last_seen(options) else 0) + (16 if counts_sightings(options) else 0)
    return per_row * rows


#: The state_dict / checkpoint entry of the rows' last steps of a table that keeps
#: ``last_seen`` (``uses_last_seen``), beside ``weight_score``.
LAST_SEEN_KEY = "weight_last_seen"


def last_seen_state(table: KVTable, ids: torch.Tensor) -> torch.Tensor:
    """The last steps of the rows of ``ids`` (stored in the table's memory, in the
    order given: a checkpoint's) for :data:`LAST_SEEN_KEY`; on ``meta``, an empty
    tensor there."""
    if table.device.type == "meta":
        return torch.empty(0, dtype=torch.int64, device=table.device)
    return table.ttl.last_seen_of(table.index.probe(ids.to(table.device)))


def warn_without_last_seen(table: KVTable, rows: int) -> None:
    """A load of ``rows`` rows without :data:`LAST_SEEN_KEY` into a table that keeps
    ``last_seen`` (a checkpoint written before it was saved): say that its rows count
    as seen at the restored step."""
    if rows and uses_last_seen(table.options):
        warnings.warn(
            f"table {table.name!r}: the loaded rows have no {LAST_SEEN_KEY} (a checkpoint "
            f"or state_dict saved before the rows' last steps were), so its {rows} rows "
            "count as seen at the restored step and their TTL starts again "
            "(docs/kv-table.md, TTL checkpoints)",
            stacklevel=3,
        )


class TableTTL:
    """One table's TTL: its rows' last steps, the sweep's cursor, the steps' times;
    and its rows' sightings where it counts them (``counts_sightings``).

    Example::

        ttl = table.ttl                       # built by KVTable for options.ttl
        ttl.last_seen_of(slots)               # last training step of rows at slots
        ttl.sweep()                           # what a training lookup runs after it
    """

    def __init__(self, table: KVTable) -> None:
        self.table = table
        #: The TTL (None: the table only counts sightings).
        self.options: TTLOptions | None = table.options.ttl
        self._last_seen: torch.Tensor | None = None
        #: ``(count, owner)`` per slot where sightings are counted (lazily made).
        self._sightings: tuple[torch.Tensor, torch.Tensor] | None = None
        #: The table was cleared (a load follows): every entry takes the restored step
        #: before it is next read (``settle``).
        self._loaded = False
        #: The next bucket the sweep reads.
        self.cursor = 0
        #: ``(step, time)`` of recent steps of a wall-time TTL (oldest first).
        self.times: deque[tuple[int, float]] = deque()

    # ------------------------------------------------------------- last seen
    @property
    def keeps_array(self) -> bool:
        """Whether the rows' last steps are an array of their own (else the scores, or
        none without a TTL)."""
        return uses_last_seen(self.table.options)

    @property
    def counting(self) -> bool:
        """Whether the table counts its rows' sightings here."""
        return counts_sightings(self.table.options)

    @property
    def bytes(self) -> int:
        return ttl_bytes(self.table.options, self.table.capacity)

    @property
    def last_seen(self) -> torch.Tensor:
        """The last training step of each slot's row ``[buckets, WAYS]`` int64 (views:
        the LRU scores, or the table's ``last_seen`` array; free slots hold stale
        values, never above the current step)."""
        if not self.keeps_array:
            return self.table.index.scores
        if self._last_seen is None:
            rows = self.table.capacity
            self._last_seen = torch.zeros(rows, dtype=torch.int64, device=self.table.device)
        return self._last_seen.view(-1, WAYS)

    def last_seen_of(self, slots: torch.Tensor) -> torch.Tensor:
        """The last training step of the rows at ``slots``."""
        self.settle(0)
        return self.last_seen.view(-1).index_select(0, slots)

    def cleared(self) -> None:
        """The table was cleared (``KVTable.clear``: a load replaces its content, by
        ``load_rows`` or by a checkpoint's placement): its rows will count as seen at
        the restored step."""
        self._loaded = self.keeps_array or self.counting

    def settle(self, lookups: int) -> None:
        """After a load, every entry takes the restored step: the table's step less
        the ``lookups`` training lookups since (no host sync)."""
        if self._loaded:
            self._loaded = False
            if self.keeps_array:
                array = self.last_seen.view(-1)
                array.copy_((self.table.clock[0] - lookups).expand(array.shape))
            if self.counting:  # no row's count is known: each starts again
                self._counts()[1].fill_(-1)

    def restore(self, ids: torch.Tensor, last_seen: torch.Tensor | None) -> None:
        """A load stored ``ids`` (the table's step restored): rows take their saved
        ``last_seen`` steps (at most the restored step), or, for ``None`` or an id
        not given, count as seen at the restored step; sightings start again."""
        self.mark_all()
        if last_seen is None or not self.keeps_array or ids.numel() == 0:
            return
        slots = self.table.index.probe(ids.to(self.table.device))
        stored = slots >= 0
        values = last_seen.to(self.table.device, torch.int64).clamp(max=self.table.step)
        self.last_seen.view(-1).index_copy_(0, slots[stored], values[stored])

    def rehashed(self, old: torch.Tensor, new: torch.Tensor, rows: int) -> None:
        """The table moved the rows at slots ``old`` to slots ``new`` of ``rows`` (a
        growth, ``KVTable.rehash_into``): their last steps and sightings move with
        them (after a load not yet settled, every entry takes the restored step
        anyway: the arrays start anew at the new size)."""
        if self._loaded:
            self._last_seen = self._sightings = None
            return
        if self._last_seen is not None:
            last = self._last_seen.new_zeros(rows)
            last[new] = self._last_seen[old]
            self._last_seen = last
        if self._sightings is not None:
            count, owner = self._sightings
            moved = (count.new_zeros(rows), owner.new_full((rows,), -1))
            moved[0][new], moved[1][new] = count[old], owner[old]
            self._sightings = moved

    def arrays(self) -> list[torch.Tensor]:
        """The arrays this object allocates (its share of ``memory_bytes``):
        ``last_seen`` where kept, the counts and owners where counted."""
        out = [self.last_seen.view(-1)] if self.keeps_array else []
        return out + list(self._counts()) if self.counting else out

    # ------------------------------------------------------------ sightings
    def _counts(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._sightings is None:
            n, device = self.table.capacity, self.table.device
            count = torch.zeros(n, dtype=torch.int64, device=device)
            self._sightings = (count, torch.full((n,), -1, dtype=torch.int64, device=device))
        return self._sightings

    def count(self, slots: torch.Tensor, occurrences: torch.Tensor | int = 1) -> None:
        """Add ``occurrences`` sightings to the rows at ``slots`` (local; -1: none),
        whose ids the index holds there; a slot whose row changed hands since its
        last count starts at zero."""
        if not self.counting or slots.numel() == 0:
            return
        self.settle(0)
        count, owner = self._counts()
        valid = slots >= 0
        # why: ids without a row address a slot of the batch's own (its largest), and
        # write what that slot's id writes (no host sync to leave them out)
        at = torch.where(valid, slots, slots.max().clamp(min=0))
        ids = self.table.index.keys.view(-1).index_select(0, at)
        fresh = owner.index_select(0, at) != ids
        count.index_put_((at,), torch.where(fresh, 0, count.index_select(0, at)))
        owner.index_put_((at,), ids)
        count.index_add_(0, at, torch.where(valid, occurrences, 0))

    def forget(self, slots: torch.Tensor) -> None:
        """The rows at ``slots`` were removed: an id stored there again counts anew."""
        if self.counting:
            self._counts()[1].index_fill_(0, slots, -1)

    def sightings_of(self, slots: torch.Tensor) -> torch.Tensor:
        """The sightings of the rows at ``slots`` (0 for a row not seen since its slot
        changed hands, or since a load)."""
        self.settle(0)
        count, owner = self._counts()
        ids = self.table.index.keys.view(-1).index_select(0, slots)
        return torch.where(owner.index_select(0, slots) == ids, count.index_select(0, slots), 0)

    def mark(self, slots: torch.Tensor) -> None:
        """The rows at ``slots`` (local; -1: none) are seen once at the current step
        (an insert)."""
        self.count(slots)
        self.mark_seen(slots)

    def mark_seen(self, slots: torch.Tensor) -> None:
        """The rows at ``slots`` (local; -1: none) are seen at the current step.

        why a max: steps only grow between loads (which reset every entry), so the
        largest of a slot's value and the step is the step, and ids without a row
        write nothing larger into slot 0 (no host sync to leave them out)."""
        if not self.keeps_array or slots.numel() == 0:
            return
        self.settle(0)
        valid = slots >= 0
        steps = torch.where(valid, self.table.clock[0], 0)
        self.last_seen.view(-1).scatter_reduce_(0, slots.clamp(min=0), steps, reduce="amax")

    def mark_all(self) -> None:
        """Every row is seen at the current step, and counts its sightings from now on
        (after a load: rows keep their last steps and counts only where the scores
        are them, docs/kv-table.md)."""
        self._loaded = False
        if self.table.device.type == "meta":
            return
        if self.keeps_array:
            self.last_seen.fill_(self.table.step)
        if self.counting:
            self._counts()[1].fill_(-1)

    # ----------------------------------------------------------------- sweep
    def after_lookup(self, slots: torch.Tensor, occurrences: torch.Tensor) -> None:
        """A training lookup ended: its unique ids got ``slots`` (local, -1: none) and
        occur ``occurrences`` times; mark and count their rows, then sweep."""
        self.settle(1)
        self.count(slots, occurrences)
        self.mark_seen(slots)
        self.sweep()

    def buckets_per_step(self) -> int:
        """Buckets the sweep reads per step (``TTLOptions.sweep_buckets_per_step``,
        else the whole table once per TTL in steps, or per ``SWEEP_STEPS`` steps)."""
        buckets = self.table.index.num_buckets
        if self.options.sweep_buckets_per_step is not None:
            return min(buckets, self.options.sweep_buckets_per_step)
        period = self.options.steps or TTLOptions.SWEEP_STEPS
        return min(buckets, math.ceil(buckets / period))

    def cutoff(self) -> torch.Tensor | int | None:
        """Rows whose last step is at or below this are past their TTL (None: none)."""
        if self.options.steps is not None:
            return self.table.clock[0] - self.options.steps
        return self._time_cutoff()

    def _time_cutoff(self) -> int | None:
        """Record this step's time; the latest step at least the TTL's seconds ago."""
        step, now = self.table.step, float(self.options.clock())
        if self.times and self.times[-1][0] != step - 1:  # a load moved the clock
            self.times.clear()
        self.times.append((step, now))
        horizon = now - self.options.wall_seconds
        while len(self.times) > 1 and self.times[1][1] <= horizon:
            self.times.popleft()
        first_step, first_time = self.times[0]
        return first_step if first_time <= horizon else None

    def sweep(self) -> None:
        """Free the rows past their TTL in the next ``buckets_per_step`` buckets (a
        no-op without a TTL)."""
        if self.options is None or self.table.device.type == "meta":
            return
        cutoff = self.cutoff()
        buckets = self.table.index.num_buckets
        self.cursor %= buckets
        start, end = self.cursor, self.cursor + self.buckets_per_step()
        self.cursor = end % buckets
        if cutoff is None:
            return
        windows = [(start, min(end, buckets))]
        if end > buckets:
            windows.append((0, end - buckets))
        for lo, hi in windows:
            self._free(lo, hi, cutoff)
        tier = self.table.tier
        if tier is not None:  # the same share of every lower tier (docs/tiers.md)
            freed = tier.expire(int(cutoff), end - start, buckets)
            self._count_freed(freed)

    def _free(self, lo: int, hi: int, cutoff: torch.Tensor | int) -> None:
        keys = self.table.index.keys[lo:hi]
        expired = (keys >= 0) & (self.last_seen[lo:hi] <= cutoff)
        keys.masked_fill_(expired, -1)
        self.table.index.scores[lo:hi].masked_fill_(expired, 0)
        if self.counting:  # the id may come back to the same slot: it starts again
            self._counts()[1][lo * WAYS : hi * WAYS].masked_fill_(expired.view(-1), -1)
        self._count_freed(expired.sum())

    def _count_freed(self, freed: torch.Tensor | int) -> None:
        if self.table.device_metrics is not None:  # a group's counters: no host sync
            self.table.device_metrics[TTL_COLUMN] += freed
        else:
            self.table.count(TTL_EVICTIONS, int(freed))


class GroupTTL:
    """The TTL of a group's tables (``KVTableGroup``): after the group's lookup, each
    TTL table's rows of the batch are marked (by global slot, no host sync) and its
    sweep runs.

    Example::

        ttl = GroupTTL.build(group.tables)    # None: no table of the group has a TTL
        ttl.after_lookup(lookup.slots, table_idx, group.row_offsets)
    """

    def __init__(self, tables: Sequence[KVTable]) -> None:
        self.tables = list(tables)
        self.ttl_tables = [(t, table) for t, table in enumerate(tables) if table.ttl is not None]

    @classmethod
    def build(cls, tables: Sequence[KVTable]) -> GroupTTL | None:
        """The group's TTL, or None when no table has one."""
        if all(t.ttl is None for t in tables):
            return None
        return cls(tables)

    def after_lookup(
        self, slots: torch.Tensor, table_idx: torch.Tensor, row_offsets: Sequence[int]
    ) -> None:
        """The group's training lookup gave global ``slots`` (-1: no row) to ids of
        ``table_idx`` (tables at ``row_offsets``): mark, then sweep."""
        for t, table in self.ttl_tables:
            ttl = table.ttl
            ttl.settle(1)
            if ttl.keeps_array or ttl.counting:
                mine = (table_idx == t) & (slots >= 0)
                local = torch.where(mine, slots - row_offsets[t], -1)
                ttl.count(local)  # one sighting per occurrence
                ttl.mark_seen(local)
            ttl.sweep()
