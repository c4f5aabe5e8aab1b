"""The ``state_dict`` / ``load_state_dict`` hooks of KV modules.

A KV module registers them in its constructor; they put each KV table's entries
(:mod:`torchrec_kvemb.state_dict`) under ``<prefix><attribute>.<table>.`` (the
attribute a stock module keeps its tables in: ``embedding_bags`` for a bag
collection, ``embeddings`` for a sequence one) and take them back, replacing
the tables' content, and give the module an ``nn.ModuleDict`` under that attribute
whose per-table modules resolve each key as an attribute
(:mod:`~torchrec_kvemb.state_dict.attributes`). The module describes its tables
with ``kv_layouts()`` (see :class:`~torchrec_kvemb.state_dict.layout.TableLayout`).

Example::

    class MyKVModule(nn.Module):
        def __init__(self, ...):
            ...
            register_unsharded_hooks(self)

        def kv_layouts(self) -> list[TableLayout]:
            return [TableLayout.unsharded(t) for t in self._tables.values()]
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor

from torchrec_kvemb.state_dict.attributes import install_table_entries
from torchrec_kvemb.state_dict.checks import (
    CheckpointError,
    check_bucket_counts,
    check_fits,
    check_table_rows,
)
from torchrec_kvemb.state_dict.entries import (
    is_distributed,
    is_placeholder,
    local_rows,
    rows_from_entries,
)
from torchrec_kvemb.state_dict.layout import KVTableDescription, KVTableSlot, TableLayout
from torchrec_kvemb.state_dict.rows import (
    KNOWN_KEYS,
    ROW_KEYS,
    TableRows,
    restore_table,
    select_columns,
    table_state,
)
from torchrec_kvemb.state_dict.sharded import sharded_entries

#: What to do with a state_dict of another world size or sharding.
RESHARD_HINT = (
    "to load a checkpoint at another world size or sharding use "
    "torchrec_kvemb.checkpoint.load (or give load_state_dict whole plain tensors)"
)


def register_unsharded_hooks(
    module: nn.Module,
    attribute: str = "embedding_bags",
    on_mark: Callable[[str], None] | None = None,
) -> None:
    """state_dict / load_state_dict hooks of a module holding whole KV tables
    (``KVEmbeddingBagCollection``, ``KVEmbeddingCollection``): plain tensors. Its
    tables' placeholder weights take ``apply_optimizer_in_backward``, calling
    ``on_mark(table)`` (a bound method, held weakly) for each mark."""
    _register(module, False, None, attribute, on_mark)


def register_sharded_hooks(
    module: nn.Module, group: dist.ProcessGroup | None, attribute: str = "embedding_bags"
) -> None:
    """state_dict / load_state_dict hooks of a sharded KV module
    (``ShardedKVEmbeddingBagCollection``): ShardedTensors over ``group``, and a
    ``state_dict()`` that is a collective over it."""
    _register(module, True, group, attribute)


def _register(
    module: nn.Module,
    sharded: bool,
    group: dist.ProcessGroup | None,
    attribute: str,
    on_mark: Callable[[str], None] | None = None,
) -> None:
    # Each entry's key as an attribute path (torch's state-dict helpers walk keys so).
    layouts = module.kv_layouts()
    devices = [layout.table.device for layout in layouts if layout.table is not None]
    install_table_entries(
        module,
        attribute,
        {layout.name: layout.dim for layout in layouts},
        devices[0] if devices else None,
        on_mark,
    )

    # The hooks get the module as an argument: closing over it would make a
    # reference cycle that keeps a model (and its process group) alive until gc.
    def state_dict_hook(module: nn.Module, destination: dict, prefix: str, _metadata) -> None:
        layouts = module.kv_layouts()
        if isinstance(destination, KVTableDescription):
            for layout in layouts:
                key = f"{prefix}{attribute}.{layout.name}.weight"
                destination[key] = KVTableSlot.of(layout)
            return
        if not sharded:
            for layout in layouts:
                for key, value in table_state(layout.table).items():
                    destination[f"{prefix}{attribute}.{layout.name}.{key}"] = value
            return
        for name, entries in sharded_entries(layouts, group).items():
            for key, value in entries.items():
                destination[f"{prefix}{attribute}.{name}.{key}"] = value

    def load_hook(
        module: nn.Module,
        state_dict: dict,
        prefix: str,
        _metadata,
        strict: bool,
        missing_keys: list[str],
        _unexpected: list[str],
        _errors: list[str],
    ) -> None:
        pending = []
        for layout in module.kv_layouts():
            base = f"{prefix}{attribute}.{layout.name}."
            entries = {
                key[len(base) :]: state_dict.pop(key)
                for key in [k for k in state_dict if k.startswith(base)]
                if key[len(base) :] in KNOWN_KEYS
            }
            if "weight_id" not in entries:
                weight = entries.get("weight")
                if weight is not None and not is_placeholder(weight):
                    raise CheckpointError(
                        f"table {layout.name!r}: the state_dict holds a weight but no "
                        "weight_id, as a stock table would; to load a stock table's rows use "
                        "torchrec_kvemb.checkpoint.migrate.load_dense_into_kv"
                    )
                if weight is None and strict:
                    missing_keys.extend(base + k for k in ROW_KEYS)
                continue
            rows = _owned_rows(layout, entries)
            if rows is not None:
                pending.append((layout.table, rows))
        for table, rows in pending:
            restore_table(table, rows)

    module.register_state_dict_post_hook(state_dict_hook)
    module.register_load_state_dict_pre_hook(load_hook)


def _owned_rows(layout: TableLayout, entries: dict[str, Any]) -> TableRows | None:
    """The checked rows this rank keeps of one table's entries (None: it holds no
    shard of the table). Whole tensors give every row, of which a sharded rank
    keeps the ids it owns; a shard (ShardedTensor, sharded DTensor) must be this
    rank's shard of this layout: one of another layout is refused."""
    if layout.columns is not None and is_distributed(entries["weight_id"]):
        raise CheckpointError(
            f"table {layout.name!r}: load_state_dict cannot take a column-wise shard "
            "(a column shard's ShardedTensors hold its columns, and only the first shard "
            "the ids); load column-wise tables with torchrec_kvemb.checkpoint.load, or give "
            "whole plain tensors"
        )
    rows = rows_from_entries(layout.name, entries)
    shard = is_distributed(entries["weight_id"])
    table = layout.table
    if table is None:
        if shard and rows.ids.numel():
            _refuse_shard(layout, f"holds {rows.ids.numel()} rows of a table it does not hold")
        return None
    if table.device.type == "meta":
        check_fits(table, rows)  # a table on meta takes no rows; nothing to check then
        return None
    state_shapes = table.optim.state_shapes(layout.dim)
    check_table_rows(layout.name, layout.dim, state_shapes, rows, layout.num_buckets)
    bucket = entries.get("bucket")
    if not shard and type(bucket) is torch.Tensor and not bucket.is_meta:
        check_bucket_counts(layout.name, rows.ids, bucket)
    if shard:
        _check_shard(layout, rows, entries.get("bucket"))
    rows = select_columns(rows.select(layout.owns(rows.ids)), layout.columns)
    if rows.admission is not None:
        keep = layout.owns(rows.admission[0])
        rows.admission = tuple(t[keep] for t in rows.admission)
    check_fits(table, rows)
    return rows


def _check_shard(layout: TableLayout, rows: TableRows, bucket: Any) -> None:
    """A shard given to this rank holds ids of the buckets it owns only and, where
    ``bucket`` is given, exactly its bucket range (its count and row total)."""
    outside = int((~layout.owns(rows.ids)).sum())
    if outside:
        _refuse_shard(layout, f"holds {outside} ids of routing buckets this rank does not own")
    if bucket is None:
        return
    lo, hi = layout.owned
    counts = local_rows(layout.name, "bucket", bucket)
    start = lo
    if isinstance(bucket, ShardedTensor) and counts.numel():
        start = min(s.metadata.shard_offsets[0] for s in bucket.local_shards())
    if (start, counts.numel(), int(counts.sum())) != (lo, hi - lo, rows.ids.numel()):
        _refuse_shard(
            layout,
            f"covers routing buckets [{start}, {start + counts.numel()}) with "
            f"{int(counts.sum())} rows, this rank owns buckets [{lo}, {hi}) and was given "
            f"{rows.ids.numel()} rows",
        )


def _refuse_shard(layout: TableLayout, what: str) -> None:
    raise CheckpointError(
        f"table {layout.name!r}: this rank's shard of the state_dict {what} (a state_dict "
        f"of another world size or sharding); {RESHARD_HINT}"
    )
