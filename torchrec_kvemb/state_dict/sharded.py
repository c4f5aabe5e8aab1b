"""KV table entries as ShardedTensors: one shard per rank holding that rank's rows.

A sharded table's ranks hold different numbers of rows, known only at
``state_dict()`` time: :func:`gather_row_counts` learns every rank's (one
``all_gather_object``), :func:`row_sharded_tensor` builds a ShardedTensor from
them, :func:`sharded_entries` all entries of a sharded collection's KV tables.

Example::

    shards = gather_row_counts([ids.numel()], device, group)   # collective
    weight_id = row_sharded_tensor(ids, shards.counts(0), shards.placements, shards.me, group)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardMetadata
from torch.distributed._shard.sharded_tensor.metadata import (
    ShardedTensorMetadata,
    TensorProperties,
)

from torchrec_kvemb.state_dict.layout import TableLayout
from torchrec_kvemb.state_dict.rows import ADMISSION_KEYS, LAST_SEEN_KEY, table_state


@dataclass(frozen=True)
class RowCounts:
    """What every rank of a group told the others (see :func:`gather_row_counts`).

    Example::

        shards = gather_row_counts([n_user, n_item], "cpu", group)
        shards.counts(1)   # rows of the second tensor on each rank
    """

    #: ``rank:<global rank>/<device>`` of each rank of the group, in group order.
    placements: list[str]
    #: Each rank's values, None where a rank has none.
    values: list[Any]
    #: This rank's index in the group.
    me: int

    def counts(self, i: int) -> list[int]:
        """Entry ``i`` of every rank's list of counts (0 where a rank has none)."""
        return [0 if v is None or v[i] is None else v[i] for v in self.values]


def gather_row_counts(values: Any, device: str, group: dist.ProcessGroup | None) -> RowCounts:
    """Every rank's ``values`` (e.g. row counts) and device: one ``all_gather_object``
    over ``group`` (a collective: call it on every rank of the group)."""
    world = dist.get_world_size(group)
    gathered: list = [None] * world
    dist.all_gather_object(gathered, (device, values), group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(world))
    placements = [f"rank:{ranks[r]}/{gathered[r][0]}" for r in range(world)]
    return RowCounts(placements, [g[1] for g in gathered], dist.get_rank(group))


def row_sharded_tensor(
    value: torch.Tensor | None,
    counts: Sequence[int],
    placements: Sequence[str],
    me: int | None,
    group: dist.ProcessGroup | None,
    tail: tuple[int, ...] | None = None,
    dtype: torch.dtype | None = None,
) -> ShardedTensor:
    """A ShardedTensor of ``sum(counts)`` rows, shard ``i`` (on ``placements[i]``)
    holding ``counts[i]`` of them at offset ``sum(counts[:i])``; ``value`` is shard
    ``me`` (None: an empty one, of ``tail`` and ``dtype``). Zero-row shards are
    kept: DCP and ShardedTensor need every rank's shard, and a table may be empty.

    Zero-row shards sit at the end offset: DCP keys a saved chunk by (name, offset),
    so an empty shard at a real shard's offset could replace it in the save plan.
    """
    if value is not None:
        tail, dtype = tuple(value.shape[1:]), value.dtype
    total = sum(counts)
    shards_md = []
    offset = 0
    for placement, n in zip(placements, counts, strict=True):
        at = offset if n else total
        shards_md.append(ShardMetadata([at] + [0] * len(tail), [n, *tail], placement))
        offset += n
    metadata = ShardedTensorMetadata(
        shards_md, torch.Size([total, *tail]), TensorProperties(dtype=dtype)
    )
    local = []
    if me is not None:
        if value is None:
            device = placements[me].split("/", 1)[1]
            value = torch.empty((0, *tail), dtype=dtype, device=device)
        local = [Shard(value.contiguous(), shards_md[me])]
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local, metadata, process_group=group
    )


def sharded_entries(
    layouts: list[TableLayout], group: dist.ProcessGroup | None
) -> dict[str, dict[str, Any]]:
    """Every KV table's state_dict entries as ShardedTensors over ``group``: one shard
    per rank with that rank's rows (a collective: one ``all_gather_object``)."""
    local: list[dict[str, torch.Tensor] | None] = []
    info = []
    for layout in layouts:
        if layout.table is None:
            local.append(None)
            info.append(None)
            continue
        state = table_state(layout.table)
        lo, hi = layout.owned
        state["bucket"] = state["bucket"][lo:hi]
        local.append(state)
        info.append(
            {
                "rows": state["weight_id"].numel(),
                "admission": state["admission_id"].numel() if layout.admission else 0,
                "step": state["step"].tolist(),
                "state_shapes": layout.table.optim.state_shapes(layout.dim),
                "bucket": hi - lo,
                "last_seen": LAST_SEEN_KEY in state,
                "columns": layout.columns,
            }
        )
    shards = gather_row_counts(info, _device_of(layouts), group)
    out: dict[str, dict[str, Any]] = {}
    for i, layout in enumerate(layouts):
        holders = [v[i] for v in shards.values]
        known = [h for h in holders if h is not None]
        if not known:
            continue  # no rank holds it (cannot happen for a planned table)
        mine = local[i]
        if layout.sharding == "column_wise":
            out[layout.name] = column_entries(layout, mine, holders, shards, group)
            continue

        def sharded(key: str, field: str, tail: tuple[int, ...], dtype) -> ShardedTensor:
            counts = [0 if h is None else h[field] for h in holders]  # noqa: B023
            value = None if mine is None else mine[key]  # noqa: B023
            return row_sharded_tensor(
                value, counts, shards.placements, shards.me, group, tail, dtype
            )

        entries: dict[str, Any] = {
            "weight": sharded("weight", "rows", (layout.dim,), layout.weights_dtype),
            "weight_id": sharded("weight_id", "rows", (), torch.int64),
            "weight_score": sharded("weight_score", "rows", (), torch.int64),
        }
        for name, tail in known[0]["state_shapes"].items():
            entries[name] = sharded(name, "rows", tail, torch.float32)
        if known[0].get("last_seen"):
            entries[LAST_SEEN_KEY] = sharded(LAST_SEEN_KEY, "rows", (), torch.int64)
        entries["bucket"] = sharded("bucket", "bucket", (), torch.int64)
        steps = [h["step"] for h in known]
        entries["step"] = torch.tensor([max(s[0] for s in steps), max(s[1] for s in steps)])
        if layout.admission:
            for key in ADMISSION_KEYS:
                entries[key] = sharded(key, "admission", (), torch.int64)
        out[layout.name] = entries
    return out


def column_sharded_tensor(
    value: torch.Tensor | None,
    rows: int,
    dim: int,
    pieces: Sequence[tuple[int, int] | None],
    placements: Sequence[str],
    me: int | None,
    group: dist.ProcessGroup | None,
    dtype: torch.dtype,
) -> ShardedTensor:
    """A ShardedTensor ``[rows, dim]`` cut by columns: shard ``i`` (on ``placements[i]``)
    holds the columns ``pieces[i] = (first, width)`` of every row, a rank without a
    piece a zero-size shard (at the end, as in :func:`row_sharded_tensor`); ``value``
    is shard ``me``."""
    shards_md = []
    for placement, piece in zip(placements, pieces, strict=True):
        if piece is None:
            shards_md.append(ShardMetadata([rows, 0], [0, dim], placement))
        else:
            shards_md.append(ShardMetadata([0, piece[0]], [rows, piece[1]], placement))
    metadata = ShardedTensorMetadata(
        shards_md, torch.Size([rows, dim]), TensorProperties(dtype=dtype)
    )
    local = []
    if me is not None:
        if value is None:
            device = placements[me].split("/", 1)[1]
            value = torch.empty((0, dim), dtype=dtype, device=device)
        local = [Shard(value.contiguous(), shards_md[me])]
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        local, metadata, process_group=group
    )


def column_entries(
    layout: TableLayout,
    mine: dict[str, torch.Tensor] | None,
    holders: list[dict | None],
    shards: RowCounts,
    group: dist.ProcessGroup | None,
) -> dict[str, Any]:
    """The entries of a column-wise table: every shard holds the same ids in the same
    order, so ``weight`` and Adam's moments are cut by columns (each rank's shard at
    ``(0, first column)``), and the per-row entries (ids, scores, buckets, admission,
    last steps) come from the shard of the first columns alone (the others give
    zero-row shards). Row-wise Adagrad's ``momentum1``, kept per shard over its
    columns, is saved as its mean over all columns: ``sum(width_i * m_i) / dim``
    (one ``all_reduce`` over ``group``; what one whole-width state would average)."""
    known = [h for h in holders if h is not None]
    first = next(r for r, h in enumerate(holders) if h is not None and h["columns"][0] == 0)
    rows = holders[first]["rows"]
    me = shards.me
    pieces = [None if h is None else tuple(h["columns"]) for h in holders]

    def by_first(key: str, field: str, tail: tuple[int, ...], dtype) -> ShardedTensor:
        counts = [holders[first][field] if r == first else 0 for r in range(len(holders))]
        value = mine[key] if mine is not None and me == first else None
        return row_sharded_tensor(value, counts, shards.placements, me, group, tail, dtype)

    def by_columns(key: str, dtype) -> ShardedTensor:
        value = None if mine is None else mine[key]
        return column_sharded_tensor(
            value, rows, layout.dim, pieces, shards.placements, me, group, dtype
        )

    entries: dict[str, Any] = {
        "weight": by_columns("weight", layout.weights_dtype),
        "weight_id": by_first("weight_id", "rows", (), torch.int64),
        "weight_score": by_first("weight_score", "rows", (), torch.int64),
    }
    for name, tail in known[0]["state_shapes"].items():
        if tail:
            entries[name] = by_columns(name, torch.float32)
            continue
        total = torch.zeros(rows, dtype=torch.float32, device=_device_of([layout]))
        if mine is not None:
            total += mine[name].to(torch.float32) * layout.columns[1]
        dist.all_reduce(total, group=group)
        value = total / layout.dim if me == first else None
        counts = [rows if r == first else 0 for r in range(len(holders))]
        entries[name] = row_sharded_tensor(
            value, counts, shards.placements, me, group, (), torch.float32
        )
    if known[0].get("last_seen"):
        entries[LAST_SEEN_KEY] = by_first(LAST_SEEN_KEY, "rows", (), torch.int64)
    entries["bucket"] = by_first("bucket", "bucket", (), torch.int64)
    steps = [h["step"] for h in known]
    entries["step"] = torch.tensor([max(s[0] for s in steps), max(s[1] for s in steps)])
    if layout.admission:
        for key in ADMISSION_KEYS:
            entries[key] = by_first(key, "admission", (), torch.int64)
    return entries


def _device_of(layouts: list[TableLayout]) -> str:
    """The device of this rank's tables, with its index (``cuda:0``, not ``cuda``: a
    shard's placement must name the device its tensor is on)."""
    for layout in layouts:
        if layout.table is not None:
            device = torch.device(layout.table.device)
            if device.type == "cuda" and device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            return str(device)
    return "cpu"
