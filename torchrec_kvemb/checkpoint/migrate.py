"""Moving tables between stock TorchRec (dense ``[N, dim]`` weights) and KV tables.

* :func:`load_dense_into_kv`: a stock table's weight ``[N, dim]`` becomes ids
  ``0 .. N-1`` of a KV table (row ``i`` is id ``i``), optimizer state zero.
* :func:`export_dense`: the rows of ids ``0 .. N-1`` of a KV table as a
  ``[N, dim]`` tensor for a stock table; ids without a row get their initial
  row (or zeros).

Both take a ``KVEmbeddingBagCollection`` or ``KVEmbeddingCollection``, a sharded
collection or a model holding them (tables found by name); with a sharded module
they are collectives. The stock weights may come from either stock collection:
``embedding_bags.<table>.weight`` (``EmbeddingBagCollection``) or
``embeddings.<table>.weight`` (``EmbeddingCollection``).

Example::

    stock = EmbeddingBagCollection(tables)              # trained, N rows per table
    kv = KVEmbeddingBagCollection(tables, options)
    load_dense_into_kv(kv, stock.state_dict())          # or a DCP checkpoint path
    ...
    weight = export_dense(kv, "user", num_rows=stock_rows)
    stock.embedding_bags["user"].weight.data.copy_(weight)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from torchrec_kvemb.checkpoint.collectives import single_process_ok
from torchrec_kvemb.checkpoint.reader import ParallelFileSystemReader
from torchrec_kvemb.state_dict import (
    CheckpointError,
    KVTableSlot,
    TableRows,
    check_fits,
    check_table_rows,
    kv_table_slots,
    restore_table,
)

__all__ = ["export_dense", "load_dense_into_kv"]

#: Where a stock collection keeps a table's weight: ``EmbeddingBagCollection``,
#: ``EmbeddingCollection`` (and their sharded forms, under the same names).
STOCK_ATTRIBUTES = ("embedding_bags", "embeddings")


def _slot(module: nn.Module, table: str) -> KVTableSlot:
    found = [s for s in kv_table_slots(module).values() if s.layout.name == table]
    if len(found) != 1:
        what = "no KV table" if not found else f"{len(found)} KV tables"
        raise CheckpointError(f"the module has {what} named {table!r}")
    return found[0]


def _group(slot: KVTableSlot) -> dist.ProcessGroup | None:
    if slot.layout.sharding == "unsharded" or not dist.is_initialized():
        return None
    return dist.group.WORLD


# -------------------------------------------------------------- stock -> KV
def load_dense_into_kv(
    kv_module: nn.Module,
    source: Mapping[str, Any] | str | os.PathLike,
    tables: Mapping[str, str] | None = None,
) -> dict[str, int]:
    """Replace KV tables' content by stock tables' weights: row ``i`` of the stock
    ``[N, dim]`` weight becomes id ``i`` (optimizer state zero, scores those of a
    fresh insert). Returns the rows stored per table (on this rank).

    ``source``: a stock ``state_dict`` (plain tensors, e.g. an unsharded
    ``EmbeddingBagCollection``'s or ``EmbeddingCollection``'s) or the directory of
    a DCP checkpoint holding one (every rank reads the whole weight and keeps the
    ids it owns). ``tables``: KV table name -> stock table name; by default every
    KV table of ``kv_module``, by its own name. The stock weight is the one entry
    whose key ends with ``embedding_bags.<stock name>.weight`` or
    ``embeddings.<stock name>.weight`` (either collection's rows fit either KV
    collection). Every table is checked before any changes (dim, capacity); errors
    name the table.
    """
    slots = {s.layout.name: s for s in kv_table_slots(kv_module).values()}
    mapping = dict(tables) if tables is not None else {name: name for name in slots}
    for name in mapping:
        if name not in slots:
            raise CheckpointError(f"the module has no KV table named {name!r}")
    if isinstance(source, (str, os.PathLike)):
        weights = _read_dcp_weights(os.fspath(source), mapping, slots)
    else:
        weights = {name: _find_weight(source, stock, name) for name, stock in mapping.items()}
    pending = []
    for name, (shape, weight) in weights.items():
        slot = slots[name]
        if len(shape) != 2 or shape[1] != slot.layout.dim:
            raise CheckpointError(
                f"table {name!r}: the stock weight has shape {tuple(shape)}, the KV "
                f"table has dim {slot.layout.dim}"
            )
        table = slot.layout.table
        if table is None:
            continue  # a table-wise table on another rank
        ids = torch.arange(shape[0], dtype=torch.int64)
        shapes = table.optim.state_shapes(table.dim)
        state = {n: torch.zeros(ids.numel(), *shape) for n, shape in shapes.items()}
        rows = TableRows(ids, weight.detach().to(torch.float32), None, state)
        rows = rows.select(slot.layout.owns(ids))
        check_table_rows(name, table.dim, shapes, rows)
        check_fits(table, rows)
        pending.append((table, rows))
    stored = {}
    for table, rows in pending:
        lost = restore_table(table, rows)
        stored[table.name] = rows.ids.numel() - lost
    return stored


def _weight_keys(keys: list[str], stock: str) -> list[str]:
    """The keys of ``keys`` naming stock table ``stock``'s weight, in either layout."""
    suffixes = [f"{attribute}.{stock}.weight" for attribute in STOCK_ATTRIBUTES]
    return [k for k in keys if any(k == s or k.endswith("." + s) for s in suffixes)]


def _not_one_weight(found: list[str], stock: str, table: str, where: str) -> CheckpointError:
    """The error for ``found`` (not exactly one) weight entries of ``stock``."""
    wanted = " or ".join(f"'{a}.{stock}.weight'" for a in STOCK_ATTRIBUTES)
    if found:
        return CheckpointError(
            f"table {table!r}: {where} has {len(found)} entries ending in {wanted}: {found}; "
            "pass the state_dict of one collection, or name the stock table with tables="
        )
    return CheckpointError(
        f"table {table!r}: {where} has no entry ending in {wanted} (the weight of a stock "
        "EmbeddingBagCollection or EmbeddingCollection table)"
    )


def _find_weight(
    state: Mapping[str, Any], stock: str, table: str
) -> tuple[torch.Size, torch.Tensor]:
    keys = _weight_keys(list(state), stock)
    if len(keys) != 1:
        raise _not_one_weight(keys, stock, table, "the state_dict")
    value = state[keys[0]]
    if isinstance(value, ShardedTensor):
        raise CheckpointError(
            f"table {table!r}: {keys[0]} is a ShardedTensor; pass the directory of a DCP "
            "checkpoint of it, or the whole tensor"
        )
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"table {table!r}: {keys[0]} is not a tensor")
    return value.shape, value


def _read_dcp_weights(
    path: str, mapping: Mapping[str, str], slots: Mapping[str, KVTableSlot]
) -> dict[str, tuple[torch.Size, torch.Tensor | None]]:
    """The stock weights of a DCP checkpoint (read where this rank holds the KV table)."""
    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    targets: dict[str, torch.Tensor] = {}
    out: dict[str, tuple[torch.Size, torch.Tensor | None]] = {}
    tensors = [k for k, md in saved.items() if isinstance(md, TensorStorageMetadata)]
    for name, stock in mapping.items():
        found = _weight_keys(tensors, stock)
        if len(found) != 1:
            raise _not_one_weight(found, stock, name, f"checkpoint {path!r}")
        md = saved[found[0]]
        tensor = None
        if slots[name].layout.table is not None:
            tensor = targets.setdefault(found[0], torch.empty(md.size, dtype=md.properties.dtype))
        out[name] = (md.size, tensor)
    group = dist.group.WORLD if dist.is_initialized() else None
    with single_process_ok():
        dcp.load(
            targets,
            storage_reader=ParallelFileSystemReader(path),
            process_group=group,
            no_dist=group is None,
        )
    return out


# -------------------------------------------------------------- KV -> stock
def export_dense(
    kv_module: nn.Module,
    table: str,
    num_rows: int,
    missing_as_zeros: bool = False,
) -> torch.Tensor:
    """The rows of ids ``0 .. num_rows - 1`` of KV table ``table`` as a
    ``[num_rows, dim]`` float32 tensor (for a stock table of ``num_rows`` rows).

    Ids the table does not hold get their initial row (what the KV table would
    give them on first sight), or zeros with ``missing_as_zeros``. Ids
    ``>= num_rows`` are left out. Sharded: a collective; every rank gets the
    whole tensor.
    """
    if num_rows < 0:
        raise ValueError(f"num_rows must be >= 0, got {num_rows}")
    slot = _slot(kv_module, table)
    ids = torch.arange(num_rows, dtype=torch.int64)
    rows = torch.zeros(num_rows, slot.layout.dim, dtype=torch.float32)
    kv = slot.layout.table
    if kv is not None:
        # Each id has one owner rank; it fills the id's row (stored, initial or zero).
        mine = ids[slot.layout.owns(ids)]
        got, hit = kv.find(mine.to(kv.device))
        got, hit = got.cpu(), hit.cpu()
        if not missing_as_zeros and not bool(hit.all()):
            got[~hit] = kv.initial_rows(mine[~hit].to(kv.device)).cpu()
        rows[mine] = got
    group = _group(slot)
    if group is not None:
        dist.all_reduce(rows, group=group)
    return rows
