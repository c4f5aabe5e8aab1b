"""``TieredKVTable``: a KV table whose rows in memory are a cache over a lower tier.

The lower tier (an :class:`~torchrec_kvemb.ssd.store.SSDStore`: rows on disk)
is used through its contract only (:class:`~torchrec_kvemb.tier.LowerTier`,
built in one place: ``_open_tier``):

* ``lookup_train`` / ``lookup_eval``: an id the lower tier holds is promoted
  (its row, optimizer state and score come back to memory) and the rows that
  make room for it are demoted (written to the lower tier);
* ``insert``: overwrites the row in whichever tier holds it; rows that find no
  memory row go to the lower tier;
* ``find`` and ``export``: read both tiers;
* ``prefetch``, ``flush``, ``close``; at construction, what the last flush of a
  previous run left is restored.

Ids of a training batch that find no memory row (a bucket full of the batch's
ids) train in scratch rows after the memory rows (``ssd/scratch.py``), written
to the SSD tier at the table's next call.

The native one-pass lookup (``tiered_lookup.py``) does a batch's tier work
through the table's public steps: ``settle``, ``fetch_lower``, ``reserve_batch``,
``demote_rows``, ``write_scratch``, ``advance_step`` and ``tier``; it moves the
rows of all its tables in one gather and one scatter (``transfers.py``), as
``demote`` and ``promote`` do for one table (on CUDA: copies on a side stream).
The evaluation lookup is steps too (``plan_eval``, the moves, ``finish_eval``),
which a group composes for all its tables (``tiered_eval.py``), moving their rows
likewise in one gather and one scatter.

The two tiers never hold the same id. ``KVTable(..., options)`` with
``options.ssd`` builds this class. See docs/ssd-tier.md.

On the CPU with the native kernels, ``lookup_train`` is one native
find-or-insert of the whole batch with the SSD ids as promotions
(``native.TierPromotion``); the torch path stays the reference it is tested
against (tests/ssd/test_tier_backends.py).

Why one file of some 600 lines: one class, each of whose methods is the
table's contract over two tiers (the training lookup twice: native and torch;
the steps of a batch over the tier, which the native pass calls too); the
tier's contract (``tier.py``), the storage (``ssd/``) and the scratch pad
(``ssd/scratch.py``) already live apart.

Example::

    table = KVTable("user", 8, KVTableOptions(capacity=1000, ssd=SSDOptions("/mnt/ssd")))
    slots = table.lookup_train(ids)   # promotes the SSD rows of ids, demotes to make room
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from torchrec_kvemb.backend import implementation
from torchrec_kvemb.contracts import GroupLayout, GroupLookup, InsertResult, TableStorage
from torchrec_kvemb.host_tier import HostTier
from torchrec_kvemb.ops.hashing import INT64_MAX, route_bucket
from torchrec_kvemb.optimizer import FusedOptimConfig
from torchrec_kvemb.options import WAYS, EvictionPolicy, KVTableOptions
from torchrec_kvemb.ssd.scratch import ScratchPad, TablePad
from torchrec_kvemb.ssd.store import SSDStore, default_rank
from torchrec_kvemb.table import KVTable, max_per_unique
from torchrec_kvemb.tier import LowerTier
from torchrec_kvemb.tiered_lookup import lookup_train_tiers
from torchrec_kvemb.transfers import gather_down, scatter_up, upload
from torchrec_kvemb.validation import check_ids


def _scores_at(before: tuple[torch.Tensor, torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
    """The scores ``slots`` held in ``before`` (``TieredKVTable._scores_before``: the
    scores of some buckets before an insert)."""
    buckets, scores = before
    return scores[torch.searchsorted(buckets, slots // WAYS), slots % WAYS]


class EvalPlan(NamedTuple):
    """An evaluation batch's index and tier work (``TieredKVTable.plan_eval``): what
    is left to move. Slots are the table's own (from its first row); ``rows`` and
    ``scores`` in host memory where planned ``on_host``, as the indices into them."""

    #: Each unique id's memory slot, -1 where none (scratch rows: ``finish_eval``).
    slots: torch.Tensor
    #: Each id's position among the unique ids.
    inverse: torch.Tensor
    #: The rows the promotions evict from memory, their slots and memory scores.
    evicted_ids: torch.Tensor
    evicted_slots: torch.Tensor
    evicted_scores: torch.Tensor
    #: The tier's rows ``[k, dim + state_dim]`` of the promoted ids, their memory scores.
    rows: torch.Tensor
    scores: torch.Tensor
    #: Which of ``rows`` took memory rows, and their slots.
    placed: torch.Tensor
    placed_slots: torch.Tensor
    #: Which of ``rows`` found no memory row, and their positions among the unique ids.
    left: torch.Tensor
    left_at: torch.Tensor


class TieredKVTable(KVTable, serves_ssd=True):
    """A :class:`~torchrec_kvemb.table.KVTable` over an SSD tier (``options.ssd``): see
    the module docstring; ``flush()`` makes every row durable, ``close()`` too."""

    def __init__(
        self,
        name: str,
        dim: int,
        options: KVTableOptions,
        optim: FusedOptimConfig | None = None,
        device: torch.device | str | None = None,
        rank: int | None = None,
        storage: TableStorage | None = None,
        pad: TablePad | None = None,
    ) -> None:
        """``storage`` and ``pad``: a group's arrays and this table's share of the
        group's scratch pad (``KVTableGroup`` of tiered tables), instead of new ones."""
        super().__init__(name, dim, options, optim, device, storage=storage)
        policy = options.eviction
        kind = "a host tier" if options.host_tier is not None else "an SSD tier"
        if policy == EvictionPolicy.NONE:
            raise ValueError(
                f"table {name!r}: {kind} needs a table that evicts "
                "(EvictionPolicy.NONE never demotes a row)"
            )
        for label, tier in (("SSD", options.ssd), ("host tier", options.host_tier)):
            if tier is None:
                continue
            if tier.eviction in (EvictionPolicy.LFU, EvictionPolicy.CUSTOM_SCORE) and (
                tier.eviction != policy
            ):
                raise ValueError(
                    f"table {name!r}: {label} eviction {tier.eviction.name} ranks rows by "
                    f"the table's scores, which are {policy.name} scores; use LRU or NONE"
                )
        rank = default_rank() if rank is None else rank
        #: Whether the scratch pad is the table's own (else its group's share).
        self._own_pad = pad is None
        self._pad = pad or ScratchPad(self.weights, self.state).for_table(0, 0)
        self._native: tuple[GroupLayout, TableStorage] | None = None
        self._scratch_rows = 0  # distinct ids served from the pad (``scratch_rows``)
        self._tier = self._open_tier(rank)
        try:
            self._restore()
        except BaseException:
            self._tier.close()
            raise

    def _open_tier(self, rank: int) -> LowerTier:
        """The lower tier under the memory rows: a ``HostTier`` over ``options.host_tier``
        (over an ``SSDStore`` with ``options.ssd`` too), else an ``SSDStore``."""
        ssd = None
        if self.options.ssd is not None:
            ssd = SSDStore(self.name, self.dim, self.state_dim, self.options.ssd, rank)
        host = self.options.host_tier
        if host is None:
            return ssd
        try:
            return HostTier(
                self.name,
                self.dim,
                self.state_dim,
                host,
                lower=ssd,
                lower_scores=self._ssd_scores,
                pin_memory=host.pin_memory and self.device.type == "cuda",
            )
        except BaseException:
            if ssd is not None:
                ssd.close()
            raise

    @property
    def ssd(self) -> LowerTier:
        """The lower tier under the in-memory rows (an ``SSDStore``, or a ``HostTier``
        over an optional ``SSDStore``)."""
        return self._tier

    @property
    def tier(self) -> LowerTier:
        """The lower tier, through its contract (``torchrec_kvemb.tier``)."""
        return self._tier

    @property
    def scratch(self) -> TablePad:
        """This table's share of the scratch pad (``ssd/scratch.py``)."""
        return self._pad

    @property
    def total_size(self) -> int:
        """Ids stored in memory, on the SSD tier and in the scratch pad."""
        return self.size + self._tier.size + self._pad.pending

    def room(self) -> int | None:
        """Memory rows plus the lower tiers' capacity (None when the lowest grows)."""
        lowest = self.options.ssd or self.options.host_tier
        if lowest.capacity is None and getattr(lowest, "memory_budget_bytes", None) is None:
            return None
        return self.capacity + self._tier.capacity

    def tier_metrics(self) -> dict[str, float]:
        """The tiers' counters, the scratch rows served, ``ssd_size`` and
        ``host_size``: rows on each tier (scratch rows waiting to be written to the
        tier under the memory rows counted there)."""
        tier = self._tier
        if isinstance(tier, HostTier):
            host = tier.host_size + self._pad.pending
            ssd = tier.lower.size if tier.lower is not None else 0
        else:
            host, ssd = 0, tier.size + self._pad.pending
        return {
            **tier.metrics(),
            "scratch_rows": self._scratch_rows,
            "ssd_size": ssd,
            "host_size": host,
        }

    def batch_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The table's rows and, after them, its scratch rows (``ssd/scratch.py``)."""
        return self._pad.arrays

    def memory_bytes(self) -> int:
        """``KVTable.memory_bytes`` plus the scratch rows allocated."""
        return super().memory_bytes() + self._pad.memory_bytes()

    # ----------------------------------------------------------------- growth
    def rows_needed(self, ids: torch.Tensor, counts: torch.Tensor | None = None) -> int:
        """``KVTable.rows_needed`` over the tiers: an id the lower tier holds (or the
        scratch pad, until written back) takes a memory row whatever admission says
        (a promotion), so it counts as admitted."""
        if counts is not None and self.counter is not None and self.capacity < self.max_capacity:
            if ids.numel():
                held = (self._tier.lookup(ids.cpu()) >= 0).to(ids.device)
                held[self._pad.find(ids)[0]] = True
                counts = torch.where(held, self.options.admission_threshold, counts)
        return super().rows_needed(ids, counts)

    def rehash_into(self, storage: TableStorage) -> None:
        """``KVTable.rehash_into``, after the last batch's scratch rows went to the
        lower tier (``settle``: the pad after the old rows goes with them)."""
        self.settle()
        super().rehash_into(storage)

    def use_rows(self, storage: TableStorage) -> None:
        """``KVTable.use_rows``; a table with a pad of its own starts a new one after the
        new rows (a group's table gets its share of the group's: ``use_pad``)."""
        super().use_rows(storage)
        self._native = None
        if self._own_pad and hasattr(self, "_pad"):
            self._pad = ScratchPad(self.weights, self.state).for_table(0, 0)

    def use_pad(self, pad: TablePad) -> None:
        """The table's share of its group's new scratch pad (a group that grew)."""
        self._pad = pad

    def _restore(self) -> None:
        """Load what the last flush of a previous run left: counters, memory rows
        (those that no longer fit go to the SSD tier)."""
        restored = self._tier.read_restored()
        if restored is None:
            return
        self.step = int(restored.meta.get("step", 0))
        self.optim_step = int(restored.meta.get("optim_step", 0))
        ids, records, scores = restored.ids, restored.records, restored.memory_scores
        self.fit(ids)  # a growing table: as the table at its maximum restores them
        result = self.index.insert(
            ids.to(self.device), scores.to(self.device), accumulate=False, keep_existing=True
        )
        stored = result.slots >= 0
        rows = restored.rows.to(self.device)
        self.set_rows(result.slots[stored], rows[stored.to(rows.device)])
        left = (~stored).cpu()
        self._tier.adopt(ids[left], self._tier_scores(scores[left]), records[left])

    # --------------------------------------------------------------- lookups
    def lookup_train(
        self, ids: torch.Tensor, custom_scores: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``KVTable.lookup_train`` over both tiers: an SSD id competes for a memory row
        as a stored id would and comes back with its row, state and score. An id with
        a row, or new and admitted, that finds no memory row gets a scratch row.
        On the CPU with the native kernels: one find-or-insert pass for the whole
        batch (``_lookup_train_native``), the same outcome."""
        if self.lookup_backend(ids.device) == "native":
            return self._lookup_train_native(ids, custom_scores).slots
        self._begin_batch()
        uniq, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
        self.make_room(uniq, counts)  # a growing table grows before it demotes
        mem_slots = self.index.probe(uniq)
        miss = (mem_slots < 0).nonzero().squeeze(1)
        found, ssd_slots, ssd_scores, ssd_rows = self.fetch_lower(uniq, miss)
        self.reserve_batch(miss.numel())  # every eviction makes room for a missed id
        self._count_ssd(counts, miss, found)
        self.advance_step()
        values = self.score_values(
            uniq, counts, max_per_unique(custom_scores, inverse, uniq.numel())
        ).clone()
        accumulate = self.options.eviction == EvictionPolicy.LFU
        promoted_scores = values[found] + ssd_scores if accumulate else values[found]
        values[found] = INT64_MAX
        before = self._scores_before(uniq[miss])
        stored = mem_slots >= 0
        stored[found] = True
        slots_u, hit_u, inserted_u, result, no_room = self.compete(uniq, counts, values, stored)
        moved = (slots_u[found] >= 0) | no_room[found]  # leaves the SSD tier
        self._tier.remove(ssd_slots[moved.cpu()])
        promoted = (slots_u[found] >= 0).nonzero().squeeze(1)
        self._demote_evicted(result, before)
        self.promote(slots_u[found[promoted]], ssd_rows[promoted], promoted_scores[promoted])
        self.count("inserts", -promoted.numel())
        inserted_u[found[promoted]] = False
        self.init_rows_at(slots_u[inserted_u], uniq[inserted_u])
        self.count_hits(ids.numel(), counts, hit_u)
        if bool(no_room.any()):
            pad = no_room.nonzero().squeeze(1)
            state = torch.zeros(pad.numel(), self.state_dim, device=self.device)
            rows = torch.cat([self.initial_rows(uniq[pad]), state], dim=1)
            scores = values[pad]
            from_ssd = no_room[found].nonzero().squeeze(1)
            at = torch.searchsorted(pad, found[from_ssd])
            rows[at], scores[at] = ssd_rows[from_ssd].to(rows.dtype), promoted_scores[from_ssd]
            slots_u[pad] = self.write_scratch(rows, uniq[pad], scores)
        if self.ttl is not None:  # sweeps the memory rows and every lower tier
            self.ttl.after_lookup(slots_u, counts)
        return slots_u[inverse]

    def lookup_train_rows(
        self, ids: torch.Tensor, custom_scores: torch.Tensor | None = None
    ) -> GroupLookup:
        """``lookup_train`` with each id's unique row (scratch rows included) where
        the native kernel looked the batch up: the native fused backward then reduces
        over them without sorting the slots."""
        if self.lookup_backend(ids.device) == "native":
            return self._lookup_train_native(ids, custom_scores)
        return GroupLookup(self.lookup_train(ids, custom_scores))

    def lookup_backend(self, device: torch.device | str) -> str:
        """What runs this table's training lookup: the native kernel where
        ``backend.implementation`` says ``"native"`` (one pass over both tiers,
        ``tiered_lookup``), else the torch path (a lone table over tiers; a group of
        them runs the Triton group kernels on CUDA: ``KVTableGroup.backend``)."""
        return "native" if implementation(device) == "native" else "torch"

    def _lookup_train_native(
        self, ids: torch.Tensor, custom_scores: torch.Tensor | None
    ) -> GroupLookup:
        """``lookup_train`` by the native group kernel as a group of one table
        (``tiered_lookup.lookup_train_tiers``: the batch's SSD ids go in as
        promotions; evicted rows are demoted before promoted and new rows take
        their slots)."""
        self._begin_batch()
        if self.capacity < self.max_capacity:  # grows before it demotes
            uniq, counts = torch.unique(ids, return_counts=True)
            self.make_room(uniq, counts)
        layout, storage = self._native_group()
        return lookup_train_tiers(
            [self],
            layout,
            storage,
            [0],
            ids,
            torch.zeros_like(ids),
            custom_scores,
            None if custom_scores is None else [True],
            self.clock[0:1],
        )

    def _native_group(self) -> tuple[GroupLayout, TableStorage]:
        """This table as a group of one for the native kernel: its layout and arrays
        (built once; the arrays grow in place with the scratch pad)."""
        if self._native is None:
            counted = self.counts.numel() if self.counts is not None else 0
            layout = GroupLayout.build([self.capacity // WAYS], [counted // WAYS], [self.options])
            self._native = (layout, self.storage())
        return self._native

    def lookup_eval(self, ids: torch.Tensor) -> torch.Tensor:
        """``KVTable.lookup_eval`` over both tiers: ids held by the SSD tier are promoted
        (outranking unprotected stored ids; the batch's hits keep their rows and
        scores), so that the pooled lookup finds them in memory; those that find no
        memory row are read into scratch rows for the batch. The steps a group over
        tiers composes for all its tables at once (``tiered_eval``): ``plan_eval``,
        then the evicted rows down and the promoted rows up, then ``finish_eval``."""
        self._begin_batch()
        plan = self.plan_eval(ids)
        # why this order: every evicted row is read before a promoted row may take its slot
        self.demote(plan.evicted_ids, plan.evicted_slots, plan.evicted_scores)
        scatter_up(self.weights, self.state, plan.placed_slots, plan.rows[plan.placed])
        return self.finish_eval(plan)

    def plan_eval(self, ids: torch.Tensor, on_host: bool = False) -> EvalPlan:
        """The index and tier work of an evaluation batch (``lookup_eval``), no row
        moved: the batch's ids the lower tier holds are read (``fetch_lower``; rows
        and scores in host memory with ``on_host``) and compete for memory rows
        (growing first, a table below its maximum), the rows they evict are to be
        demoted, and those that took memory rows have left the tier. The caller then
        demotes the evicted rows (``demote_rows`` of their gathered rows) before it
        writes the placed rows at their slots, then calls ``finish_eval``."""
        uniq, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
        mem_slots = self.index.probe(uniq)
        hit = mem_slots >= 0
        miss = (~hit).nonzero().squeeze(1)
        found, ssd_slots, ssd_scores, ssd_rows = self.fetch_lower(uniq, miss, on_host)
        if found.numel():
            self.reserve_batch(found.numel())  # every eviction makes room for a promotion
        self.count_hits(ids.numel(), counts, hit)
        self._count_ssd(counts, miss, found)
        if found.numel() == 0:
            none, on_rows = mem_slots[:0], miss[:0].to(ssd_rows.device)
            return EvalPlan(
                mem_slots, inverse, none, none, none, ssd_rows, ssd_scores, on_rows, none,
                on_rows, none,
            )  # fmt: skip
        if self.capacity < self.max_capacity:  # grows before a promotion demotes
            self.make_room(uniq[found])
            mem_slots = self.index.probe(uniq)
        before = self._scores_before(uniq[found])
        # The batch's hits in the buckets promotions go to stay protected, scores unchanged.
        hit_idx = hit.nonzero().squeeze(1)
        near = torch.isin(self.index.buckets_of(uniq[hit_idx]), before[0])
        hit_idx = hit_idx[near]
        accumulate = self.options.eviction == EvictionPolicy.LFU
        hit_values = self.index.scores_at(mem_slots[hit_idx])
        values = torch.cat(
            [
                torch.zeros_like(hit_values) if accumulate else hit_values,
                torch.full_like(found, INT64_MAX),
            ]
        )
        result = self.index.insert(
            uniq[torch.cat([hit_idx, found])], values, accumulate=accumulate, keep_existing=False
        )
        self.count("evictions", result.evicted_ids.numel())
        slots_u = mem_slots.clone()
        found_slots = result.slots[hit_idx.numel() :]
        slots_u[found] = found_slots
        placed = (found_slots >= 0).nonzero().squeeze(1)
        self._tier.remove(ssd_slots[placed.cpu()])  # read already: their rows are ``ssd_rows``
        left = (found_slots < 0).nonzero().squeeze(1)
        return EvalPlan(
            slots_u,
            inverse,
            result.evicted_ids,
            result.evicted_slots,
            _scores_at(before, result.evicted_slots),
            ssd_rows,
            ssd_scores,
            placed.to(ssd_rows.device),
            found_slots[placed],
            left.to(ssd_rows.device),
            found[left],
        )

    def finish_eval(self, plan: EvalPlan, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The end of an evaluation batch (``plan_eval``), once the evicted rows went
        down and the placed rows are at their slots: the placed rows' scores and
        count, the scratch rows of the promoted ids that found no memory row (a
        read-only copy: their rows stay in the tier), and the batch's slots.
        ``rows``: ``plan.rows`` on the table's device, where the caller moved them
        (a group's one copy up); default ``plan.rows``."""
        rows = plan.rows if rows is None else rows
        if plan.placed.numel():
            placed_scores = plan.scores[plan.placed].to(self.device)
            self.index.set_scores(plan.placed_slots, placed_scores)
        self.count("promotions", plan.placed_slots.numel())
        if plan.left.numel():  # a read-only copy: their rows stay in the tier
            plan.slots[plan.left_at] = self.write_scratch(rows[plan.left.to(rows.device)])
        return plan.slots[plan.inverse]

    # ------------------------------------------------------ reads and writes
    def insert(
        self,
        ids: torch.Tensor,
        weights: torch.Tensor,
        state: torch.Tensor | None = None,
        scores: torch.Tensor | None = None,
        *,
        exact_scores: bool = False,
    ) -> torch.Tensor:
        """``KVTable.insert`` over both tiers: an id held by the SSD tier is overwritten
        as a stored id would be (and moves to memory); rows that find no memory row
        go to the SSD tier (slot -1)."""
        ids, values = self._checked_insert(ids, weights, state, scores, exact_scores)
        self.settle()
        self.make_room(ids)  # a growing table grows before it demotes
        tier = self._tier
        ssd_slots = tier.lookup(ids.cpu())
        held = (ssd_slots >= 0).nonzero().squeeze(1)
        old_scores, _, ok = tier.fetch(ids.cpu()[held], ssd_slots[held], use_staged=False)
        held, old_scores = held[ok], old_scores[ok].to(self.device)
        self.reserve_batch(ids.numel())
        tier.remove(ssd_slots[held])
        held = held.to(self.device)
        given = values
        values = values.clone()
        accumulate = self.options.eviction == EvictionPolicy.LFU and not exact_scores
        held_scores = values[held] + old_scores if accumulate else values[held]
        values[held] = INT64_MAX
        before = self._scores_before(ids)
        result = self.insert_ids(ids, values)
        self.count("inserts", -int(result.inserted[held].sum()))  # they were stored
        self._demote_evicted(result, before)
        held_slots = result.slots[held]
        placed = held_slots >= 0
        self.index.set_scores(held_slots[placed], held_scores[placed])
        stored = result.slots >= 0
        slots = result.slots[stored]
        if exact_scores:  # an LFU hit in memory added its value to the stored count
            self.index.set_scores(slots, given[stored])
        weights = weights.to(self.weights)
        state = (
            state.to(self.state)
            if state is not None
            else torch.zeros(ids.numel(), self.state_dim, device=self.device)
        )
        self.weights.index_copy_(0, slots, weights[stored])
        self.state.index_copy_(0, slots, state[stored])
        left = ~stored
        memory_scores = values
        memory_scores[held] = held_scores
        memory_scores = memory_scores[left].cpu()
        rows = torch.cat([weights[left], state[left]], dim=1).cpu()
        tier.put(ids[left].cpu(), memory_scores, self._tier_scores(memory_scores), rows)
        return result.slots

    def find(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``KVTable.find`` over both tiers (read-only: nothing is promoted)."""
        ids = check_ids(self.name, ids).to(self.device)
        rows, found = super().find(ids)
        if bool(found.all()):
            return rows, found
        missing = (~found).nonzero().squeeze(1)
        uniq, inverse = torch.unique(ids[missing], return_inverse=True)
        ssd_slots = self._tier.lookup(uniq.cpu())
        held = (ssd_slots >= 0).nonzero().squeeze(1)
        _, ssd_rows, ok = self._tier.fetch(uniq.cpu()[held], ssd_slots[held], use_staged=False)
        got = torch.zeros(uniq.numel(), dtype=torch.bool)
        got[held[ok]] = True
        uniq_rows = torch.zeros(uniq.numel(), self.dim, dtype=rows.dtype)
        uniq_rows[held[ok]] = ssd_rows[ok, : self.dim]
        rows[missing] = uniq_rows.to(self.device)[inverse]
        found[missing] = got.to(self.device)[inverse]
        held, pad_rows = self._pad.find(ids)  # the last batch's scratch rows
        rows[held] = pad_rows.to(rows.dtype)
        found[held] = True
        return rows, found

    def export(self, route_buckets: int | None = None) -> dict[str, torch.Tensor]:
        """``KVTable.export`` over both tiers."""
        self.settle()
        memory = super().export()
        ssd_ids, ssd_scores, ssd_rows = self._tier.export()
        ids, order = torch.sort(torch.cat([memory["ids"], ssd_ids.to(self.device)]))
        if route_buckets is not None:
            by_bucket = torch.sort(route_bucket(ids, route_buckets), stable=True).indices
            ids, order = ids[by_bucket], order[by_bucket]
        ssd_rows = ssd_rows.to(self.device)
        weights = torch.cat([memory["weights"], ssd_rows[:, : self.dim].to(self.weights)])
        out = {
            "ids": ids,
            "weights": weights[order],
            "scores": torch.cat([memory["scores"], ssd_scores.to(self.device)])[order],
        }
        ssd_state = self.optim.split_state(ssd_rows[:, self.dim :], self.dim)
        for name, value in ssd_state.items():
            out[name] = torch.cat([memory[name], value])[order]
        return out

    def load_rows(
        self,
        ids: torch.Tensor,
        weights: torch.Tensor,
        state: torch.Tensor | None,
        scores: torch.Tensor | None,
        step: tuple[int, int] | None = None,
        last_seen: torch.Tensor | None = None,
    ) -> int:
        """``KVTable.load_rows`` over both tiers (``last_seen``: unused, a tiered TTL
        table is LRU, whose scores are its last steps): each index bucket keeps its rows of
        the highest scores in memory (then smallest ids, as an insert ranks them), the
        others go to the SSD tier; every row keeps its score in either tier. Nothing
        is lost (0)."""
        if step is not None:
            # why first: an SSD tier ranking rows by demotion time (LRU over another
            # policy) stamps the rows it takes now with the saved step.
            self.step, self.optim_step = step
        if ids.numel():
            self.insert(ids, weights, state, scores, exact_scores=scores is not None)
        return 0

    def clear(self) -> None:
        """Remove every id from both tiers, and the admission counts."""
        super().clear()
        self._pad.release()
        if self._tier.size:
            ids = self._tier.export()[0]
            self._tier.remove(self._tier.lookup(ids))

    def prefetch(self, ids: torch.Tensor) -> None:
        """Start reading, on a background thread, the SSD rows of ids a coming lookup
        will need (those not in memory now); the next lookup uses them if they are
        still current."""
        ids = check_ids(self.name, ids).to(self.device)
        uniq = torch.unique(ids)
        self._tier.prefetch(uniq[self.index.probe(uniq) < 0].cpu())

    # ------------------------------------------------------------ durability
    def flush(self) -> None:
        """Make every row durable: the SSD tier's and the in-memory ones (written to
        the slab as a snapshot), then the index, atomically. Reopening the SSD path
        after this returns restores the table as of now (rows, optimizer state,
        scores, step counters; admission counts restart). Raises ``KVStorageError``
        (naming the table and file) on an I/O error; the previous flush then stays
        the durable one."""
        slots = self.index.live_slots()
        pad_ids, pad_scores, pad_rows = self._pad.pending_rows()  # not written back yet
        ids = torch.cat([self.index.ids_at(slots), pad_ids])
        scores = torch.cat([self.index.scores_at(slots), pad_scores])
        rows = self.rows_at(slots)
        rows = torch.cat([rows, pad_rows.to(rows.dtype)])
        meta = {"step": self.step, "optim_step": self.optim_step}
        self._tier.flush(ids.cpu(), scores.cpu(), rows.cpu(), meta)

    def close(self) -> None:
        """``flush()``, then close the SSD tier's files (a no-op when closed already).
        The table cannot be used afterwards."""
        if self._tier.closed:
            return
        self.settle()
        self.flush()
        self._tier.close()

    def reserve(self, n: int) -> None:
        """Room on disk for ``n`` rows before anything changes (a full disk raises
        ``KVStorageError`` here)."""
        self._tier.reserve(n)

    # ------------------------------------------------------------- internals
    def _tier_scores(self, memory_scores: torch.Tensor) -> torch.Tensor:
        """The eviction scores, in the tier under the memory rows, of rows leaving memory
        with ``memory_scores``."""
        host = self.options.host_tier
        return self._ssd_scores(memory_scores, host.eviction if host is not None else None)

    def _ssd_scores(
        self, memory_scores: torch.Tensor, policy: EvictionPolicy | None = None
    ) -> torch.Tensor:
        """The SSD tier's eviction scores (or those of a tier of eviction ``policy``) of
        rows leaving memory with ``memory_scores``."""
        policy = policy or self.options.ssd.eviction
        if policy == EvictionPolicy.NONE:
            return torch.zeros_like(memory_scores)
        if policy == self.options.eviction:
            return memory_scores
        return torch.full_like(memory_scores, self.step)  # LRU over another policy: demotion time

    def _begin_batch(self) -> None:
        """A lookup's batch begins: the scratch rows of the last one are written back,
        and the pad starts over (a group's pad: when the group's batch begins)."""
        self.settle()
        self._pad.begin_batch()

    def _scores_before(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The scores of the buckets of ``ids``, kept to know evicted rows' scores."""
        buckets = torch.unique(self.index.buckets_of(ids))
        return buckets, self.index.scores.index_select(0, buckets)

    def _demote_evicted(
        self, result: InsertResult, before: tuple[torch.Tensor, torch.Tensor]
    ) -> None:
        """``demote`` of an insert's evictions, their scores taken from ``before``
        (``_scores_before`` of the insert's ids)."""
        self.demote(
            result.evicted_ids, result.evicted_slots, _scores_at(before, result.evicted_slots)
        )

    def _count_ssd(self, counts: torch.Tensor, miss: torch.Tensor, found: torch.Tensor) -> None:
        """Count the id occurrences of ``miss`` the SSD tier held (``found``) or not."""
        ssd_hits = int(counts[found].sum())
        self.count("ssd_hits", ssd_hits)
        self.count("ssd_misses", int(counts[miss].sum()) - ssd_hits)

    # ------------------------------------------- a batch's steps over the tier
    def settle(self) -> None:
        """Write the scratch rows of the last training batch (trained by its backward
        since) to the SSD tier. A full disk raises here, and they stay in the pad."""
        if not self._pad.pending:
            return
        ids, scores, rows = self._pad.pending_rows()
        self.reserve_batch(ids.numel())
        self._tier.put(ids.cpu(), scores.cpu(), self._tier_scores(scores).cpu(), rows.cpu())
        self._pad.release()

    def reserve_batch(self, n: int) -> None:
        """Room in the lower tier for the ``n`` rows a batch may write, before anything
        in memory changes (a full disk raises here); flushes first when the tier
        asks for it (``LowerTier.needs_flush``). Room for a flush's snapshot of the
        memory rows is kept free beside them (why: a flush cannot free records
        before it has written that snapshot, so a slab without that room grew by
        half at every periodic flush: 1.7x the bound of docs/ssd-tier.md in a
        soak)."""
        n += self.capacity + self._pad.pending
        if self._tier.needs_flush(n):
            self.flush()
        self._tier.reserve(n)

    def fetch_lower(
        self, uniq: torch.Tensor, miss: torch.Tensor, on_host: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The lower tier's rows of ``uniq[miss]`` (unique ids): ``(positions in uniq,
        tier slots, memory scores, rows [k, dim + state_dim])`` of those it holds
        intact, on the table's device (``on_host``: scores and rows in host memory, for
        a group's one copy up). They stay in the tier until ``tier.remove``."""
        miss_ids = uniq[miss].cpu()
        ssd_slots = self._tier.lookup(miss_ids)
        held = (ssd_slots >= 0).nonzero().squeeze(1)
        scores, rows, ok = self._tier.fetch(miss_ids[held], ssd_slots[held])
        if not bool(ok.all()):
            held, scores, rows = held[ok], scores[ok], rows[ok]
        found = miss[held.to(miss.device)]
        if on_host:
            return found, ssd_slots[held], scores, rows
        # A host tier under a CUDA table gathers into pinned memory: the copies to the
        # device run on the transfers' side stream without a pageable bounce buffer.
        return found, ssd_slots[held], upload(scores, self.device), upload(rows, self.device)

    def demote(
        self,
        evicted_ids: torch.Tensor,
        evicted_slots: torch.Tensor,
        memory_scores: torch.Tensor,
    ) -> None:
        """Write the rows evicted from memory at ``evicted_slots``, with their in-memory
        scores, to the lower tier (call before their slots are refilled; after
        ``reserve_batch``)."""
        if evicted_ids.numel() == 0:
            return
        down = gather_down(self.weights, self.state, evicted_slots)
        self.demote_rows(evicted_ids, memory_scores, down.rows())

    def demote_rows(
        self, evicted_ids: torch.Tensor, memory_scores: torch.Tensor, rows: torch.Tensor
    ) -> None:
        """Write rows evicted from memory, gathered already (``transfers.gather_down``:
        host rows ``[n, dim + state_dim]``), with their in-memory scores, to the lower
        tier (after ``reserve_batch``)."""
        if evicted_ids.numel() == 0:
            return
        memory_scores = memory_scores.cpu()
        self._tier.put(evicted_ids.cpu(), memory_scores, self._tier_scores(memory_scores), rows)
        self.count("demotions", evicted_ids.numel())

    def exchange_lower(
        self,
        weights: torch.Tensor,
        state: torch.Tensor,
        evicted_slots: torch.Tensor,
        evicted_ids: torch.Tensor,
        memory_scores: torch.Tensor,
        up_ids: torch.Tensor,
        up_tier_slots: torch.Tensor,
        up_slots: torch.Tensor,
    ) -> None:
        """``demote`` and the promotions' ``tier.remove`` in one pass, where the tier
        ``exchanges_rows`` (``LowerTier.exchange``; CPU arrays): the rows evicted at
        ``evicted_slots`` of ``weights`` and ``state`` (this table's arrays, or its
        group's with global slots) go down, then the tier's rows of ``up_ids`` come
        up to ``up_slots`` (-1: none) and leave it (after ``reserve_batch``)."""
        self._tier.exchange(
            weights, state, evicted_slots, evicted_ids, memory_scores,
            self._tier_scores(memory_scores), up_ids, up_tier_slots, up_slots,
        )  # fmt: skip
        self.count("demotions", evicted_ids.numel())

    def promote(
        self, slots: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor | None = None
    ) -> None:
        """Rows fetched from the lower tier (``fetch_lower``) take their new memory
        ``slots``, with their memory ``scores`` (None: the index holds them already,
        as after the native lookup)."""
        scatter_up(self.weights, self.state, slots, rows)
        if scores is not None:
            self.index.set_scores(slots, scores)
        self.count("promotions", slots.numel())

    def write_scratch(
        self,
        rows: torch.Tensor,
        ids: torch.Tensor | None = None,
        scores: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Put ``rows [n, dim + state_dim]`` in scratch rows for this batch; their slots
        (``TablePad.write``). With ``ids`` (sorted) and their memory ``scores`` the
        rows are written to the lower tier at the table's next call (``settle``);
        without, they are a read-only copy. Counted in ``scratch_rows``."""
        slots = self._pad.write(rows, ids, scores)
        self._scratch_rows += rows.shape[0]
        return slots
