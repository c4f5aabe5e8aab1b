"""``merge_replicas`` (torchrec_kvemb/sharding/replica_sync.py) against a per-id,
dict-based model of the merge rule, on replicas built by hand with every status an
id can have since the last sync: kept and updated, quiet, new, evicted, evicted and
stored again in another way; with buckets over capacity (the merged ranking evicts)."""

from __future__ import annotations

import pytest
import torch

from torchrec_kvemb.options import WAYS, EvictionPolicy
from torchrec_kvemb.sharding.replica_sync import ShardState, merge_replicas

DIM, STATE = 3, 1
NUM_BUCKETS = 3


def init_of(ids: torch.Tensor) -> torch.Tensor:
    """Initial rows that depend on the id only."""
    return (ids.double()[:, None] * torch.tensor([0.001, -0.002, 0.003])).remainder(1).float()


def synced_shard(g: torch.Generator) -> ShardState:
    keys = torch.full((NUM_BUCKETS * WAYS,), -1, dtype=torch.int64)
    for b in range(NUM_BUCKETS):
        n = int(torch.randint(4, WAYS + 1, (1,), generator=g))
        ways = torch.randperm(WAYS, generator=g)[:n]
        keys[b * WAYS + ways] = b + NUM_BUCKETS * torch.randperm(40, generator=g)[:n]
    scores = torch.where(keys >= 0, torch.randint(1, 10, keys.shape, generator=g), 0)
    rows = torch.randn(keys.numel(), DIM + STATE, generator=g) * (keys >= 0)[:, None]
    return ShardState(keys, scores, rows)


def trained_replica(synced: ShardState, g: torch.Generator, step: int) -> ShardState:
    """The synced shard after some training: rows updated (their score to ``step``),
    ids evicted, some of them stored again in another way, new ids in free ways."""
    keys, scores, rows = synced.keys.clone(), synced.scores.clone(), synced.rows.clone()
    for slot in (keys >= 0).nonzero().squeeze(1).tolist():
        roll = float(torch.rand((), generator=g))
        if roll < 0.4:  # kept: looked up and updated
            rows[slot] += torch.randn(DIM + STATE, generator=g)
            scores[slot] = step
        elif roll < 0.55:  # left: evicted (the row is not zeroed, as in a table)
            keys[slot] = -1
    for b in range(NUM_BUCKETS):
        free = (keys[b * WAYS : (b + 1) * WAYS] < 0).nonzero().squeeze(1).tolist()
        lost = [int(k) for k in synced.keys[b * WAYS : (b + 1) * WAYS] if k >= 0 and k not in keys]
        news = (b + NUM_BUCKETS * (40 + torch.randperm(30, generator=g))).tolist()
        for way in free:
            slot = b * WAYS + way
            if lost and float(torch.rand((), generator=g)) < 0.3:
                keys[slot] = lost.pop()  # reborn: evicted, stored again elsewhere
            elif float(torch.rand((), generator=g)) < 0.7:
                keys[slot] = news.pop()  # new
            else:
                continue
            rows[slot] = torch.cat([init_of(keys[slot : slot + 1])[0], torch.zeros(STATE)])
            rows[slot] += torch.randn(DIM + STATE, generator=g)
            scores[slot] = step + int(torch.randint(0, 2, (), generator=g))
    return ShardState(keys, scores, rows)


def reference_merge(synced: ShardState, replicas: list[ShardState], policy: EvictionPolicy):
    """The merge rule, one id at a time with dicts."""
    r_count = len(replicas)
    s0 = {int(k): s for s, k in enumerate(synced.keys.tolist()) if k >= 0}
    where = [{int(k): s for s, k in enumerate(rep.keys.tolist()) if k >= 0} for rep in replicas]
    candidates = sorted(set().union(*[set(w) for w in where]))
    merged = {}
    for x in candidates:
        if x in s0:
            base = synced.rows[s0[x]]
        else:
            base = torch.cat([init_of(torch.tensor([x]))[0], torch.zeros(STATE)])
        total = torch.zeros(DIM + STATE)
        for rep, w in zip(replicas, where, strict=True):
            mine = w.get(x)
            use = mine is not None and (mine == s0[x] if x in s0 else True)
            total = total + (rep.rows[mine] if use else base)
        score = max(int(rep.scores[w[x]]) for rep, w in zip(replicas, where) if x in w)
        merged[x] = (total / r_count, score)
    keys = torch.full_like(synced.keys, -1)
    scores = torch.zeros_like(synced.scores)
    rows = torch.zeros_like(synced.rows)
    for b in range(NUM_BUCKETS):
        mine = [x for x in candidates if min(w[x] for w in where if x in w) // WAYS == b]
        if policy is EvictionPolicy.LRU:
            ranked = sorted(mine, key=lambda x: (-merged[x][1], x in s0, x))
        else:
            ranked = sorted(mine, key=lambda x: (x not in s0, -merged[x][1], x))
        winners = ranked[:WAYS]
        taken = {s0[x] for x in winners if x in s0}
        free = iter(s for s in range(b * WAYS, (b + 1) * WAYS) if s not in taken)
        for x in winners:
            slot = s0[x] if x in s0 else next(free)
            keys[slot], scores[slot], rows[slot] = x, merged[x][1], merged[x][0]
    return keys, scores, rows, len(candidates) - int((keys >= 0).sum())


@pytest.mark.parametrize("policy", [EvictionPolicy.LRU, EvictionPolicy.NONE], ids=["lru", "none"])
@pytest.mark.parametrize("replicas", [2, 3], ids=["R2", "R3"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_merge_matches_per_id_rule(policy, replicas, seed):
    g = torch.Generator().manual_seed(seed)
    synced = synced_shard(g)
    reps = [trained_replica(synced, g, step=20) for _ in range(replicas)]
    got, stats = merge_replicas(synced, reps, init_of, DIM, policy)
    keys, scores, rows, evicted = reference_merge(synced, reps, policy)
    assert torch.equal(got.keys, keys), (got.keys.view(-1, WAYS), keys.view(-1, WAYS))
    assert torch.equal(got.scores, scores)
    torch.testing.assert_close(got.rows, rows, rtol=0, atol=1e-6)
    assert stats.sync_evictions == evicted
    assert stats.ids == int(torch.unique(torch.cat([r.keys for r in reps])).gt(-1).sum())


def test_merge_evicts_over_capacity():
    """A bucket whose replicas each filled their free ways with other new ids keeps
    WAYS of them, by the merged ranking."""
    g = torch.Generator().manual_seed(7)
    synced = synced_shard(g)
    reps = [trained_replica(synced, g, step=20) for _ in range(3)]
    _, stats = merge_replicas(synced, reps, init_of, DIM, EvictionPolicy.LRU)
    assert stats.sync_evictions > 0


def test_unchanged_replicas_merge_to_themselves():
    g = torch.Generator().manual_seed(3)
    synced = synced_shard(g)
    got, stats = merge_replicas(synced, [synced, synced], init_of, DIM, EvictionPolicy.LRU)
    assert torch.equal(got.keys, synced.keys)
    assert torch.equal(got.scores, synced.scores)
    assert torch.equal(got.rows, synced.rows)
    assert stats.sync_evictions == 0
