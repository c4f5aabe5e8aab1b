"""``KVFusedOptimizer``: what TorchRec's ``fused_optimizer`` sees of KV tables.

Its ``state`` holds, per KV table with optimizer state, one
:class:`KVOptimizerState` under ``"by_id"``: TorchRec's ``KeyedOptimizer`` calls
its ``state_dict()`` / ``load_state_dict()`` (the stateful protocol), so
``fused_optimizer.state_dict()`` gives each table's optimizer state **by id**,
never by storage slot::

    fused_optimizer.state_dict()["state"]["ebc.embedding_bags.user.weight"]["by_id"]
    # {"weight_id": [rows], "momentum1": [rows]}   (Adam: "exp_avg", "exp_avg_sq")

rows in the order of the model's state_dict (routing bucket, then id), plain
tensors for a standalone kernel, ShardedTensors when sharded (row-wise: one
shard per rank, like the model's entries, a collective; table-wise: one shard,
on the rank holding the table). ``load_state_dict`` applies state rows by id,
and refuses (``CheckpointError`` naming the table) ids other than the table's
stored ids: load the model's state_dict first, then the optimizer's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torchrec.optim.fused import FusedOptimizer

from torchrec_kvemb.state_dict import (
    CheckpointError,
    TableLayout,
    TableRows,
    admission_state,
    check_ids,
    check_state,
    gather_row_counts,
    is_distributed,
    local_rows,
    owned_buckets,
    restore_table,
    row_sharded_tensor,
    table_rows,
)
from torchrec_kvemb.table import KVTable

#: The key of a KV table's :class:`KVOptimizerState` in its ``state`` entry.
BY_ID = "by_id"


class KVOptimizerState:
    """One KV table's optimizer state, by id (the stateful protocol TorchRec's
    ``KeyedOptimizer.state_dict`` / ``load_state_dict`` honour).

    ``group``: None for plain tensors, else the process group of a sharded table
    (``row_wise``: every rank of it holds a shard; else this rank holds the table).

    Example::

        state = KVOptimizerState(TableLayout.unsharded(table))
        saved = state.state_dict()       # {"weight_id": ..., "momentum1": ...}
        state.load_state_dict(saved)     # by id; other ids are refused
        state.apply()                    # (KVFusedOptimizer.post_load_state_dict)
    """

    def __init__(
        self,
        layout: TableLayout,
        group: dist.ProcessGroup | None = None,
        row_wise: bool = False,
    ) -> None:
        self.layout = layout
        self.group = group
        self.row_wise = row_wise
        self._pending: TableRows | None = None

    @property
    def table(self) -> KVTable:
        return self.layout.table

    def state_dict(self) -> dict[str, Any]:
        """``weight_id`` and the optimizer state tensors, rows sorted by routing
        bucket then id (row-wise sharded: a collective over the group)."""
        table = self.table
        data = table_rows(table)
        local = {"weight_id": data["ids"]}
        local.update({name: data[name] for name in table.optim.state_names()})
        if self.group is None:
            return local
        if self.row_wise:
            shards = gather_row_counts([local["weight_id"].numel()], str(table.device), self.group)
            counts, placements, me = shards.counts(0), shards.placements, shards.me
        else:  # table-wise: this rank holds the whole table, one shard
            rank = dist.get_global_rank(self.group, dist.get_rank(self.group))
            placements, me = [f"rank:{rank}/{table.device}"], 0
            counts = [local["weight_id"].numel()]
        return {
            key: row_sharded_tensor(value, counts, placements, me, self.group)
            for key, value in local.items()
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Check ``state_dict`` (as :meth:`state_dict` gives it; plain tensors may
        hold the whole table, of which the ids this rank owns count) and keep it
        for :meth:`apply`. Raises :class:`CheckpointError` naming the table when
        its ids are not exactly the table's stored ids, or its state does not
        fit the table's optimizer."""
        self._pending = None
        name, table = self.layout.name, self.table
        if "weight_id" not in state_dict:
            raise CheckpointError(f"table {name!r}: the optimizer state has no weight_id")
        ids = local_rows(name, "weight_id", state_dict["weight_id"])
        state = {k: local_rows(name, k, v) for k, v in state_dict.items() if k != "weight_id"}
        check_ids(name, ids)
        check_state(name, table.optim.state_shapes(table.dim), state, ids.numel())
        if not is_distributed(state_dict["weight_id"]):
            keep = self.layout.owns(ids)
            ids, state = ids[keep], {k: v[keep] for k, v in state.items()}
        data = table_rows(table)
        stored = data["ids"]
        mine, order = torch.sort(ids.to(stored.device))
        if mine.numel() != stored.numel() or not torch.equal(mine, torch.sort(stored).values):
            missing = int((~torch.isin(stored, mine)).sum())
            extra = int((~torch.isin(mine, stored)).sum())
            raise CheckpointError(
                f"table {name!r}: the optimizer state is for other ids than the table holds "
                f"({extra} ids the table does not hold, {missing} stored ids without state); "
                "optimizer state is applied by id, never by position: load the model's "
                "state_dict (which carries the same state) first"
            )
        # The given row of each stored id: ids[order[k]] is the k-th smallest id.
        by_stored = torch.empty_like(order)
        by_stored[torch.argsort(stored)] = order
        self._pending = TableRows(
            ids=stored,
            weights=data["weights"],
            scores=data["scores"],
            state={k: v.to(stored.device)[by_stored] for k, v in state.items()},
            admission=admission_state(table) if self.layout.admission else None,
        )

    def apply(self) -> None:
        """Put the state kept by :meth:`load_state_dict` into the table (its rows,
        scores and counters unchanged)."""
        rows, self._pending = self._pending, None
        if rows is not None:
            restore_table(self.table, rows)


class KVFusedOptimizer(FusedOptimizer):
    """TorchRec's view of the optimizer fused into a ``KVEmbeddingBag``'s backward.

    ``step`` and ``zero_grad`` do nothing (rows update in backward). One param
    group, which the tables read their learning rate from
    (``KVTable.use_param_group``), so ``param_groups[0]["lr"] = x`` changes the
    next update. ``params`` maps ``<table>.weight`` to the local shard's value
    rows; ``state`` maps them to ``{"by_id": KVOptimizerState}`` for tables with
    optimizer state: ``state_dict()`` / ``load_state_dict()`` are by id (see the
    module docstring). ``group`` / ``row_wise``: how the tables are sharded
    (None: plain tensors).

    Example::

        for group in model.fused_optimizer.param_groups:
            group["lr"] = 0.01
        saved = model.fused_optimizer.state_dict()   # per id, every rank
    """

    def __init__(
        self,
        tables: Sequence[KVTable],
        group: dist.ProcessGroup | None = None,
        row_wise: bool = False,
    ) -> None:
        params = {f"{t.name}.weight": t.weights for t in tables}
        layouts = [_layout(t, group, row_wise) for t in tables]
        self._by_id = [KVOptimizerState(layout, group, row_wise) for layout in layouts]
        state = {s.table.weights: {BY_ID: s} for s in self._by_id if s.table.state_dim}
        lr = tables[0].learning_rate if tables else 0.0
        super().__init__(params, state, [{"params": list(params.values()), "lr": lr}])
        for table in tables:
            table.use_param_group(self.param_groups[0])

    @property
    def learning_rate(self) -> float:
        """``param_groups[0]["lr"]``: the learning rate of the next update."""
        return float(self.param_groups[0]["lr"])

    @learning_rate.setter
    def learning_rate(self, value: float) -> None:
        self.param_groups[0]["lr"] = float(value)

    def step(self, closure: Any = None) -> None:
        """Nothing to do: the KV rows were updated inside backward."""

    def zero_grad(self, set_to_none: bool = False) -> None:
        """Nothing to do: KV tables never hold a ``.grad``."""

    def post_load_state_dict(self) -> None:
        """After every table's state was checked (``load_state_dict``, also through
        TorchRec's ``CombinedOptimizer``): put it into the tables."""
        for state in self._by_id:
            state.apply()


def _layout(table: KVTable, group: dist.ProcessGroup | None, row_wise: bool) -> TableLayout:
    if group is None:
        return TableLayout.unsharded(table)
    num_buckets = table.options.total_num_buckets
    owned = owned_buckets(
        num_buckets, dist.get_rank(group), dist.get_world_size(group), row_wise, True
    )
    return TableLayout(
        table.name,
        table.dim,
        num_buckets,
        table,
        owned,
        table.options.admission_threshold > 1,
        "row_wise" if row_wise else "table_wise",
    )
