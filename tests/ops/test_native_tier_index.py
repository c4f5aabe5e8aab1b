"""The training kernel probing a host tier's index itself (``native.TierIndex``)
against the same kernel given the tier's ids as promotions (``native.TierPromotion``,
probed in Python as ``tiered_lookup._Fetched`` does), bit for bit.

A real unbounded ``HostTier`` holds ids, some of them in its stash (ids of one
main bucket, more than it has ways); the memory index holds other ids. Each
batch mixes memory hits, tier ids (main part and stash) and new ids, repeated.
Both runs start from clones of one memory index.
"""

from __future__ import annotations

import pytest
import torch

from torchrec_kvemb import native_lib
from torchrec_kvemb.contracts import GroupLayout, InitSpec
from torchrec_kvemb.host_tier import HostTier
from torchrec_kvemb.ops import native
from torchrec_kvemb.ops.hashing import index_bucket
from torchrec_kvemb.ops.probe import probe_torch
from torchrec_kvemb.options import WAYS, EvictionPolicy, HostTierOptions
from torchrec_kvemb.slot_index import INITIAL_BUCKETS

LRU, LFU = EvictionPolicy.LRU, EvictionPolicy.LFU
STEP = 17
#: Memory buckets per table: roomy (nothing evicted) or tight (promotions evict).
CAPACITY = {"roomy": 37, "tight": 3}
#: Ids of the memory index, of the tier and new ones: 3k, 3k + 1, 3k + 2 (disjoint).
MEMORY, TIER, NEW = 0, 1, 2


@pytest.fixture(autouse=True)
def build(native_build: str) -> str:
    """Every test runs on each build of the library (tests/ops/conftest.py)."""
    return native_build


def pool(kind: int, n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randperm(20_000, generator=gen)[:n] * 3 + kind


def make_tier(gen: torch.Generator, policy: EvictionPolicy, stash: bool) -> HostTier:
    """An unbounded host tier of 211 ids (``stash``: 29 more of one main bucket,
    more than its ways: 13 or more of them in the stash)."""
    tier = HostTier("t", dim=3, state_dim=1, options=HostTierOptions())
    ids = pool(TIER, 211, gen)
    if stash:
        many = pool(TIER, 20_000, gen)
        ids = torch.cat([ids, many[index_bucket(many, INITIAL_BUCKETS) == 5][:29]]).unique()
    n = ids.numel()
    high = STEP if policy == LRU else 9
    memory_scores = torch.randint(1, high, (n,), generator=gen)
    tier.reserve(n)
    tier.put(ids, memory_scores, torch.randint(0, 50, (n,), generator=gen), torch.randn(n, 4))
    slots = tier.lookup(ids)
    assert bool((slots >= 0).all())
    in_stash = int((slots >= tier.probe_arrays()[0].numel()).sum())
    assert (in_stash >= 13) == stash, f"{in_stash} ids in the stash"
    return tier


def held_ids(tier: HostTier) -> torch.Tensor:
    main_keys, stash_keys = tier.probe_arrays()[:2]
    ids = torch.cat([main_keys.view(-1), stash_keys.view(-1)])
    return ids[ids >= 0]


def memory_index(
    num_buckets: list[int], gen: torch.Generator, policy: EvictionPolicy, fill: float
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """Group keys and scores, tables' buckets ``fill`` full of ``MEMORY`` ids hashed to
    them; each table's ids."""
    keys = torch.full((sum(num_buckets), WAYS), -1, dtype=torch.int64)
    scores = torch.zeros_like(keys)
    held, offset = [], 0
    for nb in num_buckets:
        ids = pool(MEMORY, 4000, gen)
        home = index_bucket(ids, nb)
        mine = []
        for b in range(nb):
            k = min(WAYS, round(fill * WAYS) + int(torch.randint(-2, 1, (1,), generator=gen)))
            here = ids[home == b][:k]
            ways = torch.randperm(WAYS, generator=gen)[: here.numel()]
            keys[offset + b, ways] = here
            high = STEP if policy == LRU else 9
            scores[offset + b, ways] = torch.randint(1, high, (here.numel(),), generator=gen)
            mine.append(here)
        held.append(torch.cat(mine))
        offset += nb
    return keys, scores, held


def pick(ids: torch.Tensor, n: int, gen: torch.Generator) -> torch.Tensor:
    """``n`` of ``ids``, with repeats."""
    return ids[torch.randint(0, ids.numel(), (n,), generator=gen)]


def table_batch(
    gen: torch.Generator, memory: torch.Tensor, tier_ids: torch.Tensor, stash_ids: torch.Tensor
) -> torch.Tensor:
    """Memory hits, tier ids (stash ones among them) and new ids, repeated, shuffled."""
    parts = [pick(memory, 23, gen), pick(tier_ids, 41, gen), pick(pool(NEW, 13, gen), 19, gen)]
    if stash_ids.numel():
        parts.append(pick(stash_ids, 11, gen))
    ids = torch.cat(parts)
    return ids[torch.randperm(ids.numel(), generator=gen)]


def promotion(
    tier: HostTier, keys: torch.Tensor, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The table's ids the tier holds, none in memory (ascending), and their memory
    scores: as ``tiered_lookup._Fetched`` finds them."""
    missed = torch.unique(ids[probe_torch(keys, ids) < 0])
    slots = tier.lookup(missed)
    found = slots >= 0
    scores, _, _ = tier.fetch(missed[found], slots[found])
    return missed[found], scores


def tier_rows(arrays: list[tuple[torch.Tensor, ...] | None]) -> torch.Tensor:
    """``TierIndex.rows``: a table without a tier, a row of zeros."""
    rows = [
        [0] * native.TIER_INDEX_COLUMNS if a is None else native.tier_index_row(*a) for a in arrays
    ]
    return torch.tensor(rows, dtype=torch.int64)


def snapshot(tier: HostTier) -> list[torch.Tensor]:
    return [a.clone() for a in tier.probe_arrays()]


CASES = [
    (policy, capacity, tables, stash)
    for policy in (LRU, LFU)
    for capacity in CAPACITY
    for tables in ("one-table", "two-tables")
    for stash in ("stash", "main-only", "no-stash-array")
]


@pytest.mark.parametrize("threads", [1, 3], ids=lambda t: f"threads{t}")
@pytest.mark.parametrize(
    "policy, capacity, tables, stash", CASES, ids=[f"{c[0].name}-{'-'.join(c[1:])}" for c in CASES]
)
def test_tier_index_matches_promotions(
    policy: EvictionPolicy, capacity: str, tables: str, stash: str, threads: int
) -> None:
    """Same slots, uniques, flags, scores, evictions, metrics and memory index; each
    promoted unique's tier slot is the tier's slot of its id, the others' -1."""
    gen = torch.Generator().manual_seed(CASES.index((policy, capacity, tables, stash)))
    tier = make_tier(gen, policy, stash == "stash")
    T = 1 if tables == "one-table" else 2
    num_buckets = [CAPACITY[capacity], CAPACITY[capacity] + 2][:T]
    fill = 0.3 if capacity == "roomy" else 1.0
    keys, scores, memory = memory_index(num_buckets, gen, policy, fill)
    layout = GroupLayout.of(
        num_buckets, [policy] * T, [InitSpec(t, False, -0.1, 0.1) for t in range(T)]
    )

    held = held_ids(tier)
    main_slots = tier.probe_arrays()[0].numel()
    in_stash = held[tier.lookup(held) >= main_slots]
    # table 0 over the tier; table 1 (no tier) sees some of the tier's ids too: new there
    batches = [table_batch(gen, memory[0], held, in_stash)]
    if T == 2:
        batches.append(table_batch(gen, memory[1], held, torch.empty(0, dtype=torch.int64)))
    ids = torch.cat(batches)
    table_idx = torch.cat([torch.full((b.numel(),), t) for t, b in enumerate(batches)])
    order = torch.randperm(ids.numel(), generator=gen)
    ids, table_idx = ids[order].contiguous(), table_idx[order].contiguous()

    nb0 = num_buckets[0]
    promote_ids, promote_scores = promotion(tier, keys[:nb0], ids[table_idx == 0])
    offsets = None if T == 1 else torch.tensor([0, promote_ids.numel(), promote_ids.numel()])
    arrays = tier.probe_arrays()
    if stash == "no-stash-array":  # a tier without stash entries, given no stash
        assert int((arrays[1] >= 0).sum()) == 0
        empty = torch.empty(0, WAYS, dtype=torch.int64)
        arrays = (arrays[0], empty, arrays[2], empty.clone())
    index = native.TierIndex(tier_rows([arrays] + [None] * (T - 1)), arrays)
    before = snapshot(tier)

    rows = sum(num_buckets) * WAYS
    runs = {}
    for name, tier_arg in (
        ("promotion", native.TierPromotion(promote_ids, promote_scores, offsets)),
        ("index", index),
    ):
        k, s = keys.clone(), scores.clone()
        out = native.lookup_train_group(
            layout, k, s, torch.zeros(rows, 3), torch.zeros(rows, 1), ids, table_idx,
            [STEP] * T, num_threads=threads, tier=tier_arg,
        )  # fmt: skip
        runs[name] = out, k, s
    (a, keys_a, scores_a), (b, keys_b, scores_b) = runs["promotion"], runs["index"]

    for field in native.TrainLookup._fields:
        x, y = getattr(a, field), getattr(b, field)
        if field == "unique_tier_slots":
            assert x is None and y is not None
        else:
            assert torch.equal(x, y), f"{field} differs"
    assert torch.equal(keys_a, keys_b) and torch.equal(scores_a, scores_b)
    for was, now in zip(before, tier.probe_arrays(), strict=True):
        assert torch.equal(was, now), "the kernel only reads the tier"

    # the tier slots of the promoted uniques, and what the cases are meant to cover
    promoted = (b.unique_flags & native.UNIQUE_PROMOTED) != 0
    assert torch.equal(
        b.unique_tier_slots[~promoted], torch.full_like(b.unique_tier_slots[~promoted], -1)
    )
    assert torch.equal(b.unique_tier_slots[promoted], tier.lookup(b.unique_ids[promoted]))
    assert torch.equal(b.unique_table[promoted], torch.zeros_like(b.unique_table[promoted]))
    assert torch.equal(torch.sort(b.unique_ids[promoted]).values, promote_ids)
    assert promote_ids.numel() > 20
    if stash == "stash":
        assert bool((b.unique_tier_slots[promoted] >= main_slots).any()), "stash ids promoted"
    if T == 2:
        again = (b.unique_table == 1) & torch.isin(b.unique_ids, held)
        assert bool(again.any()) and not bool(promoted[again].any()), "no tier in table 1"
    if capacity == "tight":
        assert b.evicted_ids.numel() > 0, "promotions evict"
    else:
        assert b.evicted_ids.numel() == 0

    # a promoted id's score: LRU the step, LFU its batch count plus its memory score
    has_row = promoted & (b.unique_slots >= 0)
    counts = torch.bincount(b.unique_index[b.unique_index >= 0], minlength=b.unique_ids.numel())
    memory_score = promote_scores[torch.searchsorted(promote_ids, b.unique_ids[has_row])]
    want = torch.full_like(memory_score, STEP) if policy == LRU else counts[has_row] + memory_score
    assert torch.equal(b.unique_scores[has_row], want)
    assert bool(has_row.any())


BAD_ROWS = {
    "main-buckets-0": (1, 0),
    "stash-buckets-0": (3, 0),
    "no-main-scores": (4, 0),
    "no-stash-scores": (5, 0),
}


@pytest.mark.parametrize("bad", list(BAD_ROWS))
def test_bad_tier_index_rows_are_refused(bad: str) -> None:
    """A tier index row the kernel cannot read is refused; the memory index is left
    as it was."""
    gen = torch.Generator().manual_seed(5)
    tier = make_tier(gen, LRU, True)
    keys, scores, memory = memory_index([7], gen, LRU, 0.5)
    layout = GroupLayout.of([7], [LRU], [InitSpec(0, False, -0.1, 0.1)])
    arrays = tier.probe_arrays()
    rows = tier_rows([arrays])
    column, value = BAD_ROWS[bad]
    rows[0, column] = value
    ids = table_batch(gen, memory[0], held_ids(tier), torch.empty(0, dtype=torch.int64))
    k, s = keys.clone(), scores.clone()
    with pytest.raises(native_lib.NativeOpError, match="inconsistent"):
        native.lookup_train_group(
            layout, k, s, torch.zeros(7 * WAYS, 3), torch.zeros(7 * WAYS, 1), ids,
            torch.zeros_like(ids), [STEP], num_threads=1, tier=native.TierIndex(rows, arrays),
        )  # fmt: skip
    assert torch.equal(k, keys) and torch.equal(s, scores)


def test_tier_index_rows_are_checked() -> None:
    """``tier_index_row`` refuses arrays of the wrong shape, and a ``TierIndex`` of
    the wrong number of rows is refused."""
    gen = torch.Generator().manual_seed(6)
    tier = make_tier(gen, LRU, True)
    main_keys, stash_keys, main_scores, stash_scores = tier.probe_arrays()
    with pytest.raises(ValueError, match="tier main scores"):
        native.tier_index_row(main_keys, stash_keys, main_scores[:-1], stash_scores)
    layout = GroupLayout.of([7, 5], [LRU, LRU], [InitSpec(0, False, -0.1, 0.1)] * 2)
    arrays = tier.probe_arrays()
    with pytest.raises(ValueError, match="tier index"):
        native.lookup_train_group(
            layout, torch.full((12, WAYS), -1), torch.zeros(12, WAYS, dtype=torch.int64),
            torch.zeros(12 * WAYS, 3), torch.zeros(12 * WAYS, 1), torch.tensor([3]),
            torch.tensor([0]), [STEP, STEP], tier=native.TierIndex(tier_rows([arrays]), arrays),
        )  # fmt: skip
