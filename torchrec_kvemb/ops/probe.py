"""Probe: the slot of each id in a bucketed index, or -1 (torch path).

The index is ``keys [num_buckets, WAYS]`` int64 with -1 marking an empty way.
An id lives only in its own bucket (``index_bucket``), so a probe reads one
bucket: ``slot = bucket * WAYS + way``.
"""

from __future__ import annotations

import torch

from torchrec_kvemb.ops.hashing import index_bucket


def probe_rows(keys: torch.Tensor, ids: torch.Tensor, buckets: torch.Tensor) -> torch.Tensor:
    """Slots of ``ids`` whose index buckets are ``buckets``; -1 where absent."""
    ways = keys.shape[1]
    # why index_select: 6x faster than advanced indexing for [n, 16] rows on CPU.
    match = keys.index_select(0, buckets) == ids.unsqueeze(1)
    # An id sits in at most one way, so a dot product with 1..ways names it
    # (0: absent) in one pass; any() + argmax() take twice as long.
    way1 = match.to(torch.float32) @ torch.arange(
        1, ways + 1, dtype=torch.float32, device=ids.device
    )
    way1 = way1.to(torch.int64)
    return torch.where(way1 > 0, buckets * ways + way1 - 1, -1)


def probe_torch(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Slots ``[n]`` int64 of ``ids`` in ``keys``; -1 where absent."""
    return probe_rows(keys, ids, index_bucket(ids, keys.shape[0]))
