"""Memory arithmetic of a KV table: the one place rows and bytes are counted.

A table (or shard) of ``capacity`` rows holds, per row: ``dim`` weights of
``options.weights_dtype`` (4 bytes each for float32, 2 for float16 / bfloat16),
``4 * state_dim`` bytes of float32 optimizer state, 8 bytes of key and 8 of
score, and with a TTL that is not LRU 8 of last step (``ttl.ttl_bytes``). An
admission counter (``admission_threshold > 1``) adds 24 bytes per
counted id (key, score, count), allocated whole from the start (it does not
grow). With a lower tier (SSD or host), ``SCRATCH_RESERVE_ROWS`` scratch rows (weights and
state, ``ssd/scratch.py``) are part of the table too.

``memory_budget_bytes`` covers all of it: the rows are what is left of the
budget after the scratch reserve and an explicit ``admission_counter_capacity``,
divided by a row's bytes (plus 24 when the counter follows the capacity), in
whole buckets. ``KVTable.memory_bytes``, the planner's storage stand-in and the
SSD tier's ``storage_estimate`` all use :func:`table_memory`: its ``bytes`` are
those of the table at its maximum capacity.

**Growth.** With ``initial_capacity`` a table starts with ``initial_buckets``
index buckets and doubles them up to ``max_buckets = initial_buckets * 2**k``:
every bucket of a smaller table splits into buckets of the larger one (an id's
bucket is its hash modulo the bucket count), so a table that grew before any
bucket overflowed holds, bucket by bucket, what a table built at the maximum
holds. The maximum is rounded up (``capacity``) or down (a budget) to such a
multiple of the initial bucket count.
"""

from __future__ import annotations

import math
from typing import NamedTuple

from torchrec_kvemb.optimizer import FusedOptimConfig
from torchrec_kvemb.options import WAYS, KVTableOptions
from torchrec_kvemb.ttl import ttl_bytes

INDEX_BYTES_PER_ROW = 16
COUNTER_BYTES_PER_ID = 24
#: Scratch rows a table with an SSD tier allocates on its first overflowing batch
#: (``ssd.scratch.MIN_PAD_ROWS``, the pad's first size), counted in its memory.
SCRATCH_RESERVE_ROWS = 256


def bytes_per_row(dim: int, state_dim: int, weight_bytes: int = 4) -> int:
    """Memory one row of capacity costs: weights (``weight_bytes`` each), float32
    optimizer state, key and score."""
    return weight_bytes * dim + 4 * state_dim + INDEX_BYTES_PER_ROW


def scratch_row_bytes(dim: int, state_dim: int, weight_bytes: int = 4) -> int:
    """Memory one scratch row costs: weights and float32 optimizer state."""
    return weight_bytes * dim + 4 * state_dim


def _whole_buckets(n: int) -> int:
    return math.ceil(n / WAYS) * WAYS


class Buckets(NamedTuple):
    """Index buckets of a table: at build (``initial``) and at most (``maximum``)."""

    initial: int
    maximum: int


def table_buckets(options: KVTableOptions, dim: int, state_dim: int) -> Buckets:
    """The table's index buckets at build and at its maximum (see the module
    docstring); both equal without ``initial_capacity``."""
    weight_bytes = options.weights_dtype.itemsize
    if options.capacity is not None:
        most = _whole_buckets(options.capacity) // WAYS
    else:
        per_row = bytes_per_row(dim, state_dim, weight_bytes) + ttl_bytes(options, 1)
        fixed = 0
        if options.tiered:
            fixed += SCRATCH_RESERVE_ROWS * scratch_row_bytes(dim, state_dim, weight_bytes)
        if options.admission_threshold > 1:
            if options.admission_counter_capacity is None:
                per_row += COUNTER_BYTES_PER_ID
            else:
                counted = _whole_buckets(options.admission_counter_capacity)
                fixed += counted * COUNTER_BYTES_PER_ID
        rows = max(0, options.memory_budget_bytes - fixed) // per_row
        if rows < WAYS:
            raise ValueError(
                f"memory_budget_bytes={options.memory_budget_bytes} holds fewer than {WAYS} rows "
                f"of {per_row} bytes (after {fixed} bytes of scratch rows and admission counter)"
            )
        most = rows // WAYS
    if options.initial_capacity is None:
        return Buckets(most, most)
    first = _whole_buckets(options.initial_capacity) // WAYS
    if first > most:
        raise ValueError(
            f"initial_capacity={options.initial_capacity} is above the {most * WAYS} rows "
            f"memory_budget_bytes={options.memory_budget_bytes} holds"
        )
    doublings = 0
    while first << (doublings + 1) <= most:
        doublings += 1
    if options.capacity is not None:
        initial = -(-most // (1 << doublings))
    else:
        initial = most // (1 << doublings)
    return Buckets(initial, initial << doublings)


def resolve_capacity(options: KVTableOptions, dim: int, state_dim: int) -> int:
    """Rows the table holds at most: ``capacity`` or what fits ``memory_budget_bytes``
    (rows, index, admission counter and scratch reserve within it), in whole buckets."""
    return table_buckets(options, dim, state_dim).maximum * WAYS


def counter_capacity(options: KVTableOptions, capacity: int) -> int:
    """Ids the admission counter tracks (whole buckets); 0 without admission.
    ``capacity``: the table's maximum rows."""
    if options.admission_threshold <= 1:
        return 0
    return _whole_buckets(options.admission_counter_capacity or capacity)


class TableMemory(NamedTuple):
    """What one table (or shard) built from some options holds in memory."""

    rows: int  # capacity at most: rows in memory
    state_dim: int  # optimizer state floats per row
    counter_ids: int  # admission counter entries
    bytes: int  # at most: rows, index, admission counter, scratch reserve
    initial_rows: int  # capacity at build (``rows`` unless the table grows)
    row_bytes: int  # bytes of one row of capacity (weights, state, key, score, TTL)
    scratch_bytes: int  # the scratch reserve (tables with an SSD tier)


def table_memory(options: KVTableOptions, dim: int, optim: FusedOptimConfig) -> TableMemory:
    """The memory of a table of ``dim`` built from ``options`` with ``optim``, at its
    maximum capacity (what the planner plans by).

    Example::

        table_memory(KVTableOptions(capacity=1000), 16, FusedOptimConfig()).bytes  # 84224
    """
    state_dim = optim.state_dim(dim)
    weight_bytes = options.weights_dtype.itemsize
    buckets = table_buckets(options, dim, state_dim)
    rows = buckets.maximum * WAYS
    counted = counter_capacity(options, rows)
    per_row = bytes_per_row(dim, state_dim, weight_bytes) + ttl_bytes(options, 1)
    scratch = 0
    if options.tiered:
        scratch = SCRATCH_RESERVE_ROWS * scratch_row_bytes(dim, state_dim, weight_bytes)
    total = rows * per_row + counted * COUNTER_BYTES_PER_ID + scratch
    return TableMemory(rows, state_dim, counted, total, buckets.initial * WAYS, per_row, scratch)


def memory_at(memory: TableMemory, rows: int) -> int:
    """Bytes of the table of ``memory`` holding ``rows`` rows of capacity (a growing
    table on its way to ``memory.rows``): rows, index and admission counter (not
    the scratch rows, which a table with an SSD tier counts as it allocates them)."""
    return rows * memory.row_bytes + memory.counter_ids * COUNTER_BYTES_PER_ID
