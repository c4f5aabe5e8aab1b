"""``HostTier.exchange``: a growing host tier trading rows with a table's arrays in
one native call (``kvemb::host_exchange``), where the call places the evicted ids
itself, and where it finds no room for one (a full main bucket over a full stash
bucket) and the tier places them first (its stash grows), with nothing lost."""

from __future__ import annotations

import pytest
import torch

from torchrec_kvemb import dispatch, native_lib
from torchrec_kvemb.host_tier import HostTier
from torchrec_kvemb.ops.hashing import index_bucket
from torchrec_kvemb.options import WAYS, HostTierOptions

DIM, STATE = 5, 1


def _ids_in(bucket: int, buckets: int, n: int, start: int, stash: tuple[int, int] | None = None):
    """``n`` ids from ``start`` on whose index bucket among ``buckets`` is ``bucket``
    (and, with ``stash`` = (its bucket, its buckets), whose stash bucket is that)."""
    out, i = [], start
    while len(out) < n:
        ids = torch.arange(i, i + 50_000)
        hit = index_bucket(ids, buckets) == bucket
        if stash is not None:
            hit &= index_bucket(ids, stash[1]) == stash[0]
        out.extend(ids[hit].tolist())
        i += 50_000
    return torch.tensor(out[:n])


def _tier_with(*batches: torch.Tensor) -> HostTier:
    """A growing host tier given ``batches`` of ids, one ``put`` each."""
    tier = HostTier("t", DIM, STATE, HostTierOptions())
    for ids in batches:
        tier.reserve(ids.numel())
        n = ids.numel()
        rows = torch.arange(n * (DIM + STATE), dtype=torch.float32).view(n, -1) + ids[0]
        tier.put(ids, torch.arange(n), torch.zeros(n, dtype=torch.int64), rows)
    return tier


def _exchange(tier: HostTier, down_ids: torch.Tensor, up_ids: torch.Tensor):
    """Rows 0.. of a table go down as ``down_ids``; ``up_ids`` come up to the rows
    they free. Returns the table's arrays before and after."""
    weights = torch.randn(23, DIM, generator=torch.Generator().manual_seed(1))
    state = torch.rand(23, STATE, generator=torch.Generator().manual_seed(2))
    before = weights.clone(), state.clone()
    n = down_ids.numel()
    tier.reserve(n)
    up_slots = tier.lookup(up_ids)
    tier.exchange(
        weights, state, torch.arange(n), down_ids, torch.arange(100, 100 + n),
        torch.zeros(n, dtype=torch.int64), up_ids, up_slots, torch.arange(up_ids.numel()),
    )  # fmt: skip
    return before, (weights, state)


def _check(tier: HostTier, down_ids, up_ids, held_rows, before, after) -> None:
    """The down rows are held with their memory scores, the up rows landed and left."""
    weights, state = before
    slots = tier.lookup(down_ids)
    assert bool((slots >= 0).all())
    scores, rows, ok = tier.fetch(down_ids, slots)
    assert bool(ok.all())
    n = down_ids.numel()
    assert torch.equal(rows, torch.cat([weights[:n], state[:n]], dim=1))
    assert torch.equal(scores, torch.arange(100, 100 + n))
    assert bool((tier.lookup(up_ids) < 0).all())
    p = up_ids.numel()
    assert torch.equal(torch.cat([after[0][:p], after[1][:p]], dim=1), held_rows)


def test_the_call_places_the_evicted_ids():
    """The usual step: one native call, no ``NoRoomError``; rows and scores in place."""
    held = torch.arange(1000, 1040)
    tier = _tier_with(held)
    up = held[[3, 17, 30]]
    held_rows = tier.fetch(up, tier.lookup(up))[1]
    down = torch.arange(5000, 5011)
    size = tier.host_size
    before, after = _exchange(tier, down, up)
    _check(tier, down, up, held_rows, before, after)
    assert tier.host_size == size + down.numel() - up.numel()
    assert tier.metrics()["host_writes"] == held.numel() + down.numel()


def test_no_room_in_the_call_places_them_first(monkeypatch):
    """An evicted id whose main bucket and stash bucket are full: the native call
    refuses (nothing written), the tier places the ids (its stash grows) and the
    exchange runs; nothing is lost."""
    tier = _tier_with(torch.arange(1, 2))
    main_buckets, stash_buckets = (
        tier._index._main.index.num_buckets,
        tier._index._stash.index.num_buckets,
    )
    in_main = _ids_in(0, main_buckets, WAYS, 10)
    in_stash = _ids_in(0, main_buckets, WAYS, 10_000_000, stash=(0, stash_buckets))
    tier = _tier_with(in_main, in_stash)  # main bucket 0 full, then stash bucket 0
    assert tier._index.probe(in_stash).min() >= tier._index.main_slots
    down = torch.cat(
        [torch.arange(7000, 7004), _ids_in(0, main_buckets, 1, 20_000_000, (0, stash_buckets))]
    )
    up = in_main[:2]
    held_rows = tier.fetch(up, tier.lookup(up))[1]
    refused = []
    call = dispatch.host_exchange

    def spy(*args):
        try:
            call(*args)
        except native_lib.NoRoomError:
            refused.append(True)
            raise

    monkeypatch.setattr(dispatch, "host_exchange", spy)
    before, after = _exchange(tier, down, up)
    assert refused == [True]
    _check(tier, down, up, held_rows, before, after)
    everyone = torch.cat([in_main[2:], in_stash, down])
    assert bool((tier.lookup(everyone) >= 0).all())


def test_a_bounded_tier_does_not_exchange_rows():
    """A host tier with a capacity may evict inside ``put``: it keeps the buffered
    path (``exchanges_rows`` False) and refuses an exchange, changing nothing."""
    tier = HostTier("t", DIM, STATE, HostTierOptions(capacity=3 * WAYS))
    assert not tier.exchanges_rows
    assert _tier_with(torch.arange(5)).exchanges_rows
    with pytest.raises(RuntimeError, match="bounded host tier does not exchange rows"):
        _exchange(tier, torch.arange(4), torch.empty(0, dtype=torch.int64))
    assert tier.host_size == 0
