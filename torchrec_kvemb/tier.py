"""``LowerTier``: the contract between a table's memory rows and the tier under them.

A table with a lower tier (``TieredKVTable``) keeps ``capacity`` rows in memory
and every other row it holds in its lower tier; the two never hold the same id.
The table moves rows between them through the methods below only, so a new
tier (rows on disk: ``ssd.store.SSDStore``; rows in host memory, over an
optional SSD tier: ``host_tier.HostTier``) plugs in by implementing them.
docs/ssd-tier.md ("The lower-tier contract") says what each one guarantees.

A row crosses the boundary as ``[n, dim + state_dim]`` float32 (weights, then
optimizer state) with two int64 scores: its *memory score* (the eviction score
it had in memory and gets back when promoted) and, going down, its *tier score*
(what the tier's own eviction ranks it by). A tier addresses the ids it holds by
its own *slots* (``lookup``), which mean nothing to the table but are handed
back to ``fetch`` and ``remove``. Ids, scores and rows are CPU tensors.

Example (a batch of the table: promote what the tier holds, demote what memory
evicts)::

    tier.reserve(len(missed))                 # a full disk raises here, nothing changed
    slots = tier.lookup(missed)               # -1: not held
    held = (slots >= 0).nonzero().squeeze(1)
    memory_scores, rows, ok = tier.fetch(missed[held], slots[held])
    tier.remove(slots[held][ok])              # promoted: the ids leave the tier
    tier.put(evicted_ids, evicted_scores, tier_scores, evicted_rows)
    tier.metrics()["ssd_reads"]
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, NamedTuple

import torch

#: The counters a lower tier reports (``LowerTier.metrics``), under the names
#: ``KVTable.metrics()`` shows (docs/tiers.md, "Metrics"): ``ssd_*`` of the SSD
#: tier, ``host_*`` of the host-memory tier; a tier counts those that apply to it
#: and leaves the others at 0 (a host tier over an SSD tier reports both).
TIER_COUNTERS = (
    "ssd_reads",
    "ssd_writes",
    "ssd_bytes_read",
    "ssd_bytes_written",
    "ssd_evictions",
    "ssd_corrupt",
    "ssd_prefetch_hits",
    "ssd_flushes",
    "host_reads",
    "host_writes",
    "host_bytes_read",
    "host_bytes_written",
    "host_evictions",
)
#: What ``KVTable.metrics()`` shows of its lower tiers: their counters, the table's
#: scratch rows and the rows each tier holds (all 0 without a tier).
TIER_METRICS = (*TIER_COUNTERS, "scratch_rows", "ssd_size", "host_size")


def sweep_window(cursor: int, slots: int, part: int, parts: int) -> tuple[torch.Tensor, int]:
    """The slots a tier of ``slots`` slots sweeps for ``LowerTier.expire`` from its
    ``cursor``: ``ceil(slots * part / parts)`` of them (every slot when ``part >=
    parts``), wrapping; and the cursor after them."""
    if slots == 0:
        return torch.empty(0, dtype=torch.int64), 0
    count = slots if part >= parts else min(slots, -(-slots * part // parts))
    start = cursor % slots
    window = torch.arange(start, start + count, dtype=torch.int64) % slots
    return window, (start + count) % slots


class RestoredRows(NamedTuple):
    """The memory rows a previous run's last ``flush`` left (``LowerTier.read_restored``)."""

    #: The ``meta`` that flush was given (the table's clocks).
    meta: dict[str, Any]
    ids: torch.Tensor
    #: Where the tier keeps each row: handed back to ``adopt`` for rows memory
    #: does not take.
    records: torch.Tensor
    memory_scores: torch.Tensor
    #: ``[n, dim + state_dim]`` float32.
    rows: torch.Tensor


class LowerTier(ABC):
    """The rows of one table shard that are not in memory (see the module docstring).

    A tier keeps, per id, its row and memory score; it drops rows by its own
    capacity and policy only inside ``put``. Every write the table makes in a
    batch is preceded by ``reserve``, so that a failure (a full disk) raises
    before anything, in memory or in the tier, has changed.
    """

    # ------------------------------------------------------------------ shape
    @property
    @abstractmethod
    def size(self) -> int:
        """Rows the tier holds."""

    @property
    @abstractmethod
    def capacity(self) -> int:
        """Rows the tier can hold now (a growing tier: its current slots)."""

    @property
    @abstractmethod
    def closed(self) -> bool:
        """Whether ``close`` ran (a closed tier raises on every read or write)."""

    @abstractmethod
    def memory_bytes(self) -> int:
        """Bytes of host memory the tier holds (its index and bookkeeping, and its
        rows where they live in memory)."""

    @abstractmethod
    def metrics(self) -> dict[str, int]:
        """The tier's counters since it was opened: every name of ``TIER_COUNTERS``."""

    # ------------------------------------------------------------------ reads
    @abstractmethod
    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """The tier's slots of ``ids``, -1 where it does not hold the id (read-only)."""

    @abstractmethod
    def fetch(
        self, ids: torch.Tensor, slots: torch.Tensor, use_staged: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(memory scores [n], rows [n, dim + state_dim], ok [n])`` of unique ``ids``
        held at ``slots``. The ids stay in the tier (``remove`` takes them out). A row
        the tier cannot vouch for (a failed checksum) has ``ok`` False: it is dropped
        from the tier and counted, and the table treats its id as missing.
        ``use_staged``: rows ``prefetch`` read may serve where still current."""

    @abstractmethod
    def prefetch(self, ids: torch.Tensor) -> None:
        """Start reading the rows of the ``ids`` the tier holds, for the next ``fetch``
        (a tier with nothing to gain may do nothing). Changes no row."""

    @abstractmethod
    def export(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every row the tier holds: ``(ids, memory scores, rows)`` (read-only; rows
        that fail their checks are dropped as ``fetch`` drops them)."""

    # ----------------------------------------------------------------- writes
    @abstractmethod
    def reserve(self, n: int) -> None:
        """Make room to write ``n`` rows, or raise (``KVStorageError`` for a full
        disk) with nothing changed. Writes up to ``n`` rows after it cannot fail for
        want of room."""

    @abstractmethod
    def needs_flush(self, n: int) -> bool:
        """Whether the table should ``flush`` before it writes ``n`` rows (a flush
        frees what the tier holds for durability; a volatile tier: False)."""

    @abstractmethod
    def put(
        self,
        ids: torch.Tensor,
        memory_scores: torch.Tensor,
        tier_scores: torch.Tensor,
        rows: torch.Tensor,
    ) -> None:
        """Accept rows demoted from memory (``ids`` the tier does not hold). A bounded
        tier that is full drops rows by its own policy, ranked by ``tier_scores``
        (the new ones included; counted in ``ssd_evictions``)."""

    @abstractmethod
    def remove(self, slots: torch.Tensor) -> None:
        """Take the ids at ``slots`` out of the tier (promoted to memory, or
        overwritten there)."""

    @abstractmethod
    def expire(self, cutoff: int, part: int, parts: int) -> int:
        """The TTL sweep of the tier (a TTL table over it, docs/tiers.md): free the
        rows whose memory score (an LRU table's: the step it last saw the row) is
        at or below ``cutoff`` among the next ``part / parts`` of the tier's slots
        from its own cursor, which then moves on and wraps (``part >= parts``: every
        slot), and sweep the tier below likewise. Costs the slots swept. Returns
        the rows freed here and below."""

    # --------------------------------------------------- direct row exchange
    @property
    def exchanges_rows(self) -> bool:
        """Whether ``probe_arrays`` and ``exchange`` serve this tier: its rows are host
        arrays a CPU table's rows can trade places with in one call (the host tier
        without a bound and nothing under it). Other tiers: False, and the table
        uses ``lookup``, ``fetch``, ``remove`` and ``put``."""
        return False

    def probe_arrays(self) -> tuple[torch.Tensor, ...]:
        """``(main keys, stash keys, main scores, stash scores)``: the tier's index,
        whose score of an id is its memory score, as the native training lookup
        probes it for the batch's ids not in memory (``native.tier_index_row``;
        ``exchanges_rows`` only). Read-only, and valid until the tier's next write."""
        raise TypeError(f"{type(self).__name__} does not exchange rows (exchanges_rows is False)")

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
        """``put`` and ``remove`` of a batch in one pass, without a buffer between
        (``exchanges_rows`` only): the table's rows at ``down_slots`` of ``weights``
        and ``state`` (evicted ids ``down_ids``, with their memory and tier scores)
        come into the tier; then the rows of ``up_ids`` at the tier's
        ``up_tier_slots`` (the slots the lookup found) go to the table's rows at ``up_slots`` (-1:
        not copied; the caller read it with ``read_rows``) and leave the tier."""
        raise TypeError(f"{type(self).__name__} does not exchange rows (exchanges_rows is False)")

    def read_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Rows ``[n, dim + state_dim]`` at the tier's ``slots``, uncounted
        (``exchanges_rows`` only: the rows of promoted ids that get no memory row)."""
        raise TypeError(f"{type(self).__name__} does not exchange rows (exchanges_rows is False)")

    # ------------------------------------------------------------- durability
    @abstractmethod
    def read_restored(self) -> RestoredRows | None:
        """What a previous run's last ``flush`` left for memory (None: nothing). The
        table takes back the rows that fit and ``adopt``s the others."""

    @abstractmethod
    def adopt(self, ids: torch.Tensor, tier_scores: torch.Tensor, records: torch.Tensor) -> None:
        """Hold ``ids`` whose rows the tier keeps already at ``records``
        (``read_restored``), as ``put`` would."""

    @abstractmethod
    def flush(
        self,
        ids: torch.Tensor,
        memory_scores: torch.Tensor,
        rows: torch.Tensor,
        meta: dict[str, Any],
    ) -> None:
        """Make the tier's rows and the memory rows given here durable at once
        (``meta``, JSON, comes back in ``read_restored``), or raise with the previous
        flush still the durable one. A volatile tier keeps nothing across runs."""

    @abstractmethod
    def close(self) -> None:
        """Release the tier's files and threads (no flush: the table flushes first)."""
