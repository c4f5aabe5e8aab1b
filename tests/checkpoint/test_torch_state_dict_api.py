"""torch's state-dict helpers (``torch.distributed.checkpoint.state_dict``) on models
with KV tables, each call made on a stock twin in the same model too
(docs/checkpoint-format.md, "torch's state-dict helpers"): ``get_model_state_dict`` /
``set_model_state_dict`` round-trip exactly (rows, ids, scores, optimizer state, then
identical training), unsharded and sharded, through ``dcp.save`` / ``dcp.load`` too;
``get_state_dict`` / ``set_state_dict`` with a dense optimizer; a full state_dict
gathered whole. One process (sharded: a world-size-1 gloo group); two ranks:
test_plain_dcp.py."""

import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.checkpoint.one_rank_dmp import shard_on_one_rank
from tests.checkpoint.test_optimizer_state import batch as sharded_batch
from tests.checkpoint.test_optimizer_state import kv, sharded, stock_rows
from tests.checkpoint.test_optimizer_state import train as train_sharded
from tests.checkpoint.test_state_dict import ADAGRAD, ADAM, OPTIONS, assert_same, snapshot
from tests.sharding.test_composable_shard import build as sequence_build
from tests.sharding.test_composable_shard import local_state
from tests.sharding.test_composable_shard import plan_for as sequence_plan
from tests.sharding.test_composable_shard import train as train_sequences
from torchrec_kvemb import KVEmbeddingBagCollection, KVEmbeddingCollection, checkpoint
from torchrec_kvemb.checkpoint import CheckpointError
from torchrec_kvemb.state_dict import KVStateKey

DIM = 5
CPU = torch.device("cpu")


# ------------------------------------------------------------ unsharded
class Model(nn.Module):
    """A KV collection (bags or sequences: tables ``user`` and ``item``) beside its stock
    twin (table ``stock``), and a dense layer over their outputs."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        if kind == "bags":
            configs = [
                EmbeddingBagConfig(
                    name=n, embedding_dim=DIM, num_embeddings=2**40, feature_names=[f]
                )
                for n, f in (("user", "u"), ("item", "i"))
            ]
            self.kv = KVEmbeddingBagCollection(configs, OPTIONS, fused_params=ADAM)
            stock = EmbeddingBagConfig(
                name="stock", embedding_dim=DIM, num_embeddings=53, feature_names=["s"]
            )
            self.stock = EmbeddingBagCollection([stock])
        else:
            configs = [
                EmbeddingConfig(name=n, embedding_dim=DIM, num_embeddings=2**40, feature_names=[f])
                for n, f in (("user", "u"), ("item", "i"))
            ]
            self.kv = KVEmbeddingCollection(configs, OPTIONS, fused_params=ADAM)
            stock = EmbeddingConfig(
                name="stock", embedding_dim=DIM, num_embeddings=53, feature_names=["s"]
            )
            self.stock = EmbeddingCollection([stock])
        torch.manual_seed(0)
        self.dense = nn.Linear(DIM, 1)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        jts = features.to_dict()
        kv_in = KeyedJaggedTensor.from_jt_dict({k: jts[k] for k in ("u", "i")})
        stock_in = KeyedJaggedTensor.from_jt_dict({"s": jts["s"]})
        if self.kind == "bags":
            pooled = [self.kv(kv_in).values(), self.stock(stock_in).values()]
            rows = torch.cat([p.reshape(-1, DIM) for p in pooled])
        else:
            out = {**self.kv(kv_in), **self.stock(stock_in)}
            rows = torch.cat([out[k].values() for k in ("u", "i", "s")])
        return self.dense(rows)


def batch(step: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(1, 5, (3 * 3,), generator=g)
    n = lengths.view(3, 3).sum(1).tolist()
    values = [
        torch.randint(0, 30, (n[0],), generator=g) + 2**39,
        torch.randint(0, 20, (n[1],), generator=g),
        torch.randint(0, 53, (n[2],), generator=g),
    ]
    return KeyedJaggedTensor.from_lengths_sync(
        keys=["u", "i", "s"], values=torch.cat(values), lengths=lengths
    )


def train(model: Model, steps: range) -> list[torch.Tensor]:
    """Steps of the fused KV optimizer and plain SGD over the stock and dense weights
    (stateless: two models stay comparable)."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    outputs = []
    for step in steps:
        out = model(batch(step))
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        outputs.append(out.detach())
    return outputs


def assert_equal_dicts(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for key, value in want.items():
        assert torch.equal(got[key], value), key


KINDS = pytest.mark.parametrize("kind", ["bags", "sequences"])


@KINDS
def test_the_state_dicts_keys_resolve_as_attributes_as_a_stock_modules_do(kind):
    model = Model(kind)
    attribute = "embedding_bags" if kind == "bags" else "embeddings"
    assert getattr(model.stock, attribute)["stock"].weight is not None  # the stock twin
    for key in model.kv.state_dict():
        *path, last = key.split(".")
        owner = model.kv
        for name in path:
            owner = getattr(owner, name)
        if last == "weight":  # a stock table's parameter name, with no rows
            assert getattr(owner, last).shape == (0, DIM), key
        else:
            assert getattr(owner, last) == KVStateKey(path[1], last), key
    kv_modules = [name for name, _ in model.kv.named_modules()]
    assert kv_modules == ["", attribute, f"{attribute}.user", f"{attribute}.item"]
    kv_parameters = [name for name, _ in model.kv.named_parameters()]
    assert kv_parameters == [f"{attribute}.user.weight", f"{attribute}.item.weight"]


@KINDS
def test_get_and_set_model_state_dict_round_trip_exactly(kind):
    model = Model(kind)
    train(model, range(3))
    state = get_model_state_dict(model)
    assert_equal_dicts(state, model.state_dict())
    assert "stock.embedding_bags.stock.weight" in state or "stock.embeddings.stock.weight" in state

    fresh = Model(kind)
    loaded = set_model_state_dict(fresh, state)
    assert not loaded.missing_keys and not loaded.unexpected_keys
    assert_same(snapshot(fresh.kv), snapshot(model.kv))
    assert_equal_dicts(fresh.state_dict(), model.state_dict())
    for a, b in zip(train(model, range(3, 6)), train(fresh, range(3, 6)), strict=True):
        assert torch.equal(a, b)
    assert_same(snapshot(fresh.kv), snapshot(model.kv))


@KINDS
def test_dcp_save_and_load_of_get_model_state_dict(kind, tmp_path):
    model = Model(kind)
    train(model, range(3))
    fresh = Model(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that there is no process group
        dcp.save(get_model_state_dict(model), checkpoint_id=tmp_path / "ckpt", no_dist=True)
        target = get_model_state_dict(fresh)
        dcp.load(
            target,
            checkpoint_id=tmp_path / "ckpt",
            planner=checkpoint.KVLoadPlanner(),
            no_dist=True,
        )
    set_model_state_dict(fresh, target)
    assert_equal_dicts(fresh.state_dict(), model.state_dict())
    for a, b in zip(train(model, range(3, 5)), train(fresh, range(3, 5)), strict=True):
        assert torch.equal(a, b)


# -------------------------------------------------------------- sharded
def sequence_model() -> tuple[nn.Module, list]:
    return sequence_build("sequences")


SHARDINGS = pytest.mark.parametrize("sharding", ["row_wise", "table_wise"])


@SHARDINGS
def test_sharded_round_trip_through_the_module_dmp_wraps(sharding, one_rank):
    """``model.module``: torch's helpers do not take ``DistributedModelParallel``
    itself (its parameter names skip its wrapped module), stock tables alike."""
    model = sharded("adam", sharding)
    train_sharded(model, range(3))
    state = get_model_state_dict(model.module)
    assert list(state) == list(model.module.state_dict())
    fresh = sharded("adam", sharding)
    loaded = set_model_state_dict(fresh.module, state)
    assert not loaded.missing_keys and not loaded.unexpected_keys
    fresh.fused_optimizer.load_state_dict(model.fused_optimizer.state_dict())  # the stock table's
    assert_same(snapshot(kv(fresh)), snapshot(kv(model)))
    for a, b in zip(
        train_sharded(model, range(3, 5)), train_sharded(fresh, range(3, 5)), strict=True
    ):
        assert torch.equal(a, b)
    assert_same(snapshot(kv(fresh)), snapshot(kv(model)))
    for name, value in stock_rows(model).items():
        assert torch.equal(stock_rows(fresh)[name], value), name


@SHARDINGS
def test_sharded_sequences_round_trip(sharding, one_rank):
    """A stock ``EmbeddingCollection`` with a KV table by the sharder, a
    ``KVEmbeddingCollection`` and a stock table, under DMP."""
    model, sharders = sequence_model()
    plan = sequence_plan(model, sharders, sharding)
    model = DistributedModelParallel(
        model, device=torch.device("cpu"), plan=plan, sharders=sharders
    )
    train_sequences("sequences", model, range(3))
    state = get_model_state_dict(model.module)
    assert list(state) == list(model.module.state_dict())
    fresh, _ = sequence_model()
    fresh = DistributedModelParallel(
        fresh, device=torch.device("cpu"), plan=plan, sharders=sharders
    )
    loaded = set_model_state_dict(fresh.module, state)
    assert not loaded.missing_keys and not loaded.unexpected_keys
    fresh.fused_optimizer.load_state_dict(model.fused_optimizer.state_dict())
    for a, b in zip(
        train_sequences("sequences", model, range(3, 5)),
        train_sequences("sequences", fresh, range(3, 5)),
        strict=True,
    ):
        assert torch.equal(a, b)
    want, got = local_state(model.module), local_state(fresh.module)
    assert got["kv.embeddings.item.weight_id"].numel()
    for key, value in want.items():
        assert torch.equal(got[key], value), key


def test_get_and_set_state_dict_with_a_dense_optimizer(one_rank):
    model = sharded("adagrad", "row_wise")
    optimizer = torch.optim.Adam(model.module.dense.parameters(), lr=0.02)
    for step in range(3):
        out = model(sharded_batch(step))
        out.sum().backward()
        optimizer.step()
        optimizer.zero_grad()
    model_state, optim_state = get_state_dict(model.module, optimizer)
    assert sorted(optim_state["state"]) == ["dense.bias", "dense.weight"]

    fresh = sharded("adagrad", "row_wise")
    fresh_optimizer = torch.optim.Adam(fresh.module.dense.parameters(), lr=0.02)
    set_state_dict(
        fresh.module, fresh_optimizer, model_state_dict=model_state, optim_state_dict=optim_state
    )
    fresh.fused_optimizer.load_state_dict(model.fused_optimizer.state_dict())
    assert_same(snapshot(kv(fresh)), snapshot(kv(model)))
    for a, b in zip(
        fresh_optimizer.state_dict()["state"].values(),
        optimizer.state_dict()["state"].values(),
        strict=True,
    ):
        assert all(torch.equal(a[k], b[k]) for k in b)
    for name, value in stock_rows(model).items():
        assert torch.equal(stock_rows(fresh)[name], value), name


def test_get_state_dict_with_the_fused_optimizer_fails_for_stock_tables_alike(one_rank):
    """torch maps an optimizer's state by integer parameter ids; TorchRec's
    ``fused_optimizer`` keys it by name, so torch's helpers fail on it for stock tables
    too. The recipe: ``get_model_state_dict(model.module)`` with
    ``model.fused_optimizer.state_dict()`` (docs/checkpoint-format.md)."""
    stock_config = EmbeddingBagConfig(
        name="stock", embedding_dim=4, num_embeddings=100, feature_names=["s"]
    )
    stock_only = shard_on_one_rank(
        nn.ModuleDict({"ebc": EmbeddingBagCollection([stock_config], device=torch.device("meta"))}),
        [EmbeddingBagCollectionSharder(fused_params=ADAGRAD)],
        ["stock"],
        "table_wise",
    )
    with pytest.raises(KeyError, match="stock.weight"):
        get_state_dict(stock_only.module, stock_only.fused_optimizer)
    model = sharded("adagrad", "row_wise")
    train_sharded(model, range(2))
    with pytest.raises(KeyError, match="weight"):
        get_state_dict(model.module, model.fused_optimizer)


def test_a_full_state_dict_at_world_size_one_round_trips(one_rank):
    """``full_state_dict=True`` gathers ShardedTensors into whole tensors by even row
    chunks per rank: exact at world size one (one shard)."""
    options = StateDictOptions(full_state_dict=True)
    model = sharded("adam", "row_wise")
    train_sharded(model, range(3))
    full = get_model_state_dict(model.module, options=options)
    assert all(type(v) is torch.Tensor for v in full.values())
    fresh = sharded("adam", "table_wise")
    set_model_state_dict(fresh.module, full, options=options)
    assert_same(snapshot(kv(fresh)), snapshot(kv(model)))


def even_chunk_gather(whole: torch.Tensor, first_shard: int) -> torch.Tensor:
    """What an even-chunk gather makes of two unequal row shards (the first holding
    ``first_shard`` rows): each padded with zero rows to ``ceil(rows / 2)``, the
    whole cut back to ``rows``."""
    rows = whole.shape[0]
    chunk = -(-rows // 2)
    pad = torch.zeros((chunk - first_shard, *whole.shape[1:]), dtype=whole.dtype)
    return torch.cat([whole[:first_shard], pad, whole[first_shard:]])[:rows]


def test_rows_of_an_uneven_gather_are_refused_naming_the_recipe(one_rank):
    """Sharded KV tables hold unequal shards; an even-chunk gather of them (torch's
    ``full_state_dict`` at world size > 1) loses rows and adds zero rows: the load
    refuses it and changes nothing."""
    model = sharded("adam", "row_wise")
    train_sharded(model, range(3))
    full = get_model_state_dict(model.module, options=StateDictOptions(full_state_dict=True))
    prefix = "ebc.embedding_bags.user."  # ids from 2**41: the zero row's id 0 is new
    rows = full[prefix + "weight_id"].shape[0]
    for key in [k for k in full if k.startswith(prefix) and k.rpartition(".")[2] != "bucket"]:
        if full[key].dim() and full[key].shape[0] == rows:
            full[key] = even_chunk_gather(full[key], -(-rows // 2) - 1)
    fresh = sharded("adam", "row_wise")
    before = snapshot(kv(fresh))
    with pytest.raises(CheckpointError, match="'user'.*rows were lost or added.*KVLoadPlanner"):
        set_model_state_dict(fresh.module, full)
    assert_same(snapshot(kv(fresh)), before)
