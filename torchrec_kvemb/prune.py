"""Pruning at publish: keep only the rows seen often enough, or recently enough.

A model published for inference needs the rows that matter, not every id
training ever stored. :func:`prune_export` gives a table's kept rows (as
``KVTable.export`` gives all of them) and how many it dropped;
:func:`prune_tables` drops the others from a collection's tables in place, so
that TorchRec's ``quantize_inference_model`` (docs/inference.md) or
``torch.export`` publishes the kept rows only.

The rules (both given: a row must pass both):

* ``min_count=k``: rows seen at least ``k`` times in training. The sightings are
  an LFU table's scores (a training lookup adds an id's occurrences in the batch;
  an insert adds one), or those a table built with ``count_sightings=True``
  counts the same way (``torchrec_kvemb.ttl``); other tables are refused.
* ``seen_within_steps=n``: rows looked up in one of the last ``n`` training
  steps (last step > step - n). The last steps are an LRU table's scores, or a
  TTL table's ``last_seen`` (``torchrec_kvemb.ttl``); others are refused.

Example::

    dropped = prune_tables(model.sparse_arch.embedding_bag_collection, min_count=3)
    # {"user": Pruned(kept=812_333, dropped=4_102_876), ...}
    quantize_inference_model(model)
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from torchrec_kvemb.options import EvictionPolicy
from torchrec_kvemb.state_dict.rows import TableRows, restore_table
from torchrec_kvemb.table import KVTable

__all__ = ["Pruned", "PrunedRows", "prune_export", "prune_tables"]


class PrunedRows(NamedTuple):
    """The rows a pruning keeps (``KVTable.export``'s entries: ``ids``, ``weights``,
    ``scores``, the optimizer state by name) and how many rows it dropped."""

    rows: dict[str, torch.Tensor]
    dropped: int


class Pruned(NamedTuple):
    """Rows one table kept and dropped."""

    kept: int
    dropped: int


def _check_rule(table: KVTable, min_count: int | None, seen_within_steps: int | None) -> None:
    if min_count is None and seen_within_steps is None:
        raise ValueError(f"table {table.name!r}: give min_count, seen_within_steps or both")
    if min_count is not None and min_count < 1:
        raise ValueError(f"table {table.name!r}: min_count must be >= 1, got {min_count}")
    if seen_within_steps is not None and seen_within_steps < 1:
        raise ValueError(
            f"table {table.name!r}: seen_within_steps must be >= 1, got {seen_within_steps}"
        )
    policy = table.options.eviction
    stats = table.ttl
    if min_count is not None and policy != EvictionPolicy.LFU and not (stats and stats.counting):
        raise ValueError(
            f"table {table.name!r}: min_count needs each row's sightings, which an LFU "
            f"table's scores count, or a table built with count_sightings=True; this "
            f"{policy.name} table has neither. Prune it by seen_within_steps, or give it "
            "KVTableOptions(count_sightings=True)"
        )
    if seen_within_steps is not None and policy != EvictionPolicy.LRU:
        if not (stats and stats.keeps_array):
            raise ValueError(
                f"table {table.name!r}: seen_within_steps needs each row's last training "
                f"step, which an LRU table's scores are, or a TTL table keeps; this "
                f"{policy.name} table has neither. Prune it by min_count, or give it "
                "KVTableOptions(ttl=TTLOptions(...))"
            )


def _rows(table: KVTable) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
    """``(rows, slots)``: ``export()``'s rows (memory and every tier) and their memory
    slots (None for a tiered table, whose rows may be in a lower tier)."""
    if table.options.tiered:
        return table.export(), None
    ids, slots = table.export_order()
    return {"ids": ids, **table.rows_of_slots(slots)}, slots


def _keep(
    table: KVTable,
    rows: dict[str, torch.Tensor],
    slots: torch.Tensor | None,
    min_count: int | None,
    seen_within_steps: int | None,
) -> torch.Tensor:
    """Which rows pass the rule (checked by ``_check_rule``)."""
    keep = torch.ones_like(rows["ids"], dtype=torch.bool)
    lfu, lru = (table.options.eviction == p for p in (EvictionPolicy.LFU, EvictionPolicy.LRU))
    if min_count is not None:
        counts = rows["scores"] if lfu else table.ttl.sightings_of(slots)
        keep &= counts >= min_count
    if seen_within_steps is not None:
        last = rows["scores"] if lru else table.ttl.last_seen_of(slots)
        keep &= last > table.step - seen_within_steps
    return keep


def prune_export(
    table: KVTable, *, min_count: int | None = None, seen_within_steps: int | None = None
) -> PrunedRows:
    """The rows of ``table`` (every tier) seen at least ``min_count`` times and / or in
    the last ``seen_within_steps`` training steps, sorted by id, and how many rows
    the rule dropped; the table is left as it is. Refused (``ValueError`` naming the
    table) where the table does not know what the rule reads (module docstring).

    Example::

        kept, dropped = prune_export(table, seen_within_steps=1000)
    """
    _check_rule(table, min_count, seen_within_steps)
    rows, slots = _rows(table)
    keep = _keep(table, rows, slots, min_count, seen_within_steps)
    kept = {name: value[keep] for name, value in rows.items()}
    return PrunedRows(kept, int(keep.numel() - keep.sum()))


def prune_table(
    table: KVTable, *, min_count: int | None = None, seen_within_steps: int | None = None
) -> Pruned:
    """Drop from ``table`` (every tier) the rows :func:`prune_export` leaves out; the
    kept rows keep their values, optimizer state, scores and last steps."""
    _check_rule(table, min_count, seen_within_steps)
    rows, slots = _rows(table)
    keep = _keep(table, rows, slots, min_count, seen_within_steps)
    dropped = int(keep.numel() - keep.sum())
    if dropped == 0:
        return Pruned(keep.numel(), 0)
    if slots is not None:  # memory only: free the slots, nothing else moves
        table.index.remove(slots[~keep])
        if table.ttl is not None:
            table.ttl.forget(slots[~keep])
    else:  # a tiered table: its content replaced by the kept rows, in every tier
        names = table.optim.state_names()
        admission = table.admission_entries() if table.counter is not None else None
        kept = TableRows(
            rows["ids"][keep],
            rows["weights"][keep],
            rows["scores"][keep],
            {name: rows[name][keep] for name in names},
            admission=admission,
        )
        restore_table(table, kept)
    return Pruned(keep.numel() - dropped, dropped)


def prune_tables(
    module: nn.Module,
    *,
    min_count: int | None = None,
    seen_within_steps: int | None = None,
    tables: list[str] | None = None,
) -> dict[str, Pruned]:
    """Prune the KV tables of an unsharded KV collection (``KVEmbeddingBagCollection``
    or ``KVEmbeddingCollection``; ``tables``: those by name, default all) in place by
    :func:`prune_table`'s rule; returns each table's kept and dropped rows. Every
    table is checked before any changes.

    Example::

        prune_tables(ebc, min_count=2)   # {"user": Pruned(kept=..., dropped=...)}
    """
    if not hasattr(module, "kv_tables"):
        raise TypeError(
            f"{type(module).__name__}: prune_tables takes an unsharded KV collection "
            "(prune the model before sharding it, as TorchRec's inference flow quantizes "
            "before sharding)"
        )
    every = module.kv_tables()
    names = list(every) if tables is None else list(tables)
    unknown = sorted(set(names) - set(every))
    if unknown:
        raise ValueError(
            f"{type(module).__name__}: no KV table(s) {unknown}; it has {sorted(every)}"
        )
    for name in names:
        _check_rule(every[name], min_count, seen_within_steps)
    return {
        name: prune_table(every[name], min_count=min_count, seen_within_steps=seen_within_steps)
        for name in names
    }
