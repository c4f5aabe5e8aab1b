"""Row entries of a ``state_dict()`` filled after it returns, while a writer writes.

Within :func:`deferred_rows`, the ``state_dict()`` of an unsharded KV collection
gives each in-memory table's ``weight``, ``weight_score`` and optimizer state as
tensors of their final shape that are not filled yet (ids, buckets and counters
are filled at once: their order is where the time goes only when gathered with
the rows). :meth:`DeferredRows.fill` gathers the rows into them, table by table,
on a thread; a writer calls :meth:`DeferredRows.wait_for` before it reads a
tensor. ``checkpoint.save`` writes table ``k`` while table ``k + 1`` is gathered.

A tensor is known by its storage, so a view of an entry waits for it too.

Example::

    with deferred_rows() as deferred:
        state = model.state_dict()
    threading.Thread(target=deferred.fill).start()
    for value in state.values():
        deferred.wait_for(value)      # then write it
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

from torchrec_kvemb.table import KVTable

_ACTIVE: ContextVar[DeferredRows | None] = ContextVar("kvemb_deferred_rows", default=None)


class DeferredRows:
    """Tables whose row entries are to be gathered, and their fill state."""

    def __init__(self) -> None:
        self._jobs: list[tuple[KVTable, torch.Tensor, dict[str, torch.Tensor]]] = []
        self._ready: dict[int, threading.Event] = {}
        self._error: BaseException | None = None
        self.waited: set[int] = set()

    def add(self, table: KVTable, slots: torch.Tensor, rows: dict[str, torch.Tensor]) -> None:
        """Gather ``table``'s rows of ``slots`` into ``rows`` (``rows_of_slots`` names)
        at :meth:`fill`."""
        self._jobs.append((table, slots, rows))
        for tensor in rows.values():
            self._ready[_storage(tensor)] = threading.Event()

    @property
    def pending(self) -> set[int]:
        """The storages of the deferred tensors (by data pointer)."""
        return set(self._ready)

    def fill(self) -> None:
        """Gather every table's rows, in the order they were added (any thread)."""
        try:
            for table, slots, rows in self._jobs:
                table.rows_of_slots(slots, out=rows)
                for tensor in rows.values():
                    self._ready[_storage(tensor)].set()
        except BaseException as e:
            self._error = e
            for event in self._ready.values():
                event.set()

    def wait_for(self, tensor: torch.Tensor) -> None:
        """Return once ``tensor`` (or the entry it views) is filled; raise if gathering
        failed. Other tensors return at once."""
        key = _storage(tensor)
        event = self._ready.get(key)
        if event is None:
            return
        event.wait()
        if self._error is not None:
            raise RuntimeError("gathering the rows of a KV table failed") from self._error
        self.waited.add(key)


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def active() -> DeferredRows | None:
    """The :class:`DeferredRows` of the enclosing :func:`deferred_rows`, if any."""
    return _ACTIVE.get()


@contextmanager
def deferred_rows() -> Iterator[DeferredRows]:
    """Defer the row entries of ``state_dict()`` calls within (see the module)."""
    deferred = DeferredRows()
    token = _ACTIVE.set(deferred)
    try:
        yield deferred
    finally:
        _ACTIVE.reset(token)
