"""The id -> slot work of a group of KV tables, for a whole batch in O(1) launches (Triton).

Twin of the per-table torch path (``KVTable.lookup_train`` / ``lookup_eval``,
table by table; the ranking rule is in ``contracts.py``): the same keys,
scores, slots and counters, bit for bit. No host sync: every buffer has the
batch's size ``n`` (an upper bound of what it holds) and counts stay on the
device.

Training, for ``n`` ids of ``T`` tables:

1. torch: de-duplicate (table, id) by two stable sorts; ``u_start[k]`` is the
   first sorted position of unique ``k`` (``n`` past the last one).
2. ``group_find_kernel`` (one lane per unique): probe; a hit updates its score;
   an id of an admission table that is not stored is counted in the admission
   counter (a counter hit adds its sightings) and is admitted once it has been
   seen ``admission_threshold`` times. Each unique gets a kind (``KIND_*``).
3. torch: sort the uniques of each bucket (its hits first, then its new
   candidates ranked by score desc, id asc); ``group_insert_kernel`` (one
   program per bucket) ranks the bucket's stored entries against the head of
   its new candidates, evicts the losers, places the winners in the freed and
   empty ways and writes their initial rows and zero state. With admission, a
   second launch of the same kernel (``COUNTER``) does the same for the
   admission counter, and removes the admitted ids from it.

Evaluation: ``group_probe_kernel`` (one lane per id). Every launch has one
program per block of ``n``: programs past the batch's uniques or buckets mask
everything off.

Why one file of some 550 lines: the three kernels and their host side share the
buffers and codes of one lookup (``KIND_*``, the per-unique arrays, the bucket
order); split apart, a change to one buffer's meaning would span files.
"""

# Triton's convention: constexpr kernel arguments are UPPER_CASE.
# ruff: noqa: N803

from __future__ import annotations

import torch
import triton
import triton.language as tl

from torchrec_kvemb.contracts import INT64_MAX, GroupLayout, GroupLookup, stable_argsort
from torchrec_kvemb.kernels.hashing import index_bucket, init_values_any
from torchrec_kvemb.kernels.rounding import round_to

# Kinds of a batch's unique ids after the find step.
KIND_NONE = 0  # not an id of the group (or a padding lane)
KIND_HIT = 1  # stored: keeps its row
KIND_NEW = 2  # not stored, competes for a row now
KIND_COUNTED = 3  # waiting for admission, in the counter, not admitted yet
KIND_ADMIT_HIT = 4  # was in the counter, admitted now: competes, leaves the counter
KIND_WAIT_NEW = 5  # waiting, not in the counter: enters it, not admitted
KIND_ADMIT_NEW = 6  # waiting, not in the counter, admitted at once: competes

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
def group_find_kernel(
    keys_ptr,
    scores_ptr,
    counter_keys_ptr,
    counter_scores_ptr,
    counts_ptr,
    u_ids_ptr,
    u_table_ptr,
    u_start_ptr,
    u_custom_ptr,
    bucket_offset_ptr,
    num_buckets_ptr,
    policy_ptr,
    step_ptr,
    use_custom_ptr,
    threshold_ptr,
    counter_offset_ptr,
    counter_buckets_ptr,
    u_slot_ptr,
    u_value_ptr,
    u_bucket_ptr,
    u_kind_ptr,
    u_counter_bucket_ptr,
    u_counter_slot_ptr,
    n,
    num_tables,
    HAS_CUSTOM: tl.constexpr,
    HAS_ADMISSION: tl.constexpr,
    WAYS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    k = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    in_range = k < n
    start = tl.load(u_start_ptr + k, mask=in_range, other=n)
    end = tl.load(u_start_ptr + k + 1, mask=in_range, other=n)
    table = tl.load(u_table_ptr + k, mask=in_range, other=num_tables)
    valid = in_range & (start < n) & (table < num_tables)
    t = tl.where(valid, table, 0)
    ids = tl.load(u_ids_ptr + k, mask=valid, other=0)
    count = end - start
    policy = tl.load(policy_ptr + t)
    step = tl.load(step_ptr + t)
    bucket = tl.load(bucket_offset_ptr + t) + index_bucket(ids, tl.load(num_buckets_ptr + t))
    ways = tl.arange(0, WAYS)
    row = bucket * WAYS
    stored = tl.load(keys_ptr + row[:, None] + ways[None, :], mask=valid[:, None], other=-1)
    first = tl.min(tl.where(stored == ids[:, None], ways[None, :], WAYS), axis=1)
    hit = valid & (first < WAYS)
    slot = tl.where(hit, row + first, -1)

    # The score value the id brings: LFU its count, CUSTOM_SCORE its custom score
    # (when given), else the table's clock.
    value = step
    if HAS_CUSTOM:
        use = tl.load(use_custom_ptr + t)
        custom = tl.load(u_custom_ptr + k, mask=valid, other=0)
        value = tl.where((policy == 2) & (use != 0), custom, value)
    value = tl.where(policy == 1, count, value)
    old = tl.load(scores_ptr + slot, mask=hit, other=0)
    tl.store(scores_ptr + slot, tl.where(policy == 1, old + value, value), mask=hit)
    kind = tl.where(hit, 1, tl.where(valid, 2, 0))

    if HAS_ADMISSION:
        threshold = tl.load(threshold_ptr + t)
        waiting = valid & ~hit & (threshold > 1)
        counter_buckets = tl.maximum(tl.load(counter_buckets_ptr + t), 1)
        c_bucket = tl.load(counter_offset_ptr + t) + index_bucket(ids, counter_buckets)
        c_row = c_bucket * WAYS
        c_stored = tl.load(
            counter_keys_ptr + c_row[:, None] + ways[None, :], mask=waiting[:, None], other=-1
        )
        c_first = tl.min(tl.where(c_stored == ids[:, None], ways[None, :], WAYS), axis=1)
        c_hit = waiting & (c_first < WAYS)
        c_slot = tl.where(c_hit, c_row + c_first, -1)
        seen = count + tl.load(counts_ptr + c_slot, mask=c_hit, other=0)
        tl.store(counts_ptr + c_slot, seen, mask=c_hit)
        tl.store(counter_scores_ptr + c_slot, step, mask=c_hit)
        admitted = seen >= threshold
        waiting_kind = tl.where(c_hit, tl.where(admitted, 4, 3), tl.where(admitted, 6, 5))
        kind = tl.where(waiting, waiting_kind, kind)
        tl.store(u_counter_bucket_ptr + k, tl.where(waiting, c_bucket, -1), mask=in_range)
        tl.store(u_counter_slot_ptr + k, c_slot, mask=in_range)

    tl.store(u_slot_ptr + k, slot, mask=in_range)
    tl.store(u_value_ptr + k, value, mask=in_range)
    tl.store(u_bucket_ptr + k, tl.where(valid, bucket, -1), mask=in_range)
    tl.store(u_kind_ptr + k, kind.to(tl.int64), mask=in_range)


@triton.jit
def group_insert_kernel(
    keys_ptr,
    scores_ptr,
    counts_ptr,
    weights_ptr,
    state_ptr,
    seg_start_ptr,
    seg_order_ptr,
    u_ids_ptr,
    u_value_ptr,
    u_kind_ptr,
    u_bucket_ptr,
    u_table_ptr,
    u_start_ptr,
    u_counter_slot_ptr,
    u_slot_ptr,
    u_inserted_ptr,
    seg_evicted_ptr,
    policy_ptr,
    seed_mix_ptr,
    init_normal_ptr,
    init_a_ptr,
    init_b_ptr,
    step_ptr,
    n,
    dim,
    state_dim,
    COUNTER: tl.constexpr,
    WAYS: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    start = tl.load(seg_start_ptr + pid)
    end = tl.load(seg_start_ptr + pid + 1)
    live = start < end
    if live:  # programs past the last bucket of the batch do nothing
        head = tl.load(seg_order_ptr + start, mask=live, other=0)
        bucket = tl.load(u_bucket_ptr + head, mask=live, other=0)
        table = tl.load(u_table_ptr + head, mask=live, other=0)
        row = bucket * WAYS

        # Candidates c in [0, 2 * WINDOW): c < WAYS is stored way c; WAYS <= c < WAYS +
        # WINDOW is entry c - WAYS of the bucket's sorted segment; the rest is padding.
        c = tl.arange(0, 2 * WINDOW)
        # why a vector: the interpreter gives a scalar comparison & a vector a non-bool mask.
        live_c = (tl.zeros([2 * WINDOW], dtype=tl.int64) + start) < end
        is_stored = c < WAYS
        j = c - WAYS
        pos = start + tl.where((j >= 0) & (j < WINDOW), j, 0)
        in_seg = live_c & (j >= 0) & (j < WINDOW) & (pos < end)
        u = tl.load(seg_order_ptr + pos, mask=in_seg, other=0)
        kind = tl.load(u_kind_ptr + u, mask=in_seg, other=0)
        if COUNTER:
            is_hit = in_seg & ((kind == 3) | (kind == 4))
            is_new = in_seg & ((kind == 5) | (kind == 6))
        else:
            is_hit = in_seg & (kind == 1)
            is_new = in_seg & ((kind == 2) | (kind == 4) | (kind == 6))
        entry_id = tl.load(u_ids_ptr + u, mask=in_seg, other=-1)
        if COUNTER:  # the counter ranks by the table's clock (LRU)
            entry_value = tl.zeros([2 * WINDOW], dtype=tl.int64) + tl.load(
                step_ptr + table, mask=live, other=0
            )
        else:
            entry_value = tl.load(u_value_ptr + u, mask=in_seg, other=0)
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
            first = tl.load(u_start_ptr + u, mask=won, other=0)
            last = tl.load(u_start_ptr + u + 1, mask=won, other=0)
            admitted = kind == 6
            tl.store(keys_ptr + slot, tl.where(admitted, -1, cand_key), mask=won)
            tl.store(scores_ptr + slot, tl.where(admitted, 0, cand_score), mask=won)
            tl.store(counts_ptr + slot, tl.where(admitted, 0, last - first), mask=won)
            leaving = is_hit & (kind == 4)
            c_slot = tl.load(u_counter_slot_ptr + u, mask=leaving, other=0)
            tl.store(keys_ptr + c_slot, tl.full([2 * WINDOW], -1, tl.int64), mask=leaving)
            tl.store(scores_ptr + c_slot, tl.zeros([2 * WINDOW], dtype=tl.int64), mask=leaving)
            tl.store(counts_ptr + c_slot, tl.zeros([2 * WINDOW], dtype=tl.int64), mask=leaving)
        else:
            tl.store(keys_ptr + slot, cand_key, mask=won)
            tl.store(scores_ptr + slot, cand_score, mask=won)
            tl.store(u_slot_ptr + u, slot, mask=won)
            tl.store(u_inserted_ptr + u, tl.full([2 * WINDOW], 1, tl.int8), mask=won)
            tl.store(seg_evicted_ptr + pid, tl.sum(evicted.to(tl.int64), axis=0), mask=live)
            # New rows: initial values (a pure function of id, seed, column), zero state.
            per_row = tl.zeros([2 * WINDOW], dtype=tl.int64) + table
            seed = tl.load(seed_mix_ptr + per_row)
            normal = tl.load(init_normal_ptr + per_row)
            a = tl.load(init_a_ptr + per_row)
            b = tl.load(init_b_ptr + per_row)
            for d0 in range(0, dim, BLOCK_D):
                cols = d0 + tl.arange(0, BLOCK_D)
                mask = won[:, None] & (cols < dim)[None, :]
                rows = init_values_any(cand_key, cols, seed, normal, a, b)
                rows = round_to(rows, weights_ptr.dtype.element_ty)
                tl.store(weights_ptr + slot[:, None] * dim + cols[None, :], rows, mask=mask)
            for d0 in range(0, state_dim, BLOCK_D):
                cols = d0 + tl.arange(0, BLOCK_D)
                mask = won[:, None] & (cols < state_dim)[None, :]
                zero = tl.zeros([2 * WINDOW, BLOCK_D], dtype=tl.float32)
                tl.store(state_ptr + slot[:, None] * state_dim + cols[None, :], zero, mask=mask)


@triton.jit
def group_probe_kernel(
    keys_ptr,
    ids_ptr,
    table_idx_ptr,
    bucket_offset_ptr,
    num_buckets_ptr,
    slots_ptr,
    n,
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
    first = tl.min(tl.where(stored == ids[:, None], ways[None, :], WAYS), axis=1)
    tl.store(slots_ptr + i, tl.where(valid & (first < WAYS), row + first, -1), mask=i < n)


# ----------------------------------------------------------------- launchers
def _segments(sorted_keys: torch.Tensor, live: torch.Tensor) -> torch.Tensor:
    """``starts [n + 2]`` of the runs of equal ``sorted_keys`` among the ``live`` ones
    (a prefix): run ``k`` is ``[starts[k], starts[k + 1])``; past the last run,
    ``starts`` is ``n`` (no host sync: the run count stays on the device)."""
    n = sorted_keys.numel()
    head = live.clone()
    head[1:] &= sorted_keys[1:] != sorted_keys[:-1]
    run = torch.cumsum(head, 0) - 1
    starts = torch.full((n + 2,), n, dtype=torch.int64, device=sorted_keys.device)
    target = torch.where(head, run, n + 1)
    starts.scatter_(0, target, torch.arange(n, device=sorted_keys.device))
    starts[n + 1] = n
    return starts


def _ranked(bucket: torch.Tensor, first: torch.Tensor, value: torch.Tensor, ids: torch.Tensor):
    """The permutation sorting by (bucket asc, first asc, value desc, id asc)."""
    order = stable_argsort(ids)
    order = order[stable_argsort(value[order], descending=True)]
    order = order[stable_argsort(first[order])]
    return order[stable_argsort(bucket[order])]


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
    adds the per-table counters to ``metrics [T, 6]`` (hits, misses, inserts,
    evictions, admission rejects, insert failures), all in place, with no host
    sync. ``step [T]``: each table's clock for this batch (already advanced)."""
    device = ids.device
    n = ids.numel()
    T = layout.num_tables
    i64 = dict(dtype=torch.int64, device=device)
    if n == 0:
        empty = torch.empty(0, **i64)
        return GroupLookup(empty, empty, empty, empty)
    ids = ids.contiguous()
    dim = weights.shape[1]
    state_dim = state.shape[1]

    # 1. De-duplicate (table, id); ids of no table of the group sort last.
    table_key = torch.where(table_idx >= 0, table_idx, T)
    order = stable_argsort(ids)
    order = order[stable_argsort(table_key[order])]
    sorted_ids, sorted_table = ids[order], table_key[order]
    head = torch.ones(n, dtype=torch.bool, device=device)
    head[1:] = (sorted_ids[1:] != sorted_ids[:-1]) | (sorted_table[1:] != sorted_table[:-1])
    useg = torch.cumsum(head, 0) - 1
    unique_index = torch.empty_like(useg).scatter_(0, order, useg)
    dest = torch.where(head, useg, n)
    u_start = torch.full((n + 2,), n, **i64)
    u_start.scatter_(0, torch.where(head, useg, n + 1), torch.arange(n, device=device))
    u_start[n + 1] = n
    u_ids = torch.zeros(n + 1, **i64).scatter_(0, dest, sorted_ids)[:n].contiguous()
    u_table = torch.full((n + 1,), T, **i64).scatter_(0, dest, sorted_table)[:n].contiguous()
    u_custom = u_ids
    if custom_scores is not None:
        low = torch.iinfo(torch.int64).min
        u_custom = torch.full((n,), low, **i64).scatter_reduce_(
            0, useg, custom_scores.to(torch.int64)[order], reduce="amax"
        )

    # 2. Find; admission counting.
    admission = layout.has_admission
    u_slot, u_value, u_bucket, u_kind = (torch.empty(n, **i64) for _ in range(4))
    u_counter_bucket = torch.full((n,), -1, **i64)
    u_counter_slot = torch.full((n,), -1, **i64)
    group_find_kernel[(triton.cdiv(n, BLOCK_IDS),)](
        keys,
        scores,
        counter_keys,
        counter_scores,
        counts,
        u_ids,
        u_table,
        u_start,
        u_custom,
        layout.bucket_offset,
        layout.num_buckets,
        layout.policy,
        step,
        use_custom if use_custom is not None else layout.policy,
        layout.admission_threshold,
        layout.counter_bucket_offset,
        layout.counter_num_buckets,
        u_slot,
        u_value,
        u_bucket,
        u_kind,
        u_counter_bucket,
        u_counter_slot,
        n,
        T,
        HAS_CUSTOM=custom_scores is not None,
        HAS_ADMISSION=admission,
        WAYS=keys.shape[1],
        BLOCK=BLOCK_IDS,
    )
    u_inserted = torch.zeros(n, dtype=torch.int8, device=device)
    seg_evicted = torch.zeros(n, **i64)
    block_d = min(triton.next_power_of_2(max(dim, state_dim, 1)), MAX_BLOCK_D)

    def insert(counter: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Sort a step's competitors by bucket (hits first) and launch the insert."""
        if counter:
            member = u_kind >= KIND_COUNTED
            bucket = torch.where(member, u_counter_bucket, INT64_MAX)
            first = torch.where((u_kind == KIND_COUNTED) | (u_kind == KIND_ADMIT_HIT), 0, 1)
            value = torch.zeros_like(u_value)  # one clock per bucket: ranked by id
        else:
            member = (u_kind == KIND_HIT) | (u_kind == KIND_NEW)
            member |= (u_kind == KIND_ADMIT_HIT) | (u_kind == KIND_ADMIT_NEW)
            bucket = torch.where(member, u_bucket, INT64_MAX)
            first = torch.where(u_kind == KIND_HIT, 0, 1)
            value = u_value
        seg_order = _ranked(bucket, first, value, u_ids)
        seg_start = _segments(bucket[seg_order], member[seg_order])
        target = (counter_keys, counter_scores, counts) if counter else (keys, scores, counts)
        group_insert_kernel[(n,)](
            *target,
            weights,
            state,
            seg_start,
            seg_order,
            u_ids,
            u_value,
            u_kind,
            u_counter_bucket if counter else u_bucket,
            u_table,
            u_start,
            u_counter_slot,
            u_slot,
            u_inserted,
            seg_evicted,
            layout.policy,
            layout.seed_mix,
            layout.init_normal,
            layout.init_a,
            layout.init_b,
            step,
            n,
            dim,
            state_dim,
            COUNTER=counter,
            WAYS=keys.shape[1],
            WINDOW=WINDOW,
            BLOCK_D=block_d,
        )
        return seg_order, seg_start

    if admission:
        insert(counter=True)
    seg_order, seg_start = insert(counter=False)

    # 4. Per-table counters (integer sums: exact in any order).
    valid = u_kind != KIND_NONE
    table = torch.where(valid, u_table, 0)
    occurrences = u_start[1 : n + 1] - u_start[:n]
    hit = u_kind == KIND_HIT
    candidate = (u_kind == KIND_NEW) | (u_kind == KIND_ADMIT_HIT) | (u_kind == KIND_ADMIT_NEW)
    inserted = u_inserted.bool()
    rejected = (u_kind == KIND_COUNTED) | (u_kind == KIND_WAIT_NEW)
    hits = torch.where(hit, occurrences, 0)
    seen = torch.where(valid, occurrences, 0)
    evicted_table = u_table[seg_order[seg_start[:n].clamp(max=n - 1)]].clamp(max=T - 1)
    delta = torch.stack(
        [
            hits,
            seen - hits,
            inserted.to(torch.int64),
            torch.zeros_like(hits),
            rejected.to(torch.int64),
            (candidate & ~inserted).to(torch.int64),
        ],
        dim=1,
    )
    metrics[:, : delta.shape[1]].index_add_(0, table, delta)
    metrics[:, 3].index_add_(0, evicted_table, seg_evicted)
    slots = u_slot.index_select(0, unique_index)
    return GroupLookup(slots, unique_index, u_slot, u_table)


def group_lookup_eval_triton(
    layout: GroupLayout,
    keys: torch.Tensor,
    ids: torch.Tensor,
    table_idx: torch.Tensor,
    metrics: torch.Tensor,
) -> torch.Tensor:
    """Global slots of a group's evaluation batch (-1: not stored); adds hits and
    misses to ``metrics``. One launch, no host sync."""
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
        n,
        WAYS=keys.shape[1],
        BLOCK=BLOCK_IDS,
    )
    valid = table_idx >= 0
    table = torch.where(valid, table_idx, 0)
    hit = (slots >= 0).to(torch.int64)
    delta = torch.stack([hit, valid.to(torch.int64) - hit], dim=1)
    metrics[:, :2].index_add_(0, table, delta)
    return slots
