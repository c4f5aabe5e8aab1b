"""Checks of a KV table's rows before they replace its content.

Every check raises :class:`CheckpointError` (a ``ValueError``) naming the table,
before anything changes.

Example::

    check_table_rows("user", 8, {"momentum1": ()}, rows, num_buckets=4096)
    check_fits(table, rows)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from torchrec_kvemb.dispatch import route_bucket

if TYPE_CHECKING:
    from torchrec_kvemb.state_dict.rows import TableRows
    from torchrec_kvemb.table import KVTable


class CheckpointError(ValueError):
    """A state_dict or checkpoint that does not fit the model; nothing was changed.

    Example::

        try:
            model.load_state_dict(state)
        except CheckpointError as e:
            print(e)  # "table 'user': weight has dim 6, the table has dim 4"
    """


def check_table_rows(
    name: str,
    dim: int,
    state_shapes: Mapping[str, tuple[int, ...]],
    rows: TableRows,
    num_buckets: int | None = None,
) -> None:
    """Shapes, dtypes, optimizer state set and ids of a table's rows; raises
    :class:`CheckpointError` naming the table. ``num_buckets``: the routing bucket
    count the rows may be sorted by (their order then proves the ids unique)."""

    def fail(message: str) -> None:
        raise CheckpointError(f"table {name!r}: {message}")

    n = rows.ids.numel()
    if rows.ids.dim() != 1 or rows.ids.dtype != torch.int64:
        fail(f"weight_id must be a 1-D int64 tensor, got {rows.ids.dtype} {tuple(rows.ids.shape)}")
    if rows.weights.dim() != 2 or not rows.weights.is_floating_point():
        fail(f"weight must be a 2-D float tensor, got {tuple(rows.weights.shape)}")
    if rows.weights.shape[1] != dim:
        fail(f"weight has dim {rows.weights.shape[1]}, the table has dim {dim}")
    if rows.weights.shape[0] != n:
        fail(f"weight has {rows.weights.shape[0]} rows but weight_id has {n}")
    if rows.scores is not None and (
        tuple(rows.scores.shape) != (n,) or rows.scores.is_floating_point()
    ):
        fail(f"weight_score must be an integer tensor of {n} entries")
    if rows.last_seen is not None and (
        tuple(rows.last_seen.shape) != (n,) or rows.last_seen.is_floating_point()
    ):
        fail(f"weight_last_seen must be an integer tensor of {n} entries")
    check_state(name, state_shapes, rows.state, n)
    check_ids(name, rows.ids, num_buckets)
    if rows.admission is not None:
        ids, counts, scores = rows.admission
        if not (ids.shape == counts.shape == scores.shape) or ids.dim() != 1:
            fail("admission_id, admission_count and admission_score must be 1-D of one length")


def check_state(
    name: str,
    state_shapes: Mapping[str, tuple[int, ...]],
    state: Mapping[str, torch.Tensor],
    n: int,
) -> None:
    """The optimizer state tensors of ``n`` rows: the set the table's optimizer keeps,
    each float of shape ``[n, *shape]``."""
    given = sorted(state)
    if given != sorted(state_shapes):
        raise CheckpointError(
            f"table {name!r}: optimizer state {given or 'none'} does not match the table's "
            f"optimizer, which keeps {sorted(state_shapes) or 'none'}"
        )
    for key, value in state.items():
        want = (n, *state_shapes[key])
        if tuple(value.shape) != want or not value.is_floating_point():
            raise CheckpointError(
                f"table {name!r}: {key} must be a float tensor of shape {want}, "
                f"got {tuple(value.shape)}"
            )


def check_ids(name: str, ids: torch.Tensor, num_buckets: int | None = None) -> None:
    """Ids ``>= 0``, each at most once (cheap when sorted by routing bucket, then id)."""
    n = ids.numel()
    if n and bool((ids < 0).any()):
        raise CheckpointError(f"table {name!r}: weight_id holds negative ids")
    if not _sorted_unique(ids, num_buckets) and n != torch.unique(ids).numel():
        raise CheckpointError(f"table {name!r}: weight_id holds an id twice")


def check_bucket_counts(name: str, ids: torch.Tensor, bucket: torch.Tensor) -> None:
    """Whole entries of a table: ``bucket`` (rows per routing bucket) counts exactly
    the buckets of ``ids``. Entries gathered by a tool that assumes every rank holds
    an even chunk of rows (torch's ``StateDictOptions(full_state_dict=True)`` over a
    sharded module: KV shards differ in size) lose rows and gain zero rows; they are
    refused, naming the recipes that hold."""
    if bucket.numel() == 0:
        return
    counts = torch.bincount(route_bucket(ids, bucket.numel()), minlength=bucket.numel())
    if not torch.equal(counts, bucket.to(counts.dtype)):
        wrong = int((counts != bucket).sum())
        raise CheckpointError(
            f"table {name!r}: weight_id disagrees with bucket (its rows per routing bucket) "
            f"in {wrong} of {bucket.numel()} buckets: rows were lost or added on the way, "
            "as when a sharded module's state_dict is gathered whole by a tool that assumes "
            "equal shards (StateDictOptions(full_state_dict=True)); save the sharded "
            "state_dict with torch.distributed.checkpoint (dcp.save / dcp.load with "
            "torchrec_kvemb.checkpoint.KVLoadPlanner()) or use torchrec_kvemb.checkpoint."
            "save / load"
        )


def _sorted_unique(ids: torch.Tensor, num_buckets: int | None) -> bool:
    """Whether ``ids`` are sorted by routing bucket, then strictly by id (so unique:
    an id has one bucket)."""
    if ids.numel() < 2 or num_buckets is None:
        return ids.numel() < 2
    buckets = route_bucket(ids, num_buckets)
    if not bool((buckets[1:] >= buckets[:-1]).all()):
        return False
    return bool(((ids[1:] > ids[:-1]) | (buckets[1:] != buckets[:-1])).all())


def check_fits(table: KVTable, rows: TableRows) -> None:
    """A table without an SSD tier cannot take more rows than its capacity, and a
    table on the ``meta`` device none."""
    if table.device.type == "meta" and rows.ids.numel():
        raise CheckpointError(
            f"table {table.name!r} lives on the meta device and cannot take rows: "
            "materialize the model on a real device before loading"
        )
    if table.ssd is None and rows.ids.numel() > table.max_capacity:
        raise CheckpointError(
            f"table {table.name!r}: {rows.ids.numel()} rows do not fit its capacity "
            f"{table.max_capacity} (this shard)"
        )
