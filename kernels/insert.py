"""Find-or-insert with eviction over a bucketed index (Triton).

Twin of ``torchrec_kvemb/ops/insert.py`` (its docstring states the batch
semantics; this file gives the same bits). Two launches and a few torch ops:

1. ``insert_find_fwd_kernel``: probe every id; a hit updates its score. The
   batch holds unique ids, so each hit slot has one writer (no atomics).
2. torch: group the missing ids by bucket with stable sorts, so each touched
   bucket owns a contiguous segment ranked by (score desc, id asc).
3. ``insert_fwd_kernel``: one program per touched bucket merges its stored
   entries with the head of its segment, keeps the top ``WAYS``, evicts the
   stored losers and places the winning new ids in free ways, ascending.

The winners among the new ids are always a prefix of the bucket's ranked
segment (a new id that ranks above a winner wins too), and there are at most
``WAYS`` winners, so only the first ``WAYS`` ids of a segment can win: the
kernel reads that head in one go instead of looping over the whole segment.
"""

# Triton's convention: constexpr kernel arguments are UPPER_CASE.
# ruff: noqa: N803

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torchrec_kvemb.contracts import InsertResult
from torchrec_kvemb.contracts import stable_argsort as _stable_argsort
from torchrec_kvemb.kernels.probe import BLOCK_IDS, probe_block


@triton.jit
def insert_find_fwd_kernel(
    keys_ptr,
    scores_ptr,
    ids_ptr,
    values_ptr,
    slots_ptr,
    buckets_ptr,
    n,
    num_buckets,
    WAYS: tl.constexpr,
    ACCUMULATE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    ids = tl.load(ids_ptr + offs, mask=mask, other=0)
    buckets, slots = probe_block(keys_ptr, ids, mask, num_buckets, WAYS)
    hit = mask & (slots >= 0)
    values = tl.load(values_ptr + offs, mask=hit)
    if ACCUMULATE:
        values += tl.load(scores_ptr + slots, mask=hit)
    tl.store(scores_ptr + slots, values, mask=hit)
    tl.store(slots_ptr + offs, slots, mask=mask)
    tl.store(buckets_ptr + offs, buckets, mask=mask)


@triton.jit
def insert_fwd_kernel(
    keys_ptr,
    scores_ptr,
    new_ids_ptr,
    new_scores_ptr,
    new_src_ptr,
    touched_ptr,
    seg_start_ptr,
    seg_count_ptr,
    slots_ptr,
    inserted_ptr,
    evicted_ptr,
    protected_ptr,
    WAYS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    bucket = tl.load(touched_ptr + pid)
    start = tl.load(seg_start_ptr + pid)
    count = tl.load(seg_count_ptr + pid)
    row = bucket * WAYS

    # Candidates c in [0, 2*WAYS): c < WAYS is stored way c, c >= WAYS is the
    # new id at position c - WAYS of the bucket's ranked segment.
    c = tl.arange(0, 2 * WAYS)
    is_stored = c < WAYS
    j = c - WAYS
    is_new = j >= 0
    new_valid = is_new & (j < count)
    way_off = tl.where(is_stored, c, 0)
    seg_off = start + tl.where(new_valid, j, 0)
    stored_key = tl.load(keys_ptr + row + way_off, mask=is_stored, other=-1)
    stored_score = tl.load(scores_ptr + row + way_off, mask=is_stored)
    new_key = tl.load(new_ids_ptr + seg_off, mask=new_valid, other=-1)
    new_score = tl.load(new_scores_ptr + seg_off, mask=new_valid)
    cand_key = tl.where(is_stored, stored_key, new_key)
    cand_score = tl.where(is_stored, stored_score, new_score)
    occupied = is_stored & (stored_key >= 0)
    valid = occupied | new_valid
    protected = tl.load(protected_ptr + pid * WAYS + way_off, mask=is_stored, other=0) != 0

    # beats[a, b]: candidate b ranks above candidate a (protected first, score
    # desc, new before stored, id asc); ids are unique among the candidates.
    s_a = cand_score[:, None]
    s_b = cand_score[None, :]
    new_a = is_new[:, None]
    new_b = is_new[None, :]
    p_a = protected[:, None]
    p_b = protected[None, :]
    same_p = p_a == p_b
    above = (p_b & ~p_a) | (same_p & (s_b > s_a))
    tie = same_p & (s_b == s_a)
    tiebreak = (new_b & ~new_a) | ((new_a == new_b) & (cand_key[None, :] < cand_key[:, None]))
    beats = valid[None, :] & (above | (tie & tiebreak))
    rank = tl.sum(beats.to(tl.int32), axis=1)
    kept = valid & (rank < WAYS)

    evicted = occupied & ~kept
    tl.store(evicted_ptr + pid * WAYS + way_off, tl.where(evicted, cand_key, -1), mask=is_stored)

    # Free ways (empty or just evicted) go to the winning new ids in rank
    # order, lowest way first: winner j takes the free way whose free rank is j.
    free = is_stored & (~occupied | evicted)
    free_rank = tl.cumsum(free.to(tl.int32), axis=0) - 1
    takes = free[None, :] & (free_rank[None, :] == j[:, None])
    target = tl.min(tl.where(takes, c[None, :], 2 * WAYS), axis=1)
    won = is_new & kept
    slot = row + tl.where(won, target, 0)
    tl.store(keys_ptr + slot, cand_key, mask=won)
    tl.store(scores_ptr + slot, cand_score, mask=won)
    src = tl.load(new_src_ptr + seg_off, mask=won, other=0)
    tl.store(slots_ptr + src, slot, mask=won)
    tl.store(inserted_ptr + src, tl.full([2 * WAYS], 1, tl.uint8), mask=won)


def insert_triton(
    keys: torch.Tensor,
    scores: torch.Tensor,
    ids: torch.Tensor,
    values: torch.Tensor,
    accumulate: bool,
    keep_existing: bool,
) -> InsertResult:
    """Find-or-insert unique ``ids`` with per-id score ``values``; updates in place.

    Same contract and bits as ``ops.insert.insert_torch``; ``keys`` and ``scores``
    are ``[num_buckets, WAYS]`` (contiguous, WAYS a power of two) and ``values``
    has the dtype of ``scores``.
    """
    num_buckets, ways = keys.shape
    if ways & (ways - 1):
        raise ValueError(f"insert_triton: ways must be a power of two, got {ways}")
    if not (keys.is_contiguous() and scores.is_contiguous()):
        raise ValueError("insert_triton: keys and scores must be contiguous (updated in place)")
    if values.dtype != scores.dtype:
        raise TypeError(
            f"insert_triton: values dtype {values.dtype} differs from scores dtype {scores.dtype}"
        )
    device = ids.device
    ids = ids.contiguous()
    values = values.contiguous()
    n = ids.numel()
    empty = torch.empty(0, dtype=torch.int64, device=device)
    slots = torch.empty(n, dtype=torch.int64, device=device)
    buckets = torch.empty(n, dtype=torch.int64, device=device)
    if n == 0:
        no = torch.zeros(0, dtype=torch.bool, device=device)
        return InsertResult(slots, no, no.clone(), empty, empty)

    insert_find_fwd_kernel[(triton.cdiv(n, BLOCK_IDS),)](
        keys,
        scores,
        ids,
        values,
        slots,
        buckets,
        n,
        num_buckets,
        WAYS=ways,
        ACCUMULATE=accumulate,
        BLOCK=BLOCK_IDS,
    )
    hit = slots >= 0
    miss_src = (~hit).nonzero().squeeze(1)
    inserted = torch.zeros(n, dtype=torch.uint8, device=device)
    if miss_src.numel() == 0:
        return InsertResult(slots, hit, inserted.view(torch.bool), empty, empty)

    # Rank the missing ids by (bucket, score desc, id) with stable sorts, last key first.
    miss_ids = ids[miss_src]
    miss_scores = values[miss_src]
    order = _stable_argsort(miss_ids)
    order = order[_stable_argsort(miss_scores[order], descending=True)]
    order = order[_stable_argsort(buckets[miss_src[order]])]
    new_src = miss_src[order]
    touched, counts = torch.unique_consecutive(buckets[new_src], return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    t = touched.numel()
    evicted = torch.empty(t, ways, dtype=torch.int64, device=device)
    grid = touched.unsqueeze(1) * ways + torch.arange(ways, device=device)
    if keep_existing:
        protected = torch.ones(t, ways, dtype=torch.uint8, device=device)
    else:
        protected = torch.isin(grid, slots[hit]).to(torch.uint8)

    insert_fwd_kernel[(t,)](
        keys,
        scores,
        miss_ids[order],
        miss_scores[order],
        new_src,
        touched,
        starts,
        counts,
        slots,
        inserted,
        evicted,
        protected,
        WAYS=ways,
    )
    lost = evicted >= 0
    evicted_ids = evicted[lost]
    evicted_slots = grid[lost]
    return InsertResult(slots, hit, inserted.view(torch.bool), evicted_ids, evicted_slots)
