"""The column shards of a KV table: where a shard's columns start, and its options.

A column shard is a ``KVTable`` of its width holding every id of its table
(:mod:`torchrec_kvemb.sharding.cw`); these functions make its options from the
table's, for every KV sharding's lookup (a whole-width shard keeps its options).

Example::

    options = column_shard_options(options, "user", dim=64, first_col=32)
"""

from __future__ import annotations

from dataclasses import replace

from torchrec.distributed.embedding_types import ShardedEmbeddingTable

from torchrec_kvemb.memory import resolve_capacity
from torchrec_kvemb.optimizer import FusedOptimConfig
from torchrec_kvemb.options import KVTableOptions


def column_offset(table: ShardedEmbeddingTable) -> int:
    """The first column of a sharded table's local piece (0 for whole-width shards)."""
    metadata = table.local_metadata
    return 0 if metadata is None else int(metadata.shard_offsets[1])


def column_shard_options(
    options: KVTableOptions,
    name: str,
    dim: int,
    first_col: int,
    optim: FusedOptimConfig | None = None,
) -> KVTableOptions:
    """The options of a column shard of table ``name`` (``dim`` columns wide) at
    ``first_col``: the table's own, with ``column_offset`` set. Every shard must hold
    the same number of rows: a ``memory_budget_bytes`` is turned into the capacity
    it gives the whole-width table (with ``optim``'s state), the same on every shard.
    """
    if options.tiered:
        raise ValueError(
            f"table {name!r}: column-wise KV tables take no lower tier (ssd / host_tier): "
            "a tier sizes itself by row bytes, which differ between column shards; "
            "shard it row-wise or table-wise, or drop the tier"
        )
    if options.memory_budget_bytes is not None:
        state_dim = 0 if optim is None else optim.state_dim(dim)
        capacity = resolve_capacity(options, dim, state_dim)
        options = replace(options, capacity=capacity, memory_budget_bytes=None)
    return replace(options, column_offset=first_col)
