"""``KVTableGroup``: KV tables that share one set of arrays and are looked up together.

As FBGEMM's TBE does with table offsets, the tables of a group (same dim and
optimizer, same device; all with an SSD tier or none) live in one index, one
row array and one admission counter: table ``t`` owns the buckets ``[bucket_offset[t],
bucket_offset[t] + num_buckets[t])`` (``GroupLayout``), so its slots, hence its
rows, are a contiguous range of the group's. Each table stays a
:class:`~torchrec_kvemb.table.KVTable` over views of those arrays (``find``,
``insert``, ``export``, checkpoints work on it as on any table), and its
semantics do not change: buckets of two tables never mix.

Tables with SSD tiers keep their own SSD stores (files, flushes, ``resume``)
and share one scratch pad after the group's rows (``ssd/scratch.py``); their
training lookup is one pass for all of them (``tiered_lookup.py``: the native
kernel on the CPU, the Triton kernels on CUDA), and their evaluation lookup
moves their rows in one gather and one scatter (``tiered_eval.py``).

A batch of the group is ``ids [n]`` with ``table_idx [n]`` (the table of each
id; -1: not this group's) and is looked up in one call per step
(``lookup_train`` / ``lookup_eval``), whose backend ``dispatch.py``
chooses: the native CPU kernel, the Triton kernels, or the torch path (one
``KVTable`` call per table: the reference the others are tested against).

Example::

    group = KVTableGroup(["user", "item"], [KVTableOptions(capacity=1000)] * 2, dim=8)
    lookup = group.lookup_train(ids, table_idx)     # global slots, -1: no row
    group.tables[0].export()                        # "user"'s rows, as ever
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from torchrec_kvemb import dispatch
from torchrec_kvemb.backend import implementation
from torchrec_kvemb.contracts import (
    METRIC_NAMES,
    Bags,
    GroupLayout,
    GroupLookup,
    GroupOptimizer,
    TableStorage,
)
from torchrec_kvemb.memory import table_memory
from torchrec_kvemb.optimizer import FusedOptimConfig
from torchrec_kvemb.options import WAYS, KVTableOptions
from torchrec_kvemb.ssd.scratch import ScratchPad
from torchrec_kvemb.table import KVTable, grown_storage
from torchrec_kvemb.tiered_eval import lookup_eval_tiers
from torchrec_kvemb.tiered_lookup import lookup_train_tiers
from torchrec_kvemb.ttl import GroupTTL


class KVTableGroup:
    """Tables of one dim and optimizer sharing arrays (see the module docstring)."""

    def __init__(
        self,
        names: Sequence[str],
        options: Sequence[KVTableOptions],
        dim: int,
        optim: FusedOptimConfig | None = None,
        device: torch.device | str | None = None,
        optims: Sequence[FusedOptimConfig] | None = None,
    ) -> None:
        """``optims``: one config per table (learning rates may differ; the kind and
        other hyper-parameters must not), else ``optim`` for all."""
        if len(names) != len(options) or not names:
            raise ValueError("KVTableGroup: one KVTableOptions per table name, at least one")
        optims = list(optims) if optims is not None else [optim or FusedOptimConfig()] * len(names)
        first = optims[0]
        for name, config, opts in zip(names, optims, options, strict=True):
            if config.with_learning_rate(first.learning_rate) != first:
                raise ValueError(
                    f"table {name!r}: the tables of a group share one optimizer ({first}); "
                    f"got {config}"
                )
            if opts.tiered != options[0].tiered:
                raise ValueError(
                    f"table {name!r}: the tables of a group all have a lower tier or none do"
                )
            if opts.weights_dtype != options[0].weights_dtype:
                raise ValueError(
                    f"table {name!r}: the tables of a group share one weights_dtype "
                    f"({options[0].weights_dtype}); got {opts.weights_dtype}"
                )
        device = torch.device(device or "cpu")
        memories = [table_memory(o, dim, first) for o in options]
        rows = [m.initial_rows for m in memories]
        counted = [m.counter_ids for m in memories]
        storage = TableStorage.allocate(
            sum(rows), dim, memories[0].state_dim, sum(counted), device, options[0].weights_dtype
        )
        #: The scratch pad of a group of tables with SSD tiers (None without).
        self.pad = ScratchPad(storage.weights, storage.state) if options[0].tiered else None
        tables = []
        row0 = counter0 = 0
        for t, (name, opts, config, n, c) in enumerate(
            zip(names, options, optims, rows, counted, strict=True)
        ):
            part = storage.part((row0, row0 + n), (counter0, counter0 + c))
            extra = {} if self.pad is None else {"pad": self.pad.for_table(t, row0)}
            try:
                tables.append(KVTable(name, dim, opts, config, device, storage=part, **extra))
            except BaseException:
                for table in tables:
                    table.close()
                raise
            row0, counter0 = row0 + n, counter0 + c
        if self.pad is not None:  # the group's slots address its scratch rows too
            storage = storage._replace(weights=self.pad.arrays[0], state=self.pad.arrays[1])
        self._adopt(tables, storage, counted)
        #: Whether only the per-table torch path may look the group up.
        self.per_table_only = False

    @classmethod
    def alone(cls, table: KVTable) -> KVTableGroup:
        """A group of one table that keeps its own arrays (a table with an SSD tier and
        no other of its dim and optimizer, looked up by its own path)."""
        group = cls.__new__(cls)
        counter_ids = table.counts.numel() if table.counts is not None else 0
        storage = table.storage()
        group._adopt([table], storage, [counter_ids])
        group.per_table_only = True
        table.regrow = group._regrow
        group.pad = None
        return group

    def _adopt(self, tables: list[KVTable], storage: TableStorage, counted: list[int]) -> None:
        self.tables = tables
        self.storage = storage
        self.dim = tables[0].dim
        self.device = tables[0].device
        self._counted = counted
        self.metrics = torch.zeros(
            len(tables), len(METRIC_NAMES), dtype=torch.int64, device=self.device
        )
        self._place()
        for t, table in enumerate(tables):
            table.device_metrics = self.metrics[t]
            table.regrow = self._regrow
        #: Every table's clocks ``[2, T]`` (training lookups, optimizer steps; see
        #: ``KVTable.clock``): each table's are a column of these, which the group's
        #: ops advance in place.
        if len(tables) == 1:  # a lone table's clock is already the group's
            self.clocks = tables[0].clock.unsqueeze(1)
        else:
            self.clocks = torch.stack([t.clock for t in tables], dim=1)
            for t, table in enumerate(tables):
                table.clock = self.clocks[:, t]
        self._rates: tuple[list[float], torch.Tensor] | None = None
        #: The TTL tables' marks and sweeps after a lookup (None: no TTL table).
        self.ttl = GroupTTL.build(tables)

    def _place(self) -> None:
        """Where each table's rows and buckets are in the arrays (``row_offsets``,
        ``layout``), from the tables' capacities."""
        tables = self.tables
        self.row_offsets = [0]
        for table in tables[:-1]:
            self.row_offsets.append(self.row_offsets[-1] + table.capacity)
        self.layout = GroupLayout.build(
            num_buckets=[t.capacity // WAYS for t in tables],
            counter_num_buckets=[c // WAYS for c in self._counted],
            options=[t.options for t in tables],
            device=self.device,
        )
        self._row_ends = self.metrics.new_tensor(
            [start + t.capacity for start, t in zip(self.row_offsets, tables, strict=True)]
        )

    # ---------------------------------------------------------------- growth
    def make_room(self, ids: torch.Tensor, table_idx: torch.Tensor) -> None:
        """Grow the tables below their maximum that a training batch (``ids`` with
        ``table_idx``) would otherwise make evict or fail (``KVTable.make_room``), in
        one reallocation; nothing to do (no host sync) once every table is at its
        maximum."""
        rows = {}
        for t, table in enumerate(self.tables):
            if table.capacity < table.max_capacity:
                mine = ids[table_idx == t]
                if mine.numel():
                    uniq, counts = torch.unique(mine, return_counts=True)
                    rows[t] = table.rows_needed(uniq, counts)
        self._resize({t: n for t, n in rows.items() if n != self.tables[t].capacity})

    def _regrow(self, table: KVTable, rows: int) -> None:
        """``KVTable.grow`` of one of the group's tables."""
        self._resize({self.tables.index(table): rows})

    def _resize(self, rows: dict[int, int]) -> None:
        """Reallocate the group's index and rows with ``rows[t]`` rows for table ``t``
        (its ids rehashed into them, ``KVTable.rehash_into``; each counts a growth)
        and the other tables' copied as they are; the admission counter and clocks
        stay."""
        if not rows:
            return
        if self.pad is not None:  # the last batch's scratch rows go to their tiers first
            for table in self.tables:
                table.settle()
        old = self.storage
        capacities = [rows.get(t, table.capacity) for t, table in enumerate(self.tables)]
        storage = grown_storage(sum(capacities), old.weights, old.state)
        storage = storage._replace(
            counter_keys=old.counter_keys, counter_scores=old.counter_scores, counts=old.counts
        )
        row0 = 0
        for t, (table, n) in enumerate(zip(self.tables, capacities, strict=True)):
            part = storage.part((row0, row0 + n), (0, 0))
            if t in rows:
                table.rehash_into(part)
                table.count("growths", 1)
            else:
                arrays = (table.keys, table.scores, table.weights, table.state)
                for new, now in zip(part[:4], arrays, strict=True):
                    new.copy_(now)
                table.use_rows(part)
            row0 += n
        self.storage = storage
        self._place()
        if self.pad is not None:  # a new scratch pad after the new rows
            self.pad = ScratchPad(storage.weights, storage.state)
            for t, table in enumerate(self.tables):
                table.use_pad(self.pad.for_table(t, self.row_offsets[t]))
            self.storage = storage._replace(weights=self.pad.arrays[0], state=self.pad.arrays[1])
        elif self.per_table_only:  # a lone table's arrays, its scratch rows included
            self.storage = self.tables[0].storage()

    # ----------------------------------------------------------------- shape
    @property
    def num_tables(self) -> int:
        return len(self.tables)

    @property
    def optim(self) -> FusedOptimConfig:
        """The group's optimizer (the first table's learning rate)."""
        return self.tables[0].optim

    @property
    def weights(self) -> torch.Tensor:
        return self.storage.weights

    @property
    def state(self) -> torch.Tensor:
        return self.storage.state

    def learning_rates(self) -> list[float]:
        return [t.learning_rate for t in self.tables]

    def learning_rate_tensor(self) -> torch.Tensor:
        """Each table's learning rate ``[T]`` float64 on the group's device (made anew
        only when a rate changed)."""
        rates = self.learning_rates()
        if self._rates is None or self._rates[0] != rates:
            self._rates = (rates, torch.tensor(rates, dtype=torch.float64, device=self.device))
        return self._rates[1]

    # ------------------------------------------------------------- lookups
    def lookup_train(
        self,
        ids: torch.Tensor,
        table_idx: torch.Tensor,
        custom_scores: torch.Tensor | None = None,
        custom_tables: Sequence[bool] | None = None,
    ) -> GroupLookup:
        """Slots of a training batch (inserting new ids, admission and eviction
        apply per table); every table's clock advances by one. ``custom_scores``
        (one per id) feed the CUSTOM_SCORE tables flagged in ``custom_tables``
        (default: all of them)."""
        if self.pad is not None:
            self._begin_tiered_batch()
        self.make_room(ids, table_idx)
        if self.per_table_only or self.backend(ids.device) == "torch":
            return self.lookup_train_per_table(ids, table_idx, custom_scores, custom_tables)
        if self.pad is not None:  # tables over tiers: one pass, native or Triton (tiered_lookup)
            if custom_scores is not None and custom_tables is None:
                custom_tables = [True] * self.num_tables
            return lookup_train_tiers(
                self.tables, self.layout, self.storage, self.row_offsets, ids, table_idx,
                custom_scores, custom_tables, self.clocks[0],
            )  # fmt: skip
        use_custom = None
        if custom_scores is not None:
            flags = [True] * self.num_tables if custom_tables is None else list(custom_tables)
            use_custom = torch.tensor(flags, dtype=torch.int64, device=ids.device)
        lookup = dispatch.group_lookup_train(
            self.layout, self.storage, ids, table_idx, self.clocks[0], self.metrics,
            custom_scores, use_custom,
        )  # fmt: skip
        if self.ttl is not None:
            self.ttl.after_lookup(lookup.slots, table_idx, self.row_offsets)
        return lookup

    def _begin_tiered_batch(self) -> None:
        """Every table writes its scratch rows of the last batch back
        (``KVTable.settle``); the pad starts over."""
        for table in self.tables:
            table.settle()
        self.pad.begin_batch()

    def backend(self, device: torch.device) -> str:
        """What looks this group up on ``device``: ``backend.implementation``'s answer
        (``"native"``, ``"triton"``: the group kernels, for tables over tiers too,
        ``tiered_lookup``; ``"torch"``: table by table); a lone table's group runs that
        table's own lookup (``KVTable.lookup_backend``)."""
        if self.per_table_only:
            return self.tables[0].lookup_backend(device)
        return implementation(device)

    def lookup_eval(self, ids: torch.Tensor, table_idx: torch.Tensor) -> torch.Tensor:
        """Global slots of an evaluation batch (read-only); -1 for ids not stored."""
        if self.pad is not None:
            self._begin_tiered_batch()
            # One move per direction, on every backend (why the torch one too: table by
            # table, a table that grows replaces the pad under the scratch rows an
            # earlier table of the batch wrote; the stages grow every table first).
            return lookup_eval_tiers(self.tables, ids, table_idx)
        if self.per_table_only or self.backend(ids.device) == "torch":
            return self.lookup_eval_per_table(ids, table_idx)
        return dispatch.group_lookup_eval(self.layout, self.storage, ids, table_idx, self.metrics)

    def pooled_eval(
        self,
        ids: torch.Tensor,
        offsets: torch.Tensor | None,
        table_of_bag: torch.Tensor,
        per_sample_weights: torch.Tensor | None,
        mean_of_bag: torch.Tensor | None,
        bag_list: torch.Tensor,
        out_offset: torch.Tensor | None = None,
        out_shape: tuple[int, int] | None = None,
        unpooled: bool = False,
        into: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """An evaluation batch, read-only: the pooled rows of the bags cut by ``offsets``
        (ids without a row pool zeros; ``table_of_bag``: the table of each bag's ids,
        -1: not the group's; a bag's ids count their per-sample weight, divided by its
        length where ``mean_of_bag``), bag ``b``'s row at flat offset ``out_offset[b]``
        of a new ``out_shape`` tensor (rows of ``dim``: the group's bags ``bag_list`` in
        this order), or ``[B, dim]``; ``offsets`` None: every id is a bag of its own,
        ``[n, dim]``; ``unpooled``: likewise, the bags giving each id's table only.

        One fused probe-and-pool call (``kvemb::pooled_eval_group``) where the group
        has one; tables with SSD tiers, a lone table's group and the torch path look
        up (``lookup_eval``), then pool (``pooled_forward`` / ``rows_forward``).
        ``into``: memory the output may be written into (where the native kernel runs
        directly, ``dispatch.group_pooled_eval``); the result is the returned tensor."""
        if self.pad is None and not self.per_table_only and self.backend(ids.device) != "torch":
            bags = ids.shape[0] if offsets is None or unpooled else offsets.shape[0] - 1
            shape = out_shape if out_offset is not None else (bags, self.dim)
            return dispatch.group_pooled_eval(
                self.layout, self.storage, ids, offsets, table_of_bag, per_sample_weights,
                mean_of_bag, bag_list, out_offset, shape, self.metrics, unpooled, into,
            )  # fmt: skip
        n = ids.shape[0]
        if offsets is None or unpooled:
            each = torch.arange(n + 1, device=ids.device)
            table_idx = table_of_bag
            if offsets is not None:
                table_idx = table_of_bag.index_select(0, Bags.build(offsets, n).bag_of)
            slots = self.lookup_eval(ids, table_idx)
            return self.rows_forward(slots, ids, table_idx, Bags(each, each[:n], None), True)
        mean = mean_of_bag if mean_of_bag is not None else False
        bags = Bags.build(offsets, n, per_sample_weights, mean)
        table_idx = table_of_bag.index_select(0, bags.bag_of)
        slots = self.lookup_eval(ids, table_idx)
        pooled = self.pooled_forward(slots, ids, table_idx, bags, bag_list, True)
        if out_offset is None:
            return pooled
        return pooled.index_select(0, bag_list).view(out_shape)

    def pooled_forward(
        self,
        slots: torch.Tensor,
        ids: torch.Tensor,
        table_idx: torch.Tensor,
        bags: Bags,
        bag_list: torch.Tensor,
        missing_as_zero: bool,
    ) -> torch.Tensor:
        """Pooled rows ``[B, dim]`` of a batch (meaningful for the bags in ``bag_list``):
        ids without a row pool their table's initial value, or zeros."""
        return dispatch.group_pooled_forward(
            self.layout, self.weights, slots, ids, table_idx, bags, bag_list, missing_as_zero
        )

    def rows_forward(
        self,
        slots: torch.Tensor,
        ids: torch.Tensor,
        table_idx: torch.Tensor,
        bags: Bags,
        missing_as_zero: bool,
    ) -> torch.Tensor:
        """One row per id ``[n, dim]`` of a batch whose every id is a bag of its own
        (ids of another group's tables get zeros): a sequence lookup's forward."""
        return dispatch.group_rows_forward(
            self.layout, self.weights, slots, ids, table_idx, missing_as_zero
        )

    def fused_backward(
        self,
        lookup: GroupLookup,
        grad_out: torch.Tensor,
        bags: Bags,
        learning_rates: torch.Tensor,
    ) -> None:
        """One optimizer step of every table from the gradient of its pooled rows
        (``learning_rates``: ``learning_rate_tensor()`` as the forward saw it)."""
        optim = GroupOptimizer(
            configs=tuple(t.optim for t in self.tables),
            learning_rates=learning_rates,
            steps=self.clocks[1],
            row_offsets=tuple(self.row_offsets),
            rows=self._row_counts(),
            row_ends=self._row_ends,
            pad_tables=self.pad.row_table if self.pad is not None else None,
        )
        dispatch.group_fused_backward(self.storage, optim, lookup, grad_out, bags)

    def _row_counts(self) -> tuple[int, ...]:
        """Rows each table's slots may address: its capacity (a group of one table
        alone: its arrays' rows, scratch rows of an SSD tier included)."""
        if self.per_table_only:
            return (self.storage.weights.shape[0],)
        return tuple(t.capacity for t in self.tables)

    # ------------------------------------------------------ torch reference
    def lookup_train_per_table(
        self,
        ids: torch.Tensor,
        table_idx: torch.Tensor,
        custom_scores: torch.Tensor | None,
        custom_tables: Sequence[bool] | None,
    ) -> GroupLookup:
        """The torch path: ``KVTable.lookup_train`` table by table (a group of one
        table alone: its ``lookup_train_rows``, with the unique rows for the native
        backward where its lookup made them)."""
        if self.per_table_only:
            custom = custom_scores is not None and (custom_tables is None or custom_tables[0])
            return self._lookup_train_alone(ids, table_idx, custom_scores if custom else None)
        slots = torch.full_like(ids, -1)
        for t, table in enumerate(self.tables):
            mine = (table_idx == t).nonzero().squeeze(1)
            scores = None
            if custom_scores is not None and (custom_tables is None or custom_tables[t]):
                scores = custom_scores[mine]
            local = table.lookup_train(ids[mine], scores)
            slots[mine] = torch.where(local >= 0, local + self.row_offsets[t], -1)
        return GroupLookup(slots)

    def _lookup_train_alone(
        self, ids: torch.Tensor, table_idx: torch.Tensor, custom_scores: torch.Tensor | None
    ) -> GroupLookup:
        """``lookup_train`` of a group of one table alone (row offset 0; ``custom_scores``
        for its ids, or None): ids of other groups (``table_idx`` -1) get slot -1 and,
        where the table's lookup gives unique rows, one more unique of slot -1 (no
        gradient)."""
        (table,) = self.tables
        mine = (table_idx == 0).nonzero().squeeze(1)
        every = mine.numel() == ids.numel()
        if not every:
            ids = ids[mine]
            custom_scores = None if custom_scores is None else custom_scores[mine]
        look = table.lookup_train_rows(ids, custom_scores)
        if every:
            return look
        n = table_idx.numel()
        slots = look.slots.new_full((n,), -1)
        slots[mine] = look.slots
        if look.unique_index is None:
            return GroupLookup(slots)
        none = look.unique_slots.numel()  # the unique of the other groups' ids
        unique_index = look.unique_index.new_full((n,), none)
        unique_index[mine] = look.unique_index
        return GroupLookup(
            slots,
            unique_index,
            torch.cat([look.unique_slots, look.unique_slots.new_full((1,), -1)]),
            torch.cat([look.unique_table, look.unique_table.new_zeros(1)]),
        )

    def lookup_eval_per_table(self, ids: torch.Tensor, table_idx: torch.Tensor) -> torch.Tensor:
        """The torch path of ``lookup_eval``: ``KVTable.lookup_eval`` table by table."""
        slots = torch.full_like(ids, -1)
        for t, table in enumerate(self.tables):
            mine = (table_idx == t).nonzero().squeeze(1)
            local = table.lookup_eval(ids[mine])
            slots[mine] = torch.where(local >= 0, local + self.row_offsets[t], -1)
        return slots
