"""A KV table's calls over both tiers: the in-memory rows as a cache over an SSD tier.

:class:`~torchrec_kvemb.table.KVTable` holds the in-memory table; when it has
an SSD tier (``table.ssd is not None``) its calls come here:

* ``lookup_train`` / ``lookup_eval``: an id the SSD tier holds is promoted
  (its row, optimizer state and score come back to memory) and the rows that
  make room for it are demoted (written to the SSD tier);
* ``insert``: overwrites the row in whichever tier holds it; rows that find no
  memory row go to the SSD tier;
* ``find`` and ``export``: read both tiers;
* ``prefetch``, ``flush``, ``close``, and ``open_tier`` (at construction:
  checks the policies, restores what the last flush left).

The two tiers never hold the same id. These functions take the table as
their first argument and keep no reference to it (so that dropping a table
frees its files at once). See docs/ssd-tier.md.

Example::

    table = KVTable("user", 8, KVTableOptions(capacity=1000, ssd=SSDOptions("/mnt/ssd")))
    slots = table.lookup_train(ids)   # runs tiered.lookup_train(table, ids, None)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from torchrec_kvemb.ops.hashing import INT64_MAX, index_bucket
from torchrec_kvemb.ops.insert import insert as find_or_insert
from torchrec_kvemb.ops.probe import probe
from torchrec_kvemb.options import WAYS, EvictionPolicy, SSDOptions
from torchrec_kvemb.ssd.tier import SSDTier, default_rank
from torchrec_kvemb.validation import check_ids

if TYPE_CHECKING:
    from torchrec_kvemb.table import KVTable


# -------------------------------------------------------------------- opening
def open_tier(table: KVTable, ssd: SSDOptions, rank: int | None) -> SSDTier:
    """Open the SSD tier of ``table`` (files ``<path>/<name>.rank<rank>.*``; ``rank``
    None: the process's rank in torch.distributed, else 0) and restore into
    ``table`` what the last flush of a previous run left.

    Raises ``ValueError`` for an eviction policy that cannot demote rows, or an
    SSD eviction policy that cannot rank the table's scores."""
    rank = default_rank() if rank is None else rank
    policy = table.options.eviction
    if policy == EvictionPolicy.NONE:
        raise ValueError(
            f"table {table.name!r}: an SSD tier needs a table that evicts "
            "(EvictionPolicy.NONE never demotes a row)"
        )
    if ssd.eviction in (EvictionPolicy.LFU, EvictionPolicy.CUSTOM_SCORE) and (
        ssd.eviction != policy
    ):
        raise ValueError(
            f"table {table.name!r}: SSD eviction {ssd.eviction.name} ranks rows by the "
            f"table's scores, which are {policy.name} scores; use LRU or NONE"
        )
    tier = SSDTier(table.name, table.dim, table.state_dim, ssd, rank)
    try:
        _restore(table, tier)
    except BaseException:
        tier.close()
        raise
    return tier


def _restore(table: KVTable, tier: SSDTier) -> None:
    """Load what the last flush of a previous run left: counters, memory rows
    (those that no longer fit go to the SSD tier)."""
    if tier.restored is None:
        return
    table.step = int(tier.restored.meta.get("step", 0))
    table.optim_step = int(tier.restored.meta.get("optim_step", 0))
    ids, records, scores, rows = tier.read_restored()
    result = find_or_insert(
        table._index.keys,
        table._index.scores,
        ids.to(table.device),
        scores.to(table.device),
        accumulate=False,
        keep_existing=True,
    )
    stored = result.slots >= 0
    slots = result.slots[stored]
    rows = rows.to(table.device)
    table._set_rows(slots, rows[stored.to(rows.device)])
    left = (~stored).cpu()
    tier.adopt(ids[left], _ssd_scores(table, scores[left]), records[left])


# -------------------------------------------------------------------- lookups
def lookup_train(
    table: KVTable, ids: torch.Tensor, custom_scores: torch.Tensor | None
) -> torch.Tensor:
    """``lookup_train`` over both tiers: an id the SSD tier holds competes for a
    memory row as a stored id would (it outranks new ids and unprotected
    stored ones), and comes back with its row, state and score."""
    tier = table._ssd
    metrics = table._metrics
    uniq, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
    mem_slots = probe(table._index.keys, uniq)
    miss = (mem_slots < 0).nonzero().squeeze(1)
    found, ssd_slots, ssd_scores, ssd_rows = _fetch(table, uniq, miss)
    _reserve(table, miss.numel())  # every eviction makes room for a missed id
    _count(table, counts, miss, found)
    table.step += 1
    scores_u = None
    if custom_scores is not None:
        scores_u = torch.full_like(uniq, torch.iinfo(torch.int64).min)
        scores_u.scatter_reduce_(0, inverse, custom_scores.to(torch.int64), reduce="amax")
    values = table._score_values(uniq, counts, scores_u).clone()
    accumulate = table.options.eviction == EvictionPolicy.LFU
    promoted_scores = values[found] + ssd_scores if accumulate else values[found]
    values[found] = INT64_MAX
    before = _scores_before(table, uniq[miss])
    if table._counter is None:
        result = table._insert(uniq, values)
        slots_u, inserted_u, hit_u = result.slots, result.inserted, result.hit
    else:
        stored = mem_slots >= 0
        stored[found] = True
        candidates = table._admit(uniq, counts, stored)
        cand_idx = candidates.nonzero().squeeze(1)
        result = table._insert(uniq[cand_idx], values[cand_idx])
        slots_u = torch.full_like(uniq, -1).index_copy_(0, cand_idx, result.slots)
        inserted_u = torch.zeros_like(candidates).index_copy_(0, cand_idx, result.inserted)
        hit_u = torch.zeros_like(candidates).index_copy_(0, cand_idx, result.hit)
        metrics["admission_rejects"] += uniq.numel() - cand_idx.numel()
    promoted = (slots_u[found] >= 0).nonzero().squeeze(1)
    tier.remove(ssd_slots[promoted.cpu()])
    _demote(table, result.evicted_ids, result.evicted_slots, before)
    _promote(table, slots_u[found[promoted]], ssd_rows[promoted], promoted_scores[promoted])
    metrics["inserts"] -= promoted.numel()
    inserted_u[found[promoted]] = False
    new = inserted_u.nonzero().squeeze(1)
    if new.numel():
        new_slots = slots_u[new]
        table.weights.index_copy_(0, new_slots, table.initial_rows(uniq[new]))
        if table.state_dim:
            table.state.index_fill_(0, new_slots, 0.0)
    hits = int(torch.dot(counts, hit_u.to(counts.dtype)))
    metrics["hits"] += hits
    metrics["misses"] += ids.numel() - hits
    return slots_u[inverse]


def lookup_eval(table: KVTable, ids: torch.Tensor) -> torch.Tensor:
    """``lookup_eval`` over both tiers: ids held by the SSD tier are promoted
    (outranking unprotected stored ids; the batch's hits keep their rows and
    scores), so that the pooled lookup finds them in memory."""
    metrics = table._metrics
    uniq, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
    mem_slots = probe(table._index.keys, uniq)
    hit = mem_slots >= 0
    miss = (~hit).nonzero().squeeze(1)
    found, ssd_slots, ssd_scores, ssd_rows = _fetch(table, uniq, miss)
    if found.numel():
        _reserve(table, found.numel())  # every eviction makes room for a promotion
    hits = int(counts[hit].sum())
    metrics["hits"] += hits
    metrics["misses"] += ids.numel() - hits
    _count(table, counts, miss, found)
    if found.numel() == 0:
        return mem_slots[inverse]
    before = _scores_before(table, uniq[found])
    # The batch's hits in the buckets promotions go to stay protected, scores unchanged.
    hit_idx = hit.nonzero().squeeze(1)
    near = torch.isin(index_bucket(uniq[hit_idx], table._index.keys.shape[0]), before[0])
    hit_idx = hit_idx[near]
    accumulate = table.options.eviction == EvictionPolicy.LFU
    hit_values = table._index.scores.view(-1)[mem_slots[hit_idx]]
    values = torch.cat(
        [
            torch.zeros_like(hit_values) if accumulate else hit_values,
            torch.full_like(found, INT64_MAX),
        ]
    )
    result = find_or_insert(
        table._index.keys,
        table._index.scores,
        uniq[torch.cat([hit_idx, found])],
        values,
        accumulate=accumulate,
        keep_existing=False,
    )
    metrics["evictions"] += result.evicted_ids.numel()
    slots_u = mem_slots.clone()
    found_slots = result.slots[hit_idx.numel() :]
    slots_u[found] = found_slots
    promoted = (found_slots >= 0).nonzero().squeeze(1)
    table._ssd.remove(ssd_slots[promoted.cpu()])
    _demote(table, result.evicted_ids, result.evicted_slots, before)
    _promote(table, found_slots[promoted], ssd_rows[promoted], ssd_scores[promoted])
    return slots_u[inverse]


# ----------------------------------------------------------- reads and writes
def insert(
    table: KVTable,
    ids: torch.Tensor,
    values: torch.Tensor,
    weights: torch.Tensor,
    state: torch.Tensor | None,
    exact_scores: bool = False,
) -> torch.Tensor:
    """``insert`` over both tiers: an id held by the SSD tier is overwritten as a
    stored id would be (and moves to memory); rows that find no memory row go
    to the SSD tier. ``ids`` are checked and unique, ``values`` their scores
    (``exact_scores``: the scores every row keeps, in either tier; else LFU
    adds them to the stored counts)."""
    tier = table._ssd
    ssd_slots = tier.lookup(ids.cpu())
    held = (ssd_slots >= 0).nonzero().squeeze(1)
    old_scores, _, ok = tier.fetch(ids.cpu()[held], ssd_slots[held], use_staged=False)
    held, old_scores = held[ok], old_scores[ok].to(table.device)
    _reserve(table, ids.numel())
    tier.remove(ssd_slots[held])
    held = held.to(table.device)
    given = values
    values = values.clone()
    accumulate = table.options.eviction == EvictionPolicy.LFU and not exact_scores
    held_scores = values[held] + old_scores if accumulate else values[held]
    values[held] = INT64_MAX
    before = _scores_before(table, ids)
    result = table._insert(ids, values)
    table._metrics["inserts"] -= int(result.inserted[held].sum())  # they were stored
    _demote(table, result.evicted_ids, result.evicted_slots, before)
    held_slots = result.slots[held]
    table._index.scores.view(-1)[held_slots[held_slots >= 0]] = held_scores[held_slots >= 0]
    stored = result.slots >= 0
    slots = result.slots[stored]
    if exact_scores:  # an LFU hit in memory added its value to the stored count
        table._index.scores.view(-1).index_copy_(0, slots, given[stored])
    weights = weights.to(table.weights)
    state = (
        state.to(table.state)
        if state is not None
        else torch.zeros(ids.numel(), table.state_dim, device=table.device)
    )
    table.weights.index_copy_(0, slots, weights[stored])
    table.state.index_copy_(0, slots, state[stored])
    left = ~stored
    memory_scores = values
    memory_scores[held] = held_scores
    memory_scores = memory_scores[left].cpu()
    rows = torch.cat([weights[left], state[left]], dim=1).cpu()
    tier.put(ids[left].cpu(), memory_scores, _ssd_scores(table, memory_scores), rows)
    return result.slots


def find(table: KVTable, ids: torch.Tensor, rows: torch.Tensor, found: torch.Tensor) -> None:
    """Fill ``rows`` / ``found`` (of ``table.find``) in place for ids the SSD tier
    holds (read-only: nothing is promoted)."""
    tier = table._ssd
    missing = (~found).nonzero().squeeze(1)
    uniq, inverse = torch.unique(ids[missing], return_inverse=True)
    ssd_slots = tier.lookup(uniq.cpu())
    held = (ssd_slots >= 0).nonzero().squeeze(1)
    _, ssd_rows, ok = tier.fetch(uniq.cpu()[held], ssd_slots[held], use_staged=False)
    got = torch.zeros(uniq.numel(), dtype=torch.bool)
    got[held[ok]] = True
    uniq_rows = torch.zeros(uniq.numel(), table.dim, dtype=rows.dtype)
    uniq_rows[held[ok]] = ssd_rows[ok, : table.dim]
    rows[missing] = uniq_rows.to(table.device)[inverse]
    found[missing] = got.to(table.device)[inverse]


def export(
    table: KVTable,
    ids: torch.Tensor,
    weights: torch.Tensor,
    scores: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The in-memory rows of ``table.export`` (sorted by id) merged with the SSD
    tier's: ``(ids, weights, scores, state)``, sorted by id."""
    ssd_ids, ssd_scores, ssd_rows = table._ssd.export()
    ids, order = torch.sort(torch.cat([ids, ssd_ids.to(table.device)]))
    ssd_rows = ssd_rows.to(table.device)
    weights = torch.cat([weights, ssd_rows[:, : table.dim]])[order]
    scores = torch.cat([scores, ssd_scores.to(table.device)])[order]
    state = torch.cat([state, ssd_rows[:, table.dim :]])[order]
    return ids, weights, scores, state


def prefetch(table: KVTable, ids: torch.Tensor) -> None:
    """Start reading the SSD rows of ``ids`` not in memory now, on a background thread."""
    ids = check_ids(table.name, ids).to(table.device)
    uniq = torch.unique(ids)
    table._ssd.prefetch(uniq[probe(table._index.keys, uniq) < 0].cpu())


# ----------------------------------------------------------------- durability
def flush(table: KVTable) -> None:
    """Write the in-memory rows to the slab as a snapshot, then the SSD tier's
    index with the table's step counters, atomically."""
    flat = table._index.keys.view(-1)
    slots = (flat >= 0).nonzero().squeeze(1)
    rows = table._rows_at(slots)
    table._ssd.flush(
        flat[slots].cpu(),
        table._index.scores.view(-1)[slots].cpu(),
        rows.cpu(),
        {"step": table.step, "optim_step": table.optim_step},
    )


def close(table: KVTable) -> None:
    """``flush``, then close the SSD tier's files (a no-op when closed already)."""
    if table._ssd.closed:
        return
    flush(table)
    table._ssd.close()


# ------------------------------------------------------------------ internals
def _ssd_scores(table: KVTable, memory_scores: torch.Tensor) -> torch.Tensor:
    """The SSD tier's eviction scores of rows leaving memory with ``memory_scores``."""
    policy = table.options.ssd.eviction
    if policy == EvictionPolicy.NONE:
        return torch.zeros_like(memory_scores)
    if policy == table.options.eviction:
        return memory_scores
    return torch.full_like(memory_scores, table.step)  # LRU over another policy: demotion time


def _reserve(table: KVTable, n: int) -> None:
    """Room in the slab for ``n`` rows, before anything in memory changes (a
    full disk raises here); flushes first when that frees enough records."""
    if table._ssd.needs_flush(n):
        flush(table)
    table._ssd.reserve(n)


def _scores_before(table: KVTable, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The scores of the buckets of ``ids``, kept to know evicted rows' scores."""
    buckets = torch.unique(index_bucket(ids, table._index.keys.shape[0]))
    return buckets, table._index.scores.index_select(0, buckets)


def _demote(
    table: KVTable,
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
    rows = table._rows_at(evicted_slots)
    table._ssd.put(evicted_ids.cpu(), memory_scores, _ssd_scores(table, memory_scores), rows.cpu())
    table._metrics["demotions"] += evicted_ids.numel()


def _count(table: KVTable, counts: torch.Tensor, miss: torch.Tensor, found: torch.Tensor) -> None:
    """Count the id occurrences of ``miss`` the SSD tier held (``found``) or not."""
    ssd_hits = int(counts[found].sum())
    table._metrics["ssd_hits"] += ssd_hits
    table._metrics["ssd_misses"] += int(counts[miss].sum()) - ssd_hits


def _fetch(
    table: KVTable, uniq: torch.Tensor, miss: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """SSD rows of ``uniq[miss]``: ``(positions in uniq, SSD slots, memory
    scores, rows [k, dim + state_dim])`` of those the tier holds intact."""
    tier = table._ssd
    miss_ids = uniq[miss].cpu()
    ssd_slots = tier.lookup(miss_ids)
    held = (ssd_slots >= 0).nonzero().squeeze(1)
    scores, rows, ok = tier.fetch(miss_ids[held], ssd_slots[held])
    held = held[ok]
    found = miss[held.to(miss.device)]
    return (
        found,
        ssd_slots[held],
        scores[ok].to(table.device),
        rows[ok].to(table.device),
    )


def _promote(table: KVTable, slots: torch.Tensor, rows: torch.Tensor, scores: torch.Tensor) -> None:
    """Rows fetched from the SSD tier take their new memory ``slots``."""
    table._set_rows(slots, rows)
    table._index.scores.view(-1).index_copy_(0, slots, scores)
    table._metrics["promotions"] += slots.numel()
