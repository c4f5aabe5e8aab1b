"""The KV tables' fused-optimizer learning rate in checkpoints (docs/checkpoint-format.md):
saved as ``fused_optim.param_groups.<param key>.lr``, given back by ``checkpoint.load``
unsharded and sharded (one process; more ranks: test_distributed_checkpoint.py), and
checkpoints written before it was saved still load."""

import math
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.checkpoint.test_state_dict import (
    ADAGRAD,
    ADAM,
    OPTIONS,
    SGD,
    assert_same,
    configs,
    kjt,
    snapshot,
)
from torchrec_kvemb import KVEmbeddingBagCollection, KVEmbeddingBagCollectionSharder, checkpoint
from torchrec_kvemb.checkpoint import CheckpointError, save_load

#: Learning rates set during training; models are built with others (``BUILT_LR``).
CHANGED = {"user": 0.037, "item": 0.0123}
BUILT_LR = 0.9


def lr_key(table: str) -> str:
    return f"fused_optim.param_groups.ebc.embedding_bags.{table}.weight.lr"


class Model(nn.Module):
    """A KV collection (tables ``user``, dim 6, and ``item``, dim 3) and a dense layer."""

    def __init__(self, fused: dict) -> None:
        super().__init__()
        self.ebc = KVEmbeddingBagCollection(configs(), OPTIONS, fused_params=fused)
        torch.manual_seed(0)
        self.dense = nn.Linear(9, 1)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return self.dense(self.ebc(features).values())


def built(fused: dict) -> Model:
    """A model whose KV tables start at ``BUILT_LR``, not at ``fused``'s."""
    return Model(dict(fused, learning_rate=BUILT_LR))


def sharded(fused: dict, sharding: str) -> DistributedModelParallel:
    model = built(fused)
    sharders = [KVEmbeddingBagCollectionSharder(module_type=KVEmbeddingBagCollection)]
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=1, compute_device="cpu"),
        constraints={t: ParameterConstraints(sharding_types=[sharding]) for t in CHANGED},
    )
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    return DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)


def kv_module(model: nn.Module) -> nn.Module:
    return model.module.ebc if isinstance(model, DistributedModelParallel) else model.ebc


def kv_lr(model: nn.Module) -> dict[str, float]:
    """Each KV table's learning rate where a user reads it: the param group holding its
    rows in ``model.fused_optimizer`` (sharded), the table's ``optim`` (unsharded)."""
    tables = kv_module(model).kv_tables()
    if not isinstance(model, DistributedModelParallel):
        return {name: table.optim.learning_rate for name, table in tables.items()}
    groups = model.fused_optimizer.param_groups
    return {
        name: next(g["lr"] for g in groups if any(p is table.weights for p in g["params"]))
        for name, table in tables.items()
    }


def set_lr(model: nn.Module, lrs: dict[str, float]) -> None:
    """Sharded, both tables share one param group: ``param_groups[0]["lr"] = x``."""
    if isinstance(model, DistributedModelParallel):
        (group,) = model.fused_optimizer.param_groups
        (group["lr"],) = set(lrs.values())
        return
    for name, table in kv_module(model).kv_tables().items():
        table.optim = table.optim.with_learning_rate(lrs[name])


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        model(kjt(step)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()


def dense_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    dense = model.module.dense if isinstance(model, DistributedModelParallel) else model.dense
    return torch.optim.SGD(dense.parameters(), lr=0.05)


def saved_lrs(path) -> dict[str, float]:
    """The learning rate entries of a checkpoint, read with plain DCP."""
    keys = [k for k in dcp.FileSystemReader(path).read_metadata().state_dict_metadata]
    values = {k: None for k in keys if k.startswith("fused_optim.param_groups.")}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that there is no process group
        dcp.load(values, storage_reader=dcp.FileSystemReader(path), no_dist=True)
    return values


@pytest.fixture
def one_rank(tmp_path):
    """A gloo process group of one rank in this process."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------- unsharded
@pytest.mark.parametrize("fused", [SGD, ADAGRAD, ADAM], ids=["sgd", "adagrad", "adam"])
def test_learning_rate_comes_back_and_training_goes_on_the_same(fused, tmp_path):
    model = Model(fused)
    optimizer = dense_optimizer(model)
    train(model, optimizer, range(2))
    set_lr(model, CHANGED)
    train(model, optimizer, range(2, 4))
    checkpoint.save(model, tmp_path / "ckpt", optimizer=optimizer)
    assert saved_lrs(tmp_path / "ckpt") == {lr_key(t): lr for t, lr in CHANGED.items()}

    fresh = built(fused)
    fresh_optimizer = dense_optimizer(fresh)
    assert kv_lr(fresh) == {"user": BUILT_LR, "item": BUILT_LR}
    checkpoint.load(fresh, tmp_path / "ckpt", optimizer=fresh_optimizer)
    assert kv_lr(fresh) == CHANGED
    assert_same(snapshot(fresh.ebc), snapshot(model.ebc))
    # The next steps update the rows as in the run that never stopped, bit for bit.
    train(model, optimizer, range(4, 6))
    train(fresh, fresh_optimizer, range(4, 6))
    assert_same(snapshot(fresh.ebc), snapshot(model.ebc))


@pytest.mark.parametrize("where", ["unsharded", "row_wise"])
def test_a_checkpoint_without_learning_rates_loads_and_keeps_the_current_ones(
    where, tmp_path, monkeypatch, request
):
    """A checkpoint written before the learning rates were saved: no entries."""
    model = Model(ADAGRAD)
    optimizer = dense_optimizer(model)
    train(model, optimizer, range(3))
    set_lr(model, CHANGED)
    with monkeypatch.context() as patch:
        patch.setattr(save_load, "learning_rates", lambda slots: {})
        checkpoint.save(model, tmp_path / "old")
    assert saved_lrs(tmp_path / "old") == {}

    if where == "unsharded":
        fresh = built(ADAGRAD)
    else:
        request.getfixturevalue("one_rank")
        fresh = sharded(ADAGRAD, where)
    checkpoint.load(fresh, tmp_path / "old")  # strict
    assert kv_lr(fresh) == {"user": BUILT_LR, "item": BUILT_LR}
    assert {t.optim.learning_rate for t in kv_module(fresh).kv_tables().values()} == {BUILT_LR}
    assert_same(snapshot(kv_module(fresh)), snapshot(model.ebc))


@pytest.mark.parametrize(
    "bad", [-0.5, math.nan, math.inf, "0.1", None], ids=["negative", "nan", "inf", "text", "none"]
)
def test_a_bad_saved_learning_rate_names_the_table_and_changes_nothing(bad, tmp_path, monkeypatch):
    model = Model(ADAGRAD)
    train(model, dense_optimizer(model), range(2))
    with monkeypatch.context() as patch:
        rates = {"ebc.embedding_bags.item.weight": {"lr": bad}}
        patch.setattr(save_load, "learning_rates", lambda slots: rates)
        checkpoint.save(model, tmp_path / "ckpt")
    fresh = built(ADAGRAD)
    train(fresh, dense_optimizer(fresh), range(5, 6))
    before = snapshot(fresh.ebc)
    with pytest.raises(CheckpointError, match=r"table 'item' .*learning rate"):
        checkpoint.load(fresh, tmp_path / "ckpt")
    assert kv_lr(fresh) == {"user": BUILT_LR, "item": BUILT_LR}
    assert_same(snapshot(fresh.ebc), before)


# ------------------------------------------------------- sharded, one rank
@pytest.mark.parametrize(
    "saved_as, loaded_as",
    [("row_wise", "table_wise"), ("table_wise", "row_wise")],
    ids=["row_wise-to-table_wise", "table_wise-to-row_wise"],
)
def test_sharded_learning_rate_comes_back_in_another_sharding(
    saved_as, loaded_as, one_rank, tmp_path
):
    model = sharded(ADAM, saved_as)
    optimizer = dense_optimizer(model)
    train(model, optimizer, range(2))
    set_lr(model, {"user": 0.021, "item": 0.021})
    train(model, optimizer, range(2, 4))
    checkpoint.save(model, tmp_path / "ckpt", optimizer=optimizer)

    fresh = sharded(ADAM, loaded_as)
    fresh_optimizer = dense_optimizer(fresh)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # equal learning rates in one group: no warning
        checkpoint.load(fresh, tmp_path / "ckpt", optimizer=fresh_optimizer)
    assert kv_lr(fresh) == {"user": 0.021, "item": 0.021}
    assert {t.optim.learning_rate for t in kv_module(fresh).kv_tables().values()} == {0.021}
    train(model, optimizer, range(4, 6))
    train(fresh, fresh_optimizer, range(4, 6))
    assert_same(snapshot(kv_module(fresh)), snapshot(kv_module(model)))


def test_tables_sharing_a_param_group_take_one_rate_with_a_warning(one_rank, tmp_path):
    """Unsharded, each table has its own learning rate; sharded, ``user`` and ``item``
    share one param group: the rate of the table whose key sorts first (``item``)
    applies to both."""
    model = Model(ADAGRAD)
    train(model, dense_optimizer(model), range(2))
    set_lr(model, CHANGED)
    checkpoint.save(model, tmp_path / "ckpt")
    fresh = sharded(ADAGRAD, "row_wise")
    with pytest.warns(UserWarning, match=r"\['item', 'user'\] share one fused optimizer"):
        checkpoint.load(fresh, tmp_path / "ckpt")
    want = CHANGED["item"]
    assert kv_lr(fresh) == {"user": want, "item": want}
    assert {t.optim.learning_rate for t in kv_module(fresh).kv_tables().values()} == {want}
