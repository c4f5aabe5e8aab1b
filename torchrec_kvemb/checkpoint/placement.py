"""Placing a checkpoint's rows into KV tables while the rest is still being read.

``checkpoint.load`` reads a table's ids and scores first, checks them, then reads
its rows (``weight`` and the optimizer state) in blocks (:mod:`.row_stream`).
:class:`RowPlacer` places each block into the table's row arrays as soon as it is
read, on a thread of its own, so placing overlaps reading. Nothing a user can see
changes before :meth:`RowPlacer.commit`:

* the slots come from a staged index (:meth:`BucketIndex.bulk_load` into an empty
  index of the table's bucket count: the slots a load into the cleared table gives),
  so the table's index, scores, counters and step counters keep the old content
  until commit, which copies the staged index in; a table's index is planned by
  the reading thread that posts its first block, so tables plan side by side;
* before a table's first block lands, the rows of its live slots that the new
  content will overwrite are kept aside; :meth:`RowPlacer.rollback` writes them
  back. Slots that hold no id may keep rows of a failed load: no id reads them
  (a new id's row is initialised when it is inserted).

Tables with an SSD tier are not placed this way (``restore_table`` after the
whole read places their rows by score over both tiers).

Example::

    placer = RowPlacer([TablePlacement(table, ids, scores, ("weight", "momentum1"))],
                       {"model.t.weight": (0, "weight"), ...})
    with placer.running():
        stream_rows(reader, metadata, requests, placer.post)   # RowBlocks
    placer.commit()                      # or placer.rollback() if anything failed
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from torchrec_kvemb import dispatch
from torchrec_kvemb.checkpoint.row_stream import RowBlock
from torchrec_kvemb.index import BucketIndex
from torchrec_kvemb.state_dict import warn_dropped
from torchrec_kvemb.table import KVTable
from torchrec_kvemb.ttl import warn_without_last_seen

#: The entry name of a table's rows among its placed entries.
WEIGHT = "weight"


@dataclass
class TablePlacement:
    """One table's new content: ``ids`` and ``scores`` read already; the row entries
    ``entries`` (``weight`` and the optimizer state by name) come in blocks.

    ``keep``: the read rows this rank stores (None: all of them); ``scores`` None:
    the table's current step, as ``KVTable.load_rows`` gives."""

    table: KVTable
    ids: torch.Tensor
    scores: torch.Tensor | None
    entries: tuple[str, ...]
    keep: torch.Tensor | None = None
    step: tuple[int, int] | None = None
    admission: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    #: The read rows' last steps (``weight_last_seen``; None: not in the checkpoint).
    last_seen: torch.Tensor | None = None
    #: After :meth:`plan`: the staged index and each read row's slot (-1: not placed).
    index: BucketIndex | None = None
    slot_of_row: torch.Tensor | None = None
    lost: int = 0
    _every_row: bool = True
    _kept: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
    _placed: dict[str, int] = field(default_factory=dict)
    _plan_lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        # a growing table grows to hold the new content first (on the loading thread)
        self.table.fit(self.ids if self.keep is None else self.ids[self.keep])

    @property
    def planned(self) -> bool:
        return self.index is not None

    def ensure_planned(self) -> None:
        """:meth:`plan` once, whichever thread asks first (the others wait for it)."""
        with self._plan_lock:
            if not self.planned:
                self.plan()

    def plan(self) -> None:
        """Slots of the new content (a staged index), and the old rows those slots
        hold kept aside. The first change to the table's arrays comes after this."""
        table, device = self.table, self.table.device
        ids = self.ids.to(device)
        keep = None if self.keep is None else self.keep.to(device)
        if keep is not None:
            ids = ids[keep]
        if self.scores is None:
            scores = torch.full_like(ids, table.step)
        else:
            scores = self.scores.to(device, torch.int64)
            scores = scores if keep is None else scores[keep]
        index = BucketIndex.empty(table.index.num_buckets, device)
        src, slots = index.bulk_load(ids, scores)
        if keep is None and src is None:
            placed, slot_of_row = ids, slots  # every read row, in read order
        else:
            positions = torch.arange(self.ids.numel(), device=device)
            positions = positions if keep is None else positions[keep]
            placed = positions if src is None else positions[src]
            slot_of_row = torch.full((self.ids.numel(),), -1, dtype=torch.int64, device=device)
            slot_of_row[placed] = slots
        self.lost = ids.numel() - placed.numel()
        self._every_row = placed.numel() == self.ids.numel()
        overwritten = slots[table.keys.view(-1).index_select(0, slots) >= 0]
        saved_state = table.state.index_select(0, overwritten) if table.state_dim else None
        self._kept = (overwritten, table.weights.index_select(0, overwritten), saved_state)
        self.index, self.slot_of_row = index, slot_of_row
        if table.state_dim and not (set(self.entries) - {WEIGHT}):
            table.state.index_fill_(0, slots, 0.0)  # no state given: zero, as a load gives

    def place(self, entry: str, start: int, rows: torch.Tensor, column: int = 0) -> None:
        """Write read rows ``[start, start + len(rows))`` of ``entry`` into their slots:
        the table's columns ``[column, column + width)`` of them (a column piece)."""
        stop = start + rows.shape[0]
        slots = self.slot_of_row[start:stop]
        if not self._every_row:
            keep = slots >= 0
            slots, rows = slots[keep], rows[keep.to(rows.device)]
        dest = self._dest(entry)
        if dest.dim() == 2 and rows.dim() == 2 and rows.shape[1] != dest.shape[1]:
            dest = dest[:, column : column + rows.shape[1]]
        dispatch.scatter_rows(dest, slots, rows.to(dest.device, dest.dtype))
        width = rows.shape[1] if rows.dim() == 2 else 1
        self._placed[entry] = self._placed.get(entry, 0) + (stop - start) * width

    def _dest(self, entry: str) -> torch.Tensor:
        if entry == WEIGHT:
            return self.table.weights
        return self.table.optim.split_state(self.table.state, self.table.dim)[entry]

    def unplaced(self) -> list[str]:
        """Entries with values not placed yet (every row, every column)."""
        n = self.ids.numel()
        missing = []
        for e in self.entries:
            dest = self._dest(e)
            width = dest.shape[1] if dest.dim() == 2 else 1
            if n and self._placed.get(e, 0) != n * width:
                missing.append(e)
        return missing

    def rollback(self) -> None:
        """Write back the old rows the placed blocks overwrote (a no-op before
        :meth:`plan`)."""
        if self._kept is None:
            return
        slots, weights, state = self._kept
        self.table.weights.index_copy_(0, slots, weights)
        if state is not None:
            self.table.state.index_copy_(0, slots, state)
        self._kept = None

    def _restore_last_seen(self) -> None:
        """The TTL's last steps of the new content (``TableTTL.restore``): the saved
        ones, or the restored step with a warning where the checkpoint has none."""
        ids, last_seen = self.ids, self.last_seen
        if self.keep is not None:
            ids = ids[self.keep]
            last_seen = None if last_seen is None else last_seen[self.keep]
        self.table.ttl.restore(ids, last_seen)
        if last_seen is None:
            warn_without_last_seen(self.table, ids.numel())

    def commit(self) -> int:
        """Make the new content the table's: its index, step counters and admission
        entries. Returns how many rows found no room (after a warning)."""
        table = self.table
        table.clear()
        table.index.keys.copy_(self.index.keys)
        table.index.scores.copy_(self.index.scores)
        if self.step is not None:
            table.step, table.optim_step = self.step
        if table.ttl is not None:
            self._restore_last_seen()
        if self.admission is not None:
            table.load_admission(*self.admission)
        self._kept = None
        kept = self.ids.numel() if self.keep is None else int(self.keep.sum())
        if self.lost:
            warn_dropped(table.name, self.lost, kept, stacklevel=4)
        return self.lost


class RowPlacer:
    """Places the blocks a read posts (:meth:`post`) into their tables, on a thread.

    ``keys``: each read entry's key (as the read names it) to ``(table position in
    tables, entry name)``; posts for other keys are ignored."""

    def __init__(self, tables: list[TablePlacement], keys: Mapping[str, tuple[int, str]]) -> None:
        self.tables = tables
        self._keys = dict(keys)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None

    def post(self, block: RowBlock) -> None:
        """A block of rows was read (any thread); its buffer is released once placed.
        The first block of a table plans it on the posting thread (why: the reading
        threads plan the tables side by side, where the placing thread planned them
        one after the other while every reader waited for a free buffer)."""
        if block.key not in self._keys:
            block.release()
            return
        try:
            self.tables[self._keys[block.key][0]].ensure_planned()
        except BaseException:
            block.release()
            raise
        self._queue.put(block)

    @contextmanager
    def running(self) -> Iterator[None]:
        """Place posted blocks on a thread while the body reads; on leaving, every
        posted block is placed, and an error of placing (or rows never posted)
        raises here."""
        thread = threading.Thread(target=self._work, name="kvemb-row-placer", daemon=True)
        thread.start()
        try:
            yield
        finally:
            self._queue.put(None)
            thread.join()
        if self._error is not None:
            raise self._error
        for placement in self.tables:
            placement.ensure_planned()
            missing = placement.unplaced()
            if missing:
                raise RuntimeError(
                    f"table {placement.table.name!r}: rows of {missing} were not all read"
                )

    def _work(self) -> None:
        while (block := self._queue.get()) is not None:
            try:
                if self._error is None:
                    position, entry = self._keys[block.key]
                    self.tables[position].place(entry, block.start, block.rows, block.column)
            except BaseException as e:  # re-raised by running()
                self._error = e
            finally:
                block.release()

    def rollback(self) -> None:
        """Every table's rows as they were before the load (index untouched so far)."""
        for placement in self.tables:
            placement.rollback()

    def commit(self) -> None:
        for placement in self.tables:
            placement.commit()
