"""Native CPU kernels for groups of KV tables (C++ in ``csrc/``): the ops.

A group is T KV tables sharing one set of arrays, as FBGEMM's TBE shares one
weight array with table offsets: table t owns the index buckets
``[bucket_offset[t], bucket_offset[t] + num_buckets[t])`` of the group's
``keys`` / ``scores`` (int64 ``[NB, WAYS]``), so its slots are
``[WAYS * bucket_offset[t], WAYS * (bucket_offset[t] + num_buckets[t]))`` of
the group's ``weights [NB * WAYS, dim]`` and ``state [NB * WAYS, state_dim]``.
Tables with admission own a range of a second index, the admission counter
(``CounterIndex``), the same way. An id of table t lives in bucket
``bucket_offset[t] + index_bucket(id, num_buckets[t])``.

Every op gives, table by table, exactly what T calls of the per-table torch
path give (``KVTable.lookup_eval`` / ``lookup_train``, ``ops/pooled_lookup.py``):
the same slots, keys, scores, rows, optimizer state, counters and metrics,
for any ``num_threads``. Beside the group ops: one index's find-or-insert
(``insert``) and placement (``place``), and the SSD tier's slab records
(``write_records``, ``read_records``, ``record_checksum``), each bit-exact with
its torch path. See docs/native.md.

These are plain functions over CPU tensors; the registered torch ops
(``torch.ops.kvemb.*``, ``torchrec_kvemb/library/``) are their CPU
implementations' entry point. Loading the library, its ABI and the argument
checks are in ``ops/native_lib.py``; where the library was not built, every
function here raises ``NativeOpError`` and ``backend.implementation`` picks the
torch path instead.

Example::

    if native_lib.available():
        tables = GroupLayout.of([64, 7], [EvictionPolicy.LRU] * 2, [spec, spec])
        out = native.lookup_train_group(tables, keys, scores, weights, state,
                                        ids, table_idx, step=torch.tensor([3, 3]))
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import NamedTuple

import torch

from torchrec_kvemb import huge_pages
from torchrec_kvemb.contracts import KERNEL_METRICS, GroupLayout, InsertResult, seed_mix
from torchrec_kvemb.native_lib import (
    BackwardArgs,
    HostExchangeArgs,
    InsertArgs,
    NativeOpError,
    PooledArgs,
    TrainArgs,
    Workspace,
    available,
    check_status,
    library,
    per_table,
    tensor_ptr,
    threads,
    unavailable_reason,
    workspace_handle,
)
from torchrec_kvemb.ops.hashing import init_rows
from torchrec_kvemb.optimizer import FusedOptimConfig
from torchrec_kvemb.options import WAYS


# ------------------------------------------------------------------ hashing
def index_bucket(ids: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """``ops.hashing.index_bucket`` by the native multiply-high remainder."""
    out = torch.empty_like(ids)
    status = library().kv_index_bucket(
        tensor_ptr(ids, "ids", torch.int64, (-1,)), ids.numel(), int(num_buckets), out.data_ptr()
    )
    check_status(status, "index_bucket")
    return out


def export_order(
    keys: torch.Tensor, route_buckets: int, salt: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ops.export_order.export_order_torch(keys, route_buckets)`` for flat ``keys``
    (routing hash salt ``salt``): a counting sort by routing bucket, then by id."""
    n = int((keys >= 0).sum())
    ids = torch.empty(n, dtype=torch.int64)
    slots = torch.empty(n, dtype=torch.int64)
    counts = torch.empty(int(route_buckets), dtype=torch.int64)
    status = library().kv_export_order(
        tensor_ptr(keys, "keys", torch.int64, (-1,)),
        keys.numel(),
        salt & 0xFFFFFFFFFFFFFFFF,
        int(route_buckets),
        n,
        ids.data_ptr(),
        slots.data_ptr(),
        counts.data_ptr(),
    )
    check_status(status, "export_order")
    return ids, slots, counts


def init_uniform(
    ids: torch.Tensor, dim: int, seed: int, low: float, high: float, num_threads: int = 1
) -> torch.Tensor:
    """``ops.hashing.init_rows(ids, dim, seed, False, low, high)``, natively (same bits)."""
    out = torch.empty(ids.numel(), dim, dtype=torch.float32)
    status = library().kv_init_uniform(
        tensor_ptr(ids, "ids", torch.int64, (-1,)),
        ids.numel(),
        int(dim),
        seed_mix(seed),
        float(low),
        float(high),
        threads(num_threads),
        out.data_ptr(),
    )
    check_status(status, "init_uniform")
    return out


# ------------------------------------------------------------------ lookups
def lookup_eval_group(
    keys: torch.Tensor,
    bucket_offset: torch.Tensor,
    num_buckets: torch.Tensor,
    ids: torch.Tensor,
    table_idx: torch.Tensor,
    num_threads: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read-only probe of a group: ``(slots [n], hits [T])``.

    ``slots`` are global (-1: absent, or ``table_idx`` -1: not this group's id);
    ``hits`` counts the found ids per table (``misses`` = ids of the table - hits).
    """
    T = bucket_offset.numel()
    n = ids.numel()
    slots = torch.empty(n, dtype=torch.int64)
    hits = torch.empty(T, dtype=torch.int64)
    status = library().kv_lookup_eval_group(
        tensor_ptr(keys, "keys", torch.int64, (-1, WAYS)),
        keys.shape[0],
        tensor_ptr(bucket_offset, "bucket_offset", torch.int64, (T,)),
        tensor_ptr(num_buckets, "num_buckets", torch.int64, (T,)),
        T,
        tensor_ptr(ids, "ids", torch.int64, (-1,)),
        tensor_ptr(table_idx, "table_idx", torch.int64, (n,)),
        n,
        threads(num_threads, n),
        slots.data_ptr(),
        hits.data_ptr(),
    )
    check_status(status, "lookup_eval_group")
    return slots, hits


def insert(
    keys: torch.Tensor,
    scores: torch.Tensor,
    ids: torch.Tensor,
    values: torch.Tensor,
    accumulate: bool,
    keep_existing: bool,
    num_threads: int | None = None,
    workspace: Workspace | None = None,
) -> InsertResult:
    """``ops.insert.insert_torch`` natively: find-or-insert of unique ``ids`` (>= 0)
    with score ``values`` in the index ``keys`` / ``scores``, updated in place.
    The same slots, hits, insertions and evictions (evictions ascending by slot)."""
    n = ids.numel()
    slots = torch.empty(n, dtype=torch.int64)
    # Separate buffers: the results must not alias each other (a registered op's rule).
    hit, inserted = torch.empty(n, dtype=torch.bool), torch.empty(n, dtype=torch.bool)
    evicted_ids, evicted_slots = (
        torch.empty(n, dtype=torch.int64),
        torch.empty(n, dtype=torch.int64),
    )
    count = torch.zeros(1, dtype=torch.int64)
    args = InsertArgs(
        keys=tensor_ptr(keys, "keys", torch.int64, (-1, WAYS)),
        scores=tensor_ptr(scores, "scores", torch.int64, tuple(keys.shape)),
        num_buckets=keys.shape[0],
        ids=tensor_ptr(ids, "ids", torch.int64, (-1,)),
        values=tensor_ptr(values, "values", torch.int64, (n,)),
        n=n,
        accumulate=int(bool(accumulate)),
        keep_existing=int(bool(keep_existing)),
        num_threads=threads(num_threads, n),
        workspace=workspace_handle(workspace),
        slots=slots.data_ptr(),
        hit=hit.data_ptr(),
        inserted=inserted.data_ptr(),
        evicted_ids=evicted_ids.data_ptr(),
        evicted_slots=evicted_slots.data_ptr(),
        num_evicted=count.data_ptr(),
    )
    check_status(library().kv_insert(ctypes.byref(args)), "insert")
    e = int(count)
    return InsertResult(slots, hit, inserted, evicted_ids[:e], evicted_slots[:e])


def place(keys: torch.Tensor, ids: torch.Tensor, num_threads: int | None = None) -> torch.Tensor:
    """``BucketIndex.place`` natively: absent ``ids`` (>= 0) into the first empty ways
    of their buckets in the given order; their slots, -1 for every id of a bucket
    without room for all of them. ``keys`` is updated in place."""
    slots = torch.empty(ids.numel(), dtype=torch.int64)
    status = library().kv_place(
        tensor_ptr(keys, "keys", torch.int64, (-1, WAYS)),
        keys.shape[0],
        tensor_ptr(ids, "ids", torch.int64, (-1,)),
        ids.numel(),
        threads(num_threads, ids.numel()),
        slots.data_ptr(),
    )
    check_status(status, "place")
    return slots


def bulk_load(
    keys: torch.Tensor,
    scores: torch.Tensor,
    ids: torch.Tensor,
    values: torch.Tensor,
    num_threads: int | None = None,
) -> torch.Tensor:
    """``BucketIndex.bulk_load`` natively: unique ``ids`` (>= 0) with score ``values``
    into the EMPTY index ``keys`` / ``scores``; slots ``[n]``, -1 for the ids a full
    bucket left out (the same slots as the torch path)."""
    n = ids.numel()
    slots = torch.empty(n, dtype=torch.int64)
    status = library().kv_bulk_load(
        tensor_ptr(keys, "keys", torch.int64, (-1, WAYS)),
        tensor_ptr(scores, "scores", torch.int64, tuple(keys.shape)),
        keys.shape[0],
        tensor_ptr(ids, "ids", torch.int64, (-1,)),
        tensor_ptr(values, "values", torch.int64, (n,)),
        n,
        threads(num_threads, n),
        slots.data_ptr(),
    )
    check_status(status, "bulk_load")
    return slots


def scatter_rows(
    dest: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, num_threads: int | None = None
) -> None:
    """``dest.index_copy_(0, slots, rows)`` for float32 ``dest [N, w]`` and ``rows [k, w]``
    whose rows are contiguous (any row stride); ``slots`` in ``[0, N)``."""
    k = slots.numel()
    for name, t in (("dest", dest), ("rows", rows)):
        if t.dtype != torch.float32 or t.dim() != 2 or t.device.type != "cpu":
            raise ValueError(f"native op: {name} must be a 2-D float32 CPU tensor")
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"native op: {name}'s rows must be contiguous")
    if rows.shape != (k, dest.shape[1]):
        raise ValueError(f"native op: rows must have shape ({k}, {dest.shape[1]})")
    status = library().kv_scatter_rows(
        dest.data_ptr(),
        dest.shape[0],
        dest.stride(0),
        dest.shape[1],
        tensor_ptr(slots, "slots", torch.int64, (k,)),
        k,
        rows.data_ptr(),
        rows.stride(0),
        threads(num_threads, k * dest.shape[1]),
    )
    check_status(status, "scatter_rows")


def gather_rows(
    src: torch.Tensor, slots: torch.Tensor, out: torch.Tensor, num_threads: int | None = None
) -> torch.Tensor:
    """``torch.index_select(src, 0, slots, out=out)`` for float32 ``src [N, w]`` and
    ``out [k, w]`` whose rows are contiguous (any row stride: ``out`` may be a column
    block of a wider buffer); ``slots`` in ``[0, N)``. Returns ``out``."""
    k = slots.numel()
    for name, t in (("src", src), ("out", out)):
        if t.dtype != torch.float32 or t.dim() != 2 or t.device.type != "cpu":
            raise ValueError(f"native op: {name} must be a 2-D float32 CPU tensor")
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"native op: {name}'s rows must be contiguous")
    if out.shape != (k, src.shape[1]):
        raise ValueError(f"native op: out must have shape ({k}, {src.shape[1]})")
    status = library().kv_gather_rows(
        src.data_ptr(),
        src.shape[0],
        src.stride(0),
        src.shape[1],
        tensor_ptr(slots, "slots", torch.int64, (k,)),
        k,
        out.data_ptr(),
        out.stride(0),
        threads(num_threads, k * src.shape[1]),
    )
    check_status(status, "gather_rows")
    return out


# ---------------------------------------------------------------- checksums
def crc32(address: int, n: int, value: int = 0) -> int:
    """``zlib.crc32`` of the ``n`` bytes at ``address``, continuing ``value``."""
    out = ctypes.c_uint32()
    status = library().kv_crc32(address, n, value & 0xFFFFFFFF, ctypes.byref(out))
    check_status(status, "crc32")
    return out.value


def crc32_copy(dst: int, src: int, n: int, value: int = 0) -> int:
    """:func:`crc32` of the ``n`` bytes at ``src``, copied to ``dst`` in the same pass."""
    out = ctypes.c_uint32()
    status = library().kv_crc32_copy(dst, src, n, value & 0xFFFFFFFF, ctypes.byref(out))
    check_status(status, "crc32_copy")
    return out.value


def crc32_folds() -> bool:
    """Whether :func:`crc32` folds with carry-less multiplies here (x86-64 with
    PCLMULQDQ); where it does not, zlib's is faster."""
    return available() and bool(library().kv_crc32_folds())


# ------------------------------------------------------------ slab records
def record_checksum(block: torch.Tensor, num_threads: int | None = None) -> torch.Tensor:
    """Checksums ``[k]`` of slab records ``block [k, words]`` (``ssd.slab.checksum``)."""
    out = torch.empty(block.shape[0], dtype=torch.int64)
    status = library().kv_record_checksum(
        tensor_ptr(block, "block", torch.int64, (-1, -1)),
        block.shape[0],
        block.shape[1],
        threads(num_threads, block.shape[0]),
        out.data_ptr(),
    )
    check_status(status, "record_checksum")
    return out


def _record_args(slab: torch.Tensor, records: torch.Tensor, ids: torch.Tensor) -> tuple:
    """The leading arguments of the record ops: the slab ``[records, words]``, then
    ``k`` record numbers and their ids."""
    k = records.numel()
    return (
        tensor_ptr(slab, "slab", torch.int64, (-1, -1)),
        slab.shape[0],
        slab.shape[1],
        tensor_ptr(records, "records", torch.int64, (k,)),
        k,
        tensor_ptr(ids, "ids", torch.int64, (k,)),
    )


def read_records(
    slab: torch.Tensor, records: torch.Tensor, ids: torch.Tensor, num_threads: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of ``records`` of ``slab [records, words]``: ``(block [k, words], ok [k])``,
    ``ok`` where a record holds its id of ``ids`` and its checksum matches (what
    ``index_select`` then ``Slab.verify`` give)."""
    k = records.numel()
    out = torch.empty(k, slab.shape[1], dtype=torch.int64)
    ok = torch.empty(k, dtype=torch.bool)
    status = library().kv_read_records(
        *_record_args(slab, records, ids),
        threads(num_threads, k),
        out.data_ptr(),
        ok.data_ptr(),
    )
    check_status(status, "read_records")
    return out, ok


def write_records(
    slab: torch.Tensor,
    records: torch.Tensor,
    ids: torch.Tensor,
    scores: torch.Tensor,
    rows: torch.Tensor,
    num_threads: int | None = None,
) -> None:
    """Encode records of ``ids``, ``scores`` and float32 ``rows [k, width]`` (with their
    checksums) into ``slab [records, words]`` at the distinct ``records``: what
    ``slab.index_copy_(0, records, Slab.encode(ids, scores, rows))`` writes."""
    k = records.numel()
    status = library().kv_write_records(
        *_record_args(slab, records, ids),
        tensor_ptr(scores, "scores", torch.int64, (k,)),
        tensor_ptr(rows, "rows", torch.float32, (k, -1)),
        rows.shape[1],
        threads(num_threads, k),
    )
    check_status(status, "write_records")


class CounterIndex(NamedTuple):
    """A group's admission counter: keys, scores ``[NCB, WAYS]`` and counts ``[NCB * WAYS]``."""

    keys: torch.Tensor
    scores: torch.Tensor
    counts: torch.Tensor


class TrainLookup(NamedTuple):
    """What ``lookup_train_group`` did. Uniques are (table, id) pairs ordered by
    global bucket, then stored ids by way, then new ids by id; evictions by slot."""

    slots: torch.Tensor  # [n] global slot per occurrence, -1: no row
    unique_index: torch.Tensor  # [n] unique of each occurrence, -1: table_idx -1
    unique_ids: torch.Tensor  # [U]
    unique_slots: torch.Tensor  # [U], -1: no row (not admitted / no room)
    unique_table: torch.Tensor  # [U]
    unique_inserted: torch.Tensor  # [U] bool: got a new row in this call
    evicted_ids: torch.Tensor  # [E]
    evicted_slots: torch.Tensor  # [E], reused by inserted ids
    metrics: torch.Tensor  # [T, KERNEL_METRICS] int64 deltas, columns METRIC_NAMES
    # With a ``TierPromotion`` only (else None):
    unique_flags: torch.Tensor | None = None  # [U] uint8, UNIQUE_* bits
    unique_scores: torch.Tensor | None = None  # [U] the score held (or, without a row, due)
    evicted_scores: torch.Tensor | None = None  # [E] the evicted entries' scores
    # With a ``TierIndex`` only: [U] each promoted unique's tier slot, -1 for the others.
    unique_tier_slots: torch.Tensor | None = None


#: Bits of ``TrainLookup.unique_flags`` (KvUniqueFlag in csrc/kvemb_native.h).
UNIQUE_INSERTED, UNIQUE_PROMOTED, UNIQUE_NO_ROOM = 1, 2, 4


class TierPromotion(NamedTuple):
    """The batch's ids a lower tier holds (none in memory) with their in-memory
    scores: ``lookup_train_group`` of a group of tables over SSD tiers. Table by
    table (``offsets [T + 1]``: table ``t``'s at ``[offsets[t], offsets[t + 1])``;
    None: a group of one table), ascending within a table."""

    ids: torch.Tensor
    scores: torch.Tensor
    offsets: torch.Tensor | None = None


#: Columns of ``TierIndex.rows`` (KV_TIER_INDEX_COLUMNS in csrc/kvemb_native.h).
TIER_INDEX_COLUMNS = 6


class TierIndex(NamedTuple):
    """Each table's host tier index, probed by ``lookup_train_group`` itself for the
    table's ids not in memory (instead of a ``TierPromotion``): ``rows [T, 6]`` of
    addresses and sizes (``tier_index_row``; zeros: no tier), and the tensors they
    point into (held for the call)."""

    rows: torch.Tensor
    arrays: tuple[torch.Tensor, ...]


def tier_index_row(
    main_keys: torch.Tensor,
    stash_keys: torch.Tensor,
    main_scores: torch.Tensor,
    stash_scores: torch.Tensor,
) -> list[int]:
    """One table's row of ``TierIndex.rows``: a host tier's main part and stash
    (``[buckets, WAYS]`` keys and scores, each id's score its memory score; an
    empty stash: none), checked as the kernel reads them."""
    nb, sb = main_keys.shape[0], stash_keys.shape[0]
    stash = sb > 0
    return [
        tensor_ptr(main_keys, "tier main keys", torch.int64, (nb, WAYS)),
        nb,
        tensor_ptr(stash_keys, "tier stash keys", torch.int64, (sb, WAYS)) if stash else 0,
        sb,
        tensor_ptr(main_scores, "tier main scores", torch.int64, (nb, WAYS)),
        tensor_ptr(stash_scores, "tier stash scores", torch.int64, (sb, WAYS)) if stash else 0,
    ]


def lookup_train_group(
    tables: GroupLayout,
    keys: torch.Tensor,
    scores: torch.Tensor,
    weights: torch.Tensor,
    state: torch.Tensor,
    ids: torch.Tensor,
    table_idx: torch.Tensor,
    step: torch.Tensor | Sequence[int],
    custom_scores: torch.Tensor | None = None,
    custom_tables: torch.Tensor | Sequence[bool] | None = None,
    counter: CounterIndex | None = None,
    num_threads: int | None = None,
    workspace: Workspace | None = None,
    tier: TierPromotion | TierIndex | None = None,
    pad_uniques: bool = False,
) -> TrainLookup:
    """Slots for a training batch of a group, inserting new ids; updates in place.

    Per table, ``KVTable.lookup_train``: ids are de-duplicated per (table, id);
    the score value of an id is ``step[t]`` (LRU, NONE: stored entries never
    lose), its count in the batch (LFU, added to the stored count), or the max
    of its ``custom_scores`` (CUSTOM_SCORE tables with ``custom_tables[t]``
    true; default: every CUSTOM_SCORE table when ``custom_scores`` is given).
    ``step`` is each table's clock for this batch, already advanced. Ids of
    admission tables not stored are counted in ``counter``; only stored and
    admitted ids compete for rows (ops/insert.py's rule). New rows get their
    initial values (normal ones through ``ops.hashing.init_rows``) and zero
    optimizer state. ``num_threads`` (default ``torch.get_num_threads()``)
    changes the speed only; ``workspace`` keeps scratch memory between calls.

    ``tier`` (tables over lower tiers): its ids compete as stored
    ones that outrank every unprotected entry (see ``KvTrainArgs``); no row is
    written (the caller moves evicted rows out first, then writes promoted and
    new rows), and the result has ``unique_flags``, ``unique_scores`` and
    ``evicted_scores``. A ``TierIndex`` instead of the ids: the kernel probes
    each table's host tier index for the ids not in memory, and the result also
    has ``unique_tier_slots``.

    ``pad_uniques``: ``unique_slots`` and ``unique_table`` keep one entry per id, those
    past the batch's uniques with slot -1 and table 0 (the registered op's static
    sizes; no occurrence refers to them).
    """
    T = tables.num_tables
    n = ids.numel()
    nb = keys.shape[0] if keys.dim() == 2 else -1
    dim = weights.shape[1] if weights.dim() == 2 else -1
    state_dim = state.shape[1] if state.dim() == 2 else -1
    if nb < tables.total_buckets:
        raise ValueError(
            f"lookup_train_group: keys has {nb} buckets, the tables need {tables.total_buckets}"
        )
    args = TrainArgs(
        keys=tensor_ptr(keys, "keys", torch.int64, (nb, WAYS)),
        scores=tensor_ptr(scores, "scores", torch.int64, (nb, WAYS)),
        num_buckets_total=nb,
        weights=tensor_ptr(weights, "weights", weights.dtype, (nb * WAYS, dim)),
        weights_dtype=_row_dtype(weights, "lookup_train_group"),
        dim=dim,
        state=tensor_ptr(state, "state", torch.float32, (nb * WAYS, state_dim)),
        state_dim=state_dim,
        num_tables=T,
        ids=tensor_ptr(ids, "ids", torch.int64, (n,)),
        table_idx=tensor_ptr(table_idx, "table_idx", torch.int64, (n,)),
        n=n,
        num_threads=threads(num_threads),
        workspace=workspace_handle(workspace),
    )
    if tables.has_admission:
        if counter is None:
            raise ValueError("lookup_train_group: tables with admission need the counter index")
        ncb = counter.keys.shape[0] if counter.keys.dim() == 2 else -1
        if ncb < tables.total_counter_buckets:
            raise ValueError(
                f"lookup_train_group: the counter has {ncb} buckets, "
                f"the tables need {tables.total_counter_buckets}"
            )
        args.counter_keys = tensor_ptr(counter.keys, "counter.keys", torch.int64, (ncb, WAYS))
        args.counter_scores = tensor_ptr(counter.scores, "counter.scores", torch.int64, (ncb, WAYS))
        args.counter_counts = tensor_ptr(
            counter.counts, "counter.counts", torch.int64, (ncb * WAYS,)
        )
        args.counter_num_buckets_total = ncb
    use_custom = torch.zeros(T, dtype=torch.int64)
    if custom_scores is not None:
        custom_scores = custom_scores.to(torch.int64).contiguous()
        args.custom_scores = tensor_ptr(custom_scores, "custom_scores", torch.int64, (n,))
        use_custom = (
            torch.ones(T, dtype=torch.int64)
            if custom_tables is None
            else per_table(custom_tables, torch.int64, "custom_tables", T)
        )
    step = per_table(step, torch.int64, "step", T)
    table_args = dict(
        bucket_offset=tables.bucket_offset,
        num_buckets=tables.num_buckets,
        policy=tables.policy,
        step=step,
        use_custom=use_custom,
        admission_threshold=tables.admission_threshold,
        counter_bucket_offset=tables.counter_bucket_offset,
        counter_num_buckets=tables.counter_num_buckets,
        init_native=((tables.init_normal == 0) & (tables.init_col == 0)).to(torch.int64),
        seed_mix=tables.seed_mix,
    )
    for name, value in table_args.items():
        setattr(args, name, tensor_ptr(value, name, torch.int64, (T,)))
    args.init_low = tensor_ptr(tables.init_a, "init_low", torch.float64, (T,))
    args.init_high = tensor_ptr(tables.init_b, "init_high", torch.float64, (T,))

    i64 = dict(dtype=torch.int64)
    tier_out = None
    if tier is not None:
        args.weights = args.state = None
        if isinstance(tier, TierIndex):
            shape = (T, TIER_INDEX_COLUMNS)
            args.tier_index = tensor_ptr(tier.rows, "tier index", torch.int64, shape)
        else:
            if T != 1 and tier.offsets is None:
                raise ValueError("lookup_train_group: a tier of several tables needs its offsets")
            p = tier.ids.numel()
            args.promote_ids = tensor_ptr(tier.ids, "tier.ids", torch.int64, (p,))
            args.promote_scores = tensor_ptr(tier.scores, "tier.scores", torch.int64, (p,))
            if tier.offsets is not None:
                offsets = tier.offsets
                args.promote_offsets = tensor_ptr(offsets, "tier.offsets", torch.int64, (T + 1,))
            args.num_promote = p
        tier_out = (
            torch.empty(n, dtype=torch.uint8),
            torch.empty(n, **i64),
            torch.empty(n, **i64),
            torch.empty(n, **i64),
        )
        args.unique_flags, args.unique_scores, args.evicted_scores = (
            t.data_ptr() for t in tier_out[:3]
        )
        if isinstance(tier, TierIndex):
            args.unique_tier_slots = tier_out[3].data_ptr()
    slots, unique_index = torch.empty(n, **i64), torch.empty(n, **i64)
    unique_ids, unique_slots, unique_table = (torch.empty(n, **i64) for _ in range(3))
    unique_inserted = torch.empty(n, dtype=torch.bool)
    evicted_ids, evicted_slots = torch.empty(n, **i64), torch.empty(n, **i64)
    metrics, sizes = torch.empty(T, KERNEL_METRICS, **i64), torch.empty(2, **i64)
    for name, out in (
        ("slots", slots),
        ("unique_index", unique_index),
        ("unique_ids", unique_ids),
        ("unique_slots", unique_slots),
        ("unique_table", unique_table),
        ("unique_inserted", unique_inserted),
        ("evicted_ids", evicted_ids),
        ("evicted_slots", evicted_slots),
        ("metrics", metrics),
        ("sizes", sizes),
    ):
        setattr(args, name, out.data_ptr())
    check_status(library().kv_lookup_train_group(ctypes.byref(args)), "lookup_train_group")

    u, e = sizes.tolist()
    if pad_uniques:  # all n entries: those past the batch's uniques without a row
        unique_slots[u:] = -1
        unique_table[u:] = 0
    result = TrainLookup(
        slots,
        unique_index,
        unique_ids[:u],
        unique_slots if pad_uniques else unique_slots[:u],
        unique_table if pad_uniques else unique_table[:u],
        unique_inserted[:u],
        evicted_ids[:e],
        evicted_slots[:e],
        metrics,
    )
    if tier_out is not None:
        flags, scores_u, scores_e, tier_slots = tier_out
        return result._replace(
            unique_flags=flags[:u],
            unique_scores=scores_u[:u],
            evicted_scores=scores_e[:e],
            unique_tier_slots=tier_slots[:u] if isinstance(tier, TierIndex) else None,
        )
    if tables.has_normal:
        _fill_new_rows(tables, weights, result)
    return result


def _fill_new_rows(tables: GroupLayout, weights: torch.Tensor, result: TrainLookup) -> None:
    """Initial rows of the new ids of NORMAL tables and column shards, by the torch
    path (why NORMAL: its log and cos are torch's vectorized ones, which C++ libm
    does not match bit for bit; column shards: the native uniform draw starts at
    column 0)."""
    new = result.unique_inserted
    if not bool(new.any()):
        return
    dim = weights.shape[1]
    u = new.numel()  # the batch's uniques (``pad_uniques`` keeps more slots and tables)
    table, slots = result.unique_table[:u], result.unique_slots[:u]
    for t, spec in enumerate(tables.init_specs):
        if not (spec.normal or spec.first_col):
            continue
        mask = new & (table == t)
        if bool(mask.any()):
            ids = result.unique_ids[mask]
            rows = init_rows(ids, dim, spec.seed, spec.normal, spec.a, spec.b, spec.first_col)
            weights.index_copy_(0, slots[mask], rows.to(weights.dtype))


# ----------------------------------------------------------------- backward
def fused_backward_group(
    weights: torch.Tensor,
    state: torch.Tensor,
    grad_out: torch.Tensor,
    offsets: torch.Tensor,
    unique_index: torch.Tensor,
    unique_slots: torch.Tensor,
    unique_table: torch.Tensor,
    config: FusedOptimConfig,
    learning_rate: torch.Tensor | Sequence[float],
    optim_step: torch.Tensor | Sequence[int],
    per_sample_weights: torch.Tensor | None = None,
    mean: bool = False,
    num_threads: int | None = None,
    workspace: Workspace | None = None,
) -> None:
    """Reduce the pooled gradient per unique row and apply one optimizer step, in place.

    ``offsets [num_bags + 1]`` cut the lookup's occurrences into bags; the
    gradient of a unique row is the sum over its occurrences of
    ``grad_out[bag] * scale`` (scale: the per-sample weight, divided by the bag
    length for ``mean``); rows with slot -1 get nothing. ``grad_out`` is
    ``[num_bags, dim]`` or ``[G, B, dim]`` (bag ``b`` at ``[b // B, b % B]``,
    any strides with a unit last one: e.g. a ``KeyedTensor`` gradient
    ``[B, G * dim]`` viewed as ``.view(B, G, dim).transpose(0, 1)``).
    ``config`` gives the optimizer of the group; ``learning_rate`` and
    ``optim_step`` (Adam's bias correction, already advanced) are per table.
    ``weights`` are float32, float16 or bfloat16 rows (``state`` float32): a
    half-precision row takes the float32 update on its float32 value and is
    stored rounded to nearest even, as ``optimizer_update_torch`` stores it.
    """
    # KvRowDtype codes (csrc/kvemb_native.h).
    row_dtype = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}.get(weights.dtype)
    if row_dtype is None:
        raise ValueError(
            "fused_backward_group: weights must be float32, float16 or bfloat16, "
            f"got {weights.dtype}"
        )
    T = len(learning_rate) if not isinstance(learning_rate, torch.Tensor) else learning_rate.numel()
    rows = weights.shape[0] if weights.dim() == 2 else -1
    dim = weights.shape[1] if weights.dim() == 2 else -1
    state_dim = config.state_dim(dim)
    n = unique_index.numel()
    U = unique_slots.numel()
    num_bags = offsets.numel() - 1
    if num_bags < 0:
        raise ValueError("fused_backward_group: offsets must have at least one entry")
    grad = grad_out.unsqueeze(0) if grad_out.dim() == 2 else grad_out
    if (
        grad.dim() != 3
        or grad.shape[2] != dim
        or grad.shape[0] * grad.shape[1] != num_bags
        or grad.stride(2) != 1
    ):
        raise ValueError(
            f"fused_backward_group: grad_out must be [{num_bags}, {dim}] or [G, B, {dim}] with "
            f"G * B = {num_bags} and a unit last stride, got shape {tuple(grad_out.shape)} "
            f"strides {grad_out.stride()}"
        )
    if grad.dtype != torch.float32 or grad.device.type != "cpu":
        raise ValueError(
            f"fused_backward_group: grad_out must be float32 on the CPU, got {grad.dtype} "
            f"on {grad.device}"
        )
    lr = per_table(learning_rate, torch.float64, "learning_rate", T)
    steps = per_table(optim_step, torch.int64, "optim_step", T)
    args = BackwardArgs(
        weights=tensor_ptr(weights, "weights", weights.dtype, (rows, dim)),
        weights_dtype=row_dtype,
        state=tensor_ptr(state, "state", torch.float32, (rows, state_dim)),
        num_rows=rows,
        dim=dim,
        state_dim=state_dim,
        grad=grad.data_ptr(),
        bags_per_group=max(1, grad.shape[1]),
        group_stride=grad.stride(0),
        bag_stride=grad.stride(1),
        offsets=tensor_ptr(offsets, "offsets", torch.int64, (num_bags + 1,)),
        num_bags=num_bags,
        per_sample_weights=tensor_ptr(
            per_sample_weights, "per_sample_weights", torch.float32, (n,), optional=True
        ),
        mean=int(bool(mean)),
        unique_index=tensor_ptr(unique_index, "unique_index", torch.int64, (n,)),
        n=n,
        unique_slots=tensor_ptr(unique_slots, "unique_slots", torch.int64, (U,)),
        unique_table=tensor_ptr(unique_table, "unique_table", torch.int64, (U,)),
        num_unique=U,
        num_tables=T,
        learning_rate=lr.data_ptr(),
        optim_step=steps.data_ptr(),
        kind=config.kind.code,
        eps=config.eps,
        beta1=config.beta1,
        beta2=config.beta2,
        weight_decay=config.weight_decay,
        weight_decay_mode=int(config.weight_decay_mode),
        gradient_clipping=int(config.gradient_clipping),
        max_gradient=config.max_gradient,
        num_threads=threads(num_threads),
        workspace=workspace_handle(workspace),
    )
    check_status(library().kv_fused_backward_group(ctypes.byref(args)), "fused_backward_group")


# ------------------------------------------------------------ pooled forward
#: KvRowDtype codes (csrc/kvemb_native.h).
ROW_DTYPES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def _row_dtype(weights: torch.Tensor, op: str) -> int:
    code = ROW_DTYPES.get(weights.dtype)
    if code is None or weights.dim() != 2:
        raise ValueError(
            f"{op}: weights must be [rows, dim] float32, float16 or bfloat16, got "
            f"{weights.dtype} {tuple(weights.shape)}"
        )
    return code


def _pooled_call(
    op: str,
    weights: torch.Tensor,
    ids_n: int,
    offsets: torch.Tensor | None,
    out: torch.Tensor,
    out_offset: torch.Tensor | None,
    num_threads: int | None,
    **fields: int | None,
) -> None:
    num_bags = ids_n if offsets is None else offsets.numel() - 1
    if num_bags < 0:
        raise ValueError(f"{op}: offsets must have at least one entry")
    rows, dim = weights.shape
    args = PooledArgs(
        weights=tensor_ptr(weights, "weights", weights.dtype, (rows, dim)),
        weights_dtype=_row_dtype(weights, op),
        num_rows=rows,
        dim=dim,
        offsets=tensor_ptr(offsets, "offsets", torch.int64, (num_bags + 1,), optional=True),
        num_bags=num_bags,
        n=ids_n,
        out=tensor_ptr(out, "out", torch.float32),
        out_numel=out.numel(),
        out_offset=tensor_ptr(out_offset, "out_offset", torch.int64, (num_bags,), optional=True),
        num_threads=threads(num_threads, ids_n * max(dim, 1) // 16),
        **fields,
    )
    check_status(library().kv_pooled_forward(ctypes.byref(args)), op)


def pooled_forward(
    weights: torch.Tensor,
    slots: torch.Tensor,
    offsets: torch.Tensor | None,
    scale: torch.Tensor | None = None,
    table_idx: torch.Tensor | None = None,
    num_threads: int | None = None,
) -> tuple[torch.Tensor, int]:
    """Pooled rows by slot: ``(out [B, dim] float32, missing)``.

    Bag ``b`` (ids ``[offsets[b], offsets[b + 1])``; ``offsets`` None: id ``b``
    alone, unpooled rows ``[n, dim]``) is the sum in id order of its ids' rows
    (float32, float16 or bfloat16, read to float32) times ``scale`` (None: 1);
    slot -1 pools nothing. The bytes of ``ops.pooled_lookup.
    group_pooled_forward_torch`` with ``missing_as_zero`` (the sums of
    ``F.embedding_bag``, an FMA per id with a scale), for any ``num_threads``.
    ``missing``: ids of a table (``table_idx >= 0``; 0 without ``table_idx``)
    whose slot is -1."""
    n = slots.numel()
    num_bags = n if offsets is None else offsets.numel() - 1
    out = torch.empty(max(num_bags, 0), weights.shape[1] if weights.dim() == 2 else 0)
    missing = torch.zeros(1, dtype=torch.int64)
    _pooled_call(
        "pooled_forward", weights, n, offsets, out, None, num_threads,
        slots=tensor_ptr(slots, "slots", torch.int64, (n,)),
        scale=tensor_ptr(scale, "scale", torch.float32, (n,), optional=True),
        table_idx=tensor_ptr(table_idx, "table_idx", torch.int64, (n,), optional=True),
        missing=missing.data_ptr(),
    )  # fmt: skip
    return out, int(missing)


def pooled_eval(
    keys: torch.Tensor,
    bucket_offset: torch.Tensor,
    num_buckets: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    offsets: torch.Tensor | None,
    table_of_bag: torch.Tensor,
    per_sample_weights: torch.Tensor | None = None,
    mean_of_bag: torch.Tensor | None = None,
    out_offset: torch.Tensor | None = None,
    out_shape: tuple[int, int] | None = None,
    num_threads: int | None = None,
    unpooled: bool = False,
    into: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused eval lookup of a group: probe and pool in one pass, ``(out, hits
    [T], seen [T])``.

    ``table_of_bag [B]``: the table of each bag's ids (-1: not the group's bag);
    ``offsets [B + 1]`` (None: id ``b`` is bag ``b``, rows unpooled). Each id is
    probed as ``lookup_eval_group`` probes it; a found row is pooled times its
    multiplier (``per_sample_weights``, divided by the bag length where
    ``mean_of_bag``: what ``Bags.build`` computes), a missing id pools nothing.
    ``out``: ``out_shape`` float32 with bag ``b``'s row at flat offset
    ``out_offset[b]`` (-1: a bag not written), or ``[B, dim]``. ``hits`` /
    ``seen``: ids of each table found / looked up. ``unpooled``: no pooling, each
    id's row (``[n, dim]``; the bags give each id's table only). ``into``: a
    contiguous float32 CPU tensor of ``out``'s shape to write ``out`` into (every
    element is written), instead of a new one."""
    T = bucket_offset.numel()
    n = ids.numel()
    num_bags = n if offsets is None else offsets.numel() - 1
    dim = weights.shape[1] if weights.dim() == 2 else 0
    shape = out_shape if out_shape is not None else (n if unpooled else max(num_bags, 0), dim)
    if out_offset is None and out_shape is not None:
        raise ValueError("pooled_eval: out_shape needs out_offset")
    if into is not None:
        if into.dtype != torch.float32 or into.device.type != "cpu" or not into.is_contiguous():
            raise ValueError("pooled_eval: into must be a contiguous float32 CPU tensor")
        if tuple(into.shape) != tuple(shape) or out_offset is not None:
            raise ValueError(f"pooled_eval: into has shape {tuple(into.shape)}, expected {shape}")
    out = into if into is not None else torch.empty(shape)
    # Why: a large output the allocator maps afresh faults in page by page as the
    # kernel writes it; on 2 MB pages a 10.5 MB piece of a sequence eval faulted
    # ~5x fewer pages (docs/benchmarks.md, sequence eval).
    if into is None:
        huge_pages.advise(out)
    hits = torch.empty(T, dtype=torch.int64)
    seen = torch.empty(T, dtype=torch.int64)
    if mean_of_bag is not None:
        mean_of_bag = mean_of_bag.to(torch.uint8)
    _pooled_call(
        "pooled_eval", weights, n, offsets, out, out_offset, num_threads,
        per_sample_weights=tensor_ptr(
            per_sample_weights, "per_sample_weights", torch.float32, (n,), optional=True
        ),
        mean_of_bag=tensor_ptr(mean_of_bag, "mean_of_bag", torch.uint8, (num_bags,), optional=True),
        table_of_bag=tensor_ptr(table_of_bag, "table_of_bag", torch.int64, (num_bags,)),
        num_tables=T,
        keys=tensor_ptr(keys, "keys", torch.int64, (-1, WAYS)),
        num_buckets_total=keys.shape[0],
        bucket_offset=tensor_ptr(bucket_offset, "bucket_offset", torch.int64, (T,)),
        num_buckets=tensor_ptr(num_buckets, "num_buckets", torch.int64, (T,)),
        ids=tensor_ptr(ids, "ids", torch.int64, (n,)),
        hits=hits.data_ptr(),
        seen=seen.data_ptr(),
        unpooled=int(unpooled),
    )  # fmt: skip
    return out, hits, seen


__all__ = [
    "CounterIndex",
    "NativeOpError",
    "TierPromotion",
    "TrainLookup",
    "UNIQUE_INSERTED",
    "UNIQUE_NO_ROOM",
    "UNIQUE_PROMOTED",
    "Workspace",
    "available",
    "bulk_load",
    "crc32",
    "crc32_copy",
    "crc32_folds",
    "export_order",
    "fused_backward_group",
    "index_bucket",
    "init_uniform",
    "insert",
    "lookup_eval_group",
    "lookup_train_group",
    "place",
    "pooled_eval",
    "pooled_forward",
    "read_records",
    "record_checksum",
    "scatter_rows",
    "unavailable_reason",
    "write_records",
]


def host_exchange(
    weights: torch.Tensor,
    state: torch.Tensor,
    rows: torch.Tensor,
    record_ids: torch.Tensor,
    record_scores: torch.Tensor,
    free_list: torch.Tensor,
    free_count: torch.Tensor,
    main_keys: torch.Tensor,
    main_scores: torch.Tensor,
    main_record: torch.Tensor,
    stash_keys: torch.Tensor,
    stash_scores: torch.Tensor,
    stash_record: torch.Tensor,
    down_slots: torch.Tensor,
    down_ids: torch.Tensor,
    down_scores: torch.Tensor,
    down_host_slots: torch.Tensor,
    up_host_slots: torch.Tensor,
    up_slots: torch.Tensor,
    num_threads: int | None = None,
) -> None:
    """``ops.host_exchange.host_exchange_torch`` for float32 CPU arrays, in one call
    (csrc/host_exchange.cpp); a slot or record out of range is refused before
    anything is written."""
    i64 = torch.int64
    R = weights.shape[0] if weights.dim() == 2 else -1
    dim = weights.shape[1] if weights.dim() == 2 else -1
    state_dim = state.shape[1] if state.dim() == 2 else -1
    M = record_ids.numel()
    main_slots, stash_slots = main_record.numel(), stash_record.numel()
    e, p = down_slots.numel(), up_slots.numel()
    args = HostExchangeArgs(
        weights=tensor_ptr(weights, "weights", torch.float32, (R, dim)),
        state=tensor_ptr(state, "state", torch.float32, (R, state_dim)) if state_dim else None,
        table_rows=R,
        dim=dim,
        state_dim=state_dim,
        rows=tensor_ptr(rows, "rows", torch.float32, (M, dim + state_dim)),
        record_ids=tensor_ptr(record_ids, "record_ids", i64, (M,)),
        record_scores=tensor_ptr(record_scores, "record_scores", i64, (M,)),
        num_records=M,
        free_list=tensor_ptr(free_list, "free_list", i64, (M,)),
        free_count=tensor_ptr(free_count, "free_count", i64, (1,)),
        main_keys=tensor_ptr(main_keys, "main_keys", i64, (-1, WAYS)),
        main_scores=tensor_ptr(main_scores, "main_scores", i64, tuple(main_keys.shape)),
        main_record=tensor_ptr(main_record, "main_record", i64, (main_keys.numel(),)),
        main_slots=main_slots,
        stash_keys=tensor_ptr(stash_keys, "stash_keys", i64, (-1, WAYS)),
        stash_scores=tensor_ptr(stash_scores, "stash_scores", i64, tuple(stash_keys.shape)),
        stash_record=tensor_ptr(stash_record, "stash_record", i64, (stash_keys.numel(),)),
        stash_slots=stash_slots,
        down_slots=tensor_ptr(down_slots, "down_slots", i64, (e,)),
        down_ids=tensor_ptr(down_ids, "down_ids", i64, (e,)),
        down_scores=tensor_ptr(down_scores, "down_scores", i64, (e,)),
        down_host_slots=tensor_ptr(down_host_slots, "down_host_slots", i64, (e,)),
        num_down=e,
        up_host_slots=tensor_ptr(up_host_slots, "up_host_slots", i64, (p,)),
        up_slots=tensor_ptr(up_slots, "up_slots", i64, (p,)),
        num_up=p,
        num_threads=threads(num_threads, (e + p) * (dim + state_dim)),
    )
    check_status(library().kv_host_exchange(ctypes.byref(args)), "host_exchange")
