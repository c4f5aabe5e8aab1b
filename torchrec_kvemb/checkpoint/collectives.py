"""The collectives of checkpoint saves and loads, with or without a process group.

Every function takes the group :func:`process_group` returned: the default group
when ``torch.distributed`` is initialized, else None (one process: the
collectives return at once).

Example::

    group = process_group()
    token = broadcast(uuid.uuid4().hex if rank(group) == 0 else None, group)
    agree(error, group)   # raises on every rank if any rank failed
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from torchrec_kvemb.state_dict.checks import CheckpointError


def process_group() -> dist.ProcessGroup | None:
    """The default group when ``torch.distributed`` is initialized, else None."""
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


@contextlib.contextmanager
def single_process_ok() -> Iterator[None]:
    """DCP warns on every call without a process group; here that is intended."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def world_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def barrier(group: dist.ProcessGroup | None) -> None:
    if group is not None:
        dist.barrier(group)


def gather(obj: Any, group: dist.ProcessGroup | None) -> list[Any]:
    """Every rank's ``obj``, in rank order."""
    if group is None:
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast(obj: Any, group: dist.ProcessGroup | None) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if group is None:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
    return box[0]


def agree(error: Exception | None, group: dist.ProcessGroup | None) -> None:
    """Raise on every rank if any rank found an error (so that no rank goes on alone
    into a collective): this rank's own error, else the first rank's message."""
    message = None if error is None else str(error)
    if not isinstance(error, CheckpointError) and error is not None:
        message = f"{type(error).__name__}: {error}"
    errors = [m for m in gather(message, group) if m is not None]
    if error is not None:
        if isinstance(error, CheckpointError):
            raise error
        raise CheckpointError(message) from error
    if errors:
        raise CheckpointError(errors[0])
