"""``SSDStore``: one table shard's rows on disk, an id index in memory over a slab file.

It is the table's lower tier: it implements :class:`~torchrec_kvemb.tier.LowerTier`
(docs/ssd-tier.md, "The lower-tier contract"), and the table uses nothing else
of it.

Files, one pair per table and rank, in ``SSDOptions.path``::

    <table>.rank<r>.slab     the records (see ``slab.py``)
    <table>.rank<r>.index    the durable index, rewritten by every ``flush``

**Index.** A :class:`~torchrec_kvemb.slot_index.SlotIndex`: the same
bucketed index as the in-memory table, plus the slab record that holds each
slot's row. Its scores are the SSD tier's eviction scores. With a ``capacity``
the index has ``capacity`` slots and drops rows by its eviction policy
(counted in ``ssd_evictions``); without one it grows and never drops a row.

**Copy-on-write.** A row is never rewritten in place: every write takes a free
record. The index written by the last ``flush`` names the records it needs
(its *durable* records); a durable record freed later (its row was promoted,
dropped or found corrupt) becomes reusable only once the next flush has
replaced that index. So a crash at any moment leaves the last flushed index
pointing at records that nothing has touched since.

**Flush.** Writes the in-memory tier's rows (given by the table) to free
records, fsyncs the slab, then writes the index (the SSD rows, the memory
rows, the table's counters) to ``.index.tmp``, fsyncs it, renames it over
``.index`` and fsyncs the directory. Reopening the path loads that index.

Why one file of some 550 lines: one class whose index, slab records and flush
protocol must stay consistent with each other at every step (the copy-on-write
rule above); the slab format (``slab.py``) and the index (``torchrec_kvemb/slot_index.py``)
are already modules of their own.

Example::

    tier = SSDStore("user", dim=8, state_dim=1, options=SSDOptions("/mnt/ssd"), rank=0)
    tier.reserve(2)
    tier.put(ids, memory_scores, tier_scores, rows)     # rows [2, 9]: weights + state
    slots = tier.lookup(ids)
    scores, rows, ok = tier.fetch(ids, slots)
"""

from __future__ import annotations

import json
import math
import os
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torchrec_kvemb.options import WAYS, EvictionPolicy, SSDOptions
from torchrec_kvemb.slot_index import INITIAL_BUCKETS, SlotIndex
from torchrec_kvemb.ssd.prefetch import Prefetcher
from torchrec_kvemb.ssd.slab import KVStorageError, Slab, fsync_fd, fsync_path, storage_error
from torchrec_kvemb.tier import TIER_COUNTERS, LowerTier, RestoredRows, sweep_window

INDEX_FORMAT = 1
#: Records the slab grows by at least, and half its size (why: each growth maps
#: the file anew, and every page then faults once more on first touch).
MIN_GROWTH = 1024
#: Bytes of memory per slab record (free-list entry, write generation, durable flag).
BOOKKEEPING_BYTES_PER_RECORD = 17


def default_rank() -> int:
    """This process's rank in the default process group, 0 without one."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return 0


def file_stem(table: str, rank: int) -> str:
    """``<table>.rank<r>``, with characters unsafe in file names replaced by ``_``."""
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', table)}.rank{rank}"


@dataclass(frozen=True)
class Restored:
    """What the index of a previous run held for the in-memory tier."""

    ids: torch.Tensor
    records: torch.Tensor
    meta: dict[str, Any]


class SSDStore(LowerTier):
    """One table shard's SSD tier (see the module docstring): the table's
    :class:`~torchrec_kvemb.tier.LowerTier` on disk.

    Rows are ``[n, dim + state_dim]`` float32 (weights, then optimizer state);
    each row also keeps its in-memory eviction score. Ids passed to ``put`` and
    ``adopt`` must not be stored in the tier already (the table keeps the two
    tiers exclusive).
    """

    def __init__(
        self, table: str, dim: int, state_dim: int, options: SSDOptions, rank: int
    ) -> None:
        self.table = table
        self.dim = dim
        self.state_dim = state_dim
        self.options = options
        self.rank = rank
        self.directory = Path(options.path)
        self._prepare_directory()
        stem = file_stem(table, rank)
        self.slab_path = self.directory / f"{stem}.slab"
        self.index_path = self.directory / f"{stem}.index"
        self.slab = Slab(
            self.slab_path,
            table,
            dim,
            state_dim,
            io_threads=options.io_threads,
            fresh=not options.resume,
        )
        self.counters = dict.fromkeys(TIER_COUNTERS, 0)
        self.restored: Restored | None = None
        self._prefetcher = Prefetcher(table)
        self._closed = False
        self._write_generation = 0
        self._sweep_cursor = 0  # the next index slot a TTL sweep reads (``expire``)
        try:
            self._index = SlotIndex(self._initial_buckets(), stash=options.capacity is None)
            self._reset_records(torch.zeros(self.slab.records, dtype=torch.bool))
            if not options.resume:
                self.index_path.unlink(missing_ok=True)
            elif self.index_path.exists():
                self._load()
        except BaseException:
            self.slab.close()
            raise

    # ------------------------------------------------------------- set-up
    def _prepare_directory(self) -> None:
        directory = self.directory
        if directory.exists() and not directory.is_dir():
            raise KVStorageError(
                f"table {self.table!r}: SSD tier path {str(directory)!r} exists and is not a "
                "directory"
            )
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise storage_error(self.table, directory, "create the directory", err) from err
        probe_file = directory / f".{file_stem(self.table, self.rank)}.probe"
        try:
            fd = os.open(probe_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, bytes(4096))
                fsync_fd(fd)
            finally:
                os.close(fd)
                probe_file.unlink(missing_ok=True)
        except OSError as err:
            raise storage_error(self.table, directory, "write to", err) from err

    def _initial_buckets(self) -> int:
        if self.options.capacity is not None:
            return max(1, math.ceil(self.options.capacity / WAYS))
        return INITIAL_BUCKETS

    def _reset_records(self, in_use: torch.Tensor) -> None:
        """Records in ``in_use`` are the durable ones; every other record is free."""
        records = self.slab.records
        self._durable = in_use
        self._generation = torch.zeros(records, dtype=torch.int64)
        self._free = torch.empty(records, dtype=torch.int64)
        free = (~in_use).nonzero().squeeze(1).flip(0)  # popped from the end: lowest first
        self._free[: free.numel()] = free
        self._free_count = free.numel()
        self._recycled: list[torch.Tensor] = []  # freed since, reused after a merge
        self._recycled_count = 0
        self._pending = 0  # durable records freed since the last flush

    # --------------------------------------------------------------- state
    @property
    def size(self) -> int:
        """Rows stored in the tier."""
        return self._index.size

    @property
    def capacity(self) -> int:
        """Slots of the index (it grows when ``SSDOptions.capacity`` is None)."""
        return self._index.slots

    @property
    def free_records(self) -> int:
        """Slab records free to write now (those waiting for a flush not counted)."""
        return self._free_count + self._recycled_count

    @property
    def waiting_records(self) -> int:
        """Durable records freed since the last flush (reusable after the next one)."""
        return self._pending

    def memory_bytes(self) -> int:
        """Bytes of memory the tier's index and record bookkeeping hold."""
        return self._index.memory_bytes() + self.slab.records * BOOKKEEPING_BYTES_PER_RECORD

    def disk_bytes(self) -> int:
        """Bytes of the tier's files on disk."""
        total = 0
        for path in (self.slab_path, self.index_path):
            if path.exists():
                total += path.stat().st_blocks * 512
        return total

    @property
    def closed(self) -> bool:
        return self._closed

    def metrics(self) -> dict[str, int]:
        """The tier's counters (``tier.TIER_COUNTERS``) since it was opened."""
        return dict(self.counters)

    def _check_open(self) -> None:
        if self._closed:
            raise KVStorageError(f"table {self.table!r}: the SSD tier is closed")

    # -------------------------------------------------------------- records
    def reserve(self, n: int) -> None:
        """Make ``n`` records free to write, growing the slab (may raise
        ``KVStorageError``; nothing else changes then)."""
        self._check_open()
        if self._free_count >= n:
            return
        if self._recycled_count:
            self._merge_recycled()
            if self._free_count >= n:
                return
        old = self.slab.records
        new = old + max(n - self._free_count, old // 2, MIN_GROWTH)
        self.slab.grow(new)
        added = torch.arange(new - 1, old - 1, -1, dtype=torch.int64)
        free = torch.empty(new, dtype=torch.int64)
        free[: self._free_count] = self._free[: self._free_count]
        free[self._free_count : self._free_count + added.numel()] = added
        self._free = free
        self._free_count += added.numel()
        self._durable = torch.cat([self._durable, torch.zeros(new - old, dtype=torch.bool)])
        self._generation = torch.cat([self._generation, torch.zeros(new - old, dtype=torch.int64)])

    def needs_flush(self, n: int) -> bool:
        """Whether writing ``n`` rows should flush first: free records are short and
        enough records wait for a flush to become reusable (a quarter of the slab)."""
        return self.free_records < n and self._pending >= max(n, self.slab.records // 4)

    def _alloc(self, n: int) -> torch.Tensor:
        self.reserve(n)
        self._free_count -= n
        return self._free[self._free_count : self._free_count + n].flip(0)

    def _release(self, records: torch.Tensor) -> None:
        """Free ``records``: now if no durable index needs them, else after the next flush."""
        if records.numel() == 0:
            return
        durable = self._durable[records]
        self._pending += int(durable.sum())
        reusable = records[~durable]
        if reusable.numel():
            self._recycled.append(reusable)
            self._recycled_count += reusable.numel()

    def _merge_recycled(self) -> None:
        """Records freed since the last merge join the free records, all sorted so the
        lowest are taken first (why: a batch of writes then fills records near each
        other, so fewer pages of the mapping fault as they are first written
        after the kernel cleaned them; writes of freed records in the order they
        were freed hit a page each, ~4x the time for the SSD tier's demotions)."""
        merged = torch.cat([self._free[: self._free_count], *self._recycled])
        merged = torch.sort(merged, descending=True).values  # taken from the end
        self._free[: merged.numel()] = merged
        self._free_count = merged.numel()
        self._recycled, self._recycled_count = [], 0

    def _write(
        self, records: torch.Tensor, ids: torch.Tensor, scores: torch.Tensor, rows: torch.Tensor
    ) -> None:
        self.slab.write(records, ids, scores, rows)
        self._write_generation += 1
        self._generation[records] = self._write_generation
        self.counters["ssd_writes"] += records.numel()
        self.counters["ssd_bytes_written"] += records.numel() * self.slab.record_bytes

    def _read(self, records: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        block, ok = self.slab.read_verified(records, ids)
        self.counters["ssd_reads"] += records.numel()
        self.counters["ssd_bytes_read"] += records.numel() * self.slab.record_bytes
        return block, ok

    # ---------------------------------------------------------------- index
    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """Index slots of ``ids``; -1 where the tier does not hold the id."""
        self._check_open()
        return self._index.probe(ids)

    def scores_of(self, slots: torch.Tensor) -> torch.Tensor:
        """The tier's eviction scores at ``slots``."""
        return self._index.scores_at(slots)

    def records_of(self, slots: torch.Tensor) -> torch.Tensor:
        """The slab records at ``slots``."""
        return self._index.records_at(slots)

    def _index_insert(
        self, ids: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Put ``ids`` in the index with scores ``values``: ``(stored [n] bool,
        their slots, the records those slots held)``; drops are counted."""
        if self.options.capacity is None:
            slots = self._index.add(ids, values)
            stored = torch.ones(ids.numel(), dtype=torch.bool)
        else:
            keep = self.options.eviction == EvictionPolicy.NONE
            stored, slots, evicted = self._index.insert(ids, values, keep)
            self.counters["ssd_evictions"] += evicted + ids.numel() - slots.numel()
        return stored, slots, self._index.records_at(slots)

    def put(
        self,
        ids: torch.Tensor,
        memory_scores: torch.Tensor,
        tier_scores: torch.Tensor,
        rows: torch.Tensor,
    ) -> None:
        """Store ``rows`` of ``ids`` (with their in-memory ``memory_scores``), ranked
        for the tier's eviction by ``tier_scores``. Call ``reserve(len(ids))`` first
        where an I/O error must not leave the caller half done."""
        self._check_open()
        if ids.numel() == 0:
            return
        self.reserve(ids.numel())
        stored, slots, old = self._index_insert(ids, tier_scores)
        records = self._alloc(slots.numel())
        self._write(records, ids[stored], memory_scores[stored], rows[stored])
        self._index.set_records(slots, records)
        self._release(old[old >= 0])

    def adopt(self, ids: torch.Tensor, tier_scores: torch.Tensor, records: torch.Tensor) -> None:
        """Store ids whose rows are already in the slab at ``records``."""
        if ids.numel() == 0:
            return
        stored, slots, old = self._index_insert(ids, tier_scores)
        self._index.set_records(slots, records[stored])
        self._release(old[old >= 0])
        self._release(records[~stored])

    def remove(self, slots: torch.Tensor) -> None:
        """Take the ids at ``slots`` out of the tier (their records are freed)."""
        if slots.numel() == 0:
            return
        self._release(self._index.records_at(slots))
        self._index.remove(slots)

    def expire(self, cutoff: int, part: int, parts: int) -> int:
        """``LowerTier.expire``: the rows of the window whose index score is at or below
        ``cutoff`` are removed (records freed as ``remove`` frees them). The index
        scores are the memory scores of an LRU table's rows under an LRU SSD tier,
        the only TTL tables over an SSD tier (``KVTableOptions``), so no record is
        read."""
        self._check_open()
        window, self._sweep_cursor = sweep_window(
            self._sweep_cursor, self._index.slots, part, parts
        )
        live = window[self._index.ids_at(window) >= 0]
        expired = live[self._index.scores_at(live) <= cutoff]
        self.remove(expired)
        return expired.numel()

    # ----------------------------------------------------------------- rows
    def fetch(
        self, ids: torch.Tensor, slots: torch.Tensor, use_staged: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows of ``ids`` (unique, stored at ``slots``): ``(memory scores [n],
        rows [n, dim + state_dim], ok [n])``. Rows staged by ``prefetch`` are used
        where still valid (``use_staged``), the rest are read. A record that fails
        its checks (``ok`` False) is counted in ``ssd_corrupt`` and dropped."""
        self._check_open()
        records = self._index.records_at(slots)
        staged = self._prefetcher.take() if use_staged else None
        usable = None
        if staged is not None:
            usable, pos = staged.match(ids, records, self._generation[records])
            if not bool(usable.any()):
                usable = None
        if usable is None:
            block, ok = self._read(records, ids)
        else:
            block = torch.empty(ids.numel(), self.slab.words, dtype=torch.int64)
            ok = torch.empty(ids.numel(), dtype=torch.bool)
            used = usable.nonzero().squeeze(1)
            block[used] = staged.block[pos[used]]
            ok[used] = staged.ok[pos[used]]
            rest = (~usable).nonzero().squeeze(1)
            if rest.numel():
                block[rest], ok[rest] = self._read(records[rest], ids[rest])
            self.counters["ssd_prefetch_hits"] += used.numel()
        bad = (~ok).nonzero().squeeze(1)
        if bad.numel():
            self.counters["ssd_corrupt"] += bad.numel()
            self.remove(slots[bad])
        return block[:, 1], self.slab.rows(block), ok

    def prefetch(self, ids: torch.Tensor) -> None:
        """Start reading the rows the tier holds for ``ids`` on the prefetch thread."""
        self._check_open()
        ids = torch.unique(ids)
        slots = self._index.probe(ids)
        found = slots >= 0
        ids = ids[found]
        if ids.numel() == 0:
            return
        records = self._index.records_at(slots[found])
        generations = self._generation[records]
        view, slab = self.slab.view(), self.slab
        self.counters["ssd_reads"] += records.numel()
        self.counters["ssd_bytes_read"] += records.numel() * slab.record_bytes

        def read() -> tuple[torch.Tensor, torch.Tensor]:
            return slab.read_verified(records, ids, view)

        self._prefetcher.submit(ids, records, generations, read)

    def export(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every row the tier holds: ``(ids, memory scores, rows)``, corrupt ones left out."""
        self._check_open()
        slots = self._index.live()
        ids = self._index.ids_at(slots)
        scores, rows, ok = self.fetch(ids, slots, use_staged=False)
        return ids[ok], scores[ok], rows[ok]

    def read_restored(self) -> RestoredRows | None:
        """The previous run's in-memory rows, read from their records (None: the index
        named none); corrupt ones are counted and left out."""
        restored = self.restored
        if restored is None:
            return None
        block, ok = self._read(restored.records, restored.ids)
        bad = restored.records[~ok]
        if bad.numel():
            self.counters["ssd_corrupt"] += bad.numel()
            self._release(bad)
        return RestoredRows(
            restored.meta,
            restored.ids[ok],
            restored.records[ok],
            block[ok, 1],
            self.slab.rows(block[ok]),
        )

    # ----------------------------------------------------------- durability
    def flush(
        self,
        ids: torch.Tensor,
        memory_scores: torch.Tensor,
        rows: torch.Tensor,
        meta: dict[str, Any],
    ) -> None:
        """Make the tier and the in-memory rows ``ids`` / ``rows`` durable (see the
        module docstring); ``meta`` (JSON) comes back in ``restored.meta``. On a
        ``KVStorageError`` the previous flush stays the durable one."""
        self._check_open()
        self.reserve(ids.numel())
        records = self._alloc(ids.numel())
        try:
            self._write(records, ids, memory_scores, rows)
            self.slab.sync()
            self._write_index(ids, records, meta)
        except BaseException:
            self._free[self._free_count : self._free_count + records.numel()] = records
            self._free_count += records.numel()
            raise
        in_use = torch.zeros(self.slab.records, dtype=torch.bool)
        in_use[self._index.records_at(self._index.live())] = True
        in_use[records] = True
        generation = self._generation
        self._reset_records(in_use)
        self._generation = generation
        self.counters["ssd_flushes"] += 1

    def _write_index(self, mem_ids: torch.Tensor, mem_records: torch.Tensor, meta: dict) -> None:
        live = self._index.live()
        header = {
            "format": INDEX_FORMAT,
            "table": self.table,
            "dim": self.dim,
            "state_dim": self.state_dim,
            "record_bytes": self.slab.record_bytes,
            **meta,
        }
        arrays = {
            "ssd_ids": self._index.ids_at(live).numpy(),
            "ssd_scores": self._index.scores_at(live).numpy(),
            "ssd_records": self._index.records_at(live).numpy(),
            "mem_ids": mem_ids.numpy(),
            "mem_records": mem_records.numpy(),
            "meta": np.array(json.dumps(header)),
        }
        tmp = self.index_path.with_name(self.index_path.name + ".tmp")
        try:
            with open(tmp, "wb") as f:
                np.savez(f, **arrays)
                f.flush()
                fsync_fd(f.fileno())
            os.replace(tmp, self.index_path)
            fsync_path(self.directory)
        except OSError as err:
            tmp.unlink(missing_ok=True)
            raise storage_error(self.table, self.index_path, "write", err) from err

    def _load(self) -> None:
        path = self.index_path
        try:
            with np.load(path) as saved:
                arrays = {name: saved[name] for name in saved.files}
            meta = json.loads(str(arrays["meta"]))
            ssd_ids = torch.from_numpy(arrays["ssd_ids"].astype(np.int64))
            ssd_scores = torch.from_numpy(arrays["ssd_scores"].astype(np.int64))
            ssd_records = torch.from_numpy(arrays["ssd_records"].astype(np.int64))
            mem_ids = torch.from_numpy(arrays["mem_ids"].astype(np.int64))
            mem_records = torch.from_numpy(arrays["mem_records"].astype(np.int64))
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as err:
            raise KVStorageError(
                f"table {self.table!r}: SSD tier index {str(path)!r} is unreadable ({err})"
            ) from err
        expected = {
            "dim": self.dim,
            "state_dim": self.state_dim,
            "record_bytes": self.slab.record_bytes,
        }
        found = {key: meta.get(key) for key in expected}
        if meta.get("format") != INDEX_FORMAT or found != expected:
            raise KVStorageError(
                f"table {self.table!r}: SSD tier index {str(path)!r} was written for {found}, "
                f"the table needs {expected}"
            )
        records = torch.cat([ssd_records, mem_records])
        if records.numel() and (int(records.min()) < 0 or int(records.max()) >= self.slab.records):
            raise KVStorageError(
                f"table {self.table!r}: SSD tier index {str(path)!r} names records beyond its "
                f"slab file {str(self.slab_path)!r} ({self.slab.records} records)"
            )
        in_use = torch.zeros(self.slab.records, dtype=torch.bool)
        in_use[records] = True
        self._reset_records(in_use)
        self.adopt(ssd_ids, ssd_scores, ssd_records)
        self.restored = Restored(mem_ids, mem_records, meta)

    def close(self) -> None:
        """Stop the prefetch thread and close the files (no flush: see ``KVTable.close``)."""
        if self._closed:
            return
        self._closed = True
        self._prefetcher.close()
        self.slab.close()
