"""State_dict entries whose rows a checkpoint writer produces as it writes them.

Inside :func:`deferring` (``torchrec_kvemb.checkpoint.save`` opens it around
``model.state_dict()``), the row entries of a table held whole in CPU memory
(``weight``, ``weight_id``, ``weight_score``, the optimizer state and ``bucket``)
are *placeholders*: tensors of the entries' shapes and dtypes whose memory is
never written or read (allocated, never touched, so no page of it is ever
faulted in). The writer asks :meth:`DeferredEntries.find` for each tensor it
writes and fills the placeholders' rows block by block into one reused buffer
(:meth:`DeferredEntry.fill`); the table's checkpoint order is computed then, once
per table, on the writer thread that first needs it, so tables are ordered in
parallel and beside the writes. A gather into fresh memory spent more time
faulting in its result's pages than reading the rows (docs/checkpoint-format.md#throughput).

A table with an SSD tier, or on another device than the CPU, gives its entries
as ever (whole tensors). Outside :func:`deferring` nothing changes.

Example::

    with deferring() as deferred:
        state = model.state_dict()            # placeholders for in-memory tables
        for value in state.values():
            found = deferred.find(value)       # (entry, first row, rows) or None
            if found is not None:
                entry, first, n = found
                entry.fill(first, buffer[:n])  # rows first .. first + n
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch

from torchrec_kvemb.table import KVTable


class TableExport:
    """A table's rows in checkpoint order (routing bucket, then id), ordered once,
    on first use, by whichever thread asks first.

    Example::

        export = TableExport(table)
        ids, slots, counts = export.order()   # the same tensors on every call
    """

    def __init__(self, table: KVTable) -> None:
        self.table = table
        self.rows = table.size
        self.num_buckets = table.options.total_num_buckets
        self._lock = threading.Lock()
        self._order: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def order(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(ids, slots, counts)`` in checkpoint order (``KVTable.checkpoint_order``)."""
        with self._lock:
            if self._order is None:
                order = self.table.checkpoint_order(self.num_buckets)
                if order[0].numel() != self.rows:
                    raise RuntimeError(
                        f"table {self.table.name!r}: {order[0].numel()} rows stored now, "
                        f"{self.rows} when its state_dict was taken: a table must not "
                        "change while a checkpoint of it is written"
                    )
                self._order = order
            return self._order


@dataclass(frozen=True)
class DeferredEntry:
    """One deferred entry of a table: ``ids``, ``bucket`` (rows per routing bucket),
    or an array of the table (``weights``, ``scores``, an optimizer state) read at
    the export's slots.

    Example::

        entry.fill(1000, buffer[:500])   # rows 1000 .. 1499 of the entry
    """

    export: TableExport
    field: str
    #: The placeholder (kept alive: the entry is found by its memory's address).
    placeholder: torch.Tensor
    #: The table's array read at the slots (``KVTable.row_arrays``); None for
    #: ``ids`` and ``bucket``.
    source: torch.Tensor | None = None

    def fill(self, first: int, out: torch.Tensor) -> None:
        """Write rows ``[first, first + len(out))`` of the entry into ``out``."""
        stop = first + out.shape[0]
        ids, slots, counts = self.export.order()
        if self.field == "bucket":
            out.copy_(counts[first:stop])
            return
        if self.field == "ids":
            out.copy_(ids[first:stop])
            return
        torch.index_select(self.source, 0, slots[first:stop], out=out)


@dataclass
class DeferredEntries:
    """The placeholders of one :func:`deferring` block, by their memory's address.

    Example::

        entries = DeferredEntries()
        weight = entries.table_entries(table)["weights"]   # a placeholder
        entry, first, n = entries.find(weight[10:20])      # (its entry, 10, 10)
    """

    _entries: dict[int, DeferredEntry] = field(default_factory=dict)
    _exports: dict[int, TableExport] = field(default_factory=dict)

    def table_entries(self, table: KVTable) -> dict[str, torch.Tensor] | None:
        """Placeholders for ``table``'s ``ids``, ``bucket`` and row arrays (see
        :meth:`KVTable.row_arrays`), or None for a table whose entries are not
        deferred (a lower tier, another device than the CPU, no rows)."""
        if table.ssd is not None or table.device.type != "cpu":
            return None
        export = self._exports.get(id(table))
        if export is None:
            export = self._exports[id(table)] = TableExport(table)
        if export.rows == 0:
            return None
        out = {
            "ids": self._placeholder(export, "ids", (export.rows,), torch.int64),
            "bucket": self._placeholder(export, "bucket", (export.num_buckets,), torch.int64),
        }
        for name, array in table.row_arrays().items():
            out[name] = self._placeholder(
                export, name, (export.rows, *array.shape[1:]), array.dtype, array
            )
        return out

    def _placeholder(
        self,
        export: TableExport,
        name: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        source: torch.Tensor | None = None,
    ) -> torch.Tensor:
        placeholder = torch.empty(shape, dtype=dtype)
        entry = DeferredEntry(export, name, placeholder, source)
        self._entries[placeholder.untyped_storage().data_ptr()] = entry
        return placeholder

    def find(self, tensor: torch.Tensor) -> tuple[DeferredEntry, int, int] | None:
        """``(entry, first row, rows)`` when ``tensor`` is rows of a placeholder
        (the whole of it, or a contiguous run of its rows), else None. Part of a
        placeholder in any other shape raises ``ValueError``: its memory holds
        nothing to write."""
        if tensor.device.type != "cpu":
            return None
        entry = self._entries.get(tensor.untyped_storage().data_ptr())
        if entry is None:
            return None
        whole = entry.placeholder
        row = math.prod(whole.shape[1:])
        offset = tensor.storage_offset()
        if (
            tensor.dtype != whole.dtype
            or tensor.dim() != whole.dim()
            or tensor.shape[1:] != whole.shape[1:]
            or not tensor.is_contiguous()
            or offset % row
        ):
            raise ValueError(
                f"table {entry.export.table.name!r}: a checkpoint writer was given part of "
                f"its deferred {entry.field!r} entry in a shape it cannot fill "
                f"({tuple(tensor.shape)} at element {offset})"
            )
        return entry, offset // row, tensor.shape[0]

    def __len__(self) -> int:
        return len(self._entries)


_ACTIVE: ContextVar[DeferredEntries | None] = ContextVar("kvemb_deferred_entries", default=None)


@contextmanager
def deferring() -> Iterator[DeferredEntries]:
    """Defer the row entries of tables held in CPU memory in the ``state_dict()``
    calls of this block (see the module's docstring)."""
    entries = DeferredEntries()
    token = _ACTIVE.set(entries)
    try:
        yield entries
    finally:
        _ACTIVE.reset(token)


def active() -> DeferredEntries | None:
    """The innermost :func:`deferring` block's entries, or None outside one."""
    return _ACTIVE.get()
