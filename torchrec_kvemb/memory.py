"""Memory arithmetic of a KV table: the one place rows and bytes are counted.

A table (or shard) of ``capacity`` rows holds, per row: ``dim`` weights of
``options.weights_dtype`` (4 bytes each for float32, 2 for float16 / bfloat16),
``4 * state_dim`` bytes of float32 optimizer state, 8 bytes of key and 8 of
score. An admission counter (``admission_threshold > 1``) adds 24 bytes per
counted id (key, score, count). ``KVTable.memory_bytes``, the planner's storage
stand-in and the SSD tier's ``storage_estimate`` all use :func:`table_memory`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from torchrec_kvemb.optimizer import FusedOptimConfig
from torchrec_kvemb.options import WAYS, KVTableOptions

INDEX_BYTES_PER_ROW = 16
COUNTER_BYTES_PER_ID = 24


def bytes_per_row(dim: int, state_dim: int, weight_bytes: int = 4) -> int:
    """Memory one row of capacity costs: weights (``weight_bytes`` each), float32
    optimizer state, key and score."""
    return weight_bytes * dim + 4 * state_dim + INDEX_BYTES_PER_ROW


def resolve_capacity(options: KVTableOptions, dim: int, state_dim: int) -> int:
    """Rows the table holds: ``capacity`` or what fits ``memory_budget_bytes``, in whole buckets."""
    if options.capacity is not None:
        return math.ceil(options.capacity / WAYS) * WAYS
    per_row = bytes_per_row(dim, state_dim, options.weights_dtype.itemsize)
    rows = options.memory_budget_bytes // per_row
    if rows < WAYS:
        raise ValueError(
            f"memory_budget_bytes={options.memory_budget_bytes} holds fewer than {WAYS} rows "
            f"of {per_row} bytes"
        )
    return (rows // WAYS) * WAYS


def counter_capacity(options: KVTableOptions, capacity: int) -> int:
    """Ids the admission counter tracks (whole buckets); 0 without admission."""
    if options.admission_threshold <= 1:
        return 0
    return math.ceil((options.admission_counter_capacity or capacity) / WAYS) * WAYS


class TableMemory(NamedTuple):
    """What one table (or shard) built from some options holds in memory."""

    rows: int  # capacity: rows in memory
    state_dim: int  # optimizer state floats per row
    counter_ids: int  # admission counter entries
    bytes: int  # rows, index and admission counter


def table_memory(options: KVTableOptions, dim: int, optim: FusedOptimConfig) -> TableMemory:
    """The memory of a table of ``dim`` built from ``options`` with ``optim``.

    Example::

        table_memory(KVTableOptions(capacity=1000), 16, FusedOptimConfig()).bytes  # 84224
    """
    state_dim = optim.state_dim(dim)
    rows = resolve_capacity(options, dim, state_dim)
    counted = counter_capacity(options, rows)
    per_row = bytes_per_row(dim, state_dim, options.weights_dtype.itemsize)
    total = rows * per_row + counted * COUNTER_BYTES_PER_ID
    return TableMemory(rows, state_dim, counted, total)
