"""KV rows between ranks for a new plan, by id, through collectives (no files).

Each KV table's rows leave their old shard as a checkpoint exports them
(:func:`~torchrec_kvemb.state_dict.table_state` read back by
:func:`~torchrec_kvemb.state_dict.rows_from_entries`: ids, rows, every optimizer
state, eviction scores, TTL last-seen steps, admission counters, step counters),
travel to the rank that owns each id under the new plan by
``all_to_all_single`` (each per-row column as bytes, so any row dtype and gloo
or nccl carry it), and replace the content of the new shard with
:func:`~torchrec_kvemb.state_dict.restore_table`, in checkpoint order (routing
bucket, then id), as a checkpoint load would. Step counters are the largest over
the old shards and learning rates those of the old shards, as a checkpoint saves
them.

Example::

    moved = exchange_tables(old_layouts, new_layouts, ranks, world_size, group, device)
    place_tables(new_layouts, moved, group)   # both collectives
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from torchrec_kvemb.checkpoint import collectives as comm
from torchrec_kvemb.checkpoint.optimizer_state import restore_learning_rates
from torchrec_kvemb.sharding.rw import owner_rank
from torchrec_kvemb.state_dict import (
    KVTableSlot,
    TableLayout,
    TableRows,
    check_fits,
    check_table_rows,
    restore_table,
    rows_from_entries,
    table_state,
)
from torchrec_kvemb.state_dict.rows import bucket_order
from torchrec_kvemb.ttl import uses_last_seen


@dataclass
class MovedTable:
    """What one rank receives of one table for its new shard, and the table's
    learning rate (that of its old shards)."""

    rows: TableRows | None
    lr: float | None


def destination(layout: TableLayout, ranks: Sequence[int], ids: torch.Tensor) -> torch.Tensor:
    """The rank each id goes to under a new layout (``ranks``: the plan's): its
    routing bucket's owner over the world (row-wise) or over the table's node
    (table-row-wise: ``ranks[bucket // (G / L)]``, ``L = len(ranks)``), or the rank
    holding the table (table-wise, ``ranks[0]``). Column-wise rows cannot move."""
    if layout.sharding == "row_wise":
        return owner_rank(ids, layout.num_buckets, len(ranks))
    if layout.sharding == "table_row_wise":
        local = owner_rank(ids, layout.num_buckets, len(ranks))
        return torch.tensor(list(ranks), dtype=torch.int64, device=ids.device)[local]
    if layout.sharding == "table_wise":
        return torch.full_like(ids, ranks[0])
    raise ValueError(f"table {layout.name!r}: rows of a {layout.sharding} table cannot move")


def exchange_tables(
    old: Sequence[TableLayout],
    new: Sequence[TableLayout],
    new_ranks: dict[str, list[int]],
    world_size: int,
    group: dist.ProcessGroup | None,
    device: torch.device | None = None,
) -> dict[str, MovedTable]:
    """Every KV table's rows from its old shards (``old``: layouts before, this rank's
    view) to its new ones (``new``: after; ``new_ranks``: the ranks each table's new
    plan names), by table name. A collective over ``group``: every rank calls it with
    layouts of the same tables in the same order. ``device``: where the tables live
    (the tensors the collectives exchange; CPU by default). Nothing of the old tables
    changes."""
    held = {layout.name: layout for layout in old if layout.table is not None}
    # Small facts of every old shard: its counters, learning rate and export columns
    # (which every rank needs: each column is one collective, also for a rank that
    # holds no shard of the table, old or new).
    known = comm.gather(
        {
            name: (
                (layout.table.step, layout.table.optim_step),
                layout.learning_rate(),
                [(n, c.dtype, tuple(c.shape[1:])) for n, c in _columns(_empty_rows(layout))],
            )
            for name, layout in held.items()
        },
        group,
    )
    out: dict[str, MovedTable] = {}
    for after in new:
        name = after.name
        holders = [part[name] for part in known if name in part]
        if not holders:  # no rank holds the table (a planned table always has a shard)
            out[name] = MovedTable(None, None)
            continue
        steps = [s for s, _, _ in holders]
        step = (max(s[0] for s in steps), max(s[1] for s in steps))
        spec = holders[0][2]
        # One table's export at a time: the old shards, the new ones and one copy.
        rows = None
        if name in held:
            rows = rows_from_entries(name, table_state(held[name].table))
        got = _exchange_table(
            after, rows, spec, new_ranks[name], world_size, group, device or torch.device("cpu")
        )
        del rows
        if got is not None:
            got.step = step
        out[name] = MovedTable(got, holders[0][1])
    return out


def place_tables(
    new: Sequence[TableLayout], moved: dict[str, MovedTable], group: dist.ProcessGroup | None
) -> None:
    """Check the received rows against the new shards on every rank, then load them
    and the learning rates. A collective: any rank's error raises on all (as a
    ``CheckpointError``, a ``ValueError``), touching new shards only."""
    error = None
    try:
        for layout in new:
            rows = moved[layout.name].rows
            if layout.table is None or rows is None:
                continue
            shapes = layout.table.optim.state_shapes(layout.dim)
            check_table_rows(layout.name, layout.dim, shapes, rows, layout.num_buckets)
            check_fits(layout.table, rows)
    except Exception as e:
        error = e
    comm.agree(error, group)
    error = None
    try:  # a failure here (e.g. a full host tier) leaves new shards only: agree on it too
        for layout in new:
            rows = moved[layout.name].rows
            if layout.table is not None and rows is not None:
                restore_table(layout.table, rows)
    except Exception as e:
        error = e
    comm.agree(error, group)
    slots = {f"{layout.name}.": KVTableSlot.of(layout) for layout in new}
    rates = {
        f"{layout.name}.": moved[layout.name].lr
        for layout in new
        if layout.table is not None and moved[layout.name].lr is not None
    }
    restore_learning_rates(slots, rates)


def _exchange_table(
    after: TableLayout,
    rows: TableRows | None,
    spec: list[tuple[str, torch.dtype, tuple[int, ...]]],
    ranks: list[int],
    world_size: int,
    group: dist.ProcessGroup | None,
    device: torch.device,
) -> TableRows | None:
    """This rank's rows of one table for its new shard (None where it holds none);
    ``spec``: the export columns (name, dtype, trailing shape) of the old shards."""
    if rows is not None:
        columns = [(n, c.to(device)) for n, c in _columns(rows)]
    else:
        columns = [
            (n, torch.empty((0, *tail), dtype=dtype, device=device)) for n, dtype, tail in spec
        ]
    ids = columns[0][1]
    received = _all_to_all(columns, destination(after, ranks, ids), world_size, group)
    admission = None
    if after.admission:
        adm = [(n, c.to(device)) for n, c in _admission_columns(rows)]
        got = _all_to_all(adm, destination(after, ranks, adm[0][1]), world_size, group)
        order = _checkpoint_order(got["ids"], after.num_buckets)
        admission = (got["ids"][order], got["counts"][order], got["scores"][order])
    if after.table is None:
        return None
    order = _checkpoint_order(received["ids"], after.num_buckets)
    return TableRows(
        ids=received["ids"][order],
        weights=received["weights"][order],
        scores=received["scores"][order],
        state={
            k.removeprefix("state."): v[order]
            for k, v in received.items()
            if k.startswith("state.")
        },
        admission=admission,
        last_seen=received["last_seen"][order] if "last_seen" in received else None,
    )


def _empty_rows(layout: TableLayout) -> TableRows:
    """No rows of a shard ``layout`` holds, with the columns (dtypes, trailing shapes)
    its checkpoint export has."""
    empty = torch.empty(0, dtype=torch.int64)
    table = layout.table
    shapes = table.optim.state_shapes(layout.dim)
    return TableRows(
        ids=empty,
        weights=torch.empty(0, layout.dim, dtype=table.weights.dtype),
        scores=empty,
        state={k: torch.empty(0, *s, dtype=torch.float32) for k, s in shapes.items()},
        admission=(empty, empty, empty),
        last_seen=empty if uses_last_seen(table.options) else None,
    )


def _columns(rows: TableRows) -> list[tuple[str, torch.Tensor]]:
    """The per-row columns, in one order on every rank (each is one collective)."""
    cols = [("ids", rows.ids), ("weights", rows.weights), ("scores", rows.scores)]
    cols += [(f"state.{k}", rows.state[k]) for k in sorted(rows.state)]
    if rows.last_seen is not None:
        cols.append(("last_seen", rows.last_seen))
    return cols


def _admission_columns(rows: TableRows | None) -> list[tuple[str, torch.Tensor]]:
    empty = torch.empty(0, dtype=torch.int64)
    held = rows is not None and rows.admission is not None
    ids, counts, scores = rows.admission if held else (empty,) * 3
    return [("ids", ids), ("counts", counts), ("scores", scores)]


def _checkpoint_order(ids: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """The permutation that puts ``ids`` in checkpoint order: routing bucket, then id."""
    by_id = torch.argsort(ids, stable=True)
    order, _ = bucket_order(ids[by_id], num_buckets)
    return by_id[order]


def _all_to_all(
    columns: list[tuple[str, torch.Tensor]],
    dest: torch.Tensor,
    world_size: int,
    group: dist.ProcessGroup | None,
) -> dict[str, torch.Tensor]:
    """Rows (one per entry of ``dest``) to their destination ranks: one count exchange,
    then one ``all_to_all_single`` per column, each as bytes (any dtype travels; the
    byte views cost no copy, and rows already in destination order are not permuted).
    """
    n = dest.numel()
    in_order = n < 2 or bool((dest[1:] >= dest[:-1]).all())
    order = None if in_order else torch.argsort(dest, stable=True)
    send_counts = torch.bincount(dest, minlength=world_size)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)
    total = int(recv_counts.sum())
    out = {}
    for name, column in columns:
        width = _row_bytes(column)
        rows = column if order is None else column[order]
        send = rows.contiguous().view(torch.uint8).reshape(n, width)
        recv = torch.empty(total, width, dtype=torch.uint8, device=column.device)
        dist.all_to_all_single(recv, send, recv_counts.tolist(), send_counts.tolist(), group=group)
        if total == 0:  # a byte view of no bytes has no strides to reinterpret
            out[name] = column.new_empty((0, *column.shape[1:]))
        else:
            out[name] = recv.view(column.dtype).reshape(total, *column.shape[1:])
    return out


def _row_bytes(column: torch.Tensor) -> int:
    """Bytes one row of ``column`` takes (also for an empty column)."""
    per_row = 1
    for size in column.shape[1:]:
        per_row *= size
    return per_row * column.element_size()
