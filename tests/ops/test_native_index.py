"""The native find-or-insert (``native.insert``) and placement (``native.place``)
against their torch paths, bit for bit.

Every case runs the same unique ids and values through both on copies of one
index and compares the index arrays, slots, hits, insertions and evictions
(the native op returns evictions ascending by slot; the torch path's general
ranker orders them by rank, so evictions are compared as sets of (id, slot)).
Indexes use odd bucket counts, half-full to full buckets, scores with ties.
"""

from __future__ import annotations

import pytest
import torch

from torchrec_kvemb import dispatch
from torchrec_kvemb.ops import native
from torchrec_kvemb.ops.hashing import index_bucket
from torchrec_kvemb.ops.insert import insert_torch
from torchrec_kvemb.ops.place import bulk_load_torch, place_torch
from torchrec_kvemb.options import WAYS
from torchrec_kvemb.validation import KVInputError

MODES = {
    "assign": (False, False),
    "accumulate": (True, False),
    "keep-existing": (False, True),
    "accumulate-keep-existing": (True, True),
}


@pytest.fixture(autouse=True)
def build(native_build: str) -> str:
    return native_build


def random_index(num_buckets: int, fill: float, gen: torch.Generator, pool: int):
    """An index whose buckets hold ids of ``[0, pool)`` that hash to them."""
    keys = torch.full((num_buckets, WAYS), -1, dtype=torch.int64)
    scores = torch.zeros_like(keys)
    ids = torch.randperm(pool, generator=gen)
    home = index_bucket(ids, num_buckets)
    for b in range(num_buckets):
        mine = ids[home == b][:WAYS]
        k = min(mine.numel(), int(torch.binomial(torch.tensor(float(WAYS)), torch.tensor(fill))))
        ways = torch.randperm(WAYS, generator=gen)[:k]
        keys[b, ways] = mine[:k]
        scores[b, ways] = torch.randint(0, 5, (k,), generator=gen)
    return keys, scores


def assert_same(keys, scores, ids, values, accumulate, keep_existing, at=""):
    want_keys, want_scores = keys.clone(), scores.clone()
    want = insert_torch(want_keys, want_scores, ids, values, accumulate, keep_existing)
    got = native.insert(keys, scores, ids, values, accumulate, keep_existing)
    assert torch.equal(keys, want_keys) and torch.equal(scores, want_scores), at
    assert torch.equal(got.slots, want.slots), at
    assert torch.equal(got.hit, want.hit), at
    assert torch.equal(got.inserted, want.inserted), at
    assert torch.equal(got.evicted_slots, torch.sort(got.evicted_slots).values), at
    pairs = lambda r: sorted(zip(r.evicted_slots.tolist(), r.evicted_ids.tolist()))  # noqa: E731
    assert pairs(got) == pairs(want), at
    return got


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("num_buckets", [1, 3, 37])
def test_matches_insert_torch_under_churn(mode: str, num_buckets: int) -> None:
    """Rounds of batches over one index: half new ids, some stored, tied values."""
    accumulate, keep_existing = MODES[mode]
    gen = torch.Generator().manual_seed(num_buckets)
    pool = 40 * num_buckets * WAYS // 16 + 50
    keys, scores = random_index(num_buckets, 0.7, gen, pool)
    for step in range(25):
        n = int(torch.randint(0, 3 * num_buckets * WAYS // 2 + 2, (1,), generator=gen))
        ids = torch.randperm(pool, generator=gen)[:n]
        values = torch.randint(0, 6, (ids.numel(),), generator=gen)
        assert_same(keys, scores, ids, values, accumulate, keep_existing, f"step {step}")


@pytest.mark.parametrize("mode", list(MODES))
def test_more_than_32_new_ids_in_one_bucket(mode: str) -> None:
    """A bucket with 45 new ids (the torch path's sorting ranker) against a full one."""
    accumulate, keep_existing = MODES[mode]
    gen = torch.Generator().manual_seed(3)
    keys, scores = random_index(1, 1.0, gen, 200)
    stored = keys[0][keys[0] >= 0]
    new = torch.tensor([i for i in range(200, 400) if i not in stored.tolist()][:45])
    ids = torch.cat([stored[:5], new])
    values = torch.randint(0, 4, (ids.numel(),), generator=gen)
    got = assert_same(keys, scores, ids, values, accumulate, keep_existing)
    assert int(got.inserted.sum()) > 0 or keep_existing


def test_every_id_of_a_big_batch_matches_across_threads() -> None:
    """327 buckets (several parts), 6k ids: 1 and 3 threads give the same bits."""
    gen = torch.Generator().manual_seed(5)
    keys, scores = random_index(2_051, 0.9, gen, 60_000)
    ids = torch.randperm(60_000, generator=gen)[:6_007]
    values = torch.randint(0, 9, ids.shape, generator=gen)
    k1, s1 = keys.clone(), scores.clone()
    one = native.insert(k1, s1, ids, values, False, False, num_threads=1)
    three = native.insert(keys, scores, ids, values, False, False, num_threads=3)
    assert torch.equal(k1, keys) and torch.equal(s1, scores)
    for a, b in zip(one, three):
        assert torch.equal(a, b)


def test_empty_batch_changes_nothing() -> None:
    keys, scores = random_index(5, 0.5, torch.Generator().manual_seed(0), 300)
    before = keys.clone(), scores.clone()
    got = native.insert(keys, scores, torch.empty(0, dtype=torch.int64),
                        torch.empty(0, dtype=torch.int64), False, False)  # fmt: skip
    assert got.slots.numel() == 0 and got.evicted_ids.numel() == 0
    assert torch.equal(keys, before[0]) and torch.equal(scores, before[1])


def test_negative_id_is_refused_and_nothing_changes() -> None:
    keys, scores = random_index(7, 0.9, torch.Generator().manual_seed(1), 500)
    before = keys.clone(), scores.clone()
    ids = torch.tensor([600, 601, -3, 602])
    with pytest.raises(KVInputError, match="ids must be >= 0"):
        native.insert(keys, scores, ids, torch.ones_like(ids), False, False)
    assert torch.equal(keys, before[0]) and torch.equal(scores, before[1])


def test_dispatch_takes_the_native_op_for_a_cpu_index(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    real = native.insert
    monkeypatch.setattr(native, "insert", lambda *a, **k: calls.append(1) or real(*a, **k))
    keys, scores = random_index(3, 0.5, torch.Generator().manual_seed(2), 100)
    dispatch.insert(keys, scores, torch.tensor([101, 102]), torch.tensor([1, 1]), False, False)
    assert calls == [1]


# ------------------------------------------------------------------ place
@pytest.mark.parametrize("num_buckets", [1, 5, 1_031])
def test_place_matches_place_torch(num_buckets: int) -> None:
    """Absent ids into empty ways, in the given order; a bucket without room for all
    of its ids takes none: rounds until buckets fill, against ``place_torch``."""
    gen = torch.Generator().manual_seed(num_buckets)
    keys, _ = random_index(num_buckets, 0.5, gen, 20 * num_buckets + 40)
    fresh = torch.randperm(200_000, generator=gen) + 10**6  # never in the index
    used, placed, left_out = 0, 0, 0
    for step in range(12):
        n = int(torch.randint(0, 6 * num_buckets + 9, (1,), generator=gen))
        ids = fresh[used : used + n]
        used += n
        want_keys = keys.clone()
        want = place_torch(want_keys, ids)
        got = native.place(keys, ids)
        assert torch.equal(got, want), f"step {step}"
        assert torch.equal(keys, want_keys), f"step {step}"
        placed += int((got >= 0).sum())
        left_out += int((got < 0).sum())
    assert placed > 0 and left_out > 0  # both outcomes were checked


def test_place_negative_id_is_refused_and_nothing_changes() -> None:
    keys, _ = random_index(3, 0.2, torch.Generator().manual_seed(4), 100)
    before = keys.clone()
    with pytest.raises(KVInputError, match="ids must be >= 0"):
        native.place(keys, torch.tensor([10**6, -1]))
    assert torch.equal(keys, before)


# -------------------------------------------------------------- bulk load
@pytest.mark.parametrize("per_bucket", [5.3, 15.9, 21.7], ids=["sparse", "nearly-full", "overflow"])
@pytest.mark.parametrize("num_buckets", [1, 7, 1_031])
def test_bulk_load_matches_bulk_load_torch(per_bucket: float, num_buckets: int) -> None:
    """Unique ids with tied scores into an empty index: the same keys, scores and
    slots (per input id) as the torch path, rows left out where a bucket overflows."""
    gen = torch.Generator().manual_seed(num_buckets)
    n = int(per_bucket * num_buckets)
    ids = torch.randperm(50 * n + 100, generator=gen)[:n] * 7 + 3
    values = torch.randint(0, 4, (n,), generator=gen)
    empty = torch.full((num_buckets, WAYS), -1, dtype=torch.int64)
    want_keys, want_scores = empty.clone(), torch.zeros_like(empty)
    src, slots = bulk_load_torch(want_keys, want_scores, ids, values)
    want = torch.full((n,), -1, dtype=torch.int64)
    want[src if src is not None else torch.arange(n)] = slots
    keys, scores = empty.clone(), torch.zeros_like(empty)
    got = native.bulk_load(keys, scores, ids, values)
    assert torch.equal(got, want)
    assert torch.equal(keys, want_keys) and torch.equal(scores, want_scores)
    if per_bucket > WAYS:
        assert int((got < 0).sum()) > 0  # the overflow branch was compared


# ------------------------------------------------------------ row scatter
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("width", [1, 7, 64], ids=lambda w: f"width{w}")
def test_gather_rows_matches_index_select(width: int, threads: int) -> None:
    """Rows of random slots (repeats included) of a wider array's column block into a
    column block of another (row strides that are not the width), against
    ``index_select``, the same bits on 1, 2 and 3 threads; a slot outside the array
    is refused before anything is written."""
    gen = torch.Generator().manual_seed(width)
    src = torch.randn(3_001, width + 3, generator=gen)[:, 2 : 2 + width]
    slots = torch.randint(0, 3_001, (4_099,), generator=gen)
    base = torch.full((4_099, width + 5), -7.0)
    out = base[:, 1 : 1 + width]
    native.gather_rows(src, slots, out, num_threads=threads)
    assert torch.equal(out, src.index_select(0, slots))
    assert bool((base[:, 0] == -7).all()) and bool((base[:, 1 + width :] == -7).all())
    before = base.clone()
    with pytest.raises(native.NativeOpError, match="gather_rows"):
        native.gather_rows(src, torch.tensor([5, 3_001]), out[:2])
    assert torch.equal(base, before)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("width", [1, 7, 64], ids=lambda w: f"width{w}")
def test_scatter_rows_matches_index_copy(width: int, threads: int) -> None:
    """Rows into random slots of a wider array's column block (a row stride that is
    not the width), against ``index_copy_``; a slot outside the array is refused
    before anything is written."""
    gen = torch.Generator().manual_seed(width)
    base = torch.randn(3_001, width + 3, generator=gen)
    dest = base[:, 1 : 1 + width]  # rows of stride width + 3
    slots = torch.randperm(3_001, generator=gen)[:2_017]
    rows = torch.randn(2_017, width, generator=gen)
    want = dest.clone().index_copy_(0, slots, rows)
    native.scatter_rows(dest, slots, rows, num_threads=threads)
    assert torch.equal(dest, want)
    before = base.clone()
    with pytest.raises(native.NativeOpError, match="scatter_rows"):
        native.scatter_rows(dest, torch.tensor([5, 3_001]), rows[:2])
    assert torch.equal(base, before)
