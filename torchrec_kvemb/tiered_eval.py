"""The evaluation lookup of a group of tables over lower tiers: one move per direction.

A group of tables over tiers (``KVTableGroup`` with a scratch pad) looks an
evaluation batch up in three stages, whatever the number of tables, so that the
rows cross between the group's arrays and the tables' tiers in one gather and
one scatter per step, as its training lookup's do (``tiered_lookup``; docs/tiers.md,
"Transfers"):

1. per table, ``TieredKVTable.plan_eval`` on its ids: the ids the tiers hold are
   read (into host memory) and compete for memory rows; no row moves yet;
2. the rows those promotions evict, of every table, leave by one
   ``gather_down`` of the group's arrays, before any slot is refilled, and each
   table's tiers take their slice (``demote_rows``); then the promoted rows of
   every table go up as one host buffer (``rows_up``: one copy up) and those
   with memory slots land by one ``scatter_up``;
3. per table, ``finish_eval``: the promoted rows' scores, and scratch rows (from
   the buffer up) for the promoted ids that found no memory row.

A lone table's ``lookup_eval`` is the same stages with its own transfers; the
group table by table (``KVTableGroup.lookup_eval_per_table``) is the reference
this equals bit for bit where no table grows (tests/test_tiered_eval.py). The
stages run on every backend: table by table, a table that grows mid-batch
would replace the scratch pad under the rows an earlier table wrote. The tables
are ``TieredKVTable``s, typed by their base (``KVTable``) as in ``tiered_lookup``:
the module stays below ``tiered``, and ``group`` at its layer.

Example::

    slots = lookup_eval_tiers(group.tables, ids, table_idx)  # global slots, -1: absent
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torchrec_kvemb.table import KVTable
from torchrec_kvemb.tiered_triton import rows_up
from torchrec_kvemb.transfers import gather_down, scatter_up


def lookup_eval_tiers(
    tables: Sequence[KVTable], ids: torch.Tensor, table_idx: torch.Tensor
) -> torch.Tensor:
    """Global slots of an evaluation batch of ``tables`` (a group's, sharing its arrays
    and scratch pad) for ``ids`` with ``table_idx`` (-1: not theirs): -1 where an id
    has no row (see the module docstring). The group's batch has begun (scratch rows
    written back, the pad started over)."""
    T = len(tables)
    device = ids.device
    mine = [(table_idx == t).nonzero().squeeze(1) for t in range(T)]
    plans = [table.plan_eval(ids[m], on_host=True) for table, m in zip(tables, mine, strict=True)]
    # why read after the plans: a table below its maximum grows in its plan, which
    # reallocates the group's arrays and moves the tables' first rows (the pad's
    # shares follow them).
    weights, state = tables[0].scratch.pad.arrays
    offsets = [table.scratch.row_offset for table in tables]

    evicted = [p.evicted_slots + offset for p, offset in zip(plans, offsets, strict=True)]
    if sum(e.numel() for e in evicted):
        down = gather_down(weights, state, torch.cat(evicted)).rows()
        start = 0
        for table, plan in zip(tables, plans, strict=True):
            n = plan.evicted_ids.numel()
            table.demote_rows(plan.evicted_ids, plan.evicted_scores, down[start : start + n])
            start += n

    # Up: every table's promoted rows in one buffer (table by table), one copy up;
    # those with memory slots in one scatter, the others to scratch rows from it.
    starts = torch.tensor([0] + [p.rows.shape[0] for p in plans]).cumsum(0).tolist()
    up_rows = rows_up([p.rows for p in plans], device) if starts[-1] else None
    placed = [p.placed.to(device) + s for p, s in zip(plans, starts[:-1], strict=True)]
    if sum(p.numel() for p in placed):
        slots = torch.cat([p.placed_slots + o for p, o in zip(plans, offsets, strict=True)])
        scatter_up(weights, state, slots, up_rows[torch.cat(placed)])

    out = torch.full_like(ids, -1)
    for t, (table, plan) in enumerate(zip(tables, plans, strict=True)):
        rows = None if up_rows is None else up_rows[starts[t] : starts[t + 1]]
        local = table.finish_eval(plan, rows)
        out[mine[t]] = torch.where(local >= 0, local + offsets[t], -1)
    return out
