"""Where a model's KV tables are: layouts, and their state_dict prefixes.

A KV module (``KVEmbeddingBagCollection``, ``ShardedKVEmbeddingBagCollection``)
describes its tables with ``kv_layouts()``: one :class:`TableLayout` per table,
as this rank sees it. :func:`describe_state_dict` runs ``model.state_dict()``
into a :class:`KVTableDescription`, in which every KV module puts one
:class:`KVTableSlot` per table under its ``weight`` key instead of exporting
rows: the prefixes are exactly the keys ``model.state_dict()`` gives, whatever
renames them on the way (``DistributedModelParallel`` dropping DDP's
``module.``, a user module's own state_dict hooks).

Example::

    slots = kv_table_slots(model)   # {"ebc.embedding_bags.user.": KVTableSlot(...), ...}
    for prefix, slot in slots.items():
        print(prefix, slot.layout.dim, slot.optimizer)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from torchrec_kvemb.dispatch import route_bucket
from torchrec_kvemb.table import KVTable


@dataclass(frozen=True)
class TableLayout:
    """One KV table of a module as this rank sees it.

    ``table``: this rank's shard (None where a table-wise table lives on another
    rank). ``owned``: the routing buckets ``[lo, hi)`` this rank stores, None
    for none.

    Example::

        layout = TableLayout.unsharded(ebc.table("user"))
        layout.owns(torch.tensor([3, 2**40]))   # tensor([True, True])
    """

    name: str
    dim: int
    num_buckets: int
    table: KVTable | None
    owned: tuple[int, int] | None
    admission: bool
    #: ``"unsharded"``, ``"row_wise"``, ``"table_wise"``, ``"column_wise"`` or
    #: ``"table_row_wise"``.
    sharding: str = "unsharded"
    #: Sharded: the ``KVFusedOptimizer`` whose ``lr`` drives this shard (shared by
    #: the tables of its grouped config). Unsharded: None, ``table.optim`` does.
    fused_optimizer: Any = field(default=None, compare=False, repr=False)
    #: The dtype the table stores its rows in (``KVTableOptions.weights_dtype``).
    weights_dtype: torch.dtype = torch.float32
    #: A column shard's ``(first column, width)`` of the table's ``dim`` columns
    #: (``"column_wise"`` on a rank holding a shard); None for whole rows.
    columns: tuple[int, int] | None = None

    @classmethod
    def unsharded(cls, table: KVTable) -> TableLayout:
        """The layout of a whole table held by one process."""
        num_buckets = table.options.total_num_buckets
        return cls(
            table.name,
            table.dim,
            num_buckets,
            table,
            (0, num_buckets),
            table.options.admission_threshold > 1,
            weights_dtype=table.options.weights_dtype,
        )

    def learning_rate(self) -> float | None:
        """The fused optimizer's current learning rate for this table (None where
        this rank holds no shard of it)."""
        return None if self.table is None else self.table.learning_rate

    def set_learning_rate(self, lr: float) -> None:
        """Make ``lr`` the learning rate of the next update (sharded: of every table
        sharing this shard's fused optimizer)."""
        if self.table is not None:
            self.table.learning_rate = lr

    def owns(self, ids: torch.Tensor) -> torch.Tensor:
        """Which of ``ids`` this rank stores."""
        if self.owned is None:
            return torch.zeros_like(ids, dtype=torch.bool)
        lo, hi = self.owned
        if (lo, hi) == (0, self.num_buckets):
            return torch.ones_like(ids, dtype=torch.bool)
        buckets = route_bucket(ids, self.num_buckets)
        return (buckets >= lo) & (buckets < hi)


def owned_buckets(
    num_buckets: int, rank: int, world_size: int, row_wise: bool, holds_table: bool
) -> tuple[int, int] | None:
    """The routing buckets a rank stores: row-wise, rank ``r`` of ``W`` owns
    ``[r*G/W, (r+1)*G/W)``; table-wise, the rank holding the table owns all.
    Table-row-wise is row-wise over the table's node: ``rank`` its local rank,
    ``world_size`` the node's ranks (:func:`table_owned_buckets`)."""
    if row_wise:
        per_rank = num_buckets // world_size
        return rank * per_rank, (rank + 1) * per_rank
    return (0, num_buckets) if holds_table else None


def table_owned_buckets(
    num_buckets: int,
    sharding: str,
    rank: int,
    world_size: int,
    ranks: Sequence[int] | None,
    holds_table: bool,
) -> tuple[int, int] | None:
    """The routing buckets global ``rank`` stores of a table sharded ``sharding``
    over ``ranks`` (the plan's; table-row-wise: the ranks of the table's node, local
    rank ``l`` of ``L`` owning ``[l*G/L, (l+1)*G/L)``).

    Example::

        table_owned_buckets(96, "table_row_wise", rank=3, world_size=4, ranks=[2, 3],
                            holds_table=True)   # (48, 96)
    """
    if sharding == "table_row_wise":
        if ranks is None or rank not in ranks:
            return None
        return owned_buckets(num_buckets, list(ranks).index(rank), len(ranks), True, True)
    return owned_buckets(num_buckets, rank, world_size, sharding == "row_wise", holds_table)


def sharded_layouts(
    configs: Sequence[Any],
    options: Mapping[str, Any],
    sharding_types: Mapping[str, str],
    tables: Mapping[str, KVTable],
    optimizers: Mapping[str, Any],
    rank: int,
    world_size: int,
    sharding_ranks: Mapping[str, Sequence[int] | None] | None = None,
) -> list[TableLayout]:
    """The layouts of a sharded collection's KV tables (``configs``: its
    ``EmbeddingBagConfig``s, ``options``: KV options by table name, the other
    mappings by table name too: sharding type, this rank's shards, the fused
    optimizer driving each, the plan's ranks (needed for table-row-wise))."""
    out = []
    for config in configs:
        if config.name not in options:
            continue
        num_buckets = options[config.name].total_num_buckets
        table = tables.get(config.name)
        sharding = sharding_types[config.name]
        owned = table_owned_buckets(
            num_buckets,
            sharding,
            rank,
            world_size,
            (sharding_ranks or {}).get(config.name),
            table is not None,
        )
        columns = None
        if sharding == "column_wise" and table is not None:
            columns = (table.options.column_offset, table.dim)
        out.append(
            TableLayout(
                config.name,
                config.embedding_dim,
                num_buckets,
                table,
                owned,
                options[config.name].admission_threshold > 1,
                sharding,
                optimizers.get(config.name),
                options[config.name].weights_dtype,
                columns,
            )
        )
    return out


@dataclass(frozen=True)
class KVTableSlot:
    """A KV table of a model, without its rows: where it is and its optimizer.

    Example::

        slot = kv_table_slots(model)["ebc.embedding_bags.user."]
        slot.optimizer, slot.state_shapes   # "rowwise_adagrad", {"momentum1": ()}
    """

    layout: TableLayout
    #: The fused optimizer (``OptimKind`` value) and its state tensors' shapes per
    #: row (``FusedOptimConfig.state_shapes``), where this rank holds the table
    #: (None elsewhere).
    optimizer: str | None
    state_shapes: dict[str, tuple[int, ...]] | None

    @classmethod
    def of(cls, layout: TableLayout) -> KVTableSlot:
        optim = None if layout.table is None else layout.table.optim
        return cls(
            layout,
            None if optim is None else optim.kind.value,
            None if optim is None else optim.state_shapes(layout.dim),
        )


class KVTableDescription(OrderedDict):
    """A ``state_dict(destination=...)`` in which KV modules describe their tables:
    one :class:`KVTableSlot` per table under ``<prefix>embedding_bags.<table>.weight``,
    no rows exported, nothing collective; other modules' entries as usual.

    Example::

        state = model.state_dict(destination=KVTableDescription())
    """


def describe_state_dict(model: nn.Module) -> tuple[dict[str, KVTableSlot], dict[str, Any]]:
    """``model``'s KV tables by state_dict prefix (``<path>.embedding_bags.<table>.``),
    and the rest of its state_dict (stock tables, dense parameters, buffers)."""
    state = model.state_dict(destination=KVTableDescription())
    slots = {k[: -len("weight")]: v for k, v in state.items() if isinstance(v, KVTableSlot)}
    rest = {k: v for k, v in state.items() if not isinstance(v, KVTableSlot)}
    return slots, rest


def kv_table_slots(model: nn.Module) -> dict[str, KVTableSlot]:
    """Every KV table of ``model`` by the prefix of its entries in
    ``model.state_dict()``, e.g. ``{"ebc.embedding_bags.user.": KVTableSlot(...)}``."""
    return describe_state_dict(model)[0]
