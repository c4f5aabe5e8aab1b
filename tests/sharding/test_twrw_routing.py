"""Table-row-wise routing in one process (fake process group): which rank each id
is sent to (bags and sequences), the buckets each rank owns, bad plans and options."""

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torchrec.distributed.sharding.twrw_sharding import TwRwSparseFeaturesDist
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb import KVEmbeddingCollectionSharder, KVTableOptions
from torchrec_kvemb.ops.hashing import route_bucket
from torchrec_kvemb.sharding import KV_COMPUTE_KERNEL, KVEmbeddingBagCollectionSharder
from torchrec_kvemb.sharding.twrw import (
    KVTwRwSparseFeaturesDist,
    check_node_buckets,
    node_ranks,
)
from torchrec_kvemb.sharding.twrw_sequence import KVTwRwSequenceFeaturesDist, node_major_order
from torchrec_kvemb.state_dict.layout import sharded_layouts, table_owned_buckets

TWRW = "table_row_wise"


@pytest.fixture
def fake_pg(request):
    """A fake process group of ``request.param`` ranks (no communication)."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=request.param)
    try:
        yield dist.GroupMember.WORLD
    finally:
        dist.destroy_process_group()


def _batch(features: list[str], stride: int, weighted: bool) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(7)
    lengths = torch.randint(0, 6, (len(features) * stride,), generator=g)
    ids = torch.randint(0, 2**62, (int(lengths.sum()),), generator=g)
    ids[::4] = torch.arange(ids[::4].numel())  # small ids too
    weights = torch.rand(ids.numel(), generator=g) + 0.25 if weighted else None
    return KeyedJaggedTensor.from_lengths_sync(features, ids, lengths, weights=weights)


def _expected(kjt, node_of, num_buckets, mean, local, world):
    """Per destination rank, per feature of its node: lengths, ids, weights, by loops."""
    lengths = kjt.lengths().tolist()
    ids = kjt.values()
    weights = kjt.weights_or_none()
    stride = kjt.stride()
    per_rank = {r: [] for r in range(world)}
    start = 0
    for f, key in enumerate(kjt.keys()):
        g = num_buckets[f]
        owner = (route_bucket(ids, g) // (g // local)).tolist()
        bags = []
        for b in range(stride):
            n = lengths[f * stride + b]
            bags.append(list(range(start, start + n)))
            start += n
        for local_rank in range(local):
            rank = node_of[f] * local + local_rank
            lens, got, w = [], [], []
            for bag in bags:
                mine = [i for i in bag if owner[i] == local_rank]
                lens.append(len(mine))
                got += [int(ids[i]) for i in mine]
                base = [1.0 if weights is None else float(weights[i]) for i in mine]
                if mean[f]:
                    w += [float(torch.tensor(x) / max(len(bag), 1)) for x in base]
                else:
                    w += base
            per_rank[rank].append((key, lens, got, w))
    return per_rank


@pytest.mark.parametrize(
    "fake_pg, local",
    [pytest.param(4, 2, id="2-nodes-of-2"), pytest.param(6, 3, id="2-nodes-of-3")],
    indirect=["fake_pg"],
)
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_input_dist_sends_each_id_to_the_local_rank_owning_its_bucket(fake_pg, local, weighted):
    world = fake_pg.size()
    # node 0: features a, b (one table of 2 features) and c; node 1: feature d (MEAN)
    features = ["a", "b", "c", "d"]
    node_of = [0, 0, 0, 1]
    num_buckets = [local * 32, local * 32, local * 5, local * 7]
    mean = [False, False, False, True]
    features_per_rank = [3] * local + [1] * local
    input_dist = KVTwRwSparseFeaturesDist(
        fake_pg, local, features_per_rank, num_buckets, mean, device=torch.device("cpu")
    )
    sent = []

    class Capture(torch.nn.Module):
        def forward(self, routed: KeyedJaggedTensor) -> None:
            sent.append(routed)

    input_dist._dist = Capture()
    kjt = _batch(features, stride=5, weighted=weighted)
    input_dist(kjt)
    (routed,) = sent
    expected = _expected(kjt, node_of, num_buckets, mean, local, world)
    want_keys = [key for r in range(world) for key, *_ in expected[r]]
    assert routed.keys() == want_keys
    lengths = routed.lengths().view(-1, 5)
    values = torch.split(routed.values(), routed.length_per_key())
    weights = torch.split(routed.weights(), routed.length_per_key())
    k = 0
    for r in range(world):
        for key, lens, ids, w in expected[r]:
            assert lengths[k].tolist() == lens, (r, key)
            assert torch.equal(values[k], torch.tensor(ids, dtype=torch.int64)), (r, key)
            assert torch.equal(weights[k], torch.tensor(w, dtype=torch.float32)), (r, key)
            k += 1


@pytest.mark.parametrize(
    "ranks, local_rank_of",
    [
        pytest.param([2, 3], {2: 0, 3: 1}, id="node-1-of-2"),
        pytest.param([0, 1, 2], {}, id="one-node-of-3"),
    ],
)
def test_each_rank_of_the_node_owns_its_bucket_range(ranks, local_rank_of):
    g = 90 if len(ranks) == 3 else 96
    world = 4 if len(ranks) == 2 else 3
    owned = {
        r: table_owned_buckets(g, TWRW, r, world, ranks, holds_table=r in ranks)
        for r in range(world)
    }
    per = g // len(ranks)
    for r in range(world):
        if r in ranks:
            lo = ranks.index(r) * per
            assert owned[r] == (lo, lo + per)
        else:
            assert owned[r] is None
    covered = sorted(o for o in owned.values() if o is not None)
    assert covered[0][0] == 0 and covered[-1][1] == g
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
    # The layouts a sharded collection gives: off the node, no table and no buckets.
    config = EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=10, feature_names=["f"])
    options = {"t": KVTableOptions(capacity=64, total_num_buckets=g)}
    for r in range(world):
        (layout,) = sharded_layouts([config], options, {"t": TWRW}, {}, {}, r, world, {"t": ranks})
        assert (layout.sharding, layout.owned) == (TWRW, owned[r])
        ids = torch.arange(1000) * 7919
        if owned[r] is None:
            assert not layout.owns(ids).any()
        else:
            bucket = route_bucket(ids, g)
            assert torch.equal(layout.owns(ids), (bucket >= owned[r][0]) & (bucket < owned[r][1]))


def test_bad_plans_and_options_name_the_table():
    with pytest.raises(ValueError, match=r"table 'user'.*all ranks of one node \[2, 3\]"):
        node_ranks("user", [2], local_size=2, world_size=4)
    with pytest.raises(ValueError, match=r"table 'user'.*all ranks of one node \[0, 1\]"):
        node_ranks("user", [1, 2], local_size=2, world_size=4)
    with pytest.raises(ValueError, match=r"table 'user'.*world size 6.*local world size 4"):
        node_ranks("user", [0, 1, 2, 3], local_size=4, world_size=6)
    assert node_ranks("user", [2, 3], local_size=2, world_size=4) == [2, 3]
    with pytest.raises(ValueError, match=r"table 'item'.*total_num_buckets.*multiple of 3, got 64"):
        check_node_buckets("item", 64, 3)


@pytest.mark.parametrize("fake_pg", [pytest.param(4, id="4-ranks")], indirect=True)
def test_input_dist_refuses_buckets_the_node_cannot_split(fake_pg):
    with pytest.raises(ValueError, match="multiples of the local world size 2"):
        KVTwRwSparseFeaturesDist(fake_pg, 2, [1, 1, 0, 0], [63], [False])


def test_both_sharders_offer_table_row_wise_for_kv_tables():
    for sharder in (
        KVEmbeddingBagCollectionSharder({"kv": KVTableOptions(capacity=64)}),
        KVEmbeddingCollectionSharder({"kv": KVTableOptions(capacity=64)}),
    ):
        assert TWRW in sharder.kv_sharding_types and TWRW in sharder.sharding_types("cpu")
        assert KV_COMPUTE_KERNEL in sharder.compute_kernels(TWRW, "cpu")


@pytest.mark.parametrize("fake_pg", [pytest.param(6, id="6-ranks")], indirect=True)
@pytest.mark.parametrize(
    "features_per_rank, local",
    [
        pytest.param([3, 3, 1, 1, 2, 2], 2, id="3-nodes-of-2"),
        pytest.param([2, 2, 2, 4, 4, 4], 3, id="2-nodes-of-3"),
    ],
)
def test_node_major_order_is_torchrecs_table_row_wise_shuffle(fake_pg, features_per_rank, local):
    stock = TwRwSparseFeaturesDist(
        fake_pg,
        local,
        features_per_rank,
        feature_hash_sizes=[local] * sum(features_per_rank[::local]),
    )
    assert node_major_order(features_per_rank, local) == stock._sf_staggered_shuffle


@pytest.mark.parametrize("fake_pg", [pytest.param(4, id="4-ranks")], indirect=True)
def test_sequence_input_dist_records_where_each_id_went(fake_pg):
    features, node_of, num_buckets = ["a", "b", "c"], [0, 0, 1], [64, 64, 10]
    input_dist = KVTwRwSequenceFeaturesDist(fake_pg, 2, [2, 2, 1, 1], num_buckets)
    sent = []

    class Capture(torch.nn.Module):
        def forward(self, routed: KeyedJaggedTensor) -> None:
            sent.append(routed)

    input_dist._dist = Capture()
    kjt = _batch(features, stride=7, weighted=False)
    input_dist(kjt)
    (routed,) = sent
    expected = _expected(kjt, node_of, num_buckets, [False] * 3, 2, 4)
    assert routed.keys() == [key for r in range(4) for key, *_ in expected[r]]
    want_ids = [i for r in range(4) for _, _, ids, _ in expected[r] for i in ids]
    assert torch.equal(routed.values(), torch.tensor(want_ids, dtype=torch.int64))
    # The output dist puts row unbucketize_permute[i] of what was sent back as id i's.
    assert torch.equal(routed.values()[input_dist.unbucketize_permute_tensor], kjt.values())


@pytest.mark.parametrize("fake_pg", [pytest.param(4, id="4-ranks")], indirect=True)
def test_input_dist_refuses_a_batch_size_per_feature(fake_pg):
    input_dist = KVTwRwSparseFeaturesDist(fake_pg, 2, [1, 1, 1, 1], [64, 64], [False, False])
    vbe = KeyedJaggedTensor(
        keys=["a", "b"],
        values=torch.arange(6),
        lengths=torch.tensor([1, 2, 1, 1, 1]),
        stride_per_key_per_rank=[[2], [3]],
    )
    with pytest.raises(ValueError, match="table_row_wise KV tables: variable batch size"):
        input_dist(vbe)
