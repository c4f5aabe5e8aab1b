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

Example::

    pending = start("/ckpt/step_10", write)   # write() runs on a background thread
    pending.done()                            # False while it runs
    pending.result()                          # waits; CheckpointError on failure
"""

from __future__ import annotations

import copy
import os
import threading
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
from torch.distributed.tensor import DTensor

from torchrec_kvemb.state_dict.checks import CheckpointError

__all__ = ["AsyncCheckpoint", "checkpoint_group", "copied", "staged", "start", "wait_previous"]


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


def start(path: str, write: Callable[[], None]) -> AsyncCheckpoint:
    """Run ``write`` on a background thread; its failure becomes the handle's
    :class:`CheckpointError` (any other exception is wrapped in one). The thread is
    not a daemon: an interpreter that exits waits for the save to finish."""
    global _pending
    handle = AsyncCheckpoint(path)

    def run() -> None:
        lowest_priority()
        try:
            write()
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

    with _lock:
        _pending = handle
    threading.Thread(target=run, name="kvemb-async-save", daemon=False).start()
    return handle


def lowest_priority() -> None:
    """Run the calling thread (and the threads it starts) at the lowest CPU
    priority, where the OS allows it (Linux: a thread's own nice value)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


def wait_previous(raise_failure: bool) -> None:
    """Wait for the asynchronous save in flight, if any. ``raise_failure``: raise
    its error when it failed and its ``result()`` did not raise it already (once)."""
    global _pending
    with _lock:
        handle, _pending = _pending, None
    if handle is None:
        return
    error = handle._future.exception()
    if error is not None and raise_failure and not handle._observed:
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


def staged(state: dict[str, Any], fresh: Iterable[tuple[str, ...]] = ()) -> dict[str, Any]:
    """``state`` with every tensor copied (``ShardedTensor`` shards and ``DTensor``
    local tensors included, on their devices) except those at the paths ``fresh``:
    tensors made for this snapshot that nothing else holds."""
    keep = set(fresh)

    def walk(value: Any, path: tuple[str, ...]) -> Any:
        if path in keep:
            return value
        if isinstance(value, dict):
            return {k: walk(v, (*path, k)) for k, v in value.items()}
        if isinstance(value, list):
            return [walk(v, (*path, str(i))) for i, v in enumerate(value)]
        return copied(value)

    return walk(state, ())
