"""The Triton probe (interpreter, CPU tensors) gives the torch path's slots, bit for bit."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.checks import assert_same
from torchrec_kvemb.kernels.probe import probe_triton
from torchrec_kvemb.ops.hashing import INT64_MAX, index_bucket
from torchrec_kvemb.ops.probe import probe_torch
from torchrec_kvemb.options import WAYS


def fill_table(ids: torch.Tensor, num_buckets: int, ways: int, fill: float, seed: int):
    """Keys with about ``fill`` of each bucket's ways holding ids (from ``ids``), at random ways."""
    gen = torch.Generator().manual_seed(seed)
    keys = torch.full((num_buckets, ways), -1, dtype=torch.int64)
    buckets = index_bucket(ids, num_buckets)
    for b in range(num_buckets):
        mine = ids[buckets == b][: int(fill * ways)]
        way = torch.randperm(ways, generator=gen)[: mine.numel()]
        keys[b, way] = mine
    return keys


CASES = {
    "empty-7x16": (7, WAYS, 0.0, 301, 0),
    "half-3x16": (3, WAYS, 0.5, 257, 0),
    "full-7x16": (7, WAYS, 1.0, 301, 0),
    "full-1x16": (1, WAYS, 1.0, 45, 0),
    "half-37x16": (37, WAYS, 0.5, 333, 0),
    "full-5x4": (5, 4, 1.0, 61, 0),
    "full-3x16-near-int64-max": (3, WAYS, 1.0, 101, INT64_MAX - 1000),
    "no-ids": (3, WAYS, 0.5, 0, 0),
    "one-id": (3, WAYS, 0.5, 1, 0),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_probe_matches_torch(case: str) -> None:
    num_buckets, ways, fill, n, base = CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    universe = base + torch.randperm(1000, generator=gen)[: max(n, 2 * num_buckets * ways)]
    keys = fill_table(universe, num_buckets, ways, fill, seed=n)
    # Half the probed ids come from the table's universe (mostly stored), half are fresh.
    stored_half = universe[torch.randperm(universe.numel(), generator=gen)[: n - n // 2]]
    fresh = torch.randint(0, INT64_MAX, (n // 2,), generator=gen, dtype=torch.int64)
    ids = torch.cat([stored_half, fresh])[torch.randperm(n, generator=gen)]
    want = probe_torch(keys, ids)
    got = probe_triton(keys, ids)
    assert_same("slots", got, want)
    if fill > 0 and n > 1:
        assert bool((want >= 0).any()), "test case should contain stored ids"


def test_probe_int64_max_and_zero() -> None:
    keys = torch.full((3, WAYS), -1, dtype=torch.int64)
    ids = torch.tensor([0, INT64_MAX, INT64_MAX - 1], dtype=torch.int64)
    buckets = index_bucket(ids, 3)
    for way, (i, b) in enumerate(zip(ids.tolist(), buckets.tolist(), strict=True)):
        keys[b, WAYS - 1 - way] = i
    want = probe_torch(keys, ids)
    assert bool((want >= 0).all())
    assert_same("slots", probe_triton(keys, ids), want)
