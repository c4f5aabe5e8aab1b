"""Placement of ids into empty ways without ranking: the torch paths of
``BucketIndex.place`` and ``BucketIndex.bulk_load``.

``place_torch``: per bucket, absent ids (in the given order) take the bucket's
empty ways in ascending way order; a bucket without room for all of its ids
takes none of them (slot -1), so the caller can put them elsewhere whole (the
SSD tier's stash). Scores are left as they are.

``bulk_load_torch``: unique ids with scores into an EMPTY index; a bucket's ids
take ways 0, 1, ... in input order, or, when any bucket is given more than
``WAYS``, every bucket's in rank order (score desc, id asc), those past
``WAYS`` left out.

The native kernels (``csrc/place.cpp``) give the same slots.
"""

from __future__ import annotations

import torch

from torchrec_kvemb.contracts import stable_argsort
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


def bulk_load_torch(
    keys: torch.Tensor, scores: torch.Tensor, ids: torch.Tensor, values: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``(src, slots)``: the input positions that got a slot (``None``: all, in input
    order) and their slots; ``keys`` / ``scores`` (empty before) are written."""
    num_buckets = keys.shape[0]
    buckets = index_bucket(ids, num_buckets)
    counts = torch.bincount(buckets, minlength=num_buckets)
    if int(counts.max()) > WAYS:
        order = stable_argsort(ids)
        order = order[stable_argsort(values[order], descending=True)]
        order = order[stable_argsort(buckets[order])]
    else:
        order = stable_argsort(buckets)
    sorted_buckets = buckets[order]
    starts = torch.cumsum(counts, 0) - counts
    way = torch.arange(ids.numel(), device=ids.device) - starts[sorted_buckets]
    fits = way < WAYS
    if bool(fits.all()):
        slots = torch.empty_like(order).index_copy_(0, order, sorted_buckets * WAYS + way)
        src = None
    else:
        src = order[fits]
        slots = sorted_buckets[fits] * WAYS + way[fits]
    keys.view(-1).index_copy_(0, slots, ids if src is None else ids[src])
    scores.view(-1).index_copy_(0, slots, values if src is None else values[src])
    return src, slots
