"""The id -> slot work of a group of KV tables, for a whole batch in O(1) launches (Triton).

Twin of the per-table torch path (``KVTable.lookup_train`` / ``lookup_eval``,
table by table; the ranking rule is in ``contracts.py``): the same keys,
scores, slots and counters, bit for bit. No host sync: every buffer has the
batch's size ``n`` (an upper bound of what it holds) and counts stay on the
device.

Training, for ``n`` ids of ``T`` tables:

1. torch: two stable sorts order the ids by (table, id) (with custom scores, a
   sort before them puts each (table, id)'s highest score first). Sorted
   position ``p`` is lane ``p`` of the per-unique arrays; the first position of
   a run of equal (table, id) holds its unique, the others are idle lanes.
2. ``group_find_kernel`` (one lane per sorted position): finds its run's
   bounds (a galloping search over the sorted keys), writes each id's unique,
   probes; a hit updates its score; an id of an admission table that is not
   stored is counted in the admission counter (a counter hit adds its
   sightings) and is admitted once it has been seen ``admission_threshold``
   times. Each unique gets a kind (``KIND_*``) and its sort keys for step 3.
3. torch: two stable sorts order the uniques of each bucket (its hits first,
   then its new candidates ranked by score desc, id asc: the lanes are in id
   order already); ``group_insert_kernel`` (one program per sorted position,
   the first of a bucket's works) ranks the bucket's stored entries against the
   head of its new candidates, evicts the losers, places the winners in the
   freed and empty ways and writes their initial rows and zero state. With
   admission, a launch of the same kernel before it (``COUNTER``, one sort) does
   the same for the admission counter, and removes the admitted ids from it.

The per-table counters (``metrics`` columns ``HITS`` ...) are added by the
kernels themselves. Evaluation: ``group_probe_kernel`` (one lane per id).
Every launch has one program per block of ``n`` (the insert: one per lane):
programs past the batch's uniques or buckets mask everything off.

Tables over lower tiers (``group_lookup_train_tiers_triton``, the ``TIER``
variant of both kernels; ``tiered_lookup.py``): the batch's ids a lower tier
holds are given per table (ascending ids), and each such unique competes as a
stored id that outranks every unprotected entry (``KIND_PROMOTED``: value
INT64_MAX, no admission), then keeps its own score (LFU: the batch's count plus
the tier's score). No row is written: each winner's lane records the entry it
evicted (id, score), so the caller moves the evicted rows out before it writes
the promoted and new rows (the native kernel's ``TierPromotion``, bit for bit).

Why one file of some 700 lines: the three kernels and their host side share the
buffers and codes of one lookup (``KIND_*``, the per-unique arrays, the bucket
order); split apart, a change to one buffer's meaning would span files.
"""

# Triton's convention: constexpr kernel arguments are UPPER_CASE.
# ruff: noqa: N803

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from torchrec_kvemb.contracts import INT64_MAX, METRIC_NAMES, GroupLayout, GroupLookup
from torchrec_kvemb.kernels.hashing import index_bucket, init_values_any
from torchrec_kvemb.kernels.rounding import round_to

# Kinds of a batch's unique ids after the find step.
KIND_NONE = 0  # not an id of the group (or an idle lane)
KIND_HIT = 1  # stored: keeps its row
KIND_NEW = 2  # not stored, competes for a row now
KIND_COUNTED = 3  # waiting for admission, in the counter, not admitted yet
KIND_ADMIT_HIT = 4  # was in the counter, admitted now: competes, leaves the counter
KIND_WAIT_NEW = 5  # waiting, not in the counter: enters it, not admitted
KIND_ADMIT_NEW = 6  # waiting, not in the counter, admitted at once: competes
KIND_PROMOTED = 7  # held by a lower tier (TIER): competes above unprotected entries
PROMOTED = tl.constexpr(KIND_PROMOTED)
#: What a promoted id competes with: it outranks every unprotected entry.
OUTRANKS = tl.constexpr(INT64_MAX)

#: Columns of a group's ``metrics [T, >= 6]`` the lookups add to (``METRIC_NAMES``).
HITS = tl.constexpr(METRIC_NAMES.index("hits"))
MISSES = tl.constexpr(METRIC_NAMES.index("misses"))
INSERTS = tl.constexpr(METRIC_NAMES.index("inserts"))
EVICTIONS = tl.constexpr(METRIC_NAMES.index("evictions"))
REJECTS = tl.constexpr(METRIC_NAMES.index("admission_rejects"))
FAILURES = tl.constexpr(METRIC_NAMES.index("insert_failures"))
#: The insert sort key of a lane that is in no bucket's segment (it sorts last).
NO_SEGMENT = tl.constexpr(INT64_MAX)

#: Uniques per program of the find and probe kernels (why 128: enough random
#: bucket reads in flight per program to hide their latency).
BLOCK_IDS = 128
#: Entries of a bucket's sorted segment an insert program reads: its hits (at
#: most WAYS: they are stored ids) then at least WAYS ranked candidates, which
#: hold every possible winner (winners are a prefix of the ranked candidates).
WINDOW = 32
#: Columns an insert program writes at a time.
MAX_BLOCK_D = 128


@triton.jit
def _run_edge(table_ptr, ids_ptr, p, table, ids, active, n, STEP: tl.constexpr):
    """The farthest sorted position from ``p`` in direction ``STEP`` (+1 or -1) whose
    (table, id) is ``p``'s: runs of equal keys are contiguous, so a galloping search
    (distances 1, 3, 7, ...) then a bisection finds it in O(log run) reads per lane."""
    same = tl.zeros_like(p)  # a distance known to be in the run
    out = tl.zeros_like(p)  # a distance known to be past it (0: none yet)
    jump = tl.zeros_like(p) + 1
    galloping = active
    while tl.max(galloping.to(tl.int32), axis=0) > 0:
        d = same + jump
        q = p + STEP * d
        ok = galloping & (q >= 0) & (q < n)
        hit = ok & (tl.load(table_ptr + q, mask=ok, other=-1) == table)
        hit = hit & (tl.load(ids_ptr + q, mask=ok, other=0) == ids)
        out = tl.where(galloping & ~hit, d, out)
        same = tl.where(hit, d, same)
        jump = tl.where(hit, jump * 2, jump)
        galloping = hit
    bisecting = active & (out - same > 1)
    while tl.max(bisecting.to(tl.int32), axis=0) > 0:
        d = (same + out) // 2
        q = p + STEP * d
        ok = bisecting & (q >= 0) & (q < n)
        hit = ok & (tl.load(table_ptr + q, mask=ok, other=-1) == table)
        hit = hit & (tl.load(ids_ptr + q, mask=ok, other=0) == ids)
        same = tl.where(hit, d, same)
        out = tl.where(bisecting & ~hit, d, out)
        bisecting = bisecting & (out - same > 1)
    return p + STEP * same


@triton.jit
def _lower_bound(values_ptr, lo, hi, x, active):
    """The first position in ``[lo, hi)`` of the ascending ``values`` whose value is
    ``>= x`` (``hi``: none), by bisection, lane by lane."""
    left = lo
    right = tl.where(active, hi, lo)
    searching = left < right
    while tl.max(searching.to(tl.int32), axis=0) > 0:
        mid = left + (right - left) // 2
        below = searching & (tl.load(values_ptr + mid, mask=searching, other=0) < x)
        left = tl.where(below, mid + 1, left)
        right = tl.where(searching & ~below, mid, right)
        searching = left < right
    return left


@triton.jit
def _add_per_table(column_ptr, stride, table, next_table, values, num_tables):
    """``column[table[k] * stride] += values[k]`` over a block's lanes (tables
    ``>= num_tables``: none), one atomic add per run of equal ``table`` in the block:
    a run's end adds the prefix sum there, and takes it off the next run's table.
    why atomics: integer sums are exact in any order, so the counters stay
    deterministic without a pass of their own."""
    block: tl.constexpr = values.shape[0]
    total = tl.cumsum(values, axis=0)
    last = tl.arange(0, block) == block - 1
    run_end = last | (next_table != table)
    adds = run_end & (total != 0)  # adding zero changes nothing
    tl.atomic_add(
        column_ptr + table * stride, total, mask=adds & (table < num_tables), sem="relaxed"
    )
    tl.atomic_add(
        column_ptr + next_table * stride,
        -total,
        mask=adds & ~last & (next_table < num_tables),
        sem="relaxed",
    )


@triton.jit
def group_find_kernel(
    keys_ptr,
    scores_ptr,
    counter_keys_ptr,
    counter_scores_ptr,
    counts_ptr,
    sorted_ids_ptr,
    sorted_table_ptr,
    order_ptr,
    sorted_custom_ptr,
    bucket_offset_ptr,
    num_buckets_ptr,
    policy_ptr,
    step_ptr,
    use_custom_ptr,
    threshold_ptr,
    counter_offset_ptr,
    counter_buckets_ptr,
    unique_index_ptr,
    u_slot_ptr,
    u_value_ptr,
    u_kind_ptr,
    u_key_ptr,
    u_count_ptr,
    u_counter_key_ptr,
    u_counter_slot_ptr,
    promote_ids_ptr,
    promote_scores_ptr,
    promote_offsets_ptr,
    u_final_ptr,
    metrics_ptr,
    metrics_stride,
    n,
    num_tables,
    HAS_CUSTOM: tl.constexpr,
    HAS_ADMISSION: tl.constexpr,
    TIER: tl.constexpr,
    WAYS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    p = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = p < n
    # Ids of no table of the group (table T) sort last; their lanes stay idle.
    table = tl.load(sorted_table_ptr + p, mask=in_range, other=num_tables)
    ids = tl.load(sorted_ids_ptr + p, mask=in_range, other=0)
    mine = in_range & (table < num_tables)
    first = _run_edge(sorted_table_ptr, sorted_ids_ptr, p, table, ids, mine, n, -1)
    valid = mine & (first == p)  # the lane of a unique
    count = _run_edge(sorted_table_ptr, sorted_ids_ptr, p, table, ids, valid, n, 1) - p + 1
    tl.store(
        unique_index_ptr + tl.load(order_ptr + p, mask=in_range, other=0), first, mask=in_range
    )
    t = tl.where(valid, table, 0)
    policy = tl.load(policy_ptr + t)
    step = tl.load(step_ptr + t)
    bucket = tl.load(bucket_offset_ptr + t) + index_bucket(ids, tl.load(num_buckets_ptr + t))
    ways = tl.arange(0, WAYS)
    row = bucket * WAYS
    stored = tl.load(keys_ptr + row[:, None] + ways[None, :], mask=valid[:, None], other=-1)
    way = tl.min(tl.where(stored == ids[:, None], ways[None, :], WAYS), axis=1)
    hit = valid & (way < WAYS)
    slot = tl.where(hit, row + way, -1)

    # The score value the id brings: LFU its count, CUSTOM_SCORE its custom score
    # (when given; the run's first is its highest), else the table's clock.
    value = step
    if HAS_CUSTOM:
        use = tl.load(use_custom_ptr + t)
        custom = tl.load(sorted_custom_ptr + p, mask=valid, other=0)
        value = tl.where((policy == 2) & (use != 0), custom, value)
    value = tl.where(policy == 1, count, value)
    old = tl.load(scores_ptr + slot, mask=hit, other=0)
    tl.store(scores_ptr + slot, tl.where(policy == 1, old + value, value), mask=hit)
    kind = tl.where(hit, 1, tl.where(valid, 2, 0))
    promoted = valid & (p < 0)  # no lane (without TIER)
    if TIER:
        # Held by a lower tier (none of its ids is in memory): the table's promoted
        # ids are ascending in ``[offsets[t], offsets[t + 1])``.
        lo = tl.load(promote_offsets_ptr + t, mask=valid, other=0)
        hi = tl.load(promote_offsets_ptr + t + 1, mask=valid, other=0)
        at = _lower_bound(promote_ids_ptr, lo, hi, ids, valid & ~hit)
        held = valid & ~hit & (at < hi)
        promoted = held & (tl.load(promote_ids_ptr + at, mask=held, other=-1) == ids)
        tier_score = tl.load(promote_scores_ptr + at, mask=promoted, other=0)
        # The score it keeps: LFU adds the batch's count to the tier's; the others, the
        # batch's value. It competes with INT64_MAX.
        final = tl.where(promoted & (policy == 1), value + tier_score, value)
        tl.store(u_final_ptr + p, final, mask=in_range)
        value = tl.where(promoted, OUTRANKS, value)
        kind = tl.where(promoted, PROMOTED, kind)

    if HAS_ADMISSION:
        threshold = tl.load(threshold_ptr + t)
        waiting = valid & ~hit & ~promoted & (threshold > 1)
        counter_buckets = tl.maximum(tl.load(counter_buckets_ptr + t), 1)
        c_bucket = tl.load(counter_offset_ptr + t) + index_bucket(ids, counter_buckets)
        c_row = c_bucket * WAYS
        c_stored = tl.load(
            counter_keys_ptr + c_row[:, None] + ways[None, :], mask=waiting[:, None], other=-1
        )
        c_way = tl.min(tl.where(c_stored == ids[:, None], ways[None, :], WAYS), axis=1)
        c_hit = waiting & (c_way < WAYS)
        c_slot = tl.where(c_hit, c_row + c_way, -1)
        seen = count + tl.load(counts_ptr + c_slot, mask=c_hit, other=0)
        tl.store(counts_ptr + c_slot, seen, mask=c_hit)
        tl.store(counter_scores_ptr + c_slot, step, mask=c_hit)
        admitted = seen >= threshold
        waiting_kind = tl.where(c_hit, tl.where(admitted, 4, 3), tl.where(admitted, 6, 5))
        kind = tl.where(waiting, waiting_kind, kind)
        # The counter's segments: its bucket, its hits (kinds 3, 4) first.
        c_key = c_bucket * 2 + tl.where(c_hit, 0, 1)
        tl.store(u_counter_key_ptr + p, tl.where(waiting, c_key, NO_SEGMENT), mask=in_range)
        tl.store(u_counter_slot_ptr + p, c_slot, mask=in_range)
        tl.store(u_count_ptr + p, count, mask=in_range)

    # The index's segments: the bucket of every hit and candidate, its hits first.
    member = (kind == 1) | (kind == 2) | (kind == 4) | (kind == 6) | (kind == PROMOTED)
    key = bucket * 2 + tl.where(kind == 1, 0, 1)
    tl.store(u_key_ptr + p, tl.where(member, key, NO_SEGMENT), mask=in_range)
    tl.store(u_slot_ptr + p, slot, mask=in_range)
    tl.store(u_value_ptr + p, value, mask=in_range)
    tl.store(u_kind_ptr + p, kind.to(tl.int64), mask=in_range)

    # Counters: hits and misses per id; rejects; every candidate counts as an insert
    # failure until its insert program takes the winners back.
    next_table = tl.load(sorted_table_ptr + p + 1, mask=p + 1 < n, other=num_tables)
    zero = tl.zeros_like(count)
    hits = tl.where(hit, count, zero)
    misses = tl.where(valid & ~hit, count, zero)
    rejected = ((kind == 3) | (kind == 5)).to(tl.int64)
    candidate = (member & (kind != 1)).to(tl.int64)
    stride = metrics_stride
    _add_per_table(metrics_ptr + HITS, stride, table, next_table, hits, num_tables)
    _add_per_table(metrics_ptr + MISSES, stride, table, next_table, misses, num_tables)
    _add_per_table(metrics_ptr + REJECTS, stride, table, next_table, rejected, num_tables)
    _add_per_table(metrics_ptr + FAILURES, stride, table, next_table, candidate, num_tables)


@triton.jit
def group_insert_kernel(
    keys_ptr,
    scores_ptr,
    counts_ptr,
    weights_ptr,
    state_ptr,
    seg_key_ptr,
    seg_order_ptr,
    u_ids_ptr,
    u_value_ptr,
    u_kind_ptr,
    u_table_ptr,
    u_count_ptr,
    u_counter_slot_ptr,
    u_slot_ptr,
    u_final_ptr,
    ev_id_ptr,
    ev_score_ptr,
    metrics_ptr,
    metrics_stride,
    policy_ptr,
    seed_mix_ptr,
    init_normal_ptr,
    init_a_ptr,
    init_b_ptr,
    init_col_ptr,
    step_ptr,
    n,
    dim,
    state_dim,
    COUNTER: tl.constexpr,
    TIER: tl.constexpr,
    WAYS: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # Sorted position ``start``'s program works when it is the first of its bucket's
    # segment (``seg_key``: bucket * 2 + 1 for candidates, + 0 for hits).
    start = tl.program_id(0).to(tl.int64)
    key = tl.load(seg_key_ptr + start)
    prev = tl.load(seg_key_ptr + start - 1, mask=start > 0, other=-1)
    live = (key != NO_SEGMENT) & ((prev >> 1) != (key >> 1))
    if live:
        head = tl.load(seg_order_ptr + start)
        bucket = key >> 1
        table = tl.load(u_table_ptr + head)
        row = bucket * WAYS

        # Candidates c in [0, 2 * WINDOW): c < WAYS is stored way c; WAYS <= c < WAYS +
        # WINDOW is entry c - WAYS of the bucket's sorted segment; the rest is padding.
        c = tl.arange(0, 2 * WINDOW)
        # why a vector: the interpreter gives a scalar comparison & a vector a non-bool mask.
        live_c = (tl.zeros([2 * WINDOW], dtype=tl.int64) + key) != NO_SEGMENT
        is_stored = c < WAYS
        j = c - WAYS
        pos = start + tl.where((j >= 0) & (j < WINDOW), j, 0)
        in_window = live_c & (j >= 0) & (j < WINDOW) & (pos < n)
        seg_key = tl.load(seg_key_ptr + pos, mask=in_window, other=NO_SEGMENT)
        in_seg = in_window & (seg_key != NO_SEGMENT) & ((seg_key >> 1) == bucket)
        u = tl.load(seg_order_ptr + pos, mask=in_seg, other=0)
        kind = tl.load(u_kind_ptr + u, mask=in_seg, other=0)
        if COUNTER:
            is_hit = in_seg & ((kind == 3) | (kind == 4))
            is_new = in_seg & ((kind == 5) | (kind == 6))
        else:
            is_hit = in_seg & (kind == 1)
            is_new = in_seg & ((kind == 2) | (kind == 4) | (kind == 6) | (kind == PROMOTED))
        entry_id = tl.load(u_ids_ptr + u, mask=in_seg, other=-1)
        if COUNTER:  # the counter ranks by the table's clock (LRU)
            entry_value = tl.zeros([2 * WINDOW], dtype=tl.int64) + tl.load(step_ptr + table)
        else:
            entry_value = tl.load(u_value_ptr + u, mask=in_seg, other=0)
        # A segment with nothing to place (only hits; with the counter, no hit leaving
        # it either) changes nothing: skip the ranking, the bulk of a program's work.
        work = tl.sum(is_new.to(tl.int32), axis=0)
        if COUNTER:
            work += tl.sum((is_hit & (kind == 4)).to(tl.int32), axis=0)
        if work > 0:
            way = tl.where(is_stored, c, 0)
            stored_key = tl.load(keys_ptr + row + way, mask=is_stored & live_c, other=-1)
            stored_score = tl.load(scores_ptr + row + way, mask=is_stored & live_c, other=0)
            occupied = is_stored & (stored_key >= 0)

            # A stored entry hit by this batch is protected (with NONE, every stored one).
            hit_here = (stored_key[:, None] == entry_id[None, :]) & is_hit[None, :]
            protected = occupied & (tl.max(hit_here.to(tl.int32), axis=1) > 0)
            if not COUNTER:
                policy = tl.zeros([2 * WINDOW], dtype=tl.int64) + tl.load(policy_ptr + table)
                protected = protected | (occupied & (policy == 3))

            cand_key = tl.where(is_stored, stored_key, entry_id)
            cand_score = tl.where(is_stored, stored_score, entry_value)
            valid = occupied | is_new
            # beats[a, b]: candidate b ranks above candidate a (protected first, score
            # desc, new before stored, id asc); ids are unique among the candidates.
            s_a = cand_score[:, None]
            s_b = cand_score[None, :]
            n_a = is_new[:, None]
            n_b = is_new[None, :]
            p_a = protected[:, None]
            p_b = protected[None, :]
            same_p = p_a == p_b
            above = (p_b & ~p_a) | (same_p & (s_b > s_a))
            tie = same_p & (s_b == s_a)
            tiebreak = (n_b & ~n_a) | ((n_a == n_b) & (cand_key[None, :] < cand_key[:, None]))
            beats = valid[None, :] & (above | (tie & tiebreak))
            kept = valid & (tl.sum(beats.to(tl.int32), axis=1) < WAYS)
            evicted = occupied & ~kept
            won = is_new & kept

            # Free ways (empty or just evicted) go to the winners in rank (= segment)
            # order, lowest way first: winner r takes the free way whose free rank is r.
            free = is_stored & (~occupied | evicted)
            free_rank = tl.cumsum(free.to(tl.int32), axis=0) - 1
            won_rank = tl.cumsum(won.to(tl.int32), axis=0) - 1
            takes = free[None, :] & (free_rank[None, :] == won_rank[:, None])
            target = tl.min(tl.where(takes, c[None, :], 2 * WINDOW), axis=1)
            slot = row + tl.where(won, target, 0)

            if COUNTER:
                # Sightings: the batch's (a new entry starts at 0); admitted ids leave at once.
                sightings = tl.load(u_count_ptr + u, mask=won, other=0)
                admitted = kind == 6
                tl.store(keys_ptr + slot, tl.where(admitted, -1, cand_key), mask=won)
                tl.store(scores_ptr + slot, tl.where(admitted, 0, cand_score), mask=won)
                tl.store(counts_ptr + slot, tl.where(admitted, 0, sightings), mask=won)
                leaving = is_hit & (kind == 4)
                c_slot = tl.load(u_counter_slot_ptr + u, mask=leaving, other=0)
                tl.store(keys_ptr + c_slot, tl.full([2 * WINDOW], -1, tl.int64), mask=leaving)
                tl.store(scores_ptr + c_slot, tl.zeros([2 * WINDOW], dtype=tl.int64), mask=leaving)
                tl.store(counts_ptr + c_slot, tl.zeros([2 * WINDOW], dtype=tl.int64), mask=leaving)
            else:
                tl.store(keys_ptr + slot, cand_key, mask=won)
                promoted = won & (kind == PROMOTED)
                if TIER:  # a promoted id keeps its own score (it ranked by INT64_MAX)
                    final = tl.load(u_final_ptr + u, mask=promoted, other=0)
                    cand_score = tl.where(promoted, final, cand_score)
                    # The entry each winner's way held, if it was evicted: the caller
                    # moves its row out before the winner's row is written.
                    took = takes & evicted[None, :]
                    ev_key = tl.max(tl.where(took, stored_key[None, :], -1), axis=1)
                    ev_score = tl.sum(tl.where(took, stored_score[None, :], 0), axis=1)
                    tl.store(ev_id_ptr + u, ev_key, mask=won)
                    tl.store(ev_score_ptr + u, ev_score, mask=won)
                tl.store(scores_ptr + slot, cand_score, mask=won)
                tl.store(u_slot_ptr + u, slot, mask=won)
                # Counters: the winners were counted as insert failures by the find step;
                # a promoted id is no insert (it was stored).
                placed = tl.sum(won.to(tl.int64), axis=0)
                inserts = placed - tl.sum(promoted.to(tl.int64), axis=0)
                evictions = tl.sum(evicted.to(tl.int64), axis=0)
                counters = metrics_ptr + table * metrics_stride
                tl.atomic_add(counters + INSERTS, inserts, mask=inserts > 0, sem="relaxed")
                tl.atomic_add(counters + FAILURES, -placed, mask=placed > 0, sem="relaxed")
                tl.atomic_add(counters + EVICTIONS, evictions, mask=evictions > 0, sem="relaxed")
                if not TIER:  # (TIER: the caller writes them, after the evicted rows left)
                    # New rows: initial values (a pure function of id, seed, column), zero state.
                    per_row = tl.zeros([2 * WINDOW], dtype=tl.int64) + table
                    seed = tl.load(seed_mix_ptr + per_row)
                    normal = tl.load(init_normal_ptr + per_row)
                    a = tl.load(init_a_ptr + per_row)
                    b = tl.load(init_b_ptr + per_row)
                    first_col = tl.load(init_col_ptr + per_row)
                    for d0 in range(0, dim, BLOCK_D):
                        cols = d0 + tl.arange(0, BLOCK_D)
                        mask = won[:, None] & (cols < dim)[None, :]
                        rows = init_values_any(cand_key, cols, seed, normal, a, b, first_col)
                        rows = round_to(rows, weights_ptr.dtype.element_ty)
                        tl.store(weights_ptr + slot[:, None] * dim + cols[None, :], rows, mask=mask)
                    for d0 in range(0, state_dim, BLOCK_D):
                        cols = d0 + tl.arange(0, BLOCK_D)
                        mask = won[:, None] & (cols < state_dim)[None, :]
                        zero = tl.zeros([2 * WINDOW, BLOCK_D], dtype=tl.float32)
                        tl.store(
                            state_ptr + slot[:, None] * state_dim + cols[None, :], zero, mask=mask
                        )


@triton.jit
def group_probe_kernel(
    keys_ptr,
    ids_ptr,
    table_idx_ptr,
    bucket_offset_ptr,
    num_buckets_ptr,
    slots_ptr,
    metrics_ptr,
    metrics_stride,
    n,
    num_tables,
    WAYS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    table = tl.load(table_idx_ptr + i, mask=i < n, other=-1)
    valid = (i < n) & (table >= 0)
    t = tl.where(valid, table, 0)
    ids = tl.load(ids_ptr + i, mask=valid, other=0)
    bucket = tl.load(bucket_offset_ptr + t) + index_bucket(ids, tl.load(num_buckets_ptr + t))
    ways = tl.arange(0, WAYS)
    row = bucket * WAYS
    stored = tl.load(keys_ptr + row[:, None] + ways[None, :], mask=valid[:, None], other=-1)
    way = tl.min(tl.where(stored == ids[:, None], ways[None, :], WAYS), axis=1)
    hit = valid & (way < WAYS)
    tl.store(slots_ptr + i, tl.where(hit, row + way, -1), mask=i < n)

    # Counters: a hit or a miss per id of the group (ids of table -1: none).
    run = tl.where(valid, table, num_tables)
    following = tl.load(table_idx_ptr + i + 1, mask=i + 1 < n, other=-1)
    next_run = tl.where(following >= 0, following, num_tables)
    hits = hit.to(tl.int64)
    misses = (valid & ~hit).to(tl.int64)
    _add_per_table(metrics_ptr + HITS, metrics_stride, run, next_run, hits, num_tables)
    _add_per_table(metrics_ptr + MISSES, metrics_stride, run, next_run, misses, num_tables)


# ----------------------------------------------------------------- launchers
class TierPromotions(NamedTuple):
    """The batch's ids the tables' lower tiers hold (none in memory): ``ids [P]`` and
    their in-memory ``scores [P]``, table by table (table ``t``'s at
    ``[offsets[t], offsets[t + 1])``, ascending ids), on the batch's device."""

    ids: torch.Tensor
    scores: torch.Tensor
    offsets: torch.Tensor


class TierLanes(NamedTuple):
    """What ``group_lookup_train_tiers_triton`` did, lane by lane (lane ``p``: sorted
    position ``p``, in (table, id) order; a unique's lane is the first of its run,
    the others and the ids of no table of the group are idle: kind 0, slot -1).

    ``lookup`` is the ``GroupLookup`` (lanes as uniques); ``ids`` the lanes' ids;
    ``kind`` the ``KIND_*`` of each unique's lane; ``score`` the score a lane's id
    keeps or would keep (read for those without a row); ``evicted_ids`` /
    ``evicted_scores``: the entry a winner's way held before, evicted now (-1 /
    unread where none), the winner's slot being the evicted row's."""

    lookup: GroupLookup
    ids: torch.Tensor
    kind: torch.Tensor
    score: torch.Tensor
    evicted_ids: torch.Tensor
    evicted_scores: torch.Tensor


def group_lookup_train_triton(
    layout: GroupLayout,
    keys: torch.Tensor,
    scores: torch.Tensor,
    weights: torch.Tensor,
    state: torch.Tensor,
    counter_keys: torch.Tensor,
    counter_scores: torch.Tensor,
    counts: torch.Tensor,
    ids: torch.Tensor,
    table_idx: torch.Tensor,
    step: torch.Tensor,
    metrics: torch.Tensor,
    custom_scores: torch.Tensor | None = None,
    use_custom: torch.Tensor | None = None,
) -> GroupLookup:
    """Slots of a group's training batch, inserting new ids; updates the arrays and
    adds the per-table counters to ``metrics [T, >= 6]`` (rows contiguous: hits,
    misses, inserts, evictions, admission rejects, insert failures), all in place,
    with no host sync. ``step [T]``: each table's clock for this batch (already
    advanced). The uniques it hands the backward are lanes: one per id in (table,
    id) order, slot -1 where a lane holds no unique."""
    arrays = (keys, scores, weights, state, counter_keys, counter_scores, counts)
    return _lookup_train(layout, arrays, ids, table_idx, step, metrics, custom_scores,
                         use_custom, None).lookup  # fmt: skip


def group_lookup_train_tiers_triton(
    layout: GroupLayout,
    arrays: tuple[torch.Tensor, ...],
    ids: torch.Tensor,
    table_idx: torch.Tensor,
    step: torch.Tensor,
    metrics: torch.Tensor,
    custom_scores: torch.Tensor | None,
    use_custom: torch.Tensor | None,
    tier: TierPromotions,
) -> TierLanes:
    """``group_lookup_train_triton`` of tables over lower tiers (``arrays``: the
    group's ``keys, scores, weights, state, counter_keys, counter_scores, counts``):
    the ids of ``tier`` compete as promoted ones (module docstring); no row is
    written. No host sync."""
    return _lookup_train(
        layout, arrays, ids, table_idx, step, metrics, custom_scores, use_custom, tier
    )


def _lookup_train(
    layout: GroupLayout,
    arrays: tuple[torch.Tensor, ...],
    ids: torch.Tensor,
    table_idx: torch.Tensor,
    step: torch.Tensor,
    metrics: torch.Tensor,
    custom_scores: torch.Tensor | None,
    use_custom: torch.Tensor | None,
    tier: TierPromotions | None,
) -> TierLanes:
    keys, scores, weights, state, counter_keys, counter_scores, counts = arrays
    device = ids.device
    n = ids.numel()
    T = layout.num_tables
    i64 = dict(dtype=torch.int64, device=device)
    if n == 0:  # four tensors: a registered op's outputs may not share storage
        empty = [torch.empty(0, **i64) for _ in range(9)]
        return TierLanes(GroupLookup(*empty[:4]), *empty[4:])
    ids = ids.contiguous()
    dim = weights.shape[1]
    state_dim = state.shape[1]

    # 1. Order by (table, id); ids of no table of the group (-1 -> T) sort last.
    table_key = table_idx.remainder(T + 1)
    if custom_scores is None:
        sorted_ids, order = torch.sort(ids, stable=True)
    else:
        custom_scores = custom_scores.to(torch.int64)
        # why a sort first: a run's first position then holds its highest score.
        by_score = torch.sort(custom_scores, stable=True, descending=True).indices
        sorted_ids, order = torch.sort(ids.index_select(0, by_score), stable=True)
        order = by_score.index_select(0, order)
    sorted_table, by_table = torch.sort(table_key.index_select(0, order), stable=True)
    order = order.index_select(0, by_table)
    sorted_ids = sorted_ids.index_select(0, by_table)
    sorted_custom = sorted_ids
    if custom_scores is not None:
        sorted_custom = custom_scores.index_select(0, order)

    # 2. Find; admission counting. One buffer holds the per-lane arrays that are not
    # returned (the returned ones get their own: an op's outputs share no storage).
    admission = layout.has_admission
    unique_index, u_slot = torch.empty(n, **i64), torch.empty(n, **i64)
    lanes = torch.empty(6 if admission else 3, n, **i64).unbind(0)
    u_value, u_kind, u_key = lanes[:3]
    u_count, u_counter_key, u_counter_slot = lanes[3:] if admission else (u_key,) * 3
    # Tier lanes (unused pointers without a tier: any int64 tensor of the batch).
    u_final = ev_id = ev_score = u_key
    promote = (sorted_ids, sorted_ids, layout.bucket_offset)
    if tier is not None:
        u_final, ev_score = torch.empty(n, **i64), torch.empty(n, **i64)
        ev_id = torch.full((n,), -1, **i64)
        if tier.ids.numel():  # why: no pointer to an empty tensor
            promote = (tier.ids, tier.scores, tier.offsets)
        else:
            promote = (sorted_ids, sorted_ids, tier.offsets)
    group_find_kernel[(triton.cdiv(n, BLOCK_IDS),)](
        keys,
        scores,
        counter_keys,
        counter_scores,
        counts,
        sorted_ids,
        sorted_table,
        order,
        sorted_custom,
        layout.bucket_offset,
        layout.num_buckets,
        layout.policy,
        step,
        use_custom if use_custom is not None else layout.policy,
        layout.admission_threshold,
        layout.counter_bucket_offset,
        layout.counter_num_buckets,
        unique_index,
        u_slot,
        u_value,
        u_kind,
        u_key,
        u_count,
        u_counter_key,
        u_counter_slot,
        *promote,
        u_final,
        metrics,
        metrics.stride(0),
        n,
        T,
        HAS_CUSTOM=custom_scores is not None,
        HAS_ADMISSION=admission,
        TIER=tier is not None,
        WAYS=keys.shape[1],
        BLOCK=BLOCK_IDS,
    )
    block_d = min(triton.next_power_of_2(max(dim, state_dim, 1)), MAX_BLOCK_D)

    def insert(counter: bool) -> None:
        """Order the lanes by bucket segment (hits first, then candidates by score
        desc; lanes are in id order already) and launch the insert."""
        if counter:  # one clock per bucket: candidates ranked by id
            seg_key, seg_order = torch.sort(u_counter_key, stable=True)
        else:
            by_value = torch.sort(u_value, stable=True, descending=True).indices
            seg_key, by_key = torch.sort(u_key.index_select(0, by_value), stable=True)
            seg_order = by_value.index_select(0, by_key)
        target = (counter_keys, counter_scores, counts) if counter else (keys, scores, counts)
        group_insert_kernel[(n,)](
            *target,
            weights,
            state,
            seg_key,
            seg_order,
            sorted_ids,
            u_value,
            u_kind,
            sorted_table,
            u_count,
            u_counter_slot,
            u_slot,
            u_final,
            ev_id,
            ev_score,
            metrics,
            metrics.stride(0),
            layout.policy,
            layout.seed_mix,
            layout.init_normal,
            layout.init_a,
            layout.init_b,
            layout.init_col,
            step,
            n,
            dim,
            state_dim,
            COUNTER=counter,
            TIER=tier is not None and not counter,
            WAYS=keys.shape[1],
            WINDOW=WINDOW,
            BLOCK_D=block_d,
        )

    if admission:
        insert(counter=True)
    insert(counter=False)
    slots = u_slot.index_select(0, unique_index)
    lookup = GroupLookup(slots, unique_index, u_slot, sorted_table)
    return TierLanes(lookup, sorted_ids, u_kind, u_final, ev_id, ev_score)


def group_lookup_eval_triton(
    layout: GroupLayout,
    keys: torch.Tensor,
    ids: torch.Tensor,
    table_idx: torch.Tensor,
    metrics: torch.Tensor,
) -> torch.Tensor:
    """Global slots of a group's evaluation batch (-1: not stored); adds hits and
    misses to ``metrics`` (rows contiguous). One launch, no host sync; reads only
    the layout's bucket ranges."""
    n = ids.numel()
    slots = torch.empty(n, dtype=torch.int64, device=ids.device)
    if n == 0:
        return slots
    group_probe_kernel[(triton.cdiv(n, BLOCK_IDS),)](
        keys,
        ids.contiguous(),
        table_idx.contiguous(),
        layout.bucket_offset,
        layout.num_buckets,
        slots,
        metrics,
        metrics.stride(0),
        n,
        layout.num_buckets.numel(),
        WAYS=keys.shape[1],
        BLOCK=BLOCK_IDS,
    )
    return slots
