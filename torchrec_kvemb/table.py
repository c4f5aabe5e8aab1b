"""One shard of one KV table: a bucketed id index over value rows.

Memory per row (capacity): ``4 * dim`` bytes of weights, ``4 * state_dim``
bytes of optimizer state, 8 bytes of key and 8 of score. An admission counter
(when ``admission_threshold > 1``) adds 24 bytes per counted id.

With ``options.ssd`` the rows in memory are a cache over an SSD tier
(``torchrec_kvemb.ssd``): a row evicted from memory is written there with its
optimizer state (demotion), and an id missing from memory but held there comes
back with its row and state (promotion); the two tiers never hold the same id.
See docs/ssd-tier.md.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from torchrec_kvemb.ops.hashing import INT64_MAX, index_bucket, init_rows, seed_mix
from torchrec_kvemb.ops.insert import InsertResult, insert, remove
from torchrec_kvemb.ops.pooled_lookup import InitSpec
from torchrec_kvemb.ops.probe import probe
from torchrec_kvemb.optimizer import FusedOptimConfig
from torchrec_kvemb.options import WAYS, EvictionPolicy, Initializer, KVTableOptions, SSDOptions
from torchrec_kvemb.ssd.tier import COUNTERS as SSD_COUNTERS
from torchrec_kvemb.ssd.tier import SSDTier, default_rank
from torchrec_kvemb.validation import KVInputError, check_ids, check_rows

INDEX_BYTES_PER_ROW = 16
COUNTER_BYTES_PER_ID = 24


def bytes_per_row(dim: int, state_dim: int) -> int:
    """Memory one row of capacity costs: weights, optimizer state, key and score."""
    return 4 * dim + 4 * state_dim + INDEX_BYTES_PER_ROW


def resolve_capacity(options: KVTableOptions, dim: int, state_dim: int) -> int:
    """Rows the table holds: ``capacity`` or what fits ``memory_budget_bytes``, in whole buckets."""
    if options.capacity is not None:
        rows = options.capacity
    else:
        rows = options.memory_budget_bytes // bytes_per_row(dim, state_dim)
        if rows < WAYS:
            raise ValueError(
                f"memory_budget_bytes={options.memory_budget_bytes} holds fewer than {WAYS} rows "
                f"of {bytes_per_row(dim, state_dim)} bytes"
            )
        return (rows // WAYS) * WAYS
    return math.ceil(rows / WAYS) * WAYS


class _Index(NamedTuple):
    keys: torch.Tensor
    scores: torch.Tensor


def _new_index(capacity: int, device: torch.device) -> _Index:
    buckets = max(1, capacity // WAYS)
    keys = torch.full((buckets, WAYS), -1, dtype=torch.int64, device=device)
    return _Index(keys, torch.zeros_like(keys))


_METRIC_NAMES = (
    "hits",
    "misses",
    "inserts",
    "evictions",
    "admission_rejects",
    "insert_failures",
    "ssd_hits",
    "ssd_misses",
    "promotions",
    "demotions",
)


class KVTable:
    """A key-value, zero-collision embedding table (one shard).

    Ids are int64 >= 0 of any size; two ids never share a row. Rows live in
    ``weights [capacity, dim]`` and ``state [capacity, state_dim]``, addressed by
    the slot the index gives an id.

    Example::

        table = KVTable("user", dim=8, options=KVTableOptions(capacity=1000))
        table.insert(torch.tensor([7, 2**40]), torch.ones(2, 8))
        rows, found = table.find(torch.tensor([7, 3]))   # found == [True, False]

    With an SSD tier (files ``<path>/<name>.rank<rank>.*``; ``rank`` defaults to
    the process's rank in torch.distributed, else 0)::

        table = KVTable("user", 8, KVTableOptions(capacity=1000, ssd=SSDOptions("/mnt/ssd")))
        table.prefetch(next_ids)   # optional: read the next batch's SSD rows ahead
        table.flush()              # every row durable; reopening the path restores them
        table.close()
    """

    def __init__(
        self,
        name: str,
        dim: int,
        options: KVTableOptions,
        optim: FusedOptimConfig | None = None,
        device: torch.device | str | None = None,
        rank: int | None = None,
    ) -> None:
        if dim <= 0:
            raise ValueError(f"table {name!r}: dim must be > 0, got {dim}")
        self.name = name
        self.dim = dim
        self.options = options
        self.optim = optim or FusedOptimConfig()
        self.device = torch.device(device or "cpu")
        self.state_dim = self.optim.state_dim(dim)
        self.capacity = resolve_capacity(options, dim, self.state_dim)
        self._index = _new_index(self.capacity, self.device)
        self.weights = torch.zeros(self.capacity, dim, dtype=torch.float32, device=self.device)
        self.state = torch.zeros(
            self.capacity, self.state_dim, dtype=torch.float32, device=self.device
        )
        counter_rows = options.admission_counter_capacity or self.capacity
        self._counter = (
            _new_index(math.ceil(counter_rows / WAYS) * WAYS, self.device)
            if options.admission_threshold > 1
            else None
        )
        self._counts = (
            torch.zeros(self._counter.keys.numel(), dtype=torch.int64, device=self.device)
            if self._counter is not None
            else None
        )
        self.step = 0  # training lookups so far: the LRU clock
        self.optim_step = 0  # optimizer steps so far: Adam's bias correction
        self._metrics = dict.fromkeys(_METRIC_NAMES, 0)
        self._ssd: SSDTier | None = None
        if options.ssd is not None:
            self._ssd = self._open_ssd(options.ssd, default_rank() if rank is None else rank)

    # ----------------------------------------------------------------- views
    @property
    def keys(self) -> torch.Tensor:
        """The index's keys ``[buckets, WAYS]``, -1 where empty (read-only use)."""
        return self._index.keys

    @property
    def scores(self) -> torch.Tensor:
        """Eviction scores ``[buckets, WAYS]`` beside ``keys``."""
        return self._index.scores

    @property
    def size(self) -> int:
        """Ids stored."""
        return int((self._index.keys >= 0).sum())

    @property
    def init_spec(self) -> InitSpec:
        o = self.options
        if o.initializer == Initializer.NORMAL:
            return InitSpec(o.seed, True, o.init_mean, o.init_std)
        return InitSpec(o.seed, False, o.init_low, o.init_high)

    @property
    def seed_mix(self) -> int:
        return seed_mix(self.options.seed)

    def memory_bytes(self) -> int:
        """Bytes of memory the table holds (rows, index, admission counter)."""
        total = self.capacity * bytes_per_row(self.dim, self.state_dim)
        if self._counter is not None:
            total += self._counter.keys.numel() * COUNTER_BYTES_PER_ID
        return total

    def initial_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """The rows ``ids`` get when they are first stored."""
        spec = self.init_spec
        return init_rows(ids, self.dim, spec.seed, spec.normal, spec.a, spec.b)

    # ------------------------------------------------------------ public API
    def find(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Read-only lookup: ``(rows [n, dim], found [n])``; missing rows are zeros.

        With an SSD tier, rows held there are read (not promoted)."""
        ids = check_ids(self.name, ids).to(self.device)
        slots = probe(self._index.keys, ids)
        found = slots >= 0
        rows = self.weights.index_select(0, slots.clamp(min=0)) * found.unsqueeze(1)
        if self._ssd is not None and not bool(found.all()):
            self._find_ssd(ids, rows, found)
        return rows, found

    def insert(
        self,
        ids: torch.Tensor,
        weights: torch.Tensor,
        state: torch.Tensor | None = None,
        scores: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store rows for unique ``ids`` (overwriting stored ones); returns their slots.

        The eviction policy applies when a bucket is full; an id that finds no
        room gets slot -1 and is counted in ``insert_failures``.
        """
        ids = check_ids(self.name, ids).to(self.device)
        check_rows(self.name, weights, ids.numel(), self.dim)
        if state is not None:
            check_rows(self.name, state, ids.numel(), self.state_dim, what="state")
        if ids.numel() != torch.unique(ids).numel():
            raise KVInputError(f"table {self.name!r}: insert needs unique ids")
        values = self._score_values(ids, torch.ones_like(ids), scores)
        if self._ssd is not None:
            return self._insert_tiered(ids, values, weights, state)
        result = self._insert(ids, values)
        stored = result.slots >= 0
        slots = result.slots[stored]
        self.weights.index_copy_(0, slots, weights.to(self.weights)[stored.to(weights.device)])
        if state is not None:
            self.state.index_copy_(0, slots, state.to(self.state)[stored.to(state.device)])
        elif self.state_dim:
            self.state.index_fill_(0, slots, 0.0)
        return result.slots

    def export(self) -> dict[str, torch.Tensor]:
        """Every stored id with its row, score and optimizer state, sorted by id
        (with an SSD tier: the ids of both tiers)."""
        flat_keys = self._index.keys.view(-1)
        slots = (flat_keys >= 0).nonzero().squeeze(1)
        ids, order = torch.sort(flat_keys[slots])
        slots = slots[order]
        out = {
            "ids": ids,
            "weights": self.weights.index_select(0, slots),
            "scores": self._index.scores.view(-1).index_select(0, slots),
        }
        state = self.state.index_select(0, slots)
        if self._ssd is not None:
            ssd_ids, ssd_scores, ssd_rows = self._ssd.export()
            ids, order = torch.sort(torch.cat([ids, ssd_ids.to(self.device)]))
            ssd_rows = ssd_rows.to(self.device)
            out = {
                "ids": ids,
                "weights": torch.cat([out["weights"], ssd_rows[:, : self.dim]])[order],
                "scores": torch.cat([out["scores"], ssd_scores.to(self.device)])[order],
            }
            state = torch.cat([state, ssd_rows[:, self.dim :]])[order]
        names = self.optim.state_names()
        if len(names) == 1:
            out[names[0]] = state[:, 0]
        elif names:
            out[names[0]] = state[:, : self.dim]
            out[names[1]] = state[:, self.dim :]
        return out

    def metrics(self) -> dict[str, float]:
        """Counters since creation, plus ``size``, ``capacity`` and ``load_factor`` (of
        the in-memory tier) and ``ssd_size`` (see docs/ssd-tier.md for the SSD ones)."""
        out: dict[str, float] = dict(self._metrics)
        if self._ssd is not None:
            out.update(self._ssd.counters, ssd_size=self._ssd.size)
        else:
            out.update(dict.fromkeys(SSD_COUNTERS, 0), ssd_size=0)
        size = self.size
        out.update(size=size, capacity=self.capacity, load_factor=size / self.capacity)
        return out

    # -------------------------------------------------------------- SSD tier
    @property
    def ssd(self) -> SSDTier | None:
        """The SSD tier under the in-memory rows, or None."""
        return self._ssd

    def prefetch(self, ids: torch.Tensor) -> None:
        """Start reading, on a background thread, the SSD rows of ids a coming
        lookup will need (those not in memory now); the next lookup uses them if
        they are still current. A no-op without an SSD tier."""
        if self._ssd is None:
            return
        ids = check_ids(self.name, ids).to(self.device)
        uniq = torch.unique(ids)
        self._ssd.prefetch(uniq[probe(self._index.keys, uniq) < 0].cpu())

    def flush(self) -> None:
        """Make every row durable: the SSD tier's and the in-memory ones (written to
        the slab as a snapshot), then the index, atomically. Reopening the SSD path
        after this returns restores the table as of now (rows, optimizer state,
        scores, step counters; admission counts restart). A no-op without an SSD
        tier. Raises ``KVStorageError`` (naming the table and file) on an I/O
        error; the previous flush then stays the durable one."""
        if self._ssd is None:
            return
        flat = self._index.keys.view(-1)
        slots = (flat >= 0).nonzero().squeeze(1)
        rows = self._rows_at(slots)
        self._ssd.flush(
            flat[slots].cpu(),
            self._index.scores.view(-1)[slots].cpu(),
            rows.cpu(),
            {"step": self.step, "optim_step": self.optim_step},
        )

    def close(self) -> None:
        """``flush()``, then close the SSD tier's files (a no-op without one, or
        when closed already). The table cannot be used afterwards."""
        if self._ssd is None or self._ssd.closed:
            return
        self.flush()
        self._ssd.close()

    # ------------------------------------------------------- training lookups
    def lookup_train(self, ids: torch.Tensor, custom_scores: torch.Tensor | None = None):
        """Slots for a training batch, inserting new ids (admission and eviction apply).

        Returns ``slots [n]``: -1 for ids that hold no row (not yet admitted, or no
        room); they pool their initial value and their gradient is dropped.
        """
        if self._ssd is not None:
            return self._lookup_train_tiered(ids, custom_scores)
        self.step += 1
        uniq, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
        scores_u = None
        if custom_scores is not None:
            scores_u = torch.full_like(uniq, torch.iinfo(torch.int64).min)
            scores_u.scatter_reduce_(0, inverse, custom_scores.to(torch.int64), reduce="amax")
        values = self._score_values(uniq, counts, scores_u)
        if self._counter is None:
            # why: every id is a candidate; skipping the masks saves ~2 ms per 80k ids.
            result = self._insert(uniq, values)
            slots_u, new_ids, hit_u = result.slots, uniq[result.inserted], result.hit
        else:
            candidates = self._admit(uniq, counts)
            cand_idx = candidates.nonzero().squeeze(1)
            result = self._insert(uniq[cand_idx], values[cand_idx])
            slots_u = torch.full_like(uniq, -1).index_copy_(0, cand_idx, result.slots)
            new_ids = uniq[cand_idx[result.inserted]]
            hit_u = torch.zeros_like(candidates).index_copy_(0, cand_idx, result.hit)
            self._metrics["admission_rejects"] += uniq.numel() - cand_idx.numel()
        new_slots = result.slots[result.inserted]
        if new_slots.numel():
            self.weights.index_copy_(0, new_slots, self.initial_rows(new_ids))
            if self.state_dim:
                self.state.index_fill_(0, new_slots, 0.0)
        hits = int(torch.dot(counts, hit_u.to(counts.dtype)))
        self._metrics["hits"] += hits
        self._metrics["misses"] += ids.numel() - hits
        return slots_u[inverse]

    def lookup_eval(self, ids: torch.Tensor) -> torch.Tensor:
        """Slots for an evaluation batch (read-only); -1 for ids not stored.

        With an SSD tier, rows held there are promoted to memory (the rows the
        table holds do not change, only their tier; eviction scores stay)."""
        if self._ssd is not None:
            return self._lookup_eval_tiered(ids)
        slots = probe(self._index.keys, ids)
        hits = int((slots >= 0).sum())
        self._metrics["hits"] += hits
        self._metrics["misses"] += ids.numel() - hits
        return slots

    # ------------------------------------------------------------- internals
    def _score_values(
        self, ids: torch.Tensor, counts: torch.Tensor, custom: torch.Tensor | None
    ) -> torch.Tensor:
        policy = self.options.eviction
        if policy == EvictionPolicy.LFU:
            return counts.to(torch.int64)
        if policy == EvictionPolicy.CUSTOM_SCORE and custom is not None:
            return custom.to(device=ids.device, dtype=torch.int64)
        return torch.full_like(ids, self.step)

    def _insert(self, ids: torch.Tensor, values: torch.Tensor) -> InsertResult:
        policy = self.options.eviction
        result = insert(
            self._index.keys,
            self._index.scores,
            ids,
            values,
            accumulate=policy == EvictionPolicy.LFU,
            keep_existing=policy == EvictionPolicy.NONE,
        )
        n_new = int(result.inserted.sum())
        self._metrics["inserts"] += n_new
        self._metrics["evictions"] += result.evicted_ids.numel()
        self._metrics["insert_failures"] += int((~result.hit & ~result.inserted).sum())
        return result

    def _admit(
        self, uniq: torch.Tensor, counts: torch.Tensor, stored: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Which of ``uniq`` may take a row: stored already (in memory, or where
        ``stored`` says), or seen often enough."""
        if stored is None:
            stored = probe(self._index.keys, uniq) >= 0
        waiting = (~stored).nonzero().squeeze(1)
        if waiting.numel() == 0:
            return stored
        keys, scores = self._counter
        ids = uniq[waiting]
        result = insert(keys, scores, ids, torch.full_like(ids, self.step), False, False)
        seen = counts[waiting].clone()
        counted = result.slots >= 0
        slots = result.slots[counted]
        # A slot new to this id (inserted, or reused after evicting another id) starts at 0.
        previous = torch.where(result.inserted[counted], 0, self._counts[slots])
        seen[counted] += previous
        self._counts[slots] = seen[counted]
        admitted = seen >= self.options.admission_threshold
        done = result.slots[admitted & counted]
        if done.numel():
            remove(keys, scores, done)
            self._counts[done] = 0
        stored[waiting[admitted]] = True
        return stored

    # -------------------------------------------------- SSD tier internals
    def _open_ssd(self, ssd: SSDOptions, rank: int) -> SSDTier:
        policy = self.options.eviction
        if policy == EvictionPolicy.NONE:
            raise ValueError(
                f"table {self.name!r}: an SSD tier needs a table that evicts "
                "(EvictionPolicy.NONE never demotes a row)"
            )
        if ssd.eviction in (EvictionPolicy.LFU, EvictionPolicy.CUSTOM_SCORE) and (
            ssd.eviction != policy
        ):
            raise ValueError(
                f"table {self.name!r}: SSD eviction {ssd.eviction.name} ranks rows by the "
                f"table's scores, which are {policy.name} scores; use LRU or NONE"
            )
        tier = SSDTier(self.name, self.dim, self.state_dim, ssd, rank)
        try:
            self._restore(tier)
        except BaseException:
            tier.close()
            raise
        return tier

    def _restore(self, tier: SSDTier) -> None:
        """Load what the last flush of a previous run left: counters, memory rows
        (those that no longer fit go to the SSD tier)."""
        if tier.restored is None:
            return
        self.step = int(tier.restored.meta.get("step", 0))
        self.optim_step = int(tier.restored.meta.get("optim_step", 0))
        ids, records, scores, rows = tier.read_restored()
        result = insert(
            self._index.keys,
            self._index.scores,
            ids.to(self.device),
            scores.to(self.device),
            accumulate=False,
            keep_existing=True,
        )
        stored = result.slots >= 0
        slots = result.slots[stored]
        rows = rows.to(self.device)
        self._set_rows(slots, rows[stored.to(rows.device)])
        left = (~stored).cpu()
        tier.adopt(ids[left], self._ssd_scores(scores[left]), records[left])

    def _rows_at(self, slots: torch.Tensor) -> torch.Tensor:
        """Weights and state of ``slots`` side by side: ``[n, dim + state_dim]``."""
        return torch.cat(
            [self.weights.index_select(0, slots), self.state.index_select(0, slots)], dim=1
        )

    def _set_rows(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        """Write ``[n, dim + state_dim]`` rows (weights, then state) at ``slots``."""
        self.weights.index_copy_(0, slots, rows[:, : self.dim])
        if self.state_dim:
            self.state.index_copy_(0, slots, rows[:, self.dim :])

    def _ssd_scores(self, memory_scores: torch.Tensor) -> torch.Tensor:
        """The SSD tier's eviction scores of rows leaving memory with ``memory_scores``."""
        policy = self.options.ssd.eviction
        if policy == EvictionPolicy.NONE:
            return torch.zeros_like(memory_scores)
        if policy == self.options.eviction:
            return memory_scores
        return torch.full_like(memory_scores, self.step)  # LRU over another policy: demotion time

    def _reserve_ssd(self, n: int) -> None:
        """Room in the slab for ``n`` rows, before anything in memory changes (a
        full disk raises here); flushes first when that frees enough records."""
        if self._ssd.needs_flush(n):
            self.flush()
        self._ssd.reserve(n)

    def _scores_before(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The scores of the buckets of ``ids``, kept to know evicted rows' scores."""
        buckets = torch.unique(index_bucket(ids, self._index.keys.shape[0]))
        return buckets, self._index.scores.index_select(0, buckets)

    def _demote(
        self,
        evicted_ids: torch.Tensor,
        evicted_slots: torch.Tensor,
        before: tuple[torch.Tensor, torch.Tensor],
    ) -> None:
        """Write the rows evicted from memory to the SSD tier (call before their
        slots are refilled)."""
        if evicted_ids.numel() == 0:
            return
        buckets, scores = before
        row = torch.searchsorted(buckets, evicted_slots // WAYS)
        memory_scores = scores[row, evicted_slots % WAYS].cpu()
        rows = self._rows_at(evicted_slots)
        self._ssd.put(evicted_ids.cpu(), memory_scores, self._ssd_scores(memory_scores), rows.cpu())
        self._metrics["demotions"] += evicted_ids.numel()

    def _count_ssd(self, counts: torch.Tensor, miss: torch.Tensor, found: torch.Tensor) -> None:
        ssd_hits = int(counts[found].sum())
        self._metrics["ssd_hits"] += ssd_hits
        self._metrics["ssd_misses"] += int(counts[miss].sum()) - ssd_hits

    def _fetch_ssd(
        self, uniq: torch.Tensor, miss: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """SSD rows of ``uniq[miss]``: ``(positions in uniq, SSD slots, memory
        scores, rows [k, dim + state_dim])`` of those the tier holds intact."""
        miss_ids = uniq[miss].cpu()
        ssd_slots = self._ssd.lookup(miss_ids)
        held = (ssd_slots >= 0).nonzero().squeeze(1)
        scores, rows, ok = self._ssd.fetch(miss_ids[held], ssd_slots[held])
        held = held[ok]
        found = miss[held.to(miss.device)]
        return (
            found,
            ssd_slots[held],
            scores[ok].to(self.device),
            rows[ok].to(self.device),
        )

    def _promote(self, slots: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor) -> None:
        """Rows fetched from the SSD tier take their new memory ``slots``."""
        self._set_rows(slots, rows)
        self._index.scores.view(-1).index_copy_(0, slots, scores)
        self._metrics["promotions"] += slots.numel()

    def _lookup_train_tiered(
        self, ids: torch.Tensor, custom_scores: torch.Tensor | None
    ) -> torch.Tensor:
        """``lookup_train`` over both tiers: an id the SSD tier holds competes for a
        memory row as a stored id would (it outranks new ids and unprotected
        stored ones), and comes back with its row, state and score."""
        uniq, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
        mem_slots = probe(self._index.keys, uniq)
        miss = (mem_slots < 0).nonzero().squeeze(1)
        found, ssd_slots, ssd_scores, ssd_rows = self._fetch_ssd(uniq, miss)
        self._reserve_ssd(miss.numel())  # every eviction makes room for a missed id
        self._count_ssd(counts, miss, found)
        self.step += 1
        scores_u = None
        if custom_scores is not None:
            scores_u = torch.full_like(uniq, torch.iinfo(torch.int64).min)
            scores_u.scatter_reduce_(0, inverse, custom_scores.to(torch.int64), reduce="amax")
        values = self._score_values(uniq, counts, scores_u).clone()
        accumulate = self.options.eviction == EvictionPolicy.LFU
        promoted_scores = values[found] + ssd_scores if accumulate else values[found]
        values[found] = INT64_MAX
        before = self._scores_before(uniq[miss])
        if self._counter is None:
            result = self._insert(uniq, values)
            slots_u, inserted_u, hit_u = result.slots, result.inserted, result.hit
        else:
            stored = mem_slots >= 0
            stored[found] = True
            candidates = self._admit(uniq, counts, stored)
            cand_idx = candidates.nonzero().squeeze(1)
            result = self._insert(uniq[cand_idx], values[cand_idx])
            slots_u = torch.full_like(uniq, -1).index_copy_(0, cand_idx, result.slots)
            inserted_u = torch.zeros_like(candidates).index_copy_(0, cand_idx, result.inserted)
            hit_u = torch.zeros_like(candidates).index_copy_(0, cand_idx, result.hit)
            self._metrics["admission_rejects"] += uniq.numel() - cand_idx.numel()
        promoted = (slots_u[found] >= 0).nonzero().squeeze(1)
        self._ssd.remove(ssd_slots[promoted.cpu()])
        self._demote(result.evicted_ids, result.evicted_slots, before)
        self._promote(slots_u[found[promoted]], ssd_rows[promoted], promoted_scores[promoted])
        self._metrics["inserts"] -= promoted.numel()
        inserted_u[found[promoted]] = False
        new = inserted_u.nonzero().squeeze(1)
        if new.numel():
            new_slots = slots_u[new]
            self.weights.index_copy_(0, new_slots, self.initial_rows(uniq[new]))
            if self.state_dim:
                self.state.index_fill_(0, new_slots, 0.0)
        hits = int(torch.dot(counts, hit_u.to(counts.dtype)))
        self._metrics["hits"] += hits
        self._metrics["misses"] += ids.numel() - hits
        return slots_u[inverse]

    def _lookup_eval_tiered(self, ids: torch.Tensor) -> torch.Tensor:
        """``lookup_eval`` over both tiers: ids held by the SSD tier are promoted
        (outranking unprotected stored ids; the batch's hits keep their rows and
        scores), so that the pooled lookup finds them in memory."""
        uniq, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
        mem_slots = probe(self._index.keys, uniq)
        hit = mem_slots >= 0
        miss = (~hit).nonzero().squeeze(1)
        found, ssd_slots, ssd_scores, ssd_rows = self._fetch_ssd(uniq, miss)
        if found.numel():
            self._reserve_ssd(found.numel())  # every eviction makes room for a promotion
        hits = int(counts[hit].sum())
        self._metrics["hits"] += hits
        self._metrics["misses"] += ids.numel() - hits
        self._count_ssd(counts, miss, found)
        if found.numel() == 0:
            return mem_slots[inverse]
        before = self._scores_before(uniq[found])
        # The batch's hits in the buckets promotions go to stay protected, scores unchanged.
        hit_idx = hit.nonzero().squeeze(1)
        near = torch.isin(index_bucket(uniq[hit_idx], self._index.keys.shape[0]), before[0])
        hit_idx = hit_idx[near]
        accumulate = self.options.eviction == EvictionPolicy.LFU
        hit_values = self._index.scores.view(-1)[mem_slots[hit_idx]]
        values = torch.cat(
            [
                torch.zeros_like(hit_values) if accumulate else hit_values,
                torch.full_like(found, INT64_MAX),
            ]
        )
        result = insert(
            self._index.keys,
            self._index.scores,
            uniq[torch.cat([hit_idx, found])],
            values,
            accumulate=accumulate,
            keep_existing=False,
        )
        self._metrics["evictions"] += result.evicted_ids.numel()
        slots_u = mem_slots.clone()
        found_slots = result.slots[hit_idx.numel() :]
        slots_u[found] = found_slots
        promoted = (found_slots >= 0).nonzero().squeeze(1)
        self._ssd.remove(ssd_slots[promoted.cpu()])
        self._demote(result.evicted_ids, result.evicted_slots, before)
        self._promote(found_slots[promoted], ssd_rows[promoted], ssd_scores[promoted])
        return slots_u[inverse]

    def _insert_tiered(
        self,
        ids: torch.Tensor,
        values: torch.Tensor,
        weights: torch.Tensor,
        state: torch.Tensor | None,
    ) -> torch.Tensor:
        """``insert`` over both tiers: an id held by the SSD tier is overwritten as a
        stored id would be (and moves to memory); rows that find no memory row go
        to the SSD tier."""
        tier = self._ssd
        ssd_slots = tier.lookup(ids.cpu())
        held = (ssd_slots >= 0).nonzero().squeeze(1)
        old_scores, _, ok = tier.fetch(ids.cpu()[held], ssd_slots[held], use_staged=False)
        held, old_scores = held[ok], old_scores[ok].to(self.device)
        self._reserve_ssd(ids.numel())
        tier.remove(ssd_slots[held])
        held = held.to(self.device)
        values = values.clone()
        accumulate = self.options.eviction == EvictionPolicy.LFU
        held_scores = values[held] + old_scores if accumulate else values[held]
        values[held] = INT64_MAX
        before = self._scores_before(ids)
        result = self._insert(ids, values)
        self._metrics["inserts"] -= int(result.inserted[held].sum())  # they were stored
        self._demote(result.evicted_ids, result.evicted_slots, before)
        held_slots = result.slots[held]
        self._index.scores.view(-1)[held_slots[held_slots >= 0]] = held_scores[held_slots >= 0]
        stored = result.slots >= 0
        slots = result.slots[stored]
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
        tier.put(ids[left].cpu(), memory_scores, self._ssd_scores(memory_scores), rows)
        return result.slots

    def _find_ssd(self, ids: torch.Tensor, rows: torch.Tensor, found: torch.Tensor) -> None:
        """Fill ``rows`` / ``found`` in place for ids the SSD tier holds (read-only)."""
        missing = (~found).nonzero().squeeze(1)
        uniq, inverse = torch.unique(ids[missing], return_inverse=True)
        ssd_slots = self._ssd.lookup(uniq.cpu())
        held = (ssd_slots >= 0).nonzero().squeeze(1)
        _, ssd_rows, ok = self._ssd.fetch(uniq.cpu()[held], ssd_slots[held], use_staged=False)
        got = torch.zeros(uniq.numel(), dtype=torch.bool)
        got[held[ok]] = True
        uniq_rows = torch.zeros(uniq.numel(), self.dim, dtype=rows.dtype)
        uniq_rows[held[ok]] = ssd_rows[ok, : self.dim]
        rows[missing] = uniq_rows.to(self.device)[inverse]
        found[missing] = got.to(self.device)[inverse]
