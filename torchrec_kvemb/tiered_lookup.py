"""The training lookup of tables over lower tiers: one kernel pass for all of them.

A table with an SSD tier (``TieredKVTable``) alone, or a group of them sharing
arrays (``KVTableGroup`` of tiered tables), is looked up by one call of the
native group kernel per step, whatever the number of tables:

1. per table, the batch's ids not in memory are looked up in its SSD tier and
   their rows read (``TieredKVTable.fetch_lower``), and room on disk is reserved
   (``reserve_batch``); then every table's step clock advances
   (``KVTable.advance_step``);
2. one ``native.lookup_train_group`` with those ids as promotions
   (``native.TierPromotion``, table by table), or on the Triton backend (CUDA)
   the group kernels' ``TIER`` variant (``tiered_triton``, the same outcome):
   it writes no row;
3. the transfers, one per direction for the group (``transfers.py``): the rows
   evicted from memory, of every table, leave by one gather of the group's
   arrays (``gather_down``), the promoted rows of every table go up as one
   buffer in one scatter (``scatter_up``);
4. per table, its demoted rows go to its tiers (``demote_rows``), promoted rows
   leave the tier (``tier.remove``), new rows get their initial values, and ids
   without a memory row (a bucket full of the batch's ids) get scratch rows
   (``write_scratch``, ``ssd/scratch.py``); a TTL table then sweeps its memory
   rows and its tiers (``TableTTL.sweep``).

On the CPU, where every table's tier trades rows with the table's arrays
directly (``LowerTier.exchanges_rows``: host tiers without a bound), steps 1 and
3-4 shrink: nothing is looked up before the kernel, which probes each tier's
index itself (``native.TierIndex``, ``LowerTier.probe_arrays``), and each
table's tier share is one ``exchange_lower`` (``_exchange``): its evicted rows
straight into the tier, then its promoted rows straight to their slots, no
buffer between (docs/tiers.md, "Transfers").

Only public methods of the tables and of their tiers (``tier.LowerTier``) are
used: the tables are ``TieredKVTable``s (typed by their base, ``KVTable``:
``tiered`` imports this module). The native kernel runs on the CPU, where the
transfers' copies are no-ops; on CUDA the rows go down and up on the side
stream (``transfers``), one copy each way for the group, and the tier threads
below touch host memory only (the batch's probes run on the calling thread).

The per-table steps are batched calls on each table's SSD store (each table
keeps its own files), run for two tables at once on threads (``TIER_THREADS``);
the kernel, the pooled forward and the fused backward are one pass for the
group. The torch path (``TieredKVTable.lookup_train``,
table by table) is the reference this is tested against
(tests/ssd/test_tier_backends.py, tests/test_tiered_lookup.py).

Example::

    out = lookup_train_tiers(tables, layout, storage, [0, 1000], ids, table_idx,
                             None, None, group.clocks[0])   # a GroupLookup, global slots
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import contextmanager
from typing import TypeVar

import torch

from torchrec_kvemb import dispatch
from torchrec_kvemb.backend import implementation
from torchrec_kvemb.contracts import (
    KERNEL_METRICS,
    METRIC_NAMES,
    GroupLayout,
    GroupLookup,
    TableStorage,
)
from torchrec_kvemb.library.group_ops import workspace
from torchrec_kvemb.ops import native
from torchrec_kvemb.table import KVTable
from torchrec_kvemb.tiered_triton import lookup_train_triton, rows_up
from torchrec_kvemb.transfers import gather_down, scatter_up

_T = TypeVar("_T")


def _missed(table: KVTable, ids: torch.Tensor) -> torch.Tensor:
    """The unique ``ids`` not in ``table``'s memory rows."""
    return torch.unique(ids[dispatch.probe(table.index.keys, ids) < 0])


class _Fetched:
    """What one table's SSD tier holds of the batch's ids not in memory (tier slots,
    scores and rows in host memory; ids on the batch's device, or in host memory
    where they were given as ``missed``)."""

    def __init__(self, table: KVTable, ids: torch.Tensor, missed: bool = False) -> None:
        """``missed``: ``ids`` are the batch's unique ids not in memory already."""
        miss_ids = ids
        if not missed:
            miss_ids = _missed(table, ids)
        found, self.ssd_slots, self.scores, self.rows = table.fetch_lower(
            miss_ids, torch.arange(miss_ids.numel(), device=miss_ids.device), on_host=True
        )
        self.ids = miss_ids[found]  # ascending, as the kernel wants them
        self.misses = miss_ids.numel()


#: The threads of ``_per_table``, by the process that made them (a forked child
#: makes its own: it has none of its parent's threads).
_POOL: tuple[int, ThreadPoolExecutor] | None = None
#: Tables whose tier work runs at once (why 2: on 2 cores the 4 tables of
#: ``benchmarks.ssd_tier --tables 4`` stepped in 43.6-50.2 ms with 2 threads
#: against 52.6 ms on the calling thread, each system timed on its own; one
#: other thread was slower than the calling thread; docs/ssd-tier.md).
TIER_THREADS = 2


def _threads(threads: int) -> bool:
    """Whether the tables' tier work may run on threads: with more than one of the
    caller's torch threads (``threads``), unless the host tiers' own ops run in
    Triton's interpreter (forced on CPU tensors: it is not thread-safe)."""
    return threads > 1 and implementation("cpu") != "triton"


def _per_table(work: Callable[[int], _T], num_tables: int, threads: int) -> list[_T]:
    """``[work(t) for t in range(num_tables)]``, tables on threads (each table's SSD
    store is its own; the native record reads and writes and most torch ops run
    without the GIL). An error of one table is raised once every table is done."""
    global _POOL
    if num_tables == 1 or not _threads(threads):
        return [work(t) for t in range(num_tables)]
    if _POOL is None or _POOL[0] != os.getpid():
        _POOL = (os.getpid(), ThreadPoolExecutor(TIER_THREADS, thread_name_prefix="kvemb-tier"))
    futures = [_POOL[1].submit(work, t) for t in range(num_tables)]
    wait(futures)
    return [f.result() for f in futures]


def _beside(work: Callable[[int], None], num_tables: int, threads: int) -> Callable[[], None]:
    """Start ``work(t)`` for every table on the threads of ``_per_table`` (on the
    calling thread, at once, for one table or with one torch thread: a lone
    table's host-tier work beside the calling thread's took 12.4 against 12.2 ms
    a step inline, ``benchmarks.host_tier`` sizes, 2 threads); the callable
    returned waits for them and raises the first error."""
    if num_tables == 1 or not _threads(threads):
        for t in range(num_tables):
            work(t)
        return lambda: None
    global _POOL
    if _POOL is None or _POOL[0] != os.getpid():
        _POOL = (os.getpid(), ThreadPoolExecutor(TIER_THREADS, thread_name_prefix="kvemb-tier"))
    futures = [_POOL[1].submit(work, t) for t in range(num_tables)]

    def done() -> None:
        wait(futures)
        for f in futures:
            f.result()

    return done


@contextmanager
def _serial_torch_ops() -> Iterator[int]:
    """torch's intra-op threads at one while the step's tier work runs; yields the
    caller's thread count, which the native group kernel keeps.

    why: the tiered step's bookkeeping is many small torch indexing ops (a host
    tier's ids, scores and records, its index), and with 2 threads each of a few
    thousand items forks torch's OpenMP team; a fork that finds the other thread
    asleep or descheduled waited for it, up to milliseconds under load (an
    ``index_put_`` of 3,200 ids: median 9 us, worst 12-19 ms of 40 at load 3.7,
    against 14 us with one thread). The step took 140.8 against 42.3 ms so at load
    3.6-4.3 (docs/tiers.md, Measured)."""
    threads = torch.get_num_threads()
    if threads == 1:
        yield 1
        return
    torch.set_num_threads(1)
    try:
        yield threads
    finally:
        torch.set_num_threads(threads)


@contextmanager
def _torch_threads(threads: int) -> Iterator[None]:
    """torch's intra-op threads at ``threads`` for a native call inside
    ``_serial_torch_ops`` that sizes its own work by them (the host exchange's row
    copies: 1.06 against 1.24 ms with 2 threads, ``benchmarks.host_tier`` sizes)."""
    if threads == torch.get_num_threads():
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _native_pass(
    layout: GroupLayout,
    storage: TableStorage,
    ids: torch.Tensor,
    table_idx: torch.Tensor,
    steps: torch.Tensor,
    custom_scores: torch.Tensor | None,
    custom_tables: Sequence[bool] | None,
    fetched: Sequence[_Fetched] | None,
    tables: Sequence[KVTable],
    threads: int,
) -> native.TrainLookup:
    """The native kernel's pass (CPU tensors): the promotions as a ``TierPromotion``,
    or (``fetched`` None: tiers that exchange rows) the tiers' indexes to probe."""
    T = len(tables)
    counter = None
    if layout.has_admission:
        counter = native.CounterIndex(storage.counter_keys, storage.counter_scores, storage.counts)
    rows = layout.total_buckets * storage.keys.shape[1]
    if fetched is None:
        arrays = tuple(table.tier.probe_arrays() for table in tables)
        index = [native.tier_index_row(*a) for a in arrays]
        tier = native.TierIndex(torch.tensor(index, dtype=torch.int64), arrays)
    else:
        promote_offsets = None
        if T > 1:
            promote_offsets = torch.zeros(T + 1, dtype=torch.int64)
            promote_offsets[1:] = torch.tensor([f.ids.numel() for f in fetched]).cumsum(0)
        tier = native.TierPromotion(
            fetched[0].ids.contiguous() if T == 1 else torch.cat([f.ids for f in fetched]),
            fetched[0].scores.contiguous() if T == 1 else torch.cat([f.scores for f in fetched]),
            promote_offsets,
        )
    return native.lookup_train_group(
        layout,
        storage.keys,
        storage.scores,
        storage.weights[:rows],
        storage.state[:rows],
        ids,
        table_idx,
        steps,
        custom_scores,
        custom_tables,
        counter,
        num_threads=threads,
        workspace=workspace(),
        tier=tier,
    )


def lookup_train_tiers(
    tables: Sequence[KVTable],
    layout: GroupLayout,
    storage: TableStorage,
    row_offsets: Sequence[int],
    ids: torch.Tensor,
    table_idx: torch.Tensor,
    custom_scores: torch.Tensor | None,
    custom_tables: Sequence[bool] | None,
    steps: torch.Tensor,
) -> GroupLookup:
    """``lookup_train`` of ``tables`` (``TieredKVTable``s, sharing ``storage``: table
    ``t``'s rows from ``row_offsets[t]`` on) for ``ids`` with ``table_idx`` (-1: not
    theirs), by the native kernel on CPU tensors, the Triton kernels where
    ``backend.implementation`` says so (see the module docstring). Every table has
    written its scratch rows back and the pad has begun the batch. ``steps [T]``:
    the tables' step clocks (a row of ``KVTableGroup.clocks``, or a lone table's
    ``clock[0:1]``: views of each table's ``clock``), which each table advances
    once the disk has room. Returns global slots and each id's unique row. The
    torch ops of the tier work run on one thread (``_serial_torch_ops``); the
    native kernel and the tables' tier threads keep the caller's count."""
    with _serial_torch_ops() as threads:
        return _lookup_train_tiers(
            tables, layout, storage, row_offsets, ids, table_idx, custom_scores,
            custom_tables, steps, threads,
        )  # fmt: skip


def _lookup_train_tiers(
    tables: Sequence[KVTable],
    layout: GroupLayout,
    storage: TableStorage,
    row_offsets: Sequence[int],
    ids: torch.Tensor,
    table_idx: torch.Tensor,
    custom_scores: torch.Tensor | None,
    custom_tables: Sequence[bool] | None,
    steps: torch.Tensor,
    threads: int,
) -> GroupLookup:
    """``lookup_train_tiers`` with torch's threads at one; ``threads``: the caller's."""
    T = len(tables)
    ids = ids.contiguous()
    device = ids.device
    triton = implementation(device) == "triton"
    missed = None  # the Triton path: each table's missed ids, probed on this thread
    if triton:  # (device work stays on the calling thread, its stream: the threads' is host)
        missed = [_missed(tables[t], ids[table_idx == t] if T > 1 else ids).cpu() for t in range(T)]

    # A CPU group whose tiers all trade rows with the table's arrays directly: the
    # kernel probes their indexes itself, and each table's tier share is one
    # ``exchange`` (``_exchange``): no lookups before, no row buffers after.
    direct = not triton and all(table.tier.exchanges_rows for table in tables)

    def fetch(t: int) -> _Fetched:
        if missed is not None:
            fetched = _Fetched(tables[t], missed[t], missed=True)
        else:
            fetched = _Fetched(tables[t], ids[table_idx == t] if T > 1 else ids)
        tables[t].reserve_batch(fetched.misses)  # every eviction makes room for a missed id
        return fetched

    fetched = None
    if direct:
        for table in tables:  # room for as many evictions as the batch has ids
            table.reserve_batch(ids.numel())
    else:
        fetched = _per_table(fetch, T, threads)
    for table in tables:  # ``steps`` is their clocks' step row: the kernel reads it
        table.advance_step()
    if triton:
        out = lookup_train_triton(
            layout, storage, ids, table_idx, steps, custom_scores, custom_tables,
            [f.ids for f in fetched], [f.scores for f in fetched],
        )  # fmt: skip
    else:
        out = _native_pass(
            layout,
            storage,
            ids,
            table_idx,
            steps,
            custom_scores,
            custom_tables,
            fetched,
            tables,
            threads,
        )
    flags = out.unique_flags
    unique_index = out.unique_index
    metrics = out.metrics.tolist()
    from_ssd = (flags & native.UNIQUE_PROMOTED) != 0
    new = (flags & native.UNIQUE_INSERTED) != 0
    no_room = (flags & native.UNIQUE_NO_ROOM) != 0
    owner = out.unique_table
    prom = from_ssd.nonzero().squeeze(1)
    if direct:
        up_rows, row_of, promoted_rows = _exchange(tables, storage, row_offsets, out, prom, threads)
        tiers_done = None
    else:
        if prom.numel() != sum(f.ids.numel() for f in fetched):
            raise RuntimeError(
                f"{prom.numel()} ids promoted by the kernel, "
                f"{sum(f.ids.numel() for f in fetched)} held by the tiers"
            )
        up_rows, row_of, up, promoted_rows, tiers_done = _moves(
            tables, storage, row_offsets, out, fetched, prom, device, threads
        )
    promoted_occ = [0] * T  # id occurrences served by a tier (``ssd_hits``)
    if prom.numel() and T == 1:  # every id is the table's
        promoted_occ = [int(from_ssd[unique_index].sum())]
    elif prom.numel():
        theirs = unique_index >= 0
        promoted = theirs & from_ssd[unique_index.clamp(min=0)]
        promoted_occ = torch.bincount(table_idx[promoted], minlength=T).tolist()
    for t, table in enumerate(tables):
        for name, value in zip(METRIC_NAMES[:KERNEL_METRICS], metrics[t], strict=True):
            table.count(name, value)
        table.count("ssd_hits", promoted_occ[t])
        table.count("ssd_misses", metrics[t][1] - promoted_occ[t])
        table.count("promotions", promoted_rows[t])

    def in_memory(t: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Table ``t``'s new rows (the group's arrays only); its ids without a memory
        row ``(positions in the uniques, ids, rows)`` (None: none)."""
        table, offset = tables[t], row_offsets[t]
        mine = owner == t if T > 1 else None
        fresh = (new if mine is None else mine & new).nonzero().squeeze(1)
        table.init_rows_at(out.unique_slots[fresh] - offset, out.unique_ids[fresh])
        pad = (no_room if mine is None else mine & no_room).nonzero().squeeze(1)
        if pad.numel() == 0:
            return None
        pad = pad[torch.argsort(out.unique_ids[pad])]  # a pad share holds its ids sorted
        pad_ids = out.unique_ids[pad]
        state = torch.zeros(pad.numel(), table.state_dim, device=device)
        pad_rows = torch.cat([table.initial_rows(pad_ids), state], dim=1)
        back = from_ssd[pad].nonzero().squeeze(1)
        if back.numel():
            pad_rows[back] = up_rows[row_of[pad[back]]].to(pad_rows.dtype)
        return pad, pad_ids, pad_rows

    if tiers_done is None:  # the exchanges moved every row: new rows may take slots now
        padded_rows = [in_memory(t) for t in range(T)]
    else:
        try:
            if up is not None:
                scatter_up(storage.weights, storage.state, *up)
            padded_rows = [in_memory(t) for t in range(T)]
        finally:
            tiers_done()

    slots_u = None  # the unique slots with the scratch rows' (made if there are any)
    for t, padded in enumerate(padded_rows):
        if padded is None:
            continue
        if slots_u is None:
            slots_u = out.unique_slots.clone()
        pad, pad_ids, pad_rows = padded
        local = tables[t].write_scratch(pad_rows, pad_ids, out.unique_scores[pad])
        slots_u[pad] = local + row_offsets[t]
    for table in tables:  # TTL tables (LRU: scores are last steps) sweep every tier
        if table.ttl is not None:
            table.ttl.sweep()
    if slots_u is None:
        return GroupLookup(out.slots, unique_index, out.unique_slots, owner)
    slots = torch.where(unique_index >= 0, slots_u[unique_index.clamp(min=0)], -1)
    return GroupLookup(slots, unique_index, slots_u, owner)


def _exchange(
    tables: Sequence[KVTable],
    storage: TableStorage,
    row_offsets: Sequence[int],
    out: native.TrainLookup,
    prom: torch.Tensor,
    threads: int,
) -> tuple[torch.Tensor | None, torch.Tensor | None, list[int]]:
    """The tiers' share where each trades rows with the group's arrays directly
    (``LowerTier.exchange``, CPU): per table, its evicted rows go down and its
    promoted rows (the uniques ``prom`` of the kernel, at the tier slots it
    found) come up in one ``exchange_lower``, each row copied once. Returns the
    rows of the promoted ids that got no memory row (read first, for their
    scratch rows; None: none), each promoted unique's position among them (-1:
    none), and each table's rows promoted to memory."""
    T = len(tables)
    weights, state = storage.weights, storage.state
    ev_owner = prom_owner = None
    if T > 1:
        starts = torch.tensor(list(row_offsets[1:]), dtype=torch.int64)
        ev_owner = torch.searchsorted(starts, out.evicted_slots, right=True)
        prom_owner = out.unique_table[prom]
    stays, stay_rows, promoted_rows = [], [], [0] * T
    for t, table in enumerate(tables):
        ev = (ev_owner == t).nonzero().squeeze(1) if ev_owner is not None else None
        mine = prom[prom_owner == t] if prom_owner is not None else prom
        evicted = [out.evicted_slots, out.evicted_ids, out.evicted_scores]
        if ev is not None:
            evicted = [x[ev] for x in evicted]
        if evicted[0].numel() == 0 and mine.numel() == 0:
            continue
        up_ids, up_slots = out.unique_ids[mine], out.unique_slots[mine]
        tier_slots = out.unique_tier_slots[mine]
        stay = (up_slots < 0).nonzero().squeeze(1)
        if stay.numel():
            stays.append(mine[stay])
            stay_rows.append(table.tier.read_rows(tier_slots[stay]))
        promoted_rows[t] = mine.numel() - stay.numel()
        with _torch_threads(threads):
            table.exchange_lower(weights, state, *evicted, up_ids, tier_slots, up_slots)
    if not stays:
        return None, None, promoted_rows
    at = torch.cat(stays)
    row_of = torch.full((out.unique_ids.numel(),), -1, dtype=torch.int64)
    row_of[at] = torch.arange(at.numel())
    return torch.cat(stay_rows), row_of, promoted_rows


def _moves(
    tables: Sequence[KVTable],
    storage: TableStorage,
    row_offsets: Sequence[int],
    out: native.TrainLookup,
    fetched: Sequence[_Fetched],
    prom: torch.Tensor,
    device: torch.device,
    threads: int,
) -> tuple[
    torch.Tensor,
    torch.Tensor | None,
    tuple[torch.Tensor, torch.Tensor] | None,
    list[int],
    Callable[[], None],
]:
    """The tiers' share through ``fetch``, ``remove`` and ``put``: every table's
    evicted rows leave by one gather of the group's arrays (``gather_down``) before
    any slot is refilled, the tiers take them (and give up their promoted ids) on
    the tier threads beside the caller (``_beside``; the callable returned waits for
    them), and the promoted rows go up in one buffer (``rows_up``). Returns that
    buffer, each promoted unique's row in it (-1: none), the ``(slots, rows)`` of
    the promoted rows that take memory slots (None: none; the caller scatters them
    while the tiers work), each table's promoted rows, and the wait."""
    T = len(tables)
    owner = out.unique_table
    down = None
    if out.evicted_slots.numel():
        down = gather_down(storage.weights, storage.state, out.evicted_slots)
    # What the tiers take of the evictions, in host memory (no copies on the CPU).
    ev_ids, ev_scores = out.evicted_ids.cpu(), out.evicted_scores.cpu()
    ev_owner = None  # the table of each evicted row (a group of one: all its own)
    if T > 1:
        starts = torch.tensor(list(row_offsets[1:]), dtype=torch.int64)
        ev_owner = torch.searchsorted(starts, out.evicted_slots.cpu(), right=True)
    # Up: the promoted uniques in (table, id) order are the rows of ``up_rows`` (the
    # tiers' rows, table by table, ascending ids: one copy up); those with a memory
    # slot go up in one scatter, the others (no room) to scratch rows.
    up_rows = rows_up([f.rows for f in fetched], device)
    row_of = None  # position in ``up_rows`` of each promoted unique
    up = None  # (slots, rows) of the promoted rows that take memory slots
    promoted_rows = [0] * T
    if prom.numel():
        prom = prom[torch.sort(out.unique_ids[prom], stable=True).indices]
        if T > 1:
            prom = prom[torch.sort(owner[prom], stable=True).indices]
        row_of = torch.full((out.unique_ids.numel(),), -1, dtype=torch.int64, device=device)
        row_of[prom] = torch.arange(prom.numel(), device=device)
        up_slots = out.unique_slots[prom]
        moved = up_slots >= 0
        up = (up_slots, up_rows)
        if not bool(moved.all()):
            at = moved.nonzero().squeeze(1)
            up = (up_slots[at], up_rows[at])
        if T > 1:
            promoted_rows = torch.bincount(owner[prom][moved], minlength=T).tolist()
        else:
            promoted_rows = [int(moved.sum())]
    down_rows = down.rows() if down is not None else None

    def to_tier(t: int) -> None:
        """Table ``t``'s tiers' share: promoted ids leave them, its demoted rows go
        down (host arrays and files only)."""
        table, f = tables[t], fetched[t]
        table.tier.remove(f.ssd_slots)  # every promotion leaves the tier: memory or scratch
        if down_rows is not None:
            gone = (ev_owner == t).nonzero().squeeze(1) if ev_owner is not None else slice(None)
            table.demote_rows(ev_ids[gone], ev_scores[gone], down_rows[gone])

    # The tiers' work (host arrays, files) and the memory rows' (the group's arrays)
    # touch different memory: for several tables with threads, the tiers' runs
    # beside the calling thread, which writes the promoted and new rows.
    return up_rows, row_of, up, promoted_rows, _beside(to_tier, T, threads)
