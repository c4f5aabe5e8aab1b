"""Probe: the slot of each id in a bucketed index, or -1 (torch path + dispatch).

The index is ``keys [num_buckets, WAYS]`` int64 with -1 marking an empty way.
An id lives only in its own bucket (``index_bucket``), so a probe reads one
bucket: ``slot = bucket * WAYS + way``.
"""

from __future__ import annotations

import torch

from torchrec_kvemb.backend import use_triton
from torchrec_kvemb.ops.hashing import index_bucket


def probe_torch(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Slots ``[n]`` int64 of ``ids`` in ``keys``; -1 where absent."""
    num_buckets, ways = keys.shape
    buckets = index_bucket(ids, num_buckets)
    # why index_select: 6x faster than advanced indexing for [n, 16] rows on CPU.
    match = keys.index_select(0, buckets) == ids.unsqueeze(1)
    way = match.to(torch.uint8).argmax(dim=1)
    return torch.where(match.any(dim=1), buckets * ways + way, -1)


def probe(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Slots of ``ids``; -1 where absent. Triton on CUDA, torch otherwise."""
    if use_triton(ids.device):
        from torchrec_kvemb.kernels.probe import probe_triton

        return probe_triton(keys, ids)
    return probe_torch(keys, ids)
