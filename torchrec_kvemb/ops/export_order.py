"""An index's stored ids in checkpoint order (by routing bucket, then id): the
torch path of ``dispatch.export_order``, the reference the native kernel
(``csrc/export_order.cpp``) equals bit for bit.

Example::

    ids, slots, counts = export_order_torch(keys, route_buckets=40320)
    # ids[k] is stored at slot slots[k]; counts[b] ids route to bucket b
"""

from __future__ import annotations

import torch

from torchrec_kvemb.ops.hashing import route_bucket


def export_order_torch(
    keys: torch.Tensor, route_buckets: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids, slots, counts)`` of the ids stored in ``keys`` (any shape, -1 where
    empty, slots counted over its flat view): ids sorted by routing bucket among
    ``route_buckets``, then by id; ``counts [route_buckets]`` ids per bucket."""
    flat = keys.reshape(-1)
    slots = (flat >= 0).nonzero().squeeze(1)
    ids = flat.index_select(0, slots)
    buckets = route_bucket(ids, route_buckets)
    counts = torch.bincount(buckets, minlength=route_buckets)
    shift = 63 - max(1, route_buckets).bit_length()
    if ids.numel() and int(ids.max()) < (1 << shift):
        # why: ids below 2**shift leave room for the bucket above them in one int64
        # key (unique, as the ids are): one sort instead of two.
        order = torch.sort(buckets.bitwise_left_shift(shift).bitwise_or_(ids)).indices
        return ids.index_select(0, order), slots.index_select(0, order), counts
    ids, by_id = torch.sort(ids)
    by_bucket = torch.sort(buckets.index_select(0, by_id), stable=True).indices
    order = by_id.index_select(0, by_bucket)
    return ids.index_select(0, by_bucket), slots.index_select(0, order), counts
