"""A checkpoint's order of an index's ids (``dispatch.export_order``): the native
kernel equals the torch path bit for bit (ids, slots, counts per routing bucket),
on each build, for odd index sizes, empty, sparse and full indexes, one to many
routing buckets, and ids past 2**44 (the torch path's two-sort branch); the torch
path itself sorts by routing bucket, then id; a stale count is refused."""

import pytest
import torch

from torchrec_kvemb import dispatch, native_lib
from torchrec_kvemb.contracts import ROUTE_SALT
from torchrec_kvemb.ops import native
from torchrec_kvemb.ops.export_order import export_order_torch
from torchrec_kvemb.ops.hashing import route_bucket
from torchrec_kvemb.options import WAYS


def index_keys(buckets: int, fill: float, high: int, seed: int) -> torch.Tensor:
    """Keys ``[buckets, WAYS]``: a ``fill`` share of the slots holds distinct ids."""
    g = torch.Generator().manual_seed(seed)
    slots = buckets * WAYS
    n = int(slots * fill)
    ids = torch.unique(torch.randint(0, high, (2 * n + 8,), generator=g))
    ids = ids[torch.randperm(ids.numel(), generator=g)[:n]]
    keys = torch.full((slots,), -1, dtype=torch.int64)
    keys[torch.randperm(slots, generator=g)[: ids.numel()]] = ids
    return keys.view(buckets, WAYS)


CASES = [
    (37, 0.0, 2**40, 7),
    (37, 0.3, 2**40, 7),
    (101, 1.0, 1000 * 101 * WAYS, 1),
    (101, 0.6, 2**40, 40320),
    (53, 0.5, 2**62, 13),  # ids past 2**44: no room for the bucket above them
    (1, 1.0, 50, 3),
    (211, 0.7, 2**40, 2**20 + 3),
]


@pytest.mark.parametrize(
    "buckets, fill, high, route_buckets", CASES, ids=[f"{c[0]}x{c[1]}-G{c[3]}" for c in CASES]
)
def test_native_equals_torch(native_build, buckets, fill, high, route_buckets):
    keys = index_keys(buckets, fill, high, seed=buckets)
    want = export_order_torch(keys, route_buckets)
    got = native.export_order(keys.view(-1), route_buckets, ROUTE_SALT)
    for name, a, b in zip(("ids", "slots", "counts"), got, want, strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(dispatch.export_order(keys, route_buckets)[1], want[1])


@pytest.mark.parametrize("high", [2**40, 2**62], ids=["one-sort", "two-sorts"])
def test_torch_path_orders_by_bucket_then_id(high):
    keys = index_keys(67, 0.8, high, seed=5)
    ids, slots, counts = export_order_torch(keys, 29)
    flat = keys.view(-1)
    assert torch.equal(flat[slots], ids)
    assert torch.equal(torch.sort(slots).values, (flat >= 0).nonzero().squeeze(1))
    buckets = route_bucket(ids, 29)
    key = [(int(b), int(i)) for b, i in zip(buckets, ids, strict=True)]
    assert key == sorted(key)
    assert torch.equal(counts, torch.bincount(buckets, minlength=29))


def test_a_stale_count_is_refused(native_build):
    keys = index_keys(9, 0.5, 2**40, seed=2).view(-1)
    n = int((keys >= 0).sum())
    out = [torch.empty(n + 1, dtype=torch.int64) for _ in range(2)]
    counts = torch.empty(5, dtype=torch.int64)
    lib = native_lib.load_variant(native_build)[0]
    status = lib.kv_export_order(
        keys.data_ptr(), keys.numel(), ROUTE_SALT, 5, n + 1, out[0].data_ptr(),
        out[1].data_ptr(), counts.data_ptr(),
    )  # fmt: skip
    assert status == 4  # KV_BAD_ARGUMENT
