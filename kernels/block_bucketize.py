"""Triton kernels for 2-D block bucketization (see ``torchrec_kvemb.ops.block_bucketize``).

Two passes over the ids, with prefix sums in torch between them:

1. ``block_bucketize_route_kernel``: per id, find its bag and feature (binary search
   over prefix sums), compute its owner rank and new id, and count ids per
   (rank, bag) with integer atomics (exact, so the counts are deterministic).
2. ``block_bucketize_fwd_kernel``: per id, its output place is the start of its
   (rank, bag) segment plus the number of earlier ids of the same bag with the
   same owner; it scatters the new id, weight row and in-bag position there and
   records the place in ``unbucketize_permute``. The rank is counted, never
   claimed by atomics, so the output order is fixed: original order within a
   segment, as in FBGEMM.

The scatter pass costs O(BLOCK) compares per id, plus, for an id whose bag began
in an earlier block, one BLOCK-wide compare per earlier window of that bag: bags
much longer than ``SCATTER_BLOCK`` ids cost quadratically in (length / BLOCK).
"""

# ruff: noqa: N803  (Triton's convention: constexpr kernel arguments are UPPER_CASE)

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torchrec_kvemb.contracts import BucketizeInputs, BucketizeResult

# Block sizes are not tuned on a GPU yet. The routing pass streams ids, so it takes
# wide blocks; the scatter pass ranks ids with a [BLOCK, BLOCK] compare, and 64 keeps
# that tile at 4096 elements (32 per thread with 4 warps).
ROUTE_BLOCK = 1024
SCATTER_BLOCK = 64
# Most weight columns moved per step of the scatter pass.
MAX_WEIGHT_BLOCK = 32


@triton.jit
def _first_greater(bounds_ptr, count, x, num_iters):
    """Per lane, the smallest k in [0, count) with bounds[k] > x (bounds nondecreasing).

    Lanes with x >= bounds[count - 1] (masked-off tail lanes) get count - 1, so every
    pointer derived from the result stays in bounds.
    """
    lo = tl.zeros_like(x)
    hi = tl.zeros_like(x) + (count - 1)
    for _ in range(num_iters):
        mid = (lo + hi) // 2
        go_left = tl.load(bounds_ptr + mid) > x
        hi = tl.where(go_left, mid, hi)
        lo = tl.where(go_left, lo, mid + 1)
    return tl.minimum(lo, count - 1)


@triton.jit
def block_bucketize_route_kernel(
    indices_ptr,
    bag_ends_ptr,
    feature_ends_ptr,
    block_sizes_ptr,
    num_blocks_ptr,
    bag_ptr,
    owner_ptr,
    new_ids_ptr,
    counts_ptr,
    num_ids,
    num_bags,
    num_features,
    world_size,
    bag_iters,
    feature_iters,
    KEEP_ORIG_IDX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    i = pid * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    mask = i < num_ids
    ids = tl.load(indices_ptr + i, mask=mask, other=0).to(tl.int64)

    bag = _first_greater(bag_ends_ptr, num_bags, i, bag_iters)
    feature = _first_greater(feature_ends_ptr, num_features, bag, feature_iters)
    block_size = tl.load(block_sizes_ptr + feature)
    global_blocks = tl.load(num_blocks_ptr + feature)
    local_blocks = global_blocks // world_size
    global_range = block_size * global_blocks
    # A block size of 0 sends every id down the modulo branch; the max keeps `//` defined.
    local_range = tl.maximum(block_size * local_blocks, 1)
    in_range = ids < global_range
    owner = tl.where(in_range, ids // local_range, (ids % global_blocks) // local_blocks)
    if KEEP_ORIG_IDX:
        new_ids = ids
    else:
        new_ids = tl.where(in_range, ids % local_range, ids // global_blocks)

    tl.store(bag_ptr + i, bag, mask=mask)
    tl.store(owner_ptr + i, owner.to(tl.int32), mask=mask)
    tl.store(new_ids_ptr + i, new_ids.to(new_ids_ptr.dtype.element_ty), mask=mask)
    tl.atomic_add(counts_ptr + owner * num_bags + bag, 1, mask=mask)


@triton.jit
def block_bucketize_fwd_kernel(
    bag_ptr,
    owner_ptr,
    new_ids_ptr,
    bag_starts_ptr,
    segment_starts_ptr,
    weights_ptr,
    out_indices_ptr,
    out_weights_ptr,
    out_pos_ptr,
    permute_ptr,
    num_ids,
    num_bags,
    num_cols,
    HAS_WEIGHTS: tl.constexpr,
    BUCKETIZE_POS: tl.constexpr,
    BLOCK: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    block_start = pid * BLOCK
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    i = block_start + lanes
    mask = i < num_ids
    bag = tl.load(bag_ptr + i, mask=mask, other=-1)
    owner = tl.load(owner_ptr + i, mask=mask, other=-1)

    # Earlier ids of the same bag and owner inside this block.
    earlier = (
        (bag[None, :] == bag[:, None])
        & (owner[None, :] == owner[:, None])
        & (lanes[None, :] < lanes[:, None])
    )
    rank = tl.sum(earlier.to(tl.int32), axis=1).to(tl.int64)

    # Only the block's first bag can have started before the block: count its earlier
    # ids with the same owner, one window at a time (bags longer than BLOCK only).
    first_bag = tl.load(bag_ptr + block_start)
    first_start = tl.load(bag_starts_ptr + first_bag)
    carry = tl.zeros([BLOCK], dtype=tl.int64)
    for window in range(first_start, block_start, BLOCK):
        j = window + lanes
        j_mask = j < block_start
        owner_j = tl.load(owner_ptr + j, mask=j_mask, other=-1)
        same = (owner_j[None, :] == owner[:, None]) & j_mask[None, :]
        carry += tl.sum(same.to(tl.int32), axis=1).to(tl.int64)
    rank += tl.where(bag == first_bag, carry, 0)

    segment = owner.to(tl.int64) * num_bags + bag
    out = tl.load(segment_starts_ptr + segment, mask=mask, other=0) + rank
    new_ids = tl.load(new_ids_ptr + i, mask=mask, other=0)
    tl.store(out_indices_ptr + out, new_ids, mask=mask)
    tl.store(permute_ptr + i, out.to(permute_ptr.dtype.element_ty), mask=mask)
    if BUCKETIZE_POS:
        in_bag = i - tl.load(bag_starts_ptr + bag, mask=mask, other=0)
        tl.store(out_pos_ptr + out, in_bag.to(out_pos_ptr.dtype.element_ty), mask=mask)
    if HAS_WEIGHTS:
        cols = tl.arange(0, BLOCK_COLS).to(tl.int64)
        for col_start in range(0, num_cols, BLOCK_COLS):
            c = col_start + cols
            tile_mask = mask[:, None] & (c[None, :] < num_cols)
            row = tl.load(weights_ptr + i[:, None] * num_cols + c[None, :], mask=tile_mask)
            tl.store(out_weights_ptr + out[:, None] * num_cols + c[None, :], row, mask=tile_mask)


def block_bucketize_triton(inp: BucketizeInputs) -> BucketizeResult:
    """Bucketize validated inputs (``prepare_inputs``) with the Triton kernels."""
    lengths, indices, weights = inp.lengths, inp.indices, inp.weights
    device = indices.device
    num_ids = indices.numel()
    num_bags = lengths.numel()
    num_features = inp.block_sizes.numel()
    world_size = inp.world_size

    counts = torch.zeros(world_size * num_bags, dtype=torch.int64, device=device)
    out_indices = torch.empty_like(indices)
    permute = torch.empty_like(indices)
    out_pos = torch.empty_like(indices) if inp.bucketize_pos else None
    out_weights = None if weights is None else torch.empty_like(weights)
    if num_ids == 0:
        return BucketizeResult(counts.to(lengths.dtype), out_indices, out_weights, out_pos, permute)

    lengths64 = lengths.to(torch.int64)
    bag_ends = torch.cumsum(lengths64, 0)
    bag_starts = bag_ends - lengths64
    bag = torch.empty(num_ids, dtype=torch.int64, device=device)
    owner = torch.empty(num_ids, dtype=torch.int32, device=device)
    new_ids = torch.empty_like(indices)

    block_bucketize_route_kernel[(triton.cdiv(num_ids, ROUTE_BLOCK),)](
        indices,
        bag_ends,
        inp.feature_ends,
        inp.block_sizes,
        inp.num_blocks,
        bag,
        owner,
        new_ids,
        counts,
        num_ids,
        num_bags,
        num_features,
        world_size,
        num_bags.bit_length(),
        num_features.bit_length(),
        KEEP_ORIG_IDX=inp.keep_orig_idx,
        BLOCK=ROUTE_BLOCK,
    )
    segment_starts = torch.cumsum(counts, 0) - counts

    # Bool rows move as bytes; a 1-D weight vector is a one-column matrix.
    weights_arg = weights
    out_weights_arg = out_weights
    if weights is not None and weights.dtype == torch.bool:
        weights_arg = weights.view(torch.uint8)
        out_weights_arg = out_weights.view(torch.uint8)
    num_cols = 1 if weights is None or weights.dim() == 1 else weights.shape[1]
    move_weights = weights is not None and num_cols > 0

    block_bucketize_fwd_kernel[(triton.cdiv(num_ids, SCATTER_BLOCK),)](
        bag,
        owner,
        new_ids,
        bag_starts,
        segment_starts,
        weights_arg if move_weights else indices,
        out_indices,
        out_weights_arg if move_weights else indices,
        out_pos if out_pos is not None else indices,
        permute,
        num_ids,
        num_bags,
        num_cols,
        HAS_WEIGHTS=move_weights,
        BUCKETIZE_POS=inp.bucketize_pos,
        BLOCK=SCATTER_BLOCK,
        BLOCK_COLS=min(triton.next_power_of_2(max(num_cols, 1)), MAX_WEIGHT_BLOCK),
    )
    return BucketizeResult(
        lengths=counts.to(lengths.dtype),
        indices=out_indices,
        weights=out_weights,
        pos=out_pos,
        unbucketize_permute=permute,
    )
