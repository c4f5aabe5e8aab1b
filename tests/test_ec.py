"""``KVEmbeddingCollection`` on its own: outputs, read-only evaluation, bad input,
state_dict, the meta device, and the Triton and native kernels against the torch
path."""

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb import (
    EvictionPolicy,
    KVEmbeddingCollection,
    KVInputError,
    KVTableOptions,
    SSDOptions,
)
from torchrec_kvemb.backend import ENV_VAR
from torchrec_kvemb.ops import native

DIM = 5


def _ec(**kwargs) -> KVEmbeddingCollection:
    configs = [
        EmbeddingConfig(
            name="items", embedding_dim=DIM, num_embeddings=2**63 - 1, feature_names=["h", "c"]
        ),
        EmbeddingConfig(name="users", embedding_dim=DIM, num_embeddings=100, feature_names=["u"]),
    ]
    options = {
        "items": KVTableOptions(capacity=48, eviction=EvictionPolicy.LFU, admission_threshold=2),
        "users": KVTableOptions(capacity=16),
    }
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1}
    return KVEmbeddingCollection(configs, options, fused_params=fused, **kwargs)


def _kjt(values, lengths, keys=("h", "c", "u")) -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(
        keys=list(keys), values=torch.as_tensor(values), lengths=torch.as_tensor(lengths)
    )


def test_rows_per_feature_in_input_order():
    ec = _ec()
    kjt = _kjt([7, 2**40, 7, 3, 9, 1], [2, 1, 1, 0, 1, 1])  # h: [7, 2**40], [7]; c: [3]; u: 9, 1
    out = ec(kjt)
    assert list(out) == ["h", "c", "u"]
    assert out["h"].values().shape == (3, DIM)
    assert torch.equal(out["h"].lengths(), torch.tensor([2, 1]))
    # the items table admits after two sightings: 7 is admitted in this batch, 2**40 and 3 not
    items = ec.table("items")
    rows, found = items.find(torch.tensor([7, 2**40, 3]))
    assert found.tolist() == [True, False, False]
    torch.testing.assert_close(out["h"].values()[0], rows[0])
    torch.testing.assert_close(out["h"].values()[2], rows[0])
    torch.testing.assert_close(out["h"].values()[1], items.initial_rows(torch.tensor([2**40]))[0])
    users, _ = ec.table("users").find(torch.tensor([9, 1]))
    torch.testing.assert_close(out["u"].values(), users)


def test_training_updates_rows_and_eval_is_read_only():
    ec = _ec()
    kjt = _kjt([5, 5, 6, 8, 8], [2, 1, 1, 0, 1, 0])
    ec(kjt)  # 5 and 8 admitted (two sightings), 6 waits
    before = {n: t.export() for n, t in ec.kv_tables().items()}
    ec(kjt)["h"].values().sum().backward()
    after = ec.table("items").export()
    assert not torch.equal(after["weights"], before["items"]["weights"]), "rows did not train"
    ec.eval()
    with torch.no_grad():
        out = ec(_kjt([5, 123456, 8], [1, 1, 0, 0, 1, 0]))
    torch.testing.assert_close(out["h"].values()[1], torch.zeros(DIM))  # never stored
    assert ec.table("items").export()["ids"].tolist() == after["ids"].tolist()


def test_tables_of_several_dims_are_refused():
    configs = [
        EmbeddingConfig(name="a", embedding_dim=4, num_embeddings=10, feature_names=["f"]),
        EmbeddingConfig(name="b", embedding_dim=8, num_embeddings=10, feature_names=["g"]),
    ]
    with pytest.raises(ValueError, match="one embedding_dim"):
        KVEmbeddingCollection(configs, KVTableOptions(capacity=16))


@pytest.mark.parametrize(
    "values,lengths,message",
    [
        ([1, -2, 3, 4], [1, 1, 0, 1, 1, 0], r"'items'.*negative"),
        ([1.0, 2.0, 3.0, 4.0], [1, 1, 0, 1, 1, 0], r"'items'.*int64 or int32"),
        ([1, 2, 3], [1, 1, 0, 1, 1, 0], "lengths sum to 4 but there are 3 ids"),
    ],
    ids=["negative-id", "float-ids", "lengths-mismatch"],
)
def test_bad_batches_raise_and_change_nothing(values, lengths, message):
    ec = _ec()
    ec(_kjt([1, 1, 2], [1, 1, 0, 1, 0, 0]))
    before = {n: t.export() for n, t in ec.kv_tables().items()}
    with pytest.raises(KVInputError, match=message):
        ec(_kjt(values, lengths))
    for name, table in ec.kv_tables().items():
        for key, value in table.export().items():
            assert torch.equal(value, before[name][key]), f"{name} {key} changed"


def test_state_dict_round_trip_under_embeddings():
    ec = _ec()
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        values = torch.randint(0, 30, (12,), generator=gen)
        ec(_kjt(values, [2, 2, 2, 2, 2, 2]))["c"].values().sum().backward()
    state = ec.state_dict()
    assert {
        "embeddings.items.weight",
        "embeddings.items.weight_id",
        "embeddings.users.weight",
    } <= set(state)
    other = _ec()
    other.load_state_dict(state)
    for name, table in ec.kv_tables().items():
        for key, value in table.export().items():
            assert torch.equal(other.table(name).export()[key], value), f"{name} {key}"


@pytest.mark.parametrize("kernels", ["triton", "native"])
def test_kernels_match_the_torch_path(kernels, monkeypatch):
    if kernels == "native":
        assert native.available(), native.unavailable_reason()
    results = {}
    for backend in ("torch", kernels):
        monkeypatch.setenv(ENV_VAR, "auto" if backend == "native" else backend)
        ec = _ec(need_indices=True)
        gen = torch.Generator().manual_seed(3)
        outs = []
        for _ in range(4):
            lengths = torch.randint(0, 4, (6,), generator=gen)
            values = torch.randint(0, 40, (int(lengths.sum()),), generator=gen) * 1_000_003
            out = ec(_kjt(values, lengths))
            flat = torch.cat([jt.values() for jt in out.values()])
            flat.backward(torch.cos(torch.arange(flat.numel(), dtype=torch.float32)).view_as(flat))
            outs.append(flat.detach())
        results[backend] = (outs, {n: t.export() for n, t in ec.kv_tables().items()}, ec.metrics())
    (ref, ref_tables, ref_metrics), (got, tables, metrics) = results["torch"], results[kernels]
    for step, (a, b) in enumerate(zip(ref, got)):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5, msg=f"output {step}")
    assert metrics == ref_metrics
    for name in ref_tables:
        for key, value in ref_tables[name].items():
            if value.dtype == torch.int64:
                assert torch.equal(tables[name][key], value), f"{name} {key}"
            else:
                torch.testing.assert_close(tables[name][key], value, atol=1e-5, rtol=1e-5)


def test_ssd_tier_serves_sequences_like_memory(tmp_path, monkeypatch):
    """A sequence table whose memory holds a quarter of its ids, over an SSD tier,
    trains exactly as the same table all in memory (batches spread over its buckets;
    both on the torch path, whose float sums are the same in both)."""
    monkeypatch.setenv(ENV_VAR, "torch")
    configs = [
        EmbeddingConfig(
            name="items", embedding_dim=DIM, num_embeddings=2**63 - 1, feature_names=["h"]
        )
    ]
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1}
    ssd = SSDOptions(str(tmp_path / "ssd"))
    tiered = KVEmbeddingCollection(
        configs, KVTableOptions(capacity=256, ssd=ssd, seed=3), fused_params=fused
    )
    memory = KVEmbeddingCollection(
        configs, KVTableOptions(capacity=4096, seed=3), fused_params=fused
    )
    gen = torch.Generator().manual_seed(0)
    pool = torch.randint(0, 2**50, (900,), generator=gen)
    for step in range(12):
        lengths = torch.randint(0, 4, (13,), generator=gen)
        ids = pool[torch.randint(0, pool.numel(), (int(lengths.sum()),), generator=gen)]
        kjt = _kjt(ids, lengths, keys=("h",))
        got, want = tiered(kjt)["h"].values(), memory(kjt)["h"].values()
        assert torch.equal(got, want), f"step {step}"
        grad = torch.randn(got.shape, generator=gen)
        got.backward(grad)
        want.backward(grad)
    assert tiered.table("items").metrics()["demotions"] > 0  # the tier was used
    stored = memory.table("items").export()
    rows, found = tiered.table("items").find(stored["ids"])
    assert bool(found.all())
    assert torch.equal(rows, stored["weights"])
    tiered.table("items").close()


META_CONFIGS = [
    EmbeddingConfig(name="a", embedding_dim=DIM, num_embeddings=2**40, feature_names=["h", "c"]),
    EmbeddingConfig(name="b", embedding_dim=DIM, num_embeddings=2**40, feature_names=["c"]),
]


@pytest.mark.parametrize("how", ["context", "device-arg"])
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_forward_on_meta_gives_the_stock_modules_shapes(how, training):
    """Built on meta (as large models are before they are materialised), the forward
    gives meta rows of the stock module's shapes, for a CPU batch and a meta one;
    nothing is looked up."""
    meta = torch.device("meta")
    if how == "context":
        with meta:
            ec = KVEmbeddingCollection(META_CONFIGS, KVTableOptions(capacity=1 << 16))
    else:
        ec = KVEmbeddingCollection(META_CONFIGS, KVTableOptions(capacity=1 << 16), device=meta)
    assert ec.device == meta
    ec.train(training)
    stock = EmbeddingCollection(META_CONFIGS, device=meta, need_indices=False).train(training)
    kjt = _kjt([4, 5, 6, 7, 8, 9], [2, 1, 0, 3], keys=("c", "h"))
    for batch in (kjt, kjt.to(meta)):
        got, want = ec(batch), stock(batch)
        assert list(got) == list(want) == ["h", "c@a", "c@b"]
        for name in want:
            assert got[name].values().device == meta, name
            assert got[name].values().shape == want[name].values().shape, name
            assert got[name].values().requires_grad == training
            assert got[name].lengths().device == batch.lengths().device
            if batch is kjt:
                assert torch.equal(got[name].lengths(), want[name].lengths()), name
        if training:
            sum(jt.values().sum() for jt in got.values()).backward()
    assert all(t.size == 0 for t in ec.kv_tables().values())
