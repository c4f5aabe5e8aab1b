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

Example::

    table = KVTable("t", 8, KVTableOptions(capacity=64, ttl=TTLOptions(steps=3)))
    table.lookup_train(torch.tensor([1, 2]))      # step 1
    for _ in range(3):
        table.lookup_train(torch.tensor([2]))     # steps 2-4: id 1 freed at step 4
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch

from torchrec_kvemb.contracts import METRIC_NAMES
from torchrec_kvemb.options import WAYS, EvictionPolicy, KVTableOptions, TTLOptions

#: A ``torchrec_kvemb.table.KVTable`` (not imported: the table imports this module).
KVTable = Any

__all__ = ["GroupTTL", "TableTTL", "ttl_bytes", "uses_last_seen"]

#: The metric the sweep adds its freed rows to.
TTL_EVICTIONS = "ttl_evictions"
TTL_COLUMN = METRIC_NAMES.index(TTL_EVICTIONS)


def uses_last_seen(options: KVTableOptions) -> bool:
    """Whether a table of ``options`` keeps a ``last_seen`` array (a TTL table whose
    scores are not its rows' last steps: any policy but LRU)."""
    return options.ttl is not None and options.eviction != EvictionPolicy.LRU


def ttl_bytes(options: KVTableOptions, rows: int) -> int:
    """Memory a table of ``rows`` rows holds for its TTL: 8 bytes a row of
    ``last_seen`` where :func:`uses_last_seen`, else none."""
    return 8 * rows if uses_last_seen(options) else 0


class TableTTL:
    """One table's TTL: its rows' last steps, the sweep's cursor, the steps' times.

    Example::

        ttl = table.ttl                       # built by KVTable for options.ttl
        ttl.last_seen_of(slots)               # last training step of rows at slots
        ttl.sweep()                           # what a training lookup runs after it
    """

    def __init__(self, table: KVTable) -> None:
        self.table = table
        self.options: TTLOptions = table.options.ttl
        self._last_seen: torch.Tensor | None = None
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
        """Whether the rows' last steps are an array of their own (else the scores)."""
        return uses_last_seen(self.table.options)

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
        self._loaded = self.keeps_array

    def settle(self, lookups: int) -> None:
        """After a load, every entry takes the restored step: the table's step less
        the ``lookups`` training lookups since (no host sync)."""
        if self._loaded:
            self._loaded = False
            array = self.last_seen.view(-1)
            array.copy_((self.table.clock[0] - lookups).expand(array.shape))

    def mark(self, slots: torch.Tensor) -> None:
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
        """Every row is seen at the current step (after a load: rows keep their last
        steps only where the scores are them, docs/kv-table.md)."""
        self._loaded = False
        if self.keeps_array and self.table.device.type != "meta":
            self.last_seen.fill_(self.table.step)

    # ----------------------------------------------------------------- sweep
    def after_lookup(self, slots: torch.Tensor) -> None:
        """A training lookup ended: mark its rows (``slots``, local, -1: none), then
        sweep."""
        self.settle(1)
        self.mark(slots)
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
        """Free the rows past their TTL in the next ``buckets_per_step`` buckets."""
        if self.table.device.type == "meta":
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

    def _free(self, lo: int, hi: int, cutoff: torch.Tensor | int) -> None:
        keys = self.table.index.keys[lo:hi]
        expired = (keys >= 0) & (self.last_seen[lo:hi] <= cutoff)
        keys.masked_fill_(expired, -1)
        self.table.index.scores[lo:hi].masked_fill_(expired, 0)
        freed = expired.sum()
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
            table.ttl.settle(1)
            if table.ttl.keeps_array:
                mine = (table_idx == t) & (slots >= 0)
                table.ttl.mark(torch.where(mine, slots - row_offsets[t], -1))
            table.ttl.sweep()
