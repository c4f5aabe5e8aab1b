"""Row-wise routing: route_bucket and owner ranks against a hand reference, the routed
KJT against a loop, and the load balance of stored rows over ranks."""

import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb.ops.hashing import route_bucket
from torchrec_kvemb.sharding import bucketize_kv_features, owner_rank

MASK64 = (1 << 64) - 1


def ref_route_bucket(x: int, num_buckets: int) -> int:
    """MurmurHash3's fmix64 of ``x ^ salt`` on unsigned 64-bit ints, low 63 bits, mod G."""
    x = (x ^ 0x2545F4914F6CDD1D) & MASK64
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & MASK64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & MASK64
    x ^= x >> 33
    return (x & ((1 << 63) - 1)) % num_buckets


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 2**63 - 1, (n,), generator=g)
    edge = torch.tensor([0, 1, 2**31 - 1, 2**32, 2**62, 2**63 - 1, 2**63 - 2])
    return torch.cat([edge, torch.arange(50) * 1536, ids])


@pytest.mark.parametrize("num_buckets", [1, 7, 96, 1024, 1536, 2**31 - 1])
def test_route_bucket_bit_exact(num_buckets):
    ids = _ids(300)
    got = route_bucket(ids, num_buckets)
    want = torch.tensor([ref_route_bucket(int(x), num_buckets) for x in ids])
    assert got.dtype == torch.int64
    assert torch.equal(got, want)


def test_route_bucket_int32_ids_and_per_id_counts():
    ids = torch.tensor([0, 5, 2**31 - 1, 77], dtype=torch.int32)
    counts = torch.tensor([8, 12, 8, 96])
    got = route_bucket(ids, counts)
    want = [ref_route_bucket(int(x), int(g)) for x, g in zip(ids, counts)]
    assert got.tolist() == want


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_owner_rank_is_the_bucket_range(world_size):
    num_buckets = 96
    ids = _ids(500, seed=world_size)
    got = owner_rank(ids, num_buckets, world_size)
    per_rank = num_buckets // world_size
    want = torch.tensor([ref_route_bucket(int(x), num_buckets) // per_rank for x in ids])
    assert torch.equal(got, want)
    assert int(got.min()) >= 0 and int(got.max()) < world_size


def _kjt(weighted: bool, seed: int = 0) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    keys = ["a", "b", "c"]
    stride = 5
    lengths = torch.randint(0, 6, (len(keys) * stride,), generator=g)
    lengths[3] = 0
    total = int(lengths.sum())
    values = _ids(total, seed)  # edge ids first, then random ones
    values = values[torch.randperm(values.numel(), generator=g)[:total]]
    weights = torch.rand(values.numel(), generator=g) + 0.5 if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(
        keys=keys, values=values, lengths=lengths, weights=weights
    )


def _reference(kjt, num_buckets, world_size, mean_pooled):
    """Loop over ranks, features, bags: the ids each rank gets, in order."""
    keys, stride = kjt.keys(), kjt.stride()
    lengths = kjt.lengths().tolist()
    values = kjt.values().tolist()
    weights = kjt.weights_or_none()
    weights = weights.tolist() if weights is not None else [1.0] * len(values)
    bags, start = [], 0
    for n in lengths:
        bags.append(list(range(start, start + n)))
        start += n
    out_lengths, out_values, out_weights = [], [], []
    for rank in range(world_size):
        for f in range(len(keys)):
            g = num_buckets[f]
            for b in range(stride):
                bag = bags[f * stride + b]
                mine = [
                    i for i in bag if ref_route_bucket(values[i], g) // (g // world_size) == rank
                ]
                out_lengths.append(len(mine))
                out_values.extend(values[i] for i in mine)
                for i in mine:
                    w = torch.tensor(weights[i], dtype=torch.float32)
                    if mean_pooled and mean_pooled[f]:
                        w = w / torch.tensor(float(len(bag)))
                    out_weights.append(float(w))
    return out_lengths, out_values, out_weights


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("mean_pooled", [None, [False, True, False]])
def test_bucketize_kv_features_matches_loop(world_size, weighted, mean_pooled):
    kjt = _kjt(weighted, seed=world_size)
    num_buckets = [8, 12, 1024]
    routed = bucketize_kv_features(kjt, num_buckets, world_size, mean_pooled)
    lengths, values, weights = _reference(kjt, num_buckets, world_size, mean_pooled)
    assert routed.keys() == kjt.keys() * world_size
    assert routed.stride() == kjt.stride()
    assert routed.lengths().tolist() == lengths
    assert routed.values().tolist() == values
    if weighted or mean_pooled:
        assert torch.equal(routed.weights(), torch.tensor(weights, dtype=torch.float32))
    else:
        assert routed.weights_or_none() is None


def test_bucketize_kv_features_needs_divisible_bucket_counts():
    with pytest.raises(ValueError, match="multiples of world_size=3"):
        bucketize_kv_features(_kjt(False), [8, 12, 1024], world_size=3)


# ------------------------------------------------------------- load balance
G = 1536  # divisible by every world size below
N = 100_000


def _zipf_ids(draws: int, rows: int = 1_000_000, alpha: float = 1.05) -> torch.Tensor:
    """Zipf-distributed ranks mapped one-to-one into a 2**40 id space."""
    g = torch.Generator().manual_seed(0)
    cdf = torch.cumsum(torch.arange(1, rows + 1, dtype=torch.float64).pow_(-alpha), 0)
    ranks = torch.searchsorted(cdf / cdf[-1], torch.rand(draws, generator=g, dtype=torch.float64))
    return (ranks.clamp_(max=rows - 1) * (0x9E3779B97F4A7C15 - (1 << 64))) & ((1 << 40) - 1)


ID_SETS = {
    "sequential": lambda: torch.arange(N),
    f"stride {G} (= G)": lambda: torch.arange(N) * G,
    "stride 1000": lambda: torch.arange(N) * 1000,
    "zipf 1.05 (500k draws)": lambda: _zipf_ids(500_000),
}


def _imbalance(owners: torch.Tensor, world_size: int) -> float:
    counts = torch.bincount(owners, minlength=world_size).to(torch.float64)
    return float(counts.max() / counts.mean())


def test_stored_rows_are_balanced_over_ranks():
    """max / mean stored rows per rank <= 1.1; ``id % G`` routing shown for contrast."""
    lines = [f"stored rows per rank, max/mean (G={G}); in brackets: id % G routing"]
    worst = 0.0
    for label, make in ID_SETS.items():
        ids = torch.unique(make())
        row = []
        for world_size in (2, 3, 4, 8):
            ratio = _imbalance(owner_rank(ids, G, world_size), world_size)
            modulo = _imbalance((ids % G) // (G // world_size), world_size)
            worst = max(worst, ratio)
            row.append(f"W={world_size}: {ratio:.3f} ({modulo:.2f})")
        lines.append(f"  {label:<24} {ids.numel():>7} ids  " + "  ".join(row))
    print("\n" + "\n".join(lines))
    assert worst <= 1.1
