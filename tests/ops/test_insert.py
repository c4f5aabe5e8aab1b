"""Semantics of the torch find-or-insert, on hand-checked tiny tables.

Most tables have one bucket (every id lands in it) and 4 ways, so the
expected outcome can be read off the ranking rule: stored entries hit by the
batch first, then score desc, then new before stored, then id asc; the first
``ways`` candidates stay.
"""

from __future__ import annotations

import pytest
import torch

from torchrec_kvemb.ops.hashing import INT64_MAX
from torchrec_kvemb.ops.insert import insert_torch
from torchrec_kvemb.ops.probe import probe_torch
from torchrec_kvemb.options import WAYS


def table(keys: list[int], scores: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A one-bucket table."""
    return torch.tensor([keys], dtype=torch.int64), torch.tensor([scores], dtype=torch.int64)


def t(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def test_miss_into_empty_ways_in_rank_order() -> None:
    keys, scores = table([-1, 7, -1, -1], [0, 3, 0, 0])
    out = insert_torch(keys, scores, t([40, 41]), t([1, 2]), False, False)
    # 41 ranks first (score 2), so it takes the lowest free way.
    assert out.slots.tolist() == [2, 0]
    assert out.inserted.tolist() == [True, True] and out.hit.tolist() == [False, False]
    assert keys.tolist() == [[41, 7, 40, -1]] and scores.tolist() == [[2, 3, 1, 0]]
    assert out.evicted_ids.numel() == 0


def test_lru_eviction_picks_lowest_score() -> None:
    keys, scores = table([10, 11, 12, 13], [5, 3, 7, 4])
    out = insert_torch(keys, scores, t([20]), t([8]), False, False)
    assert out.evicted_ids.tolist() == [11] and out.evicted_slots.tolist() == [1]
    assert out.slots.tolist() == [1] and out.inserted.tolist() == [True]
    assert keys.tolist() == [[10, 20, 12, 13]] and scores.tolist() == [[5, 8, 7, 4]]


def test_new_id_below_every_stored_score_is_rejected() -> None:
    keys, scores = table([10, 11, 12, 13], [5, 3, 7, 4])
    out = insert_torch(keys, scores, t([20]), t([2]), False, False)
    assert out.slots.tolist() == [-1] and out.inserted.tolist() == [False]
    assert out.evicted_ids.numel() == 0
    assert keys.tolist() == [[10, 11, 12, 13]]


def test_tie_new_beats_stored() -> None:
    keys, scores = table([10, 11, 12, 13], [5, 5, 5, 5])
    out = insert_torch(keys, scores, t([3]), t([5]), False, False)
    # 3 ties the stored ids at 5 and ranks above them; the largest stored id leaves.
    assert out.slots.tolist() == [3] and out.evicted_ids.tolist() == [13]
    assert keys.tolist() == [[10, 11, 12, 3]]


def test_tie_among_stored_larger_id_is_evicted() -> None:
    keys, scores = table([13, 11, 12, 10], [2, 2, 9, 9])
    out = insert_torch(keys, scores, t([50]), t([5]), False, False)
    assert out.evicted_ids.tolist() == [13] and out.evicted_slots.tolist() == [0]
    assert keys.tolist() == [[50, 11, 12, 10]]


def test_tie_among_new_smaller_id_wins() -> None:
    keys, scores = table([10, 11, 12, -1], [9, 9, 9, 0])
    out = insert_torch(keys, scores, t([31, 30]), t([5, 5]), False, False)
    assert out.slots.tolist() == [-1, 3]
    assert out.inserted.tolist() == [False, True]


def test_winners_take_freed_and_empty_ways_ascending_in_rank_order() -> None:
    keys, scores = table([10, -1, 12, -1], [1, 0, 9, 0])
    out = insert_torch(keys, scores, t([40, 41, 42]), t([5, 8, 6]), False, False)
    # Ranking 12(9) 41(8) 42(6) 40(5) | 10(1): 10 leaves; free ways 0, 1, 3.
    assert out.evicted_ids.tolist() == [10] and out.evicted_slots.tolist() == [0]
    assert out.slots.tolist() == [3, 0, 1]
    assert keys.tolist() == [[41, 42, 12, 40]] and scores.tolist() == [[8, 6, 9, 5]]


def test_hit_updates_score_before_competing() -> None:
    keys, scores = table([10, 11, 12, 13], [1, 5, 5, 5])
    # 10 is seen again (score 1 -> 6), so it is no longer the lowest: 11, 12, 13 tie
    # at 5 and the largest id, 13, leaves.
    out = insert_torch(keys, scores, t([10, 20]), t([6, 6]), False, False)
    assert out.hit.tolist() == [True, False]
    assert out.slots.tolist() == [0, 3] and out.evicted_ids.tolist() == [13]
    assert keys.tolist() == [[10, 11, 12, 20]] and scores.tolist() == [[6, 5, 5, 6]]


def test_accumulate_adds_to_hit_scores() -> None:
    keys, scores = table([10, 11, -1, -1], [3, 4, 0, 0])
    out = insert_torch(keys, scores, t([11, 10, 20]), t([1, 2, 1]), True, False)
    assert out.hit.tolist() == [True, True, False]
    assert scores.tolist() == [[5, 5, 1, 0]] and keys.tolist() == [[10, 11, 20, -1]]


def test_keep_existing_rejects_when_full() -> None:
    keys, scores = table([10, 11, 12, 13], [0, 0, 0, 0])
    out = insert_torch(keys, scores, t([20, 21]), t([INT64_MAX, 100]), False, True)
    assert out.slots.tolist() == [-1, -1] and out.inserted.tolist() == [False, False]
    assert out.evicted_ids.numel() == 0
    assert keys.tolist() == [[10, 11, 12, 13]] and scores.tolist() == [[0, 0, 0, 0]]


def test_keep_existing_fills_empty_ways_only() -> None:
    keys, scores = table([10, -1, 12, 13], [0, 0, 0, 0])
    out = insert_torch(keys, scores, t([20, 21]), t([7, 9]), False, True)
    assert out.slots.tolist() == [-1, 1] and out.evicted_ids.numel() == 0
    assert keys.tolist() == [[10, 21, 12, 13]]


def test_hit_keeps_its_row_whatever_its_score() -> None:
    keys, scores = table([10, 11, 12, 13], [5, 5, 5, 5])
    # 10 is a hit with new score 0, below two new ids at 9: hits are protected
    # within their batch, so the new ids take the ways of 13 and 12 instead.
    out = insert_torch(keys, scores, t([10, 20, 21]), t([0, 9, 9]), False, False)
    assert out.hit.tolist() == [True, False, False]
    assert out.slots.tolist() == [0, 2, 3]
    assert sorted(out.evicted_ids.tolist()) == [12, 13]
    assert keys.tolist() == [[10, 11, 20, 21]]


@pytest.mark.parametrize("accumulate", [False, True], ids=["assign", "accumulate"])
@pytest.mark.parametrize("keep_existing", [False, True], ids=["evict", "keep-existing"])
def test_invariants_under_churn(accumulate: bool, keep_existing: bool) -> None:
    """Ids stay unique in keys; a returned slot holds its id; evicted ids are gone."""
    gen = torch.Generator().manual_seed(3)
    keys = torch.full((5, WAYS), -1, dtype=torch.int64)
    scores = torch.zeros((5, WAYS), dtype=torch.int64)
    for _ in range(8):
        ids = torch.randperm(400, generator=gen)[:120].to(torch.int64)
        values = torch.randint(0, 6, (120,), generator=gen)
        before = set(keys[keys >= 0].tolist())
        out = insert_torch(keys, scores, ids, values, accumulate, keep_existing)
        stored = keys[keys >= 0]
        assert stored.unique().numel() == stored.numel(), "an id is stored twice"
        held = out.slots >= 0
        assert torch.equal(keys.view(-1)[out.slots[held]], ids[held]), "slot holds another id"
        assert torch.equal(probe_torch(keys, ids), out.slots), "probe disagrees with slots"
        assert torch.equal(out.hit, torch.tensor([i in before for i in ids.tolist()]))
        assert not bool((out.inserted & out.hit).any())
        assert bool(held[out.inserted].all())
        assert not bool(torch.isin(out.evicted_ids, stored).any()), "evicted id still stored"
        assert bool((keys.view(-1)[out.evicted_slots] >= 0).all()), "evicted slot not reused"
        if keep_existing:
            assert out.evicted_ids.numel() == 0


@pytest.mark.parametrize("accumulate", [False, True], ids=["assign", "accumulate"])
@pytest.mark.parametrize("keep_existing", [False, True], ids=["evict", "keep-existing"])
def test_pairwise_and_sorting_rankers_agree(accumulate, keep_existing, monkeypatch) -> None:
    """Full buckets are ranked pairwise (few new ids) or by sorts (many): same bits."""
    import torchrec_kvemb.ops.insert as insert_module

    tables = []
    for _ in range(2):
        tables.append(
            (torch.full((5, WAYS), -1, dtype=torch.int64), torch.zeros(5, WAYS, dtype=torch.int64))
        )
    gen = torch.Generator().manual_seed(11)
    for step in range(12):
        ids = torch.unique(
            torch.randint(0, 400, (int(torch.randint(5, 120, (1,), generator=gen)),), generator=gen)
        )
        values = torch.randint(0, 6, ids.shape, generator=gen)
        outs = []
        for limit, (keys, scores) in zip((insert_module._DENSE_MAX_NEW, 0), tables):
            monkeypatch.setattr(insert_module, "_DENSE_MAX_NEW", limit)
            outs.append(insert_torch(keys, scores, ids, values, accumulate, keep_existing))
        a, b = outs
        assert torch.equal(tables[0][0], tables[1][0]), f"keys differ at step {step}"
        assert torch.equal(tables[0][1], tables[1][1]), f"scores differ at step {step}"
        assert torch.equal(a.slots, b.slots) and torch.equal(a.inserted, b.inserted)
        order_a, order_b = a.evicted_slots.argsort(), b.evicted_slots.argsort()
        assert torch.equal(a.evicted_slots[order_a], b.evicted_slots[order_b])
        assert torch.equal(a.evicted_ids[order_a], b.evicted_ids[order_b])
    assert tables[0][0].ge(0).all(), "the churn never filled the table"
