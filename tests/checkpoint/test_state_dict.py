"""Unsharded ``state_dict`` / ``load_state_dict`` of KV tables and ``checkpoint.save/load``
without a process group: round trips, the layout of docs/checkpoint-format.md, bad input."""

import json
import os

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb import EvictionPolicy, KVEmbeddingBagCollection, KVTableOptions, checkpoint
from torchrec_kvemb.checkpoint import CheckpointError
from torchrec_kvemb.ops.hashing import index_bucket, route_bucket
from torchrec_kvemb.state_dict import admission_state

SGD = {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.2}
ADAGRAD = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1}
ADAM = {"optimizer": EmbOptimType.ADAM, "learning_rate": 0.05}
STATE_SHAPES = {"momentum1": lambda n, d: (n,), "exp_avg": lambda n, d: (n, d)}
STATE_SHAPES["exp_avg_sq"] = STATE_SHAPES["exp_avg"]


def configs(user_dim: int = 6) -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name="user", embedding_dim=user_dim, num_embeddings=2**63 - 1, feature_names=["u"]
        ),
        EmbeddingBagConfig(name="item", embedding_dim=3, num_embeddings=2**40, feature_names=["i"]),
    ]


OPTIONS = {
    "user": KVTableOptions(
        capacity=512, eviction=EvictionPolicy.LFU, admission_threshold=2, total_num_buckets=24
    ),
    "item": KVTableOptions(capacity=256, total_num_buckets=10, seed=3),
}


def build(fused=ADAGRAD, user_dim: int = 6, options=OPTIONS) -> KVEmbeddingBagCollection:
    return KVEmbeddingBagCollection(configs(user_dim), options, fused_params=fused)


def kjt(step: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(step)
    u = torch.cat([torch.randint(0, 80, (30,), generator=g), torch.tensor([2**62 + step])])
    i = torch.randint(0, 2**40, (4,), generator=g)
    i = torch.cat([i, torch.randint(0, 40, (26,), generator=g)])
    return KeyedJaggedTensor.from_lengths_sync(
        keys=["u", "i"],
        values=torch.cat([u, i]),
        lengths=torch.tensor([7, 6, 8, 10, 10, 10, 5, 5]),
    )


def train(ebc: nn.Module, steps: range) -> list[torch.Tensor]:
    outs = []
    for step in steps:
        kt = ebc(kjt(step))
        g = torch.Generator().manual_seed(100 + step)
        (kt.values() * torch.randn(kt.values().shape, generator=g)).sum().backward()
        outs.append(kt.values().detach())
    return outs


def snapshot(ebc: KVEmbeddingBagCollection) -> dict:
    return {
        name: (t.export(), t.step, t.optim_step, admission_state(t))
        for name, t in ebc.kv_tables().items()
    }


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        (ea, sa, oa, ada), (eb, sb, ob, adb) = a[name], b[name]
        assert ea.keys() == eb.keys()
        for key in ea:
            assert torch.equal(ea[key], eb[key]), (name, key)
        assert (sa, oa) == (sb, ob)
        for x, y in zip(ada, adb, strict=True):
            assert torch.equal(x, y), (name, "admission")


# ------------------------------------------------------------ round trips
@pytest.mark.parametrize("fused", [SGD, ADAGRAD, ADAM], ids=["sgd", "adagrad", "adam"])
def test_round_trip_restores_every_id_and_training_goes_on_the_same(fused):
    ebc = build(fused)
    train(ebc, range(4))
    state = ebc.state_dict()
    fresh = build(fused)
    result = fresh.load_state_dict(state)
    assert not result.missing_keys and not result.unexpected_keys
    assert_same(snapshot(fresh), snapshot(ebc))
    assert snapshot(fresh)["user"][3][0].numel() > 0  # ids waiting for admission came back
    # Continued training is bit-identical.
    for a, b in zip(train(ebc, range(4, 7)), train(fresh, range(4, 7)), strict=True):
        assert torch.equal(a, b)
    assert_same(snapshot(fresh), snapshot(ebc))


def test_load_replaces_the_tables_content():
    ebc = build()
    train(ebc, range(3))
    target = build()
    train(target, range(10, 14))  # other ids, other rows
    target.load_state_dict(ebc.state_dict())
    assert_same(snapshot(target), snapshot(ebc))


def test_custom_scores_come_back():
    options = {
        "user": KVTableOptions(capacity=64, eviction=EvictionPolicy.CUSTOM_SCORE),
        "item": KVTableOptions(capacity=64),
    }
    ebc = build(options=options)
    ebc(kjt(0), eviction_scores={"u": torch.arange(31) * 7 + 3})
    fresh = build(options=options)
    fresh.load_state_dict(ebc.state_dict())
    assert_same(snapshot(fresh), snapshot(ebc))
    assert int(fresh.table("user").export()["scores"].max()) == 30 * 7 + 3


def test_rows_in_any_order_load_the_same():
    ebc = trained()
    state = ebc.state_dict()
    perm = torch.randperm(state["embedding_bags.user.weight_id"].numel())
    for key in ("weight", "weight_id", "weight_score", "momentum1"):
        state[f"embedding_bags.user.{key}"] = state[f"embedding_bags.user.{key}"][perm]
    fresh = build()
    fresh.load_state_dict(state)
    assert_same(snapshot(fresh), snapshot(ebc))


def test_full_index_buckets_keep_the_highest_scores():
    ids = torch.arange(4000)
    ids = ids[index_bucket(ids, 2) == 0][:20]  # one bucket of a 2-bucket (32-row) index
    options = {"user": KVTableOptions(capacity=64), "item": KVTableOptions(capacity=1024)}
    big = build(options=options)
    scores = torch.randperm(20) * 3
    slots = big.table("item").insert(ids, torch.randn(20, 3))
    big.table("item").scores.view(-1)[slots] = scores
    state = big.state_dict()
    small = build(options={"user": options["user"], "item": KVTableOptions(capacity=32)})
    with pytest.warns(UserWarning, match="'item': 4 of 20 rows found no room"):
        small.load_state_dict(state)
    kept = small.table("item").export()
    want = ids[torch.argsort(scores, descending=True)[:16]].sort().values
    assert torch.equal(kept["ids"], want)
    rows, _ = big.table("item").find(want)
    assert torch.equal(kept["weights"], rows)


# ------------------------------------------------------------------ layout
@pytest.mark.parametrize("fused", [SGD, ADAGRAD, ADAM], ids=["sgd", "adagrad", "adam"])
def test_layout(fused):
    ebc = build(fused)
    train(ebc, range(3))
    state = ebc.state_dict()
    names = {"sgd": [], "rowwise_adagrad": ["momentum1"], "adam": ["exp_avg", "exp_avg_sq"]}
    for name, table in ebc.kv_tables().items():
        p = f"embedding_bags.{name}."
        extra = ["admission_id", "admission_count", "admission_score"] if name == "user" else []
        state_names = names[table.optim.kind.value]
        want = {"weight", "weight_id", "weight_score", "bucket", "step", *state_names, *extra}
        assert {k[len(p) :] for k in state if k.startswith(p)} == want
        n, dim, g = table.size, table.dim, table.options.total_num_buckets
        ids, weight = state[p + "weight_id"], state[p + "weight"]
        assert (ids.dtype, tuple(ids.shape)) == (torch.int64, (n,))
        assert (weight.dtype, tuple(weight.shape)) == (torch.float32, (n, dim))
        assert state[p + "weight_score"].dtype == torch.int64
        for s in state_names:
            assert tuple(state[p + s].shape) == STATE_SHAPES[s](n, dim)
            assert state[p + s].dtype == torch.float32
        # Sorted by routing bucket, then id; bucket counts the rows of each bucket.
        buckets = route_bucket(ids, g)
        assert bool((buckets[1:] >= buckets[:-1]).all())
        same = buckets[1:] == buckets[:-1]
        assert bool((ids[1:][same] > ids[:-1][same]).all())
        bucket = state[p + "bucket"]
        assert (bucket.dtype, tuple(bucket.shape)) == (torch.int64, (g,))
        assert torch.equal(bucket, torch.bincount(buckets, minlength=g))
        # Row i belongs to id i, with its score and state.
        rows, found = table.find(ids)
        assert bool(found.all()) and torch.equal(rows, weight)
        export = table.export()
        order = torch.searchsorted(export["ids"], ids)
        assert torch.equal(state[p + "weight_score"], export["scores"][order])
        for s in state_names:
            assert torch.equal(state[p + s], export[s][order])
        assert state[p + "step"].tolist() == [table.step, table.optim_step]
    assert state["embedding_bags.user.admission_id"].numel() > 0


def test_empty_tables():
    ebc = build()
    state = ebc.state_dict()
    assert state["embedding_bags.user.weight"].shape == (0, 6)
    assert int(state["embedding_bags.user.bucket"].sum()) == 0
    fresh = build()
    fresh.load_state_dict(state)
    assert fresh.table("user").size == 0


# --------------------------------------------------------------- bad input
def trained() -> KVEmbeddingBagCollection:
    ebc = build()
    train(ebc, range(3))
    return ebc


def assert_refused(target: KVEmbeddingBagCollection, state: dict, *words: str) -> None:
    before = snapshot(target)
    with pytest.raises(CheckpointError) as info:
        target.load_state_dict(state)
    for word in words:
        assert word in str(info.value)
    assert_same(snapshot(target), before)


def test_wrong_dim_names_the_table_and_changes_nothing():
    state = trained().state_dict()
    target = build(user_dim=4)
    train(target, range(5, 7))
    assert_refused(target, state, "'user'", "dim 6", "dim 4")


def test_wrong_optimizer_state_set_names_the_table():
    state = trained().state_dict()  # row-wise Adagrad: momentum1
    target = build(ADAM)
    train(target, range(5, 7))
    assert_refused(target, state, "'user'", "momentum1", "exp_avg")


def test_bad_ids_are_refused():
    state = trained().state_dict()
    dup = dict(state)
    ids = dup["embedding_bags.item.weight_id"].clone()
    ids[1] = ids[0]
    dup["embedding_bags.item.weight_id"] = ids
    assert_refused(build(), dup, "'item'", "twice")
    short = dict(state)
    short["embedding_bags.item.weight_score"] = short["embedding_bags.item.weight_score"][:-1]
    assert_refused(build(), short, "'item'", "weight_score")


def test_more_rows_than_capacity_are_refused():
    state = trained().state_dict()
    small = dict(OPTIONS, item=KVTableOptions(capacity=16, total_num_buckets=10))
    assert_refused(build(options=small), state, "'item'", "capacity")


def test_a_stock_weight_points_to_migration():
    state = {"embedding_bags.user.weight": torch.zeros(5, 6)}
    assert_refused(build(), state, "'user'", "load_dense_into_kv")


def test_missing_tables_are_missing_keys():
    state = {k: v for k, v in trained().state_dict().items() if ".item." not in k}
    target = build()
    with pytest.raises(RuntimeError, match="Missing key"):
        target.load_state_dict(state)
    result = target.load_state_dict(state, strict=False)
    assert "embedding_bags.item.weight" in result.missing_keys
    assert target.table("user").size > 0


def test_unknown_entries_are_unexpected_keys():
    state = trained().state_dict()
    state["embedding_bags.user.nonsense"] = torch.zeros(1)
    result = build().load_state_dict(state, strict=False)
    assert result.unexpected_keys == ["embedding_bags.user.nonsense"]


# ------------------------------------------------------------- checkpoints
class Model(nn.Module):
    def __init__(self, fused=ADAGRAD, user_dim: int = 6) -> None:
        super().__init__()
        self.ebc = build(fused, user_dim)
        torch.manual_seed(0)
        self.dense = nn.Linear(9, 1)

    def step(self, optimizer, step: int) -> None:
        kt = self.ebc(kjt(step))
        self.dense(kt.values()).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def trained_model(fused=ADAGRAD):
    model = Model(fused)
    optimizer = torch.optim.Adam(model.dense.parameters(), lr=0.1)
    for step in range(3):
        model.step(optimizer, step)
    return model, optimizer


def test_save_and_load_without_a_process_group(tmp_path):
    model, optimizer = trained_model()
    path = tmp_path / "ckpt"
    checkpoint.save(model, path, optimizer=optimizer)
    marker = json.loads((path / checkpoint.MARKER).read_text())
    assert marker["tables"]["ebc.embedding_bags.user"] == {
        "dim": 6,
        "name": "user",
        "optimizer": "rowwise_adagrad",
        "sharding": "unsharded",
        "state": ["momentum1"],
        "total_num_buckets": 24,
        "weights_dtype": "float32",
    }
    assert marker["fingerprint"] == checkpoint.fingerprint(marker["tables"])
    fresh = Model()
    fresh_optimizer = torch.optim.Adam(fresh.dense.parameters(), lr=0.7)
    checkpoint.load(fresh, path, optimizer=fresh_optimizer)
    assert_same(snapshot(fresh.ebc), snapshot(model.ebc))
    assert torch.equal(fresh.dense.weight, model.dense.weight)
    assert fresh_optimizer.param_groups[0]["lr"] == 0.1
    want, got = optimizer.state_dict()["state"], fresh_optimizer.state_dict()["state"]
    for i in want:
        for key in want[i]:
            assert torch.equal(got[i][key], want[i][key])
    for step in range(3, 5):
        model.step(optimizer, step)
        fresh.step(fresh_optimizer, step)
    assert_same(snapshot(fresh.ebc), snapshot(model.ebc))
    assert torch.equal(fresh.dense.weight, model.dense.weight)


def test_save_replaces_an_older_checkpoint_atomically(tmp_path):
    model, _ = trained_model()
    path = tmp_path / "ckpt"
    checkpoint.save(Model(), path)
    checkpoint.save(model, path)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no tmp or old directories left
    fresh = Model()
    checkpoint.load(fresh, path)
    assert_same(snapshot(fresh.ebc), snapshot(model.ebc))
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="not a checkpoint"):
        checkpoint.save(model, tmp_path / "file")


def test_incomplete_or_missing_checkpoints_are_refused(tmp_path):
    model, _ = trained_model()
    path = tmp_path / "ckpt"
    checkpoint.save(model, path)
    (path / checkpoint.MARKER).unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        checkpoint.load(Model(), path)
    os.rename(path, tmp_path / "ckpt.tmp-1234")
    with pytest.raises(CheckpointError, match="unfinished save"):
        checkpoint.load(Model(), path)


def test_load_of_another_config_names_the_table_and_changes_nothing(tmp_path):
    model, optimizer = trained_model()
    checkpoint.save(model, tmp_path / "ckpt", optimizer=optimizer)
    for other, words in ((Model(user_dim=4), "dim"), (Model(fused=ADAM), "adam")):
        for step in range(5, 7):
            other.ebc(kjt(step))
        before = snapshot(other.ebc)
        dense = other.dense.weight.clone()
        with pytest.raises(CheckpointError) as info:
            checkpoint.load(other, tmp_path / "ckpt")
        assert "'user'" in str(info.value) and words in str(info.value)
        assert_same(snapshot(other.ebc), before)
        assert torch.equal(other.dense.weight, dense)


def test_load_with_missing_model_entries(tmp_path):
    model, _ = trained_model()
    checkpoint.save(model.ebc, tmp_path / "ebc_only")

    target = Model()
    with pytest.raises(CheckpointError, match="is not in the checkpoint"):
        checkpoint.load(target, tmp_path / "ebc_only")
    bare = build()
    checkpoint.load(bare, tmp_path / "ebc_only")
    assert_same(snapshot(bare), snapshot(model.ebc))
    checkpoint.save(model, tmp_path / "full")
    with pytest.raises(CheckpointError, match="optimizer"):
        checkpoint.load(Model(), tmp_path / "full", optimizer=torch.optim.SGD([torch.zeros(1)]))
