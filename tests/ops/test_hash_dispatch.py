"""``dispatch.index_bucket`` / ``dispatch.route_bucket`` (native on the CPU where the
library is built) give the torch path's bits: odd sizes, the extreme ids, odd bucket
counts, non-contiguous ids."""

import pytest
import torch

from torchrec_kvemb import dispatch
from torchrec_kvemb.ops import hashing


@pytest.mark.parametrize("n", [0, 1, 7, 1001])
@pytest.mark.parametrize("num_buckets", [1, 3, 24, 4096, 125_001])
def test_hash_dispatch_equals_torch(n, num_buckets):
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(0, 2**63 - 1, (n,), generator=g)
    if n:
        ids[0], ids[-1] = 0, 2**63 - 1
    for strided in (ids, torch.stack([ids, ids], dim=1)[:, 0]):
        want = hashing.route_bucket(strided, num_buckets)
        assert torch.equal(dispatch.route_bucket(strided, num_buckets), want)
        want = hashing.index_bucket(strided, num_buckets)
        assert torch.equal(dispatch.index_bucket(strided, num_buckets), want)
