"""Prefetch: read a coming batch's SSD rows on a background thread.

``KVTable.prefetch(ids)`` looks the ids up (on the caller's thread, so the
index is never shared between threads) and hands the read of their records to
one worker thread, which gathers and checks them into a staging buffer while
the caller computes the current batch. The next lookup takes the staged rows.

Staged rows may have gone stale in between: the current batch can promote a
staged id (its record is freed and may be rewritten) or demote another one.
Each staged row therefore carries the record it was read from and that
record's write generation (a counter stamped on every record written); the
lookup uses a staged row only if its id still maps to that record and the
record's generation is unchanged, and reads the others itself. A record that
is rewritten while the worker reads it has a new generation, so a torn read is
never used. Results are the same with or without prefetch.

Example::

    prefetcher = Prefetcher("user")
    prefetcher.submit(ids, records, generations, lambda: read_and_verify(records, ids))
    staged = prefetcher.take()   # waits for the read; None when nothing was staged
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StagedRows:
    """Records read ahead: row ``i`` is id ``ids[i]`` read from ``records[i]`` at
    write generation ``generations[i]``; ``ok[i]``: it passed its checks."""

    ids: torch.Tensor  # sorted
    records: torch.Tensor
    generations: torch.Tensor
    block: torch.Tensor  # [k, words] int64, the records as read
    ok: torch.Tensor

    def match(
        self, ids: torch.Tensor, records: torch.Tensor, generations: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(usable [n] bool, position [n])``: which of ``ids`` (whose current
        records and generations are given) have a staged copy still valid, and
        where it is."""
        if self.ids.numel() == 0 or ids.numel() == 0:
            return torch.zeros_like(ids, dtype=torch.bool), torch.zeros_like(ids)
        pos = torch.searchsorted(self.ids, ids).clamp_(max=self.ids.numel() - 1)
        usable = (
            (self.ids[pos] == ids)
            & (self.records[pos] == records)
            & (self.generations[pos] == generations)
        )
        return usable, pos


@dataclass
class _Pending:
    ids: torch.Tensor
    records: torch.Tensor
    generations: torch.Tensor
    future: Future


class Prefetcher:
    """One worker thread and at most one staged batch (a newer one replaces it)."""

    def __init__(self, table: str) -> None:
        self.table = table
        self._pool: ThreadPoolExecutor | None = None
        self._pending: _Pending | None = None

    def submit(
        self,
        ids: torch.Tensor,
        records: torch.Tensor,
        generations: torch.Tensor,
        read: Callable[[], tuple[torch.Tensor, torch.Tensor]],
    ) -> None:
        """Stage ``read()`` -> ``(block, ok)`` of ``records`` for sorted ``ids``."""
        if self._pending is not None:
            self._pending.future.cancel()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"kv-prefetch-{self.table}")
        self._pending = _Pending(ids, records, generations, self._pool.submit(read))

    def take(self) -> StagedRows | None:
        """The staged batch (waiting for its read to finish), or None; it is
        handed out once. A read that failed is dropped: the caller reads itself."""
        pending, self._pending = self._pending, None
        if pending is None or pending.future.cancelled():
            return None
        try:
            block, ok = pending.future.result()
        except Exception:  # why: staging only saves time; the caller's own read reports errors
            return None
        return StagedRows(pending.ids, pending.records, pending.generations, block, ok)

    def close(self) -> None:
        """Drop what is staged and stop the worker (after its current read)."""
        self._pending = None
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
