"""Probe: the slot of each id in a bucketed index, or -1 (Triton).

Twin of ``torchrec_kvemb/ops/probe.py``: an id lives only in its own bucket, so
one program loads, for each of its ids, the bucket's ``WAYS`` keys as one row
and takes the first matching way; ``slot = bucket * WAYS + way``.
"""

# Triton's convention: constexpr kernel arguments are UPPER_CASE.
# ruff: noqa: N803

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torchrec_kvemb.kernels.hashing import index_bucket

# why 128: a block loads 128 x WAYS int64 keys (16 KiB at WAYS=16), enough
# independent loads per program to hide the latency of the random bucket reads.
BLOCK_IDS = 128


@triton.jit
def probe_block(keys_ptr, ids, mask, num_buckets, WAYS: tl.constexpr):
    """Buckets and slots (-1 where absent) of a vector of ids; ``mask`` off lanes miss."""
    buckets = index_bucket(ids, num_buckets)
    ways = tl.arange(0, WAYS)
    row = buckets * WAYS  # int64: num_buckets * WAYS may exceed 2**31
    stored = tl.load(keys_ptr + row[:, None] + ways[None, :], mask=mask[:, None], other=-1)
    match = (stored == ids[:, None]) & mask[:, None]
    first = tl.min(tl.where(match, ways[None, :], WAYS), axis=1)
    slots = tl.where(first < WAYS, row + first, -1)
    return buckets, slots


@triton.jit
def probe_fwd_kernel(
    keys_ptr,
    ids_ptr,
    slots_ptr,
    n,
    num_buckets,
    WAYS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    ids = tl.load(ids_ptr + offs, mask=mask, other=0)
    _, slots = probe_block(keys_ptr, ids, mask, num_buckets, WAYS)
    tl.store(slots_ptr + offs, slots, mask=mask)


def probe_triton(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Slots ``[n]`` int64 of ``ids`` in ``keys [num_buckets, WAYS]``; -1 where absent."""
    num_buckets, ways = keys.shape
    if ways & (ways - 1):
        raise ValueError(f"probe_triton: ways must be a power of two, got {ways}")
    keys = keys.contiguous()
    ids = ids.contiguous()
    n = ids.numel()
    slots = torch.empty(n, dtype=torch.int64, device=ids.device)
    if n == 0:
        return slots
    grid = (triton.cdiv(n, BLOCK_IDS),)
    probe_fwd_kernel[grid](keys, ids, slots, n, num_buckets, WAYS=ways, BLOCK=BLOCK_IDS)
    return slots
