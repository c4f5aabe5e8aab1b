"""Input checks that run before any table is touched, with errors naming the table."""

from __future__ import annotations

import torch

_ID_DTYPES = (torch.int64, torch.int32)


class KVInputError(ValueError):
    """Bad input for a KV table; nothing was changed."""


def check_ids(table: str, ids: torch.Tensor, what: str = "ids") -> torch.Tensor:
    """``ids`` as int64 if they are a 1-D integer tensor of values >= 0."""
    if not isinstance(ids, torch.Tensor):
        raise KVInputError(f"table {table!r}: {what} must be a tensor, got {type(ids).__name__}")
    if ids.dtype not in _ID_DTYPES:
        raise KVInputError(
            f"table {table!r}: {what} must be int64 or int32, got {ids.dtype} "
            "(ids are raw integer keys; floats are not accepted)"
        )
    if ids.dim() != 1:
        raise KVInputError(f"table {table!r}: {what} must be 1-D, got shape {tuple(ids.shape)}")
    if ids.numel() and bool((ids < 0).any()):
        bad = ids[ids < 0][:3].tolist()
        raise KVInputError(f"table {table!r}: {what} must be >= 0, got negative ids such as {bad}")
    return ids.to(torch.int64)


def check_rows(table: str, rows: torch.Tensor, n: int, dim: int, what: str = "weights") -> None:
    """``rows`` is a float tensor ``[n, dim]``."""
    if not isinstance(rows, torch.Tensor) or not rows.is_floating_point():
        raise KVInputError(f"table {table!r}: {what} must be a float tensor")
    if tuple(rows.shape) != (n, dim):
        raise KVInputError(
            f"table {table!r}: {what} must have shape ({n}, {dim}), got {tuple(rows.shape)}"
        )


def check_bags(
    table: str,
    ids: torch.Tensor,
    lengths: torch.Tensor,
    weights: torch.Tensor | None,
) -> None:
    """Lengths are >= 0 and sum to the number of ids; weights match the ids."""
    if lengths.numel() and bool((lengths < 0).any()):
        raise KVInputError(f"table {table!r}: lengths must be >= 0")
    total = int(lengths.sum()) if lengths.numel() else 0
    if total != ids.numel():
        raise KVInputError(
            f"table {table!r}: lengths sum to {total} but there are {ids.numel()} ids"
        )
    if weights is not None:
        if weights.dim() != 1 or weights.numel() != ids.numel():
            raise KVInputError(
                f"table {table!r}: per-sample weights must be 1-D with one weight per id "
                f"({ids.numel()}), got shape {tuple(weights.shape)}"
            )
        if not weights.is_floating_point():
            raise KVInputError(f"table {table!r}: per-sample weights must be floats")
