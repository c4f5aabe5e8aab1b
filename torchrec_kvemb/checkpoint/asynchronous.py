"""Asynchronous saves: the snapshot, the background writer, its handle and its group.

``checkpoint.async_save`` (or ``save(..., blocking=False)``) builds what the
checkpoint holds on the calling thread, copies every tensor that training could
still change (:func:`staged`), and hands the writing to a background thread
(:func:`start`), which returns an :class:`AsyncCheckpoint`.

Rules:

* One save at a time per process: a save (either kind) and a load first wait
  for the one in flight (:func:`wait_previous`). A failed asynchronous save whose
  ``result()`` nobody called fails the next save with its error.
* Process groups: an asynchronous save runs every collective (its token, the
  tables' configs, DCP's planning, the barrier before the marker) on
  :func:`checkpoint_group`, a gloo group of every rank that the first
  asynchronous save creates on the calling thread (``new_group`` is collective:
  every rank reaches it at the same call) and later saves reuse. Training's
  collectives stay on their own groups, so the two never interleave on one
  communicator; one save at a time means the group carries one save's
  collectives at a time, in the same order on every rank.
* The snapshot's KV rows (tables in CPU memory) go into staging buffers kept for
  the next save (:func:`release_buffers`); the writing thread and the threads it
  starts run at ``SCHED_IDLE``, raised to nice 19 if training starves them
  (:mod:`.priority`).

Example::

    pending = start("/ckpt/step_10", write)   # write(priority) runs on a background thread
    pending.done()                            # False while it runs
    pending.result()                          # waits; CheckpointError on failure
"""

from __future__ import annotations

import copy
import threading
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed.tensor import DTensor

from torchrec_kvemb.checkpoint.priority import SavePriority, set_nice_19
from torchrec_kvemb.state_dict.checks import CheckpointError
from torchrec_kvemb.state_dict.deferred import DeferredEntries, DeferredEntry

__all__ = [
    "AsyncCheckpoint",
    "checkpoint_group",
    "copied",
    "lowest_priority",
    "release_buffers",
    "staged",
    "start",
    "wait_previous",
]


class AsyncCheckpoint:
    """The handle of an asynchronous save to :attr:`path`.

    ``done()`` says whether it finished (written and published, or failed);
    ``result(timeout)`` waits for it and raises :class:`CheckpointError` if it
    failed (the checkpoint at ``path`` then is the one before, if any, and the
    partly written files are removed).

    Example::

        pending = checkpoint.save(model, "/ckpt/step_10", blocking=False)
        ...                      # training steps
        pending.result()         # the COMPLETE marker is written
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._future: Future[None] = Future()
        self._observed = False
        self._priority: SavePriority | None = None

    def done(self) -> bool:
        """Whether the save has finished, successfully or not (never waits)."""
        return self._future.done()

    def result(self, timeout: float | None = None) -> None:
        """Wait until the checkpoint is complete. Raises :class:`CheckpointError` if
        the save failed, ``TimeoutError`` if it has not finished in ``timeout`` s."""
        try:
            error = self._future.exception(timeout)
        except FutureTimeout:
            raise TimeoutError(
                f"checkpoint {self.path!r}: the asynchronous save has not finished "
                f"after {timeout} s"
            ) from None
        self._observed = True
        if error is not None:
            raise error

    def exception(self, timeout: float | None = None) -> CheckpointError | None:
        """Wait, then the save's error (None when it succeeded)."""
        error = self._future.exception(timeout)
        self._observed = True
        return error  # type: ignore[return-value]

    def __repr__(self) -> str:
        state = "running" if not self.done() else "failed" if self._failed() else "complete"
        return f"AsyncCheckpoint({self.path!r}, {state})"

    def _failed(self) -> bool:
        return self._future.done() and self._future.exception() is not None


_lock = threading.Lock()
_pending: AsyncCheckpoint | None = None


def start(path: str, write: Callable[[SavePriority], None]) -> AsyncCheckpoint:
    """Run ``write(priority)`` on a background thread at the save's priority (its own
    threads enter it with ``priority.lowered()``); its failure becomes the handle's
    :class:`CheckpointError` (any other exception is wrapped in one). The thread is
    not a daemon: an interpreter that exits waits for the save to finish."""
    global _pending
    handle = AsyncCheckpoint(path)
    priority = SavePriority()
    handle._priority = priority

    def run() -> None:
        try:
            with priority.lowered():
                write(priority)
        except CheckpointError as e:
            handle._future.set_exception(e)
        except BaseException as e:  # noqa: BLE001 - any failure belongs to the handle
            error = CheckpointError(
                f"checkpoint {path!r}: the asynchronous save failed: {type(e).__name__}: {e}"
            )
            error.__cause__ = e
            handle._future.set_exception(error)
        else:
            handle._future.set_result(None)
        finally:
            priority.close()

    with _lock:
        _pending = handle
    priority.watch()
    threading.Thread(target=run, name="kvemb-async-save", daemon=False).start()
    return handle


def lowest_priority() -> None:
    """Run the calling thread (and the threads it starts) at the lowest ordinary CPU
    priority, where the OS allows it (Linux: a thread's own nice value, 19)."""
    set_nice_19()


def wait_previous(raise_failure: bool) -> None:
    """Wait for the asynchronous save in flight, if any. ``raise_failure``: then
    forget it, raising its error when it failed and its ``result()`` did not raise
    it already (once); without, a failure stays for the next save to raise."""
    global _pending
    with _lock:
        handle = _pending
    if handle is None:
        return
    error = handle._future.exception()
    if not raise_failure:
        return
    with _lock:
        if _pending is handle:
            _pending = None
    if error is not None and not handle._observed:
        handle._observed = True
        raise CheckpointError(
            f"the previous asynchronous save to {handle.path!r} failed (nothing was "
            f"published there): {error}"
        ) from error


# ------------------------------------------------------------------ group
_groups: weakref.WeakKeyDictionary[Any, dist.ProcessGroup] = weakref.WeakKeyDictionary()


def checkpoint_group() -> dist.ProcessGroup | None:
    """The gloo group of every rank that asynchronous saves use (created by the
    first call, collectively; one per default group), or None without
    ``torch.distributed``."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    world = dist.group.WORLD
    group = _groups.get(world)
    if group is None:
        group = dist.new_group(backend="gloo")
        _groups[world] = group
    return group


# ---------------------------------------------------------------- staging
def copied(value: Any) -> Any:
    """A copy of ``value`` that nothing else changes (a ``ShardedTensor``'s shards,
    a tensor or ``DTensor`` on its device, anything else deep-copied)."""
    if isinstance(value, ShardedTensor):
        shards = [Shard(s.tensor.detach().clone(), s.metadata) for s in value.local_shards()]
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            shards, copy.deepcopy(value.metadata()), process_group=value._process_group
        )
    if isinstance(value, (torch.Tensor, DTensor)):
        return value.detach().clone()
    return copy.deepcopy(value)


#: Staging buffers of the KV tables' rows by state path, kept for the next
#: asynchronous save (see :func:`release_buffers`).
_buffers: dict[tuple[str, ...], torch.Tensor] = {}


def release_buffers() -> None:
    """Free the staging buffers asynchronous saves keep for the next one (after the
    save in flight, if any, is done)."""
    wait_previous(raise_failure=False)
    _buffers.clear()


def _buffer(path: tuple[str, ...], shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``[: shape[0]]`` of the buffer kept at ``path`` (grown when too small)."""
    buffer = _buffers.get(path)
    rows, tail = shape[0], tuple(shape[1:])
    if buffer is None or buffer.dtype != dtype or tuple(buffer.shape[1:]) != tail:
        buffer = None
    if buffer is None or buffer.shape[0] < rows:
        # why the eighth: a table that grows between saves reuses its buffer.
        buffer = torch.empty((rows + rows // 8, *tail), dtype=dtype)
        _buffers[path] = buffer
    return buffer[:rows]


def staged(
    state: dict[str, Any],
    fresh: Iterable[tuple[str, ...]] = (),
    deferred: DeferredEntries | None = None,
) -> dict[str, Any]:
    """``state`` with every tensor copied (``ShardedTensor`` shards and ``DTensor``
    local tensors included, on their devices) except those at the paths ``fresh``:
    tensors made for this snapshot that nothing else holds. The placeholders of
    ``deferred`` (KV tables in CPU memory) are filled into staging buffers kept for
    the next save, the tables ordered and gathered on up to
    ``torch.get_num_threads()`` threads, one table per thread at a time."""
    keep = set(fresh)
    deferred = deferred if deferred is not None else DeferredEntries()
    fills: list[tuple[DeferredEntry, int, torch.Tensor]] = []
    used: set[tuple[str, ...]] = set()

    def filled(tensor: torch.Tensor, path: tuple[str, ...]) -> torch.Tensor | None:
        found = deferred.find(tensor)
        if found is None:
            return None
        entry, first, _ = found
        used.add(path)
        buffer = _buffer(path, tensor.shape, tensor.dtype)
        fills.append((entry, first, buffer))
        return buffer

    def walk(value: Any, path: tuple[str, ...]) -> Any:
        if isinstance(value, dict):
            return {k: walk(v, (*path, k)) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v, (*path, str(i))) for i, v in enumerate(value)]
        if isinstance(value, ShardedTensor) and path in keep:
            shards = []
            for i, shard in enumerate(value.local_shards()):
                tensor = filled(shard.tensor, (*path, str(i)))
                shards.append(shard if tensor is None else Shard(tensor, shard.metadata))
            return ShardedTensor._init_from_local_shards_and_global_metadata(
                shards, value.metadata(), process_group=value._process_group
            )
        if type(value) is torch.Tensor and path in keep:
            tensor = filled(value, path)
            return value if tensor is None else tensor
        if path in keep:
            return value
        return copied(value)

    out = walk(state, ())
    for path in [p for p in _buffers if p not in used]:
        del _buffers[path]  # a table no longer saved, or now held elsewhere
    _fill(fills)
    return out


def _fill(fills: list[tuple[DeferredEntry, int, torch.Tensor]]) -> None:
    """Fill every buffer, the entries of one table after another on each thread (a
    table is ordered once, by its first entry's thread)."""
    by_table: dict[int, list[tuple[DeferredEntry, int, torch.Tensor]]] = {}
    for fill in fills:
        by_table.setdefault(id(fill[0].export), []).append(fill)

    def run(table_fills: list[tuple[DeferredEntry, int, torch.Tensor]]) -> None:
        for entry, first, buffer in table_fills:
            entry.fill(first, buffer)

    threads = max(1, min(len(by_table), torch.get_num_threads()))
    with ThreadPoolExecutor(threads, thread_name_prefix="kvemb-ckpt-stage") as pool:
        list(pool.map(run, by_table.values()))
