"""``HostTier``: one table shard's rows in host memory, under the table's own rows.

It is a :class:`~torchrec_kvemb.tier.LowerTier` (docs/tiers.md): a table with
``KVTableOptions(host_tier=HostTierOptions(...))`` keeps ``capacity`` rows on its
device (CUDA, or the CPU) and the rows it evicts here, in host memory; a lookup
of an id held here brings the row back (promotion). With ``KVTableOptions.ssd``
too, this tier holds the SSD tier (an :class:`~torchrec_kvemb.ssd.store.SSDStore`)
under itself and the tiers stack::

    table rows (device) --evict--> host tier --evict--> SSD tier --evict--> dropped
                        <-promote--           <-promote-- (through the host tier's contract)

A row leaves a tier only into the one below it, or out of the lowest by that
tier's eviction; no two tiers hold the same id.

**Storage.** A :class:`~torchrec_kvemb.slot_index.SlotIndex` (the bucketed
index of the native CPU kernels, ``index.BucketIndex``) maps ids to slots and
slots to *records*: rows of one ``[records, dim + state_dim]`` float32 array
(pinned on a CUDA table), with each record's id and memory score beside it.
Bounded (``capacity`` or ``memory_budget_bytes``): the index has that many
slots and ranks a new row against the held ones by the tier's eviction scores;
the rows it drops go to the SSD tier (or are dropped, counted in
``host_evictions``). Unbounded: the index and the arrays grow, nothing is
dropped, and the index's score of an id is its memory score (it never ranks),
so that the native training lookup reads a held id's score where it finds it
(``probe_arrays``, ``exchange``: docs/tiers.md, "Transfers").

**Slots.** ``lookup`` gives host slots below ``LOWER_SLOT_OFFSET``, and the SSD
tier's slots plus that offset, so that ``fetch`` and ``remove`` route each
slot to its tier.

**Durability.** Host memory keeps nothing across runs. Over an SSD tier,
``flush`` writes the table's rows and this tier's rows to the SSD tier as its
memory snapshot (``SSDStore.flush``); a restart restores them into the table
and, what does not fit there, into this tier (``adopt``).

**Transfers.** On the host side, per table and step, the rows cross in one
gather (``fetch``: one ``index_select`` of the records, the native row gather
on the CPU) and one scatter (``put``: one ``index_copy_``, the native row scatter); between host
and table (or group) arrays, ``transfers.py`` moves them: one gather and one
scatter per direction for a group of tables.

Example::

    tier = HostTier("user", dim=8, state_dim=1, options=HostTierOptions(capacity=1 << 20))
    tier.reserve(2)
    tier.put(ids, memory_scores, tier_scores, rows)     # rows [2, 9]: weights + state
    slots = tier.lookup(ids)
    scores, rows, ok = tier.fetch(ids, slots)
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from torchrec_kvemb import dispatch
from torchrec_kvemb.native_lib import NoRoomError
from torchrec_kvemb.options import WAYS, EvictionPolicy, HostTierOptions
from torchrec_kvemb.slot_index import INDEX_BYTES_PER_SLOT, INITIAL_BUCKETS, SlotIndex
from torchrec_kvemb.tier import TIER_COUNTERS, LowerTier, RestoredRows, sweep_window

#: ``lookup`` gives the SSD tier's slots plus this offset (host slots stay below it).
LOWER_SLOT_OFFSET = 1 << 48
#: Bytes per record besides its row: id and memory score (8 each), free-list entry (8).
RECORD_BYTES = 24
#: Records an unbounded tier starts with, and grows by at least (then by half).
MIN_RECORDS = 1024


def host_row_bytes(dim: int, state_dim: int) -> int:
    """Bytes of host memory one row of a host tier costs: its float32 weights and
    state, its record's id, score and free-list entry, and its index slot."""
    return 4 * (dim + state_dim) + RECORD_BYTES + INDEX_BYTES_PER_SLOT


def host_capacity(
    options: HostTierOptions, dim: int, state_dim: int, table: str = ""
) -> int | None:
    """Rows a host tier of ``options`` holds, in whole index buckets (None: unbounded)."""
    if options.capacity is not None:
        return math.ceil(options.capacity / WAYS) * WAYS
    if options.memory_budget_bytes is None:
        return None
    per_row = host_row_bytes(dim, state_dim)
    rows = options.memory_budget_bytes // per_row // WAYS * WAYS
    if rows < WAYS:
        raise ValueError(
            f"table {table!r}: HostTierOptions(memory_budget_bytes="
            f"{options.memory_budget_bytes}) holds fewer than {WAYS} rows of {per_row} bytes"
        )
    return rows


def host_tier_bytes(
    options: HostTierOptions, dim: int, state_dim: int, rows: int | None = None
) -> tuple[int, int]:
    """``(rows, bytes)`` of host memory a host tier of ``options`` takes: at its
    capacity when bounded (what it allocates), else for ``rows`` expected there
    (its arrays at their size after growing to hold them)."""
    capacity = host_capacity(options, dim, state_dim)
    if capacity is not None:
        return capacity, capacity * host_row_bytes(dim, state_dim)
    if rows is None:
        raise ValueError("host tier without a capacity: give the rows expected there")
    records = MIN_RECORDS
    while records < rows:
        records = records + max(records // 2, MIN_RECORDS)
    buckets = INITIAL_BUCKETS
    while rows > 0.75 * buckets * WAYS:
        buckets *= 2
    slots = buckets * WAYS + ((buckets // 32) | 1) * WAYS
    row_bytes = 4 * (dim + state_dim) + RECORD_BYTES
    return rows, records * row_bytes + slots * INDEX_BYTES_PER_SLOT


class HostTier(LowerTier):
    """One table shard's host-memory tier (see the module docstring), optionally over
    a ``lower`` tier (the SSD tier) into which it moves the rows it evicts.

    ``lower_scores`` gives the lower tier's eviction scores of rows leaving this
    tier with their memory scores (the table's rule for its SSD tier).
    ``pin_memory``: rows in page-locked memory (a CUDA table's host tier).
    """

    def __init__(
        self,
        table: str,
        dim: int,
        state_dim: int,
        options: HostTierOptions,
        lower: LowerTier | None = None,
        lower_scores: Callable[[torch.Tensor], torch.Tensor] | None = None,
        pin_memory: bool = False,
    ) -> None:
        self.table = table
        self.dim = dim
        self.state_dim = state_dim
        self.options = options
        self.lower = lower
        self._lower_scores = lower_scores or (lambda scores: scores)
        self.pinned = bool(pin_memory) and torch.cuda.is_available()
        self._capacity = host_capacity(options, dim, state_dim, table)
        bounded = self._capacity is not None
        buckets = self._capacity // WAYS if bounded else INITIAL_BUCKETS
        self._index = SlotIndex(buckets, stash=not bounded)
        self.counters = dict.fromkeys(TIER_COUNTERS, 0)
        self._closed = False
        self._records = 0
        self._rows = self._empty_rows(0)
        self._ids = torch.empty(0, dtype=torch.int64)
        self._scores = torch.empty(0, dtype=torch.int64)
        self._free = torch.empty(0, dtype=torch.int64)
        self._free_count = 0
        self._sweep_cursor = 0  # the next slot a TTL sweep reads (``expire``)
        self._grow(self._capacity if bounded else MIN_RECORDS)

    # ------------------------------------------------------------- records
    def _empty_rows(self, n: int) -> torch.Tensor:
        return torch.empty(n, self.dim + self.state_dim, pin_memory=self.pinned)

    def _grow(self, records: int) -> None:
        """Hold ``records`` records (rows and their ids, scores, free-list entries)."""
        old = self._records
        if records <= old:
            return
        rows = self._empty_rows(records)
        rows[:old] = self._rows
        self._rows = rows
        self._ids = torch.cat([self._ids, torch.full((records - old,), -1, dtype=torch.int64)])
        self._scores = torch.cat([self._scores, torch.zeros(records - old, dtype=torch.int64)])
        free = torch.empty(records, dtype=torch.int64)
        free[: self._free_count] = self._free[: self._free_count]
        added = torch.arange(records - 1, old - 1, -1, dtype=torch.int64)  # lowest popped first
        free[self._free_count : self._free_count + added.numel()] = added
        self._free = free
        self._free_count += added.numel()
        self._records = records

    def _make_room(self, n: int) -> None:
        """``n`` free records, the arrays grown by half at least (why: growing to the
        exact need copied every row at every step, 6x a step's time)."""
        if self._free_count < n:
            self._grow(self._records + max(n - self._free_count, self._records // 2, MIN_RECORDS))

    def _alloc(self, n: int) -> torch.Tensor:
        self._make_room(n)
        self._free_count -= n
        return self._free[self._free_count : self._free_count + n].flip(0)

    def _release(self, records: torch.Tensor) -> None:
        if records.numel() == 0:
            return
        self._ids[records] = -1
        self._free[self._free_count : self._free_count + records.numel()] = records
        self._free_count += records.numel()

    # --------------------------------------------------------------- state
    @property
    def size(self) -> int:
        """Rows held here and in the tier below."""
        return self.host_size + (self.lower.size if self.lower is not None else 0)

    @property
    def host_size(self) -> int:
        """Rows held in host memory."""
        return self._index.size

    @property
    def host_capacity(self) -> int:
        """Slots of the host index (it grows when the tier has no capacity)."""
        return self._index.slots if self._capacity is None else self._capacity

    @property
    def capacity(self) -> int:
        """Rows this tier and the tier below can hold now."""
        below = self.lower.capacity if self.lower is not None else 0
        return self.host_capacity + below

    @property
    def bounded(self) -> bool:
        """Whether the host tier has a capacity (else it grows and drops nothing)."""
        return self._capacity is not None

    @property
    def closed(self) -> bool:
        return self._closed

    def host_bytes(self) -> int:
        """Bytes of host memory the host tier's rows, records and index hold."""
        return (
            self._rows.numel() * self._rows.element_size()
            + self._records * RECORD_BYTES
            + self._index.memory_bytes()
        )

    def memory_bytes(self) -> int:
        """``host_bytes`` plus the memory the tier below holds."""
        below = self.lower.memory_bytes() if self.lower is not None else 0
        return self.host_bytes() + below

    def metrics(self) -> dict[str, int]:
        """The host tier's counters and those of the tier below (``tier.TIER_COUNTERS``)."""
        out = dict(self.counters)
        if self.lower is not None:
            for name, value in self.lower.metrics().items():
                out[name] += value
        return out

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"table {self.table!r}: the host tier is closed")

    # ---------------------------------------------------------------- reads
    def _split(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions of ``slots`` in host memory and in the tier below."""
        below = slots >= LOWER_SLOT_OFFSET
        return (~below).nonzero().squeeze(1), below.nonzero().squeeze(1)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Slots of ``ids``: host slots, the lower tier's plus ``LOWER_SLOT_OFFSET``; -1
        where neither holds the id."""
        self._check_open()
        slots = self._index.probe(ids)
        if self.lower is not None and self.lower.size:
            miss = (slots < 0).nonzero().squeeze(1)
            if miss.numel():
                below = self.lower.lookup(ids[miss])
                slots[miss] = torch.where(below >= 0, below + LOWER_SLOT_OFFSET, -1)
        return slots

    def fetch(
        self, ids: torch.Tensor, slots: torch.Tensor, use_staged: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(memory scores, rows, ok)`` of ``ids`` at ``slots``: host rows in one gather
        (into pinned memory on a CUDA table), the others from the tier below."""
        self._check_open()
        n = ids.numel()
        host, below = self._split(slots)
        if below.numel() == 0:
            return self._gather(slots)
        scores = torch.empty(n, dtype=torch.int64)
        rows = self._empty_rows(n)
        ok = torch.ones(n, dtype=torch.bool)
        scores[host], rows[host], _ = self._gather(slots[host])
        low = self.lower.fetch(ids[below], slots[below] - LOWER_SLOT_OFFSET, use_staged)
        scores[below], rows[below], ok[below] = low
        return scores, rows, ok

    def _gather(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        records = self._index.records_at(slots)
        rows = dispatch.gather_rows(self._rows, records, self._empty_rows(records.numel()))
        self.counters["host_reads"] += records.numel()
        self.counters["host_bytes_read"] += rows.numel() * rows.element_size()
        ok = torch.ones(records.numel(), dtype=torch.bool)
        return self._scores[records], rows, ok

    def prefetch(self, ids: torch.Tensor) -> None:
        """Host rows need no read ahead; the tier below reads its rows of ``ids``."""
        self._check_open()
        if self.lower is None or self.lower.size == 0:
            return
        ids = torch.unique(ids)
        self.lower.prefetch(ids[self._index.probe(ids) < 0])

    def export(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every row held here and below: ``(ids, memory scores, rows)``."""
        self._check_open()
        ids, scores, rows = self._export_host()
        if self.lower is None:
            return ids, scores, rows
        low_ids, low_scores, low_rows = self.lower.export()
        return (
            torch.cat([ids, low_ids]),
            torch.cat([scores, low_scores]),
            torch.cat([rows, low_rows.to(rows.dtype)]),
        )

    def _export_host(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        records = self._index.records_at(self._index.live())
        return self._ids[records], self._scores[records], self._rows[records]

    # --------------------------------------------------------------- writes
    def reserve(self, n: int) -> None:
        """Room for ``n`` rows: an unbounded tier's arrays grow now; the tier below
        reserves room for the ``n`` rows a ``put`` may move down."""
        self._check_open()
        if self._capacity is None:
            self._make_room(n)
        if self.lower is not None:
            self.lower.reserve(n)

    def needs_flush(self, n: int) -> bool:
        """The tier below's answer for ``n`` rows and this tier's (a flush writes them
        there too); a host tier alone keeps nothing to flush."""
        if self.lower is None:
            return False
        return self.lower.needs_flush(n + self.host_size)

    def put(
        self,
        ids: torch.Tensor,
        memory_scores: torch.Tensor,
        tier_scores: torch.Tensor,
        rows: torch.Tensor,
    ) -> None:
        """Hold ``rows`` of ``ids`` in one scatter; the rows a full tier drops (ranked
        by ``tier_scores``, the new ones included) move to the tier below, or are
        dropped without one (both counted in ``host_evictions``)."""
        self._check_open()
        if ids.numel() == 0:
            return
        rows = rows.to(torch.float32)
        if self._capacity is None:  # an index that never ranks keeps the memory scores
            slots = self._index.add(ids, memory_scores)
            stored = torch.ones(ids.numel(), dtype=torch.bool)
            old = torch.empty(0, dtype=torch.int64)
        else:
            keep = self.options.eviction == EvictionPolicy.NONE
            stored, slots, _ = self._index.insert(ids, tier_scores, keep)
            old = self._index.records_at(slots)
            old = old[old >= 0]  # the records of the rows those slots held: evicted
        down = None
        if slots.numel() < ids.numel() or old.numel():  # rows leave: evicted or not taken
            rejected = (~stored).nonzero().squeeze(1)
            down = (
                torch.cat([self._ids[old], ids[rejected]]),
                torch.cat([self._scores[old], memory_scores[rejected]]),
                torch.cat([self._rows[old], rows[rejected]]),
            )
            self._release(old)
            kept = stored.nonzero().squeeze(1)
            ids, memory_scores, rows = ids[kept], memory_scores[kept], rows[kept]
        records = self._alloc(slots.numel())
        dispatch.scatter_rows(self._rows, records, rows)
        self._ids[records] = ids
        self._scores[records] = memory_scores
        self._index.set_records(slots, records)
        self.counters["host_writes"] += records.numel()
        self.counters["host_bytes_written"] += records.numel() * 4 * rows.shape[1]
        if down is not None:
            self.counters["host_evictions"] += down[0].numel()
            if self.lower is not None:
                self.lower.put(down[0], down[1], self._lower_scores(down[1]), down[2])

    def remove(self, slots: torch.Tensor) -> None:
        """Take the ids at ``slots`` out of this tier or the one below."""
        if slots.numel() == 0:
            return
        host, below = self._split(slots)
        if host.numel():
            mine = slots[host]
            self._release(self._index.records_at(mine))
            self._index.remove(mine)
        if below.numel():
            self.lower.remove(slots[below] - LOWER_SLOT_OFFSET)

    def expire(self, cutoff: int, part: int, parts: int) -> int:
        """``LowerTier.expire``: the host rows of the window whose memory score (kept
        beside each record) is at or below ``cutoff`` leave the tier; then the tier
        below sweeps its own share."""
        self._check_open()
        window, self._sweep_cursor = sweep_window(
            self._sweep_cursor, self._index.slots, part, parts
        )
        live = window[self._index.ids_at(window) >= 0]
        records = self._index.records_at(live)
        expired = live[self._scores[records] <= cutoff]
        self.remove(expired)
        freed = expired.numel()
        if self.lower is not None:
            freed += self.lower.expire(cutoff, part, parts)
        return freed

    # ------------------------------------------------- direct row exchange
    @property
    def exchanges_rows(self) -> bool:
        """``LowerTier.exchanges_rows``: a tier without a bound and nothing under it
        (a bounded one may drop or move rows down inside ``put``)."""
        return self._capacity is None and self.lower is None

    def probe_arrays(self) -> tuple[torch.Tensor, ...]:
        """``LowerTier.probe_arrays``: the index's main part and stash (keys, and the
        memory scores a tier without a bound keeps as its index scores)."""
        self._check_open()
        main_keys, main_scores, _, stash_keys, stash_scores, _ = self._index.arrays()
        return main_keys, stash_keys, main_scores, stash_scores

    def read_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """``LowerTier.read_rows``: the rows at host ``slots``."""
        records = self._index.records_at(slots)
        return dispatch.gather_rows(self._rows, records, self._empty_rows(records.numel()))

    def exchange(
        self,
        weights: torch.Tensor,
        state: torch.Tensor,
        down_slots: torch.Tensor,
        down_ids: torch.Tensor,
        memory_scores: torch.Tensor,
        tier_scores: torch.Tensor,
        up_ids: torch.Tensor,
        up_tier_slots: torch.Tensor,
        up_slots: torch.Tensor,
    ) -> None:
        """``LowerTier.exchange``: one ``dispatch.host_exchange``, which places the down
        ids in the index's empty ways, copies each row once, between its table slot
        and its record, and frees the up ids' records and slots. The index doubles
        first if the down ids would take it past its load (``SlotIndex.make_room``);
        where a main bucket and its stash bucket are both full, nothing is written
        and the ids are placed by ``SlotIndex.add`` (which grows the stash) first."""
        self._check_open()
        if not self.exchanges_rows:
            raise RuntimeError(f"table {self.table!r}: a bounded host tier does not exchange rows")
        n, p = down_ids.numel(), up_tier_slots.numel()
        self._make_room(n)
        index = self._index
        generation = index.generation
        index.make_room(n)
        if index.generation != generation and p:  # entries moved: probe again
            up_tier_slots = index.probe(up_ids)
        host_slots = torch.full((n,), -1, dtype=torch.int64)

        def call() -> None:
            free_count = torch.tensor([self._free_count])
            dispatch.host_exchange(
                weights, state, self._rows, self._ids, self._scores, self._free, free_count,
                *index.arrays(), down_slots, down_ids, memory_scores, host_slots,
                up_tier_slots, up_slots,
            )  # fmt: skip
            self._free_count = int(free_count[0])

        try:
            call()
            index.placed(n)  # (may rehash: the up ids have left by now)
        except NoRoomError:  # a full main bucket over a full stash bucket: none written
            generation = index.generation
            host_slots = index.add(down_ids, None)  # grows the stash; scores: the call's
            if index.generation != generation and p:
                up_tier_slots = index.probe(up_ids)
            call()
        self._index.size -= p
        width = 4 * (self.dim + self.state_dim)
        self.counters["host_writes"] += n
        self.counters["host_bytes_written"] += n * width
        self.counters["host_reads"] += p
        self.counters["host_bytes_read"] += p * width

    # ----------------------------------------------------------- durability
    def read_restored(self) -> RestoredRows | None:
        """What the tier below kept for memory at its last flush (the table's rows and
        this tier's); None without a tier below. Rows the table does not take come
        back here through ``adopt``."""
        if self.lower is None:
            return None
        restored = self.lower.read_restored()
        self._restored = restored
        return restored

    def adopt(self, ids: torch.Tensor, tier_scores: torch.Tensor, records: torch.Tensor) -> None:
        """Hold the restored rows of ``ids`` (at ``records`` of ``read_restored``) as
        ``put`` would (the last flush's copies below are freed by the next flush)."""
        restored = getattr(self, "_restored", None)
        if ids.numel() == 0 or restored is None:
            return
        order = torch.argsort(restored.records)
        at = order[torch.searchsorted(restored.records[order], records)]
        self.reserve(ids.numel())
        self.put(ids, restored.memory_scores[at], tier_scores, restored.rows[at])
        self._restored = None

    def flush(
        self,
        ids: torch.Tensor,
        memory_scores: torch.Tensor,
        rows: torch.Tensor,
        meta: dict[str, Any],
    ) -> None:
        """Over a tier below: the table's rows and this tier's are written there as its
        memory snapshot, durable at once (``LowerTier.flush``). Alone: nothing is
        kept across runs."""
        self._check_open()
        if self.lower is None:
            return
        host_ids, host_scores, host_rows = self._export_host()
        self.lower.flush(
            torch.cat([ids, host_ids]),
            torch.cat([memory_scores, host_scores]),
            torch.cat([rows.to(host_rows.dtype), host_rows]),
            meta,
        )

    def close(self) -> None:
        """Release the rows and close the tier below (no flush: the table flushes first)."""
        if self._closed:
            return
        self._closed = True
        if self.lower is not None:
            self.lower.close()
        self._rows = self._empty_rows(0)
