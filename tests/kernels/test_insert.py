"""The Triton find-or-insert (interpreter, CPU tensors) matches the torch path bit for bit.

Each case runs a few consecutive batches on one table; the two implementations
evolve their own copy of it and are compared after every batch: keys, scores,
slots, hit, inserted, and the evicted (id, slot) pairs sorted by slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.kernels.checks import assert_same
from torchrec_kvemb.contracts import InsertResult
from torchrec_kvemb.kernels.insert import insert_triton
from torchrec_kvemb.ops.hashing import INT64_MAX, index_bucket
from torchrec_kvemb.ops.insert import insert_torch
from torchrec_kvemb.options import WAYS


def by_slot(result: InsertResult) -> tuple[torch.Tensor, torch.Tensor]:
    order = torch.argsort(result.evicted_slots)
    return result.evicted_ids[order], result.evicted_slots[order]


def check_batch(
    tag: str,
    tables: tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    ids: torch.Tensor,
    values: torch.Tensor,
    accumulate: bool,
    keep_existing: bool,
) -> InsertResult:
    (keys_t, scores_t), (keys_k, scores_k) = tables
    want = insert_torch(keys_t, scores_t, ids, values, accumulate, keep_existing)
    got = insert_triton(keys_k, scores_k, ids, values, accumulate, keep_existing)
    for field in ("slots", "hit", "inserted"):
        assert_same(f"{tag} {field}", getattr(got, field), getattr(want, field))
    got_ids, got_slots = by_slot(got)
    want_ids, want_slots = by_slot(want)
    assert_same(f"{tag} evicted_slots", got_slots, want_slots)
    assert_same(f"{tag} evicted_ids", got_ids, want_ids)
    assert_same(f"{tag} keys", keys_k, keys_t)
    assert_same(f"{tag} scores", scores_k, scores_t)
    return want


@dataclass(frozen=True)
class Case:
    num_buckets: int
    batch: int  # ids per batch
    rounds: int  # consecutive batches on the same table
    universe: int  # batches draw their ids from this many ids (repeats make hits)
    max_score: int  # scores drawn from [0, max_score): small values make ties
    ways: int = WAYS
    base: int = 0  # ids are base + [0, universe)
    lru: bool = False  # score = round number, as the LRU policy does
    prefill: float = 0.0  # fill the table with this fraction of its ways first


CASES = {
    "empty-one-batch-7x16": Case(7, 200, 1, 1000, 1000),
    "prefilled-half-3x16": Case(3, 37, 3, 400, 100, prefill=0.5),
    "churn-7x16": Case(7, 150, 6, 500, 50),
    "churn-ties-3x16": Case(3, 61, 6, 200, 3),
    "lru-churn-5x16": Case(5, 97, 6, 300, 0, lru=True),
    "one-bucket-overflow": Case(1, 45, 4, 120, 10),
    "one-bucket-all-ties": Case(1, 40, 3, 80, 1),
    "odd-ways4-11x4": Case(11, 71, 5, 200, 5, ways=4),
    "near-int64-max-7x16": Case(7, 131, 4, 400, 20, base=INT64_MAX - 399),
    "overflow-few-buckets": Case(3, 301, 2, 301, 1000),
}


def _run(case: Case, accumulate: bool, keep_existing: bool, seed: int) -> int:
    gen = torch.Generator().manual_seed(seed)
    shape = (case.num_buckets, case.ways)
    keys = torch.full(shape, -1, dtype=torch.int64)
    scores = torch.zeros(shape, dtype=torch.int64)
    if case.prefill:
        fill_ids = case.base + torch.arange(case.universe, dtype=torch.int64)
        fill_ids = fill_ids[torch.randperm(case.universe, generator=gen)]
        buckets = index_bucket(fill_ids, case.num_buckets)
        for b in range(case.num_buckets):
            mine = fill_ids[buckets == b][: int(case.prefill * case.ways)]
            way = torch.randperm(case.ways, generator=gen)[: mine.numel()]
            keys[b, way] = mine
            scores[b, way] = torch.randint(0, 100, (mine.numel(),), generator=gen)
    tables = ((keys, scores), (keys.clone(), scores.clone()))
    evictions = 0
    for r in range(case.rounds):
        pick = torch.randperm(case.universe, generator=gen)[: case.batch]
        ids = case.base + pick.to(torch.int64)
        if case.lru:
            values = torch.full((ids.numel(),), r + 1, dtype=torch.int64)
        else:
            values = torch.randint(0, max(case.max_score, 1), (ids.numel(),), generator=gen)
        result = check_batch(f"round {r}", tables, ids, values, accumulate, keep_existing)
        evictions += result.evicted_ids.numel()
    return evictions


@pytest.mark.parametrize("keep_existing", [False, True], ids=["evict", "keep-existing"])
@pytest.mark.parametrize("accumulate", [False, True], ids=["assign", "accumulate"])
@pytest.mark.parametrize("name", list(CASES), ids=list(CASES))
def test_insert_matches_torch(name: str, accumulate: bool, keep_existing: bool) -> None:
    evictions = _run(CASES[name], accumulate, keep_existing, seed=len(name))
    if keep_existing:
        assert evictions == 0, "keep_existing must never evict"


def test_cases_exercise_eviction() -> None:
    """The churn cases really evict (else they would test little)."""
    for name in ("churn-7x16", "churn-ties-3x16", "one-bucket-overflow", "near-int64-max-7x16"):
        assert _run(CASES[name], False, False, seed=len(name)) > 0, name


def test_hit_is_never_evicted_by_its_batch() -> None:
    """A hit whose updated score is below new ids keeps its row, on both paths."""
    keys = torch.tensor([[10, 11, 12, 13]], dtype=torch.int64)
    scores = torch.tensor([[5, 5, 5, 5]], dtype=torch.int64)
    tables = ((keys, scores), (keys.clone(), scores.clone()))
    ids = torch.tensor([10, 20, 21], dtype=torch.int64)
    values = torch.tensor([0, 9, 9], dtype=torch.int64)
    result = check_batch("evicted hit", tables, ids, values, False, False)
    assert result.slots[0].item() == 0 and bool(result.hit[0])
    assert 10 not in result.evicted_ids.tolist()


def test_empty_batch_and_all_hits() -> None:
    keys = torch.full((3, WAYS), -1, dtype=torch.int64)
    scores = torch.zeros((3, WAYS), dtype=torch.int64)
    tables = ((keys, scores), (keys.clone(), scores.clone()))
    none = torch.empty(0, dtype=torch.int64)
    check_batch("empty batch", tables, none, none, False, False)
    ids = torch.tensor([5, 17, INT64_MAX, 0], dtype=torch.int64)
    check_batch("first", tables, ids, torch.tensor([1, 2, 3, 4]), True, False)
    result = check_batch("all hits", tables, ids.flip(0), torch.tensor([4, 3, 2, 1]), True, False)
    assert bool(result.hit.all()) and not bool(result.inserted.any())
