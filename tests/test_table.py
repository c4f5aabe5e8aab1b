"""KVTable: zero collisions, eviction policies, admission, initial rows, bad input."""

import pytest
import torch

from torchrec_kvemb import EvictionPolicy, Initializer, KVInputError, KVTable, KVTableOptions
from torchrec_kvemb.ops.hashing import index_bucket, route_bucket
from torchrec_kvemb.optimizer import FusedOptimConfig, OptimKind
from torchrec_kvemb.options import WAYS
from torchrec_kvemb.table import bytes_per_row


def _snapshot(table: KVTable) -> list[torch.Tensor]:
    return [t.clone() for t in (table.keys, table.scores, table.weights, table.state)]


def _same_ids_in_bucket(n: int, num_buckets: int, bucket: int = 0, start: int = 0):
    """The first ``n`` ids >= start that fall in index bucket ``bucket``."""
    ids = torch.arange(start, start + 64 * n * num_buckets)
    return ids[index_bucket(ids, num_buckets) == bucket][:n]


@pytest.mark.parametrize("policy", list(EvictionPolicy), ids=lambda p: p.name)
def test_zero_collisions_under_churn(policy):
    table = KVTable("churn", dim=3, options=KVTableOptions(capacity=16 * 5, eviction=policy))
    gen = torch.Generator().manual_seed(0)
    for step in range(40):
        ids = (
            torch.randint(0, 2**62, (53,), generator=gen)
            if step % 2
            else torch.arange(step * 50, step * 50 + 61)
        )
        slots = table.lookup_train(ids, custom_scores=torch.randint(0, 9, (ids.numel(),)))
        stored = slots >= 0
        # every stored id's row is its own: mark rows with the id, read them back
        table.weights[slots[stored]] = ids[stored].to(torch.float32).unsqueeze(1) % 9973
    exported = table.export()
    ids = exported["ids"]
    assert ids.numel() == torch.unique(ids).numel(), "export() ids are not unique"
    assert table.size == ids.numel() <= table.capacity
    rows, found = table.find(ids)
    assert found.all()
    assert torch.equal(rows, (ids.to(torch.float32).unsqueeze(1) % 9973).expand(-1, 3))
    # ids never stored are not found, whatever their bucket
    absent = torch.arange(2**62 + 5, 2**62 + 300)
    assert not table.find(absent)[1].any()
    if policy != EvictionPolicy.NONE:
        assert table.metrics()["evictions"] > 0


def test_lru_evicts_least_recently_used():
    table = KVTable("lru", dim=2, options=KVTableOptions(capacity=WAYS))  # one bucket
    ids = torch.arange(100, 100 + WAYS)
    for i in ids:  # stored one per step: id 100 is the oldest
        table.lookup_train(i.view(1))
    table.lookup_train(torch.tensor([100, 101]))  # refresh the two oldest
    table.lookup_train(torch.tensor([7, 8]))
    stored = set(table.export()["ids"].tolist())
    assert stored == (set(ids.tolist()) - {102, 103}) | {7, 8}
    assert table.metrics()["evictions"] == 2


def test_lfu_evicts_least_frequently_used():
    table = KVTable(
        "lfu", dim=2, options=KVTableOptions(capacity=WAYS, eviction=EvictionPolicy.LFU)
    )
    ids = torch.arange(WAYS)
    counts = torch.arange(WAYS) + 2  # id i seen i + 2 times
    table.lookup_train(torch.repeat_interleave(ids, counts))
    table.lookup_train(torch.tensor([500, 500, 500, 501, 501, 501, 502]))
    stored = set(table.export()["ids"].tolist())
    # 500 and 501 (count 3) replace id 0 (count 2) and id 1 (count 3: a new id wins
    # a tie); 502 (count 1) is below every stored count.
    assert stored == set(range(2, WAYS)) | {500, 501}
    assert table.metrics()["insert_failures"] == 1
    assert table.metrics()["evictions"] == 2


def test_ties_broken_by_new_first_then_smaller_id():
    table = KVTable(
        "tie", dim=1, options=KVTableOptions(capacity=WAYS, eviction=EvictionPolicy.CUSTOM_SCORE)
    )
    ids = torch.arange(10, 10 + WAYS + 3)
    table.lookup_train(ids, custom_scores=torch.zeros_like(ids))
    assert table.export()["ids"].tolist() == ids[:WAYS].tolist()
    table.lookup_train(torch.tensor([1]), custom_scores=torch.tensor([0]))
    stored = table.export()["ids"].tolist()
    assert 1 in stored and 10 + WAYS - 1 not in stored  # the largest tied id leaves
    table.lookup_train(torch.tensor([2]), custom_scores=torch.tensor([1]))
    stored = table.export()["ids"].tolist()
    assert 2 in stored and 10 + WAYS - 2 not in stored


def test_ids_in_use_keep_their_rows_within_a_batch():
    table = KVTable(
        "use", dim=2, options=KVTableOptions(capacity=WAYS, eviction=EvictionPolicy.CUSTOM_SCORE)
    )
    ids = torch.arange(WAYS)
    table.lookup_train(ids, custom_scores=torch.full_like(ids, 5))
    batch = torch.cat([ids[:4], torch.tensor([100, 101])])
    scores = torch.tensor([0, 0, 0, 0, 9, 9])  # the hits score lowest
    slots = table.lookup_train(batch, custom_scores=scores)
    assert (slots >= 0).all() and slots.unique().numel() == batch.numel()
    assert set(table.export()["ids"].tolist()) >= set(batch.tolist())


def test_none_policy_never_evicts():
    table = KVTable(
        "none", dim=2, options=KVTableOptions(capacity=WAYS, eviction=EvictionPolicy.NONE)
    )
    table.lookup_train(torch.arange(WAYS))
    slots = table.lookup_train(torch.tensor([99, 3]))
    assert slots[0] == -1 and slots[1] >= 0
    assert table.metrics()["insert_failures"] == 1
    assert table.metrics()["evictions"] == 0
    assert set(table.export()["ids"].tolist()) == set(range(WAYS))


@pytest.mark.parametrize("threshold", [2, 3, 5])
def test_admission_threshold(threshold):
    table = KVTable(
        "adm", dim=4, options=KVTableOptions(capacity=64, admission_threshold=threshold)
    )
    for sighting in range(1, threshold):
        slots = table.lookup_train(torch.tensor([42]))
        assert slots.item() == -1, f"admitted after {sighting} sightings"
        assert table.size == 0
    assert table.lookup_train(torch.tensor([42])).item() >= 0
    # repeats inside one batch count too
    slots = table.lookup_train(torch.full((threshold,), 77))
    assert (slots >= 0).all()
    assert table.metrics()["admission_rejects"] == threshold - 1


def test_admission_rejected_rows_get_no_gradient_and_initial_value():
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_kvemb import KVEmbeddingBagCollection

    ebc = KVEmbeddingBagCollection(
        [EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=100, feature_names=["f"])],
        KVTableOptions(capacity=64, admission_threshold=2),
        fused_params={"learning_rate": 0.5},
    )
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["f"], values=torch.tensor([5]), lengths=torch.tensor([1])
    )
    out = ebc(kjt).values()
    torch.testing.assert_close(out, ebc.table("t").initial_rows(torch.tensor([5])))
    out.sum().backward()
    assert ebc.table("t").size == 0
    out2 = ebc(kjt).values()  # second sighting: admitted, starts from the initial row
    torch.testing.assert_close(out2, out.detach())
    assert ebc.table("t").size == 1


def test_initial_rows_depend_only_on_id_seed_column():
    opts = KVTableOptions(capacity=256, seed=11)
    a, b = KVTable("a", 5, opts), KVTable("b", 5, opts)
    a.lookup_train(torch.tensor([3, 2**50, 9]))
    b.lookup_train(torch.tensor([9, 1, 2, 2**50, 3]))
    ra, _ = a.find(torch.tensor([3, 2**50, 9]))
    rb, _ = b.find(torch.tensor([3, 2**50, 9]))
    assert torch.equal(ra, rb)
    other = KVTable("c", 5, KVTableOptions(capacity=256, seed=12))
    other.lookup_train(torch.tensor([3]))
    assert not torch.equal(other.find(torch.tensor([3]))[0], ra[:1])
    # a wider table shares the first columns
    wide = KVTable("w", 7, opts)
    wide.lookup_train(torch.tensor([3]))
    assert torch.equal(wide.find(torch.tensor([3]))[0][:, :5], ra[:1])


@pytest.mark.parametrize("init", list(Initializer), ids=lambda i: i.name)
def test_initial_row_distribution(init):
    opts = KVTableOptions(
        capacity=16, initializer=init, init_low=-0.5, init_high=1.5, init_mean=1.0, init_std=2.0
    )
    rows = KVTable("d", 64, opts).initial_rows(torch.arange(4001))
    if init == Initializer.UNIFORM:
        assert rows.min() >= -0.5 and rows.max() < 1.5
        assert abs(rows.mean().item() - 0.5) < 0.02
    elif init == Initializer.TRUNC_NORMAL:  # N(1, 2) on [-0.5, 1.5]: mean 0.5403
        assert rows.min() >= -0.5 and rows.max() <= 1.5
        assert abs(rows.mean().item() - 0.5403) < 0.02
    else:
        assert abs(rows.mean().item() - 1.0) < 0.03
        assert abs(rows.std().item() - 2.0) < 0.03


def test_memory_budget_sizes_capacity():
    optim = FusedOptimConfig(kind=OptimKind.ADAM)
    dim = 10
    per_row = bytes_per_row(dim, 2 * dim)
    assert per_row == 4 * dim + 8 * dim + 16
    table = KVTable("m", dim, KVTableOptions(memory_budget_bytes=per_row * 100), optim)
    assert table.capacity == 96  # whole buckets of 16 that fit
    assert table.memory_bytes() <= per_row * 100
    with pytest.raises(ValueError, match="fewer than"):
        KVTable("m", dim, KVTableOptions(memory_budget_bytes=per_row * 3), optim)


def test_find_insert_export_roundtrip():
    optim = FusedOptimConfig(kind=OptimKind.ROWWISE_ADAGRAD)
    table = KVTable("r", 3, KVTableOptions(capacity=64), optim)
    ids = torch.tensor([5, 2**63 - 1, 0])
    weights = torch.randn(3, 3)
    state = torch.rand(3, 1)
    slots = table.insert(ids, weights, state=state)
    assert (slots >= 0).all()
    rows, found = table.find(torch.tensor([0, 5, 6, 2**63 - 1]))
    assert found.tolist() == [True, True, False, True]
    assert torch.equal(rows[0], weights[2]) and torch.equal(rows[2], torch.zeros(3))
    exported = table.export()
    assert exported["ids"].tolist() == [0, 5, 2**63 - 1]
    assert torch.equal(exported["weights"], weights[[2, 0, 1]])
    assert torch.equal(exported["momentum1"], state[[2, 0, 1], 0])
    m = table.metrics()
    assert m["size"] == 3 and m["capacity"] == 64 and m["load_factor"] == 3 / 64


BAD_IDS = [
    pytest.param(torch.tensor([1, -2, 3]), "negative", id="negative"),
    pytest.param(torch.tensor([1.0, 2.0]), "int64 or int32", id="float"),
    pytest.param(torch.tensor([[1, 2]]), "1-D", id="2d"),
]


@pytest.mark.parametrize("ids,message", BAD_IDS)
def test_bad_ids_raise_and_leave_table_unchanged(ids, message):
    table = KVTable("bad", 2, KVTableOptions(capacity=32))
    table.insert(torch.tensor([1, 2]), torch.ones(2, 2))
    before = _snapshot(table)
    for call in (lambda: table.find(ids), lambda: table.insert(ids, torch.ones(ids.shape[-1], 2))):
        with pytest.raises(KVInputError, match=rf"'bad'.*{message}"):
            call()
    assert all(torch.equal(x, y) for x, y in zip(before, _snapshot(table)))


def test_insert_rejects_wrong_shapes_and_duplicates():
    table = KVTable("shape", 4, KVTableOptions(capacity=32))
    before = _snapshot(table)
    with pytest.raises(KVInputError, match=r"'shape'.*\(2, 4\)"):
        table.insert(torch.tensor([1, 2]), torch.ones(2, 3))
    with pytest.raises(KVInputError, match="unique"):
        table.insert(torch.tensor([1, 1]), torch.ones(2, 4))
    assert all(torch.equal(x, y) for x, y in zip(before, _snapshot(table)))


def test_same_bucket_overflow_is_exact():
    ids = _same_ids_in_bucket(WAYS + 5, num_buckets=4)
    table = KVTable("b", 2, KVTableOptions(capacity=4 * WAYS))
    slots = table.lookup_train(ids)
    assert (slots >= 0).sum() == WAYS
    # same step, same score: the smaller ids win
    assert torch.equal(table.export()["ids"], ids.sort().values[:WAYS])


@pytest.mark.parametrize("policy", [EvictionPolicy.LRU, EvictionPolicy.LFU], ids=["lru", "lfu"])
def test_insert_with_exact_scores_keeps_them(policy):
    table = KVTable("exact", 3, KVTableOptions(capacity=4 * WAYS, eviction=policy))
    table.lookup_train(torch.tensor([4, 9, 9]))  # stored: LFU counts 1 and 2
    ids = _same_ids_in_bucket(WAYS + 3, num_buckets=4, start=100)
    ids = torch.cat([ids, torch.tensor([9])])
    scores = torch.randperm(ids.numel()) * 5 + 11
    slots = table.insert(ids, torch.randn(ids.numel(), 3), scores=scores, exact_scores=True)
    # A full bucket keeps the highest scores (9, stored already, keeps its row).
    new = ids[:-1][slots[:-1] >= 0]
    best = ids[:-1][torch.argsort(scores[:-1], descending=True)]
    assert slots[-1] >= 0 and int((slots[:-1] >= 0).sum()) <= WAYS
    assert torch.equal(new.sort().values, best[: new.numel()].sort().values)
    exported = table.export()
    got = dict(zip(exported["ids"].tolist(), exported["scores"].tolist()))
    want = dict(zip(ids[slots >= 0].tolist(), scores[slots >= 0].tolist()))
    assert {k: got[k] for k in want} == want  # LFU: 9 is set to its score, not added to


def test_exact_scores_need_integer_scores_and_change_nothing():
    table = KVTable("exact", 2, KVTableOptions(capacity=32))
    table.insert(torch.tensor([1, 2]), torch.ones(2, 2))
    before = _snapshot(table)
    for scores in (None, torch.tensor([1.0, 2.0]), torch.tensor([1])):
        with pytest.raises(KVInputError, match=r"'exact'.*exact_scores needs an integer"):
            table.insert(torch.tensor([3, 4]), torch.ones(2, 2), scores=scores, exact_scores=True)
    assert all(torch.equal(x, y) for x, y in zip(before, _snapshot(table)))


@pytest.mark.parametrize("high", [2**40, 2**63 - 1], ids=["one-sort", "two-sorts"])
@pytest.mark.parametrize("route_buckets", [None, 1, 7, 4096, 100_003])
def test_export_order_is_route_bucket_then_id(high, route_buckets):
    """Both ways of ordering an export (one sort of a bucket-and-id key when the ids
    leave room for it, else two sorts) give (routing bucket, id) order and the slots."""
    table = KVTable("t", 4, KVTableOptions(capacity=5000))
    g = torch.Generator().manual_seed(route_buckets or 0)
    ids = torch.unique(torch.randint(0, high, (1600,), generator=g))[:1501]
    ids[-1] = high - 1
    table.insert(ids, torch.randn(ids.numel(), 4, generator=g))
    got, slots = table.export_order(route_buckets)
    stored = table.keys.view(-1)[table.keys.view(-1) >= 0]
    assert stored.numel() > 1400
    want = torch.sort(stored).values
    if route_buckets is not None:
        want = want[torch.sort(route_bucket(want, route_buckets), stable=True).indices]
    assert torch.equal(got, want)
    assert torch.equal(table.keys.view(-1)[slots], got)
    assert torch.equal(table.export(route_buckets)["ids"], want)
