"""Find-or-insert with eviction over a bucketed index: the torch path.

The ranking rule is stated in ``contracts.py``; the Triton kernel
(``kernels/insert.py``) and the native CPU kernel give the same bits. In brief:

1. Each id (the batch holds unique ids) is probed in its bucket. A hit updates
   its score: ``score += value`` when ``accumulate`` (LFU counts), else
   ``score = value`` (LRU steps, custom scores).
2. Per bucket, the stored entries (scores already updated) and the bucket's
   new ids compete for the bucket's ``WAYS`` ways. Candidates are ranked:
   protected stored entries first (those hit by this batch, so an id in use
   never loses its row mid-batch; with ``keep_existing`` every stored entry),
   then by score (higher first), then new before stored (a new id replaces a
   stored one of equal score, so LFU keeps admitting), then id (smaller
   first). The first ``WAYS`` stay.
3. Stored entries that lose are evicted. Winning new ids take the freed and
   empty ways, in ascending way order, in rank order.

The outcome depends only on the index and the batch (not on thread timing).
"""

from __future__ import annotations

import torch

from torchrec_kvemb.contracts import InsertResult
from torchrec_kvemb.contracts import stable_argsort as _stable_argsort
from torchrec_kvemb.ops.hashing import index_bucket
from torchrec_kvemb.ops.probe import probe_rows


def insert_torch(
    keys: torch.Tensor,
    scores: torch.Tensor,
    ids: torch.Tensor,
    values: torch.Tensor,
    accumulate: bool,
    keep_existing: bool,
) -> InsertResult:
    """Find-or-insert unique ``ids`` with per-id score ``values``; updates in place."""
    num_buckets, ways = keys.shape
    device = ids.device
    flat_scores = scores.view(-1)
    buckets = index_bucket(ids, num_buckets)
    slots = probe_rows(keys, ids, buckets)
    hit = slots >= 0
    hit_slots = slots[hit]
    if accumulate:
        flat_scores.index_add_(0, hit_slots, values[hit])
    else:
        flat_scores.index_copy_(0, hit_slots, values[hit])

    empty = torch.empty(0, dtype=torch.int64, device=device)
    miss_src = (~hit).nonzero().squeeze(1)
    inserted = torch.zeros_like(hit)
    if miss_src.numel() == 0:
        return InsertResult(slots, hit, inserted, empty, empty)

    # New ids grouped by bucket, ranked within it by (score desc, id asc).
    miss_values = values[miss_src]
    order = torch.sort(ids[miss_src]).indices
    if bool(miss_values.min() != miss_values.max()):
        order = order[_stable_argsort(miss_values[order], descending=True)]
    order = order[_stable_argsort(buckets[miss_src[order]])]
    new_src = miss_src[order]
    touched, counts = torch.unique_consecutive(buckets[new_src], return_counts=True)
    occupied = keys.index_select(0, touched) >= 0
    fits = counts <= (~occupied).sum(dim=1)

    # Buckets with room for all their new ids evict nothing: the new ids take
    # the empty ways in ascending order, in rank order (the general rule's outcome).
    free = ~occupied & fits.unsqueeze(1)
    take = free & (torch.cumsum(free.to(torch.int64), dim=1) <= counts.unsqueeze(1))
    take_row, take_way = take.nonzero(as_tuple=True)
    fit_src = new_src[torch.repeat_interleave(fits, counts)]
    fit_slots = touched[take_row] * ways + take_way
    _write(keys, scores, ids, values, fit_src, fit_slots, slots, inserted)
    if bool(fits.all()):
        return InsertResult(slots, hit, inserted, empty, empty)

    over_src = new_src[torch.repeat_interleave(~fits, counts)]
    over_counts = counts[~fits]
    if int(over_counts.max()) <= _DENSE_MAX_NEW:
        won_src, won_slots, evicted_ids, evicted_slots = _rank_and_evict_dense(
            keys,
            scores,
            ids,
            values,
            touched[~fits],
            over_counts,
            over_src,
            hit_slots,
            keep_existing,
        )
    else:
        won_src, won_slots, evicted_ids, evicted_slots = _rank_and_evict(
            keys, scores, ids, values, buckets, over_src, hit_slots, keep_existing
        )
    _write(keys, scores, ids, values, won_src, won_slots, slots, inserted)
    return InsertResult(slots, hit, inserted, evicted_ids, evicted_slots)


def _write(keys, scores, ids, values, src, new_slots, slots, inserted) -> None:
    keys.view(-1).index_copy_(0, new_slots, ids[src])
    scores.view(-1).index_copy_(0, new_slots, values[src])
    slots[src] = new_slots
    inserted[src] = True


#: Overflowing buckets with at most this many new ids are ranked by pairwise
#: comparison in one [buckets, C, C] pass (C = ways + new ids); why: five stable
#: sorts over all candidates cost ~8 ms per 6k full buckets, the pass ~2 ms.
_DENSE_MAX_NEW = 32


def _rank_and_evict_dense(
    keys: torch.Tensor,
    scores: torch.Tensor,
    ids: torch.Tensor,
    values: torch.Tensor,
    touched: torch.Tensor,
    counts: torch.Tensor,
    src: torch.Tensor,
    hit_slots: torch.Tensor,
    keep_existing: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The general rule by pairwise ranks, bucket by bucket (``src`` grouped by bucket
    in rank order, ``counts`` new ids per bucket of ``touched``)."""
    ways = keys.shape[1]
    device = ids.device
    t = touched.numel()
    k = int(counts.max())
    starts = torch.cumsum(counts, 0) - counts
    row = torch.repeat_interleave(torch.arange(t, device=device), counts)
    col = torch.arange(src.numel(), device=device) - starts[row]
    new_key = torch.full((t, k), -1, dtype=torch.int64, device=device)
    new_key[row, col] = ids[src]
    new_score = torch.zeros((t, k), dtype=values.dtype, device=device)
    new_score[row, col] = values[src]
    new_valid = new_key >= 0

    stored_key = keys.index_select(0, touched)
    occupied = stored_key >= 0
    grid = touched.unsqueeze(1) * ways + torch.arange(ways, device=device)
    if keep_existing:
        protected = occupied
    else:
        protected = occupied & torch.isin(grid, hit_slots)
    key = torch.cat([stored_key, new_key], dim=1)
    score = torch.cat([scores.index_select(0, touched), new_score], dim=1)
    is_new = torch.cat([torch.zeros_like(occupied), new_valid], dim=1)
    prot = torch.cat([protected, torch.zeros_like(new_valid)], dim=1)
    valid = torch.cat([occupied, new_valid], dim=1)

    # beats[r, a, b]: candidate b ranks above candidate a in bucket r.
    p_a, p_b = prot.unsqueeze(2), prot.unsqueeze(1)
    s_a, s_b = score.unsqueeze(2), score.unsqueeze(1)
    n_a, n_b = is_new.unsqueeze(2), is_new.unsqueeze(1)
    same_p = p_a == p_b
    above = (p_b & ~p_a) | (same_p & (s_b > s_a))
    tie = same_p & (s_b == s_a)
    tiebreak = (n_b & ~n_a) | ((n_a == n_b) & (key.unsqueeze(1) < key.unsqueeze(2)))
    beats = valid.unsqueeze(1) & (above | (tie & tiebreak))
    kept = valid & (beats.sum(dim=2) < ways)

    evicted = occupied & ~kept[:, :ways]
    won = kept[:, ways:]  # a prefix of each bucket's new ids, in rank order
    free = ~occupied | evicted
    free_rank = torch.cumsum(free.to(torch.int64), dim=1) - 1
    take = free & (free_rank < won.sum(dim=1, keepdim=True))
    take_row, take_way = take.nonzero(as_tuple=True)
    won_row, won_col = won.nonzero(as_tuple=True)
    return (
        src[starts[won_row] + won_col],
        touched[take_row] * ways + take_way,
        stored_key[evicted],
        grid[evicted],
    )


def _rank_and_evict(
    keys: torch.Tensor,
    scores: torch.Tensor,
    ids: torch.Tensor,
    values: torch.Tensor,
    buckets: torch.Tensor,
    miss_src: torch.Tensor,
    hit_slots: torch.Tensor,
    keep_existing: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The general rule, for overflowing buckets: (winners, their slots, evicted ids, slots)."""
    ways = keys.shape[1]
    device = ids.device
    touched, touched_pos = torch.unique(buckets[miss_src], return_inverse=True)
    t = touched.numel()
    stored_keys = keys.index_select(0, touched)
    stored_scores = scores.index_select(0, touched)
    occupied = stored_keys >= 0
    stored_pos = torch.arange(t, device=device).unsqueeze(1).expand(t, ways)[occupied]
    stored_slot = (touched.unsqueeze(1) * ways + torch.arange(ways, device=device))[occupied]
    stored_score = stored_scores[occupied]
    if keep_existing:
        stored_protected = torch.ones_like(stored_pos, dtype=torch.uint8)
    else:
        stored_protected = torch.isin(stored_slot, hit_slots).to(torch.uint8)
    n_stored = stored_pos.numel()

    cand_pos = torch.cat([stored_pos, touched_pos])
    cand_score = torch.cat([stored_score, values[miss_src]])
    cand_new = torch.cat(
        [
            torch.zeros(n_stored, dtype=torch.uint8, device=device),
            torch.ones(miss_src.numel(), dtype=torch.uint8, device=device),
        ]
    )
    cand_id = torch.cat([stored_keys[occupied], ids[miss_src]])
    cand_protected = torch.cat([stored_protected, torch.zeros_like(cand_new[n_stored:])])
    # Lexicographic order (bucket, protected desc, score desc, new first, id) by
    # stable sorts, last key first.
    order = _stable_argsort(cand_id)
    order = order[_stable_argsort(cand_new[order], descending=True)]
    order = order[_stable_argsort(cand_score[order], descending=True)]
    order = order[_stable_argsort(cand_protected[order], descending=True)]
    order = order[_stable_argsort(cand_pos[order])]

    sorted_pos = cand_pos[order]
    counts = torch.bincount(sorted_pos, minlength=t)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(sorted_pos.numel(), device=device) - starts[sorted_pos]
    kept = rank < ways
    is_new = cand_new[order].bool()

    lost_stored = order[~kept & ~is_new]
    evicted_ids = cand_id[lost_stored]
    evicted_slots = stored_slot[lost_stored]
    won_new = order[kept & is_new]
    won_pos = cand_pos[won_new]

    free = ~occupied
    if evicted_slots.numel():
        evict_row = torch.searchsorted(touched, evicted_slots // ways)
        free[evict_row, evicted_slots % ways] = True
    free_rank = torch.cumsum(free.to(torch.int64), dim=1) - 1
    wanted = torch.bincount(won_pos, minlength=t)
    take = free & (free_rank < wanted.unsqueeze(1))
    take_row, take_way = take.nonzero(as_tuple=True)
    new_slots = touched[take_row] * ways + take_way
    return miss_src[won_new - n_stored], new_slots, evicted_ids, evicted_slots
