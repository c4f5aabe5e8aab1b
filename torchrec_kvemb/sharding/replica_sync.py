"""Keeping the replicas of KV table shards equal by id under 2D parallelism.

Under ``ShardingEnv2D`` every sharding group holds the same plan, and the ranks
holding one shard in every group form a replica group (``replica_pg``). Between
syncs each replica trains on its own batches, so its index takes its own ids into
its own slots: a positional average (stock ``DMPCollection.sync``) would mix ids.
:class:`KVReplicaSync` merges the replicas by id instead (docs/sharding-design.md,
"2D parallelism"), per id ``x`` of the union, with ``b`` the row at the last sync:

* ``x`` held at the last sync: ``(sum of the rows of replicas holding x in its
  synced slot + (R - those) * b) / R``; a replica that evicted ``x`` (or evicted
  and stored it again elsewhere) counts as ``b``;
* ``x`` new: ``(sum of the holders' rows + (R - holders) * init(x)) / R``, state 0
  for the others (initial rows depend only on id, seed and column);
* optimizer state as the rows; scores: the largest of the holders' (LRU clocks
  agree across replicas); the step clocks: the largest.

Membership: per index bucket, the ids some replica holds are ranked by the insert
rule (merged score higher first, new before stored on ties, smaller id first;
``NONE`` keeps stored ids first) and the first ``WAYS`` stay. Stored ids keep their
synced slots, new ones take the free ways ascending in rank order, every other
slot is emptied and zeroed. Every replica computes the merge from the same
gathered inputs in the same order, so after a sync the replicas hold the same ids
in the same slots with bitwise equal rows, state and scores.

This first version keeps a full copy of the synced shard as the baseline; each
replica sends over ``replica_pg`` only the slots it changed since, and every rank
rebuilds and merges whole shards (O(``R * capacity``) work per table). It serves
LRU and NONE tables without admission, TTL, sightings, growth or lower tiers
(:func:`check_replicable` refuses the rest, naming the table).

Example::

    with kv_replica_sync_enabled():           # the KV sharders accept ShardingEnv2D
        model = DistributedModelParallel(module, env=env_2d, plan=plan, sharders=sharders)
    sync = KVReplicaSync.of_module(model, env_2d.replica_pg)
    for batch in batches:
        model(batch).sum().backward()
        sync.sync()                             # replicas equal by id again
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from torchrec_kvemb.options import WAYS, EvictionPolicy, KVTableOptions
from torchrec_kvemb.table import KVTable

#: The eviction policies a replicated KV table may have in this version.
REPLICABLE_POLICIES = (EvictionPolicy.LRU, EvictionPolicy.NONE)
_POLICY_CODE = {EvictionPolicy.LRU: 0, EvictionPolicy.NONE: 1}
_ENABLED: ContextVar[bool] = ContextVar("kv_replica_sync_enabled", default=False)


@contextmanager
def kv_replica_sync_enabled() -> Iterator[None]:
    """Within it the KV sharders shard under ``ShardingEnv2D``: the caller promises
    to sync the KV replicas (``KVDMPCollection`` does; or a :class:`KVReplicaSync`)."""
    token = _ENABLED.set(True)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def replica_sync_is_enabled() -> bool:
    """Whether sharding now happens inside :func:`kv_replica_sync_enabled`."""
    return _ENABLED.get()


def replica_limits(options: KVTableOptions) -> list[str]:
    """What keeps a table of ``options`` from replica sync in this version: one phrase
    per reason, empty when it can be replicated."""
    reasons = []
    if options.eviction not in REPLICABLE_POLICIES:
        reasons.append(f"eviction {options.eviction.name} (LRU or NONE only)")
    if options.admission_threshold > 1:
        reasons.append(f"admission_threshold={options.admission_threshold}")
    if options.ttl is not None:
        reasons.append("ttl")
    if options.count_sightings:
        reasons.append("count_sightings")
    if options.initial_capacity is not None:
        reasons.append("initial_capacity (growth)")
    if options.ssd is not None or options.host_tier is not None:
        reasons.append("a lower tier (ssd / host_tier)")
    return reasons


def check_replicable(tables: Mapping[str, KVTableOptions]) -> None:
    """Refuse (``NotImplementedError`` naming each table and why) the ``KVTableOptions``
    by table name that replica sync does not serve yet."""
    refused = {n: r for n, o in sorted(tables.items()) if (r := replica_limits(o))}
    if refused:
        detail = "; ".join(f"table {n!r}: {', '.join(r)}" for n, r in refused.items())
        raise NotImplementedError(
            f"KV replica sync (2D parallelism) does not support {detail} "
            "(docs/sharding-design.md, '2D parallelism', Status)"
        )


@dataclass
class ShardState:
    """One shard's content as the merge reads it: flat ``keys``/``scores`` ``[C]``
    (-1: empty slot) and ``rows [C, dim + state_dim]`` float32 (weights, then state)."""

    keys: torch.Tensor
    scores: torch.Tensor
    rows: torch.Tensor

    @classmethod
    def of_table(cls, table: KVTable) -> ShardState:
        rows = torch.cat([table.weights.float(), table.state.float()], dim=1)
        return cls(table.keys.reshape(-1).clone(), table.scores.reshape(-1).clone(), rows)


@dataclass
class MergeStats:
    """What one merge did to one table: ids merged, ids evicted by the merged ranking,
    and (set by :meth:`KVReplicaSync.sync`) the slots this replica had changed since
    the last sync, which is what it sent."""

    ids: int
    sync_evictions: int
    changed_slots: int = 0


def merge_replicas(
    synced: ShardState,
    replicas: list[ShardState],
    init_of: Callable[[torch.Tensor], torch.Tensor],
    dim: int,
    policy: EvictionPolicy,
) -> tuple[ShardState, MergeStats]:
    """The merged shard of ``replicas`` (in replica order) over the last synced one
    (module docstring). ``init_of(ids)`` gives new ids' initial weight rows."""
    r_count = len(replicas)
    capacity = synced.keys.numel()
    width = synced.rows.shape[1]
    live = [synced.keys[synced.keys >= 0]] + [s.keys[s.keys >= 0] for s in replicas]
    ids = torch.unique(torch.cat(live))  # sorted ascending
    u = ids.numel()

    def slots_in(state: ShardState) -> torch.Tensor:
        slot = torch.full((u,), -1, dtype=torch.int64)
        held = (state.keys >= 0).nonzero().squeeze(1)
        slot[torch.searchsorted(ids, state.keys[held])] = held
        return slot

    s0 = slots_in(synced)
    slots = torch.stack([slots_in(s) for s in replicas]) if r_count else s0[None]
    stored = s0 >= 0
    held = slots >= 0
    kept = held & (slots == s0) & stored  # held in the synced slot: its updates count

    base = torch.zeros(u, width, dtype=torch.float32)
    base[stored] = synced.rows[s0[stored]]
    new = ~stored
    if bool(new.any()):
        base[new, :dim] = init_of(ids[new]).float()
    total = torch.zeros(u, width, dtype=torch.float32)
    for r, state in enumerate(replicas):
        use = torch.where(stored, kept[r], held[r])
        own = state.rows[slots[r].clamp(min=0)]
        total += torch.where(use[:, None], own, base)
    merged_rows = total / r_count

    lowest = torch.iinfo(torch.int64).min
    score = torch.full((u,), lowest, dtype=torch.int64)
    for r, state in enumerate(replicas):
        mine = torch.where(held[r], state.scores[slots[r].clamp(min=0)], lowest)
        score = torch.maximum(score, mine)

    # membership: rank each bucket's candidates (ids some replica holds)
    present = held.any(0)
    cand = present.nonzero().squeeze(1)  # ascending id order
    bucket = slots.max(0).values[cand] // WAYS
    order = torch.arange(cand.numel())
    c_stored = stored[cand].long()
    c_score = score[cand]
    # successive stable sorts, least significant key first (ids already ascending)
    tie = c_stored if policy is EvictionPolicy.LRU else 1 - c_stored
    keys_by_significance = [tie, -c_score] if policy is EvictionPolicy.LRU else [-c_score, tie]
    for key in keys_by_significance + [bucket]:
        perm = torch.sort(key[order], stable=True).indices
        order = order[perm]
    b_sorted = bucket[order]
    rank_in_bucket = torch.arange(order.numel()) - torch.searchsorted(b_sorted, b_sorted)
    winners = order[rank_in_bucket < WAYS]  # in rank order within each bucket
    winner_ids = cand[winners]
    w_bucket = bucket[winners]
    w_stored = stored[winner_ids]

    out_keys = torch.full((capacity,), -1, dtype=torch.int64)
    out_scores = torch.zeros(capacity, dtype=torch.int64)
    out_rows = torch.zeros(capacity, width, dtype=torch.float32)
    final = torch.empty(winner_ids.numel(), dtype=torch.int64)
    final[w_stored] = s0[winner_ids[w_stored]]
    occupied = torch.zeros(capacity // WAYS, WAYS, dtype=torch.bool)
    occupied.view(-1)[final[w_stored]] = True
    free_ways = torch.sort(occupied.to(torch.int8), dim=1, stable=True).indices
    nb = w_bucket[~w_stored]
    kth = torch.arange(nb.numel()) - torch.searchsorted(nb, nb)
    final[~w_stored] = nb * WAYS + free_ways[nb, kth]
    out_keys[final] = ids[winner_ids]
    out_scores[final] = score[winner_ids]
    out_rows[final] = merged_rows[winner_ids]
    stats = MergeStats(ids=int(cand.numel()), sync_evictions=int(cand.numel() - winners.numel()))
    return ShardState(out_keys, out_scores, out_rows), stats


def _fingerprint(table: KVTable) -> list[int]:
    return [
        table.capacity,
        table.dim,
        table.state_dim,
        _POLICY_CODE[table.options.eviction],
        table.keys.shape[0],
    ]


class KVReplicaSync:
    """Syncs KV table shards with their replicas on ``replica_pg`` (collective: every
    rank of the group calls :meth:`sync` with the same table names).

    ``tables``: this rank's shards by a name the replicas share. At construction the
    replicas must be equal (freshly sharded, or loaded from one checkpoint); the
    construction checks it and keeps the shards as the first baseline.

    Example::

        sync = KVReplicaSync(sharded_ebc.kv_tables(), env_2d.replica_pg)
        loss.backward()
        stats = sync.sync()   # {table: MergeStats}
    """

    def __init__(self, tables: Mapping[str, KVTable], replica_pg: dist.ProcessGroup) -> None:
        check_replicable({name: t.options for name, t in tables.items()})
        self.tables = dict(sorted(tables.items()))
        self.pg = replica_pg
        self.replicas = dist.get_world_size(replica_pg)
        self.metrics = {
            name: {"syncs": 0, "sync_evictions": 0, "changed_slots": 0} for name in self.tables
        }
        self._check_same_tables()
        self.reset()

    @classmethod
    def of_module(cls, model: nn.Module, replica_pg: dist.ProcessGroup) -> KVReplicaSync:
        """The KV shards of every sharded KV collection in ``model``, named
        ``<module path>.<table>``."""
        from torchrec_kvemb.sharding.sharded_common import KVShardedMixin

        tables = {}
        for path, module in model.named_modules():
            if isinstance(module, KVShardedMixin):
                for name, table in module.kv_tables().items():
                    tables[f"{path}.{name}" if path else name] = table
        return cls(tables, replica_pg)

    def _gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        out = [torch.empty_like(tensor) for _ in range(self.replicas)]
        dist.all_gather(out, tensor.contiguous(), group=self.pg)
        return out

    def _check_same_tables(self) -> None:
        names: list = [None] * self.replicas
        dist.all_gather_object(names, list(self.tables), group=self.pg)
        if any(n != names[0] for n in names):
            raise ValueError(f"KV replica sync: the replicas hold other tables: {names}")
        for name, table in self.tables.items():
            mine = torch.tensor(_fingerprint(table), dtype=torch.int64)
            seen = self._gather(mine)
            if any(not torch.equal(s, mine) for s in seen):
                raise ValueError(
                    f"table {name!r}: the replicas' shards differ in (capacity, dim, "
                    f"state_dim, policy, buckets): {[s.tolist() for s in seen]}"
                )

    def reset(self) -> None:
        """Take the shards as they are now as the synced baseline (after building or a
        checkpoint load); the replicas must be equal, bit for bit."""
        self._synced: dict[str, ShardState] = {}
        for name, table in self.tables.items():
            state = ShardState.of_table(table)
            for part in ("keys", "scores", "rows"):
                mine = getattr(state, part)
                if any(not torch.equal(o, mine) for o in self._gather(mine)):
                    raise ValueError(
                        f"table {name!r}: the replicas' shards differ ({part}); a replica "
                        "sync starts from equal replicas (freshly sharded, or loaded from "
                        "one checkpoint)"
                    )
            self._synced[name] = state

    def _gather_replicas(self, synced: ShardState, mine: ShardState) -> tuple[list, int]:
        """Every replica's shard, rebuilt from the synced one (which every replica
        holds) and the slots each replica changed since, gathered; and how many slots
        this replica changed."""
        changed = (
            (mine.keys != synced.keys)
            | (mine.scores != synced.scores)
            | (mine.rows != synced.rows).any(1)
        )
        slots = changed.nonzero().squeeze(1)
        counts = [int(c) for c in self._gather(torch.tensor([slots.numel()]))]
        most = max(counts)
        if most == 0:
            return [synced] * self.replicas, 0
        pad = most - slots.numel()
        padded = torch.cat([slots, slots.new_zeros(pad)])
        entries = torch.stack([padded, mine.keys[padded], mine.scores[padded]], dim=1)
        rows = mine.rows[padded]
        replicas = []
        for n, e, r in zip(counts, self._gather(entries), self._gather(rows), strict=True):
            state = ShardState(synced.keys.clone(), synced.scores.clone(), synced.rows.clone())
            state.keys[e[:n, 0]] = e[:n, 1]
            state.scores[e[:n, 0]] = e[:n, 2]
            state.rows[e[:n, 0]] = r[:n]
            replicas.append(state)
        return replicas, slots.numel()

    @torch.no_grad()
    def sync(self) -> dict[str, MergeStats]:
        """Merge every table with its replicas (module docstring); returns what each
        merge did."""
        stats = {}
        for name, table in self.tables.items():
            synced = self._synced[name]
            replicas, changed = self._gather_replicas(synced, ShardState.of_table(table))
            clocks = torch.stack(self._gather(table.clock.clone())).max(0).values
            merged, stats[name] = merge_replicas(
                synced, replicas, table.initial_rows, table.dim, table.options.eviction
            )
            stats[name].changed_slots = changed
            table.keys.copy_(merged.keys.view_as(table.keys))
            table.scores.copy_(merged.scores.view_as(table.scores))
            table.weights.copy_(merged.rows[:, : table.dim].to(table.weights.dtype))
            if table.state_dim:
                table.state.copy_(merged.rows[:, table.dim :].to(table.state.dtype))
            table.clock.copy_(clocks)
            # the baseline is what the table now holds (rows rounded to its dtype)
            self._synced[name] = ShardState.of_table(table)
            self.metrics[name]["syncs"] += 1
            self.metrics[name]["sync_evictions"] += stats[name].sync_evictions
            self.metrics[name]["changed_slots"] += changed
        return stats
