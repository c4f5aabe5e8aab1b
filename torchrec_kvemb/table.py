"""One shard of one KV table: a bucketed id index over value rows.

Memory per row (capacity): ``4 * dim`` bytes of weights, ``4 * state_dim``
bytes of optimizer state, 8 bytes of key and 8 of score. An admission counter
(when ``admission_threshold > 1``) adds 24 bytes per counted id.

With ``options.ssd`` the rows in memory are a cache over an SSD tier
(``torchrec_kvemb.ssd``): a row evicted from memory is written there with its
optimizer state (demotion), and an id missing from memory but held there comes
back with its row and state (promotion); the two tiers never hold the same id.
Those paths live in ``torchrec_kvemb.ssd.tiered``; see docs/ssd-tier.md.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from torchrec_kvemb.ops.hashing import init_rows, seed_mix
from torchrec_kvemb.ops.insert import InsertResult, insert, remove
from torchrec_kvemb.ops.pooled_lookup import InitSpec
from torchrec_kvemb.ops.probe import probe
from torchrec_kvemb.optimizer import FusedOptimConfig
from torchrec_kvemb.options import WAYS, EvictionPolicy, Initializer, KVTableOptions
from torchrec_kvemb.ssd import tiered
from torchrec_kvemb.ssd.tier import COUNTERS as SSD_COUNTERS
from torchrec_kvemb.ssd.tier import SSDTier
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
            self._ssd = tiered.open_tier(self, options.ssd, rank)

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
            tiered.find(self, ids, rows, found)
        return rows, found

    def insert(
        self,
        ids: torch.Tensor,
        weights: torch.Tensor,
        state: torch.Tensor | None = None,
        scores: torch.Tensor | None = None,
        *,
        exact_scores: bool = False,
    ) -> torch.Tensor:
        """Store rows for unique ``ids`` (overwriting stored ones); returns their slots.

        The eviction policy applies when a bucket is full; an id that finds no
        room gets slot -1 and is counted in ``insert_failures``. With an SSD tier,
        rows that find no memory row go to the SSD tier (slot -1 too).

        ``scores`` are custom scores, used by ``CUSTOM_SCORE`` tables only (LRU
        rows get the current step; LFU adds a count of 1). With ``exact_scores``
        they are the rows' eviction scores as given, whatever the policy (LRU
        steps, LFU counts, custom scores): they rank the rows for memory and are
        stored as they are, in whichever tier a row lands (as a checkpoint load
        restores saved scores).
        """
        ids = check_ids(self.name, ids).to(self.device)
        check_rows(self.name, weights, ids.numel(), self.dim)
        if state is not None:
            check_rows(self.name, state, ids.numel(), self.state_dim, what="state")
        if exact_scores and (
            scores is None or tuple(scores.shape) != (ids.numel(),) or scores.is_floating_point()
        ):
            raise KVInputError(
                f"table {self.name!r}: exact_scores needs an integer scores tensor of "
                f"{ids.numel()} entries"
            )
        if ids.numel() != torch.unique(ids).numel():
            raise KVInputError(f"table {self.name!r}: insert needs unique ids")
        if exact_scores:
            values = scores.to(device=self.device, dtype=torch.int64)
        else:
            values = self._score_values(ids, torch.ones_like(ids), scores)
        if self._ssd is not None:
            return tiered.insert(self, ids, values, weights, state, exact_scores)
        result = self._insert(ids, values)
        stored = result.slots >= 0
        slots = result.slots[stored]
        if exact_scores:  # an LFU hit added its value to the stored count
            self._index.scores.view(-1).index_copy_(0, slots, values[stored])
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
        weights = self.weights.index_select(0, slots)
        scores = self._index.scores.view(-1).index_select(0, slots)
        state = self.state.index_select(0, slots)
        if self._ssd is not None:
            ids, weights, scores, state = tiered.export(self, ids, weights, scores, state)
        out = {"ids": ids, "weights": weights, "scores": scores}
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
        tiered.prefetch(self, ids)

    def flush(self) -> None:
        """Make every row durable: the SSD tier's and the in-memory ones (written to
        the slab as a snapshot), then the index, atomically. Reopening the SSD path
        after this returns restores the table as of now (rows, optimizer state,
        scores, step counters; admission counts restart). A no-op without an SSD
        tier. Raises ``KVStorageError`` (naming the table and file) on an I/O
        error; the previous flush then stays the durable one."""
        if self._ssd is None:
            return
        tiered.flush(self)

    def close(self) -> None:
        """``flush()``, then close the SSD tier's files (a no-op without one, or
        when closed already). The table cannot be used afterwards."""
        if self._ssd is None:
            return
        tiered.close(self)

    # ------------------------------------------------------- training lookups
    def lookup_train(self, ids: torch.Tensor, custom_scores: torch.Tensor | None = None):
        """Slots for a training batch, inserting new ids (admission and eviction apply).

        Returns ``slots [n]``: -1 for ids that hold no row (not yet admitted, or no
        room); they pool their initial value and their gradient is dropped.
        """
        if self._ssd is not None:
            return tiered.lookup_train(self, ids, custom_scores)
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
            return tiered.lookup_eval(self, ids)
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

    # ------------------------------------------------------------------ rows
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
