"""A KV table's content: its state_dict entries, and rows that replace it.

:func:`table_state` gives a table's entries (key suffixes after
``embedding_bags.<table>.``, rows sorted by routing bucket, then id);
:class:`TableRows` is a content to load (ids, rows, scores, optimizer state,
counters, admission entries); :func:`restore_table` replaces a table's content
by checked rows.

Example::

    entries = table_state(table)    # {"weight": ..., "weight_id": ..., ...}
    restore_table(other_table, TableRows(entries["weight_id"], entries["weight"], None))
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace

import torch

from torchrec_kvemb.dispatch import route_bucket
from torchrec_kvemb.optimizer import STATE_NAMES
from torchrec_kvemb.state_dict.deferred import active as active_deferral
from torchrec_kvemb.table import KVTable
from torchrec_kvemb.ttl import (
    LAST_SEEN_KEY,
    last_seen_state,
    uses_last_seen,
    warn_without_last_seen,
)

ROW_KEYS = ("weight", "weight_id", "weight_score")
ADMISSION_KEYS = ("admission_id", "admission_count", "admission_score")
KNOWN_KEYS = frozenset(ROW_KEYS + STATE_NAMES + ADMISSION_KEYS + ("bucket", "step", LAST_SEEN_KEY))


@dataclass
class TableRows:
    """A table's content: ids with their rows, scores and optimizer state.

    Example::

        rows = TableRows(ids=torch.tensor([3, 7]), weights=torch.zeros(2, 8), scores=None)
        rows.select(rows.ids > 5)   # the row of id 7
    """

    ids: torch.Tensor
    weights: torch.Tensor
    #: Eviction scores, None to keep those the insert gives.
    scores: torch.Tensor | None
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    #: (training lookups, optimizer steps), None to leave the table's counters.
    step: tuple[int, int] | None = None
    #: (ids, sightings, counter scores) waiting for admission, None when absent.
    admission: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    #: The rows' last training steps (``weight_last_seen``, TTL tables that keep
    #: them), None when absent.
    last_seen: torch.Tensor | None = None

    def select(self, keep: torch.Tensor) -> TableRows:
        """The rows where ``keep`` is True (admission entries unchanged)."""
        if bool(keep.all()):
            return self
        return TableRows(
            self.ids[keep],
            self.weights[keep],
            None if self.scores is None else self.scores[keep],
            {k: v[keep] for k, v in self.state.items()},
            self.step,
            self.admission,
            None if self.last_seen is None else self.last_seen[keep],
        )


def select_columns(rows: TableRows, columns: tuple[int, int] | None) -> TableRows:
    """A column shard's part of whole rows: columns ``[first, first + width)`` of the
    rows and of the per-column optimizer state (Adam's moments); per-row state
    (row-wise Adagrad's) as it is. ``columns`` None: ``rows`` themselves."""
    if columns is None:
        return rows
    cols = slice(columns[0], columns[0] + columns[1])
    state = {k: v[:, cols] if v.dim() == 2 else v for k, v in rows.state.items()}
    return replace(rows, weights=rows.weights[:, cols], state=state)


def bucket_order(ids: torch.Tensor, num_buckets: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, buckets)``: the permutation that sorts id-sorted ``ids`` by routing
    bucket (then id), and the sorted bucket numbers."""
    buckets, order = torch.sort(route_bucket(ids, num_buckets), stable=True)
    return order, buckets


def table_state(table: KVTable) -> dict[str, torch.Tensor]:
    """A table's state_dict entries (key suffixes after ``embedding_bags.<table>.``),
    rows sorted by routing bucket, then id. A table on the ``meta`` device gives
    empty entries of the right dims and dtypes, on ``meta``. Inside
    :func:`~torchrec_kvemb.state_dict.deferred.deferring`, the row entries of a table
    in CPU memory are placeholders a checkpoint writer fills."""
    num_buckets = table.options.total_num_buckets
    deferred = active_deferral()
    data = deferred.table_entries(table) if deferred is not None else None
    if data is None:
        data = table_rows(table)
    out = {"weight": data["weights"], "weight_id": data["ids"], "weight_score": data["scores"]}
    for name in table.optim.state_names():
        out[name] = data[name]
    if "bucket" in data:
        out["bucket"] = data["bucket"]
    elif table.device.type == "meta":
        out["bucket"] = torch.zeros(num_buckets, dtype=torch.int64, device=table.device)
    else:
        ids = data["ids"]
        out["bucket"] = torch.bincount(route_bucket(ids, num_buckets), minlength=num_buckets)
    out["step"] = torch.tensor([table.step, table.optim_step], dtype=torch.int64)
    if uses_last_seen(table.options):
        ids = data["ids"] if deferred is None or table.device.type == "meta" else None
        if ids is None:  # a deferred entry's ids are a placeholder: the order itself
            ids = table.checkpoint_order(num_buckets)[0]
        out[LAST_SEEN_KEY] = last_seen_state(table, ids)
    if table.options.admission_threshold > 1:
        out.update(zip(ADMISSION_KEYS, admission_state(table), strict=True))
    return out


def table_rows(table: KVTable) -> dict[str, torch.Tensor]:
    """``table.export(route_buckets=G)``: ids, weights, scores and optimizer state in
    checkpoint order (routing bucket, then id). A table on the ``meta`` device holds
    no ids (no kernel there can list them): empty tensors of its dims, on ``meta``."""
    if table.device.type != "meta":
        return table.export(route_buckets=table.options.total_num_buckets)
    meta = table.device
    out = {
        "ids": torch.empty(0, dtype=torch.int64, device=meta),
        "weights": torch.empty(0, table.dim, dtype=table.weights.dtype, device=meta),
        "scores": torch.empty(0, dtype=torch.int64, device=meta),
    }
    for name, shape in table.optim.state_shapes(table.dim).items():
        out[name] = torch.empty(0, *shape, dtype=torch.float32, device=meta)
    return out


def admission_state(table: KVTable) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids, sightings, scores)`` of the ids the admission counter tracks, sorted by
    routing bucket, then id (empty for a table without admission, or on ``meta``)."""
    if table.device.type == "meta":
        empty = torch.empty(0, dtype=torch.int64, device=table.device)
        return empty, empty, empty
    ids, counts, scores = table.admission_entries()
    ids, by_id = torch.sort(ids)
    order, _ = bucket_order(ids, table.options.total_num_buckets)
    entry = by_id[order]
    return ids[order], counts[entry], scores[entry]


def restore_table(table: KVTable, rows: TableRows) -> int:
    """Replace the table's content by ``rows`` (checked already); returns how many
    rows found no room (a full index bucket), after a warning.

    With an SSD tier, each index bucket keeps its rows of the highest scores in
    memory (then smallest ids, as a fresh insert ranks them) and the others go to
    the SSD tier; every row keeps its saved score in either tier. A table on the
    ``meta`` device holds nothing: an empty content is a no-op (``check_fits``
    refuses rows)."""
    if table.device.type == "meta":
        return 0
    table.reserve(rows.ids.numel())  # a full disk raises here, before the table changes
    table.clear()
    state = table.optim.join_state(rows.state, table.dim) if rows.ids.numel() else None
    lost = table.load_rows(
        rows.ids, rows.weights, state, rows.scores, rows.step, last_seen=rows.last_seen
    )
    if rows.last_seen is None:
        warn_without_last_seen(table, rows.ids.numel())
    if rows.admission is not None:
        table.load_admission(*rows.admission)
    if lost:
        warn_dropped(table.name, lost, rows.ids.numel(), stacklevel=3)
    return lost


def warn_dropped(name: str, lost: int, n: int, stacklevel: int = 2) -> None:
    """Warn that ``lost`` of the ``n`` rows loaded into table ``name`` found no room."""
    warnings.warn(
        f"table {name!r}: {lost} of {n} rows found no room "
        "(their index buckets are full) and were dropped",
        stacklevel=stacklevel + 1,
    )
