"""Placement of absent ids into empty ways: the torch path of ``BucketIndex.place``.

Per bucket, the ids (in the given order) take the bucket's empty ways in
ascending way order; a bucket without room for all of its ids takes none of
them (slot -1), so the caller can put them elsewhere whole (the SSD tier's
stash). Scores are left as they are. The native kernel (``csrc/place.cpp``)
gives the same slots.
"""

from __future__ import annotations

import torch

from torchrec_kvemb.ops.hashing import index_bucket
from torchrec_kvemb.options import WAYS


def place_torch(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Slots ``[n]`` of the absent ``ids`` placed in ``keys`` (updated in place)."""
    buckets = index_bucket(ids, keys.shape[0])
    sorted_buckets, order = torch.sort(buckets, stable=True)
    touched, counts = torch.unique_consecutive(sorted_buckets, return_counts=True)
    free = keys.index_select(0, touched) < 0
    fits = counts <= free.sum(dim=1)
    take = free & fits.unsqueeze(1) & (torch.cumsum(free, dim=1) <= counts.unsqueeze(1))
    row, way = take.nonzero(as_tuple=True)
    src = order[torch.repeat_interleave(fits, counts)]
    new_slots = touched[row] * WAYS + way
    keys.view(-1).index_copy_(0, new_slots, ids[src])
    slots = torch.full_like(ids, -1)
    slots[src] = new_slots
    return slots
