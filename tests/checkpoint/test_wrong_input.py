"""Every wrong input of ``load_state_dict`` and ``checkpoint.load`` gives the documented
``CheckpointError`` naming the table, and changes nothing, whether the entries are
plain tensors, ShardedTensors or DTensors (docs/checkpoint-format.md, "load_state_dict").
One process with a world-size-1 gloo group (the distributed cases: test_plain_dcp.py)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

from tests.checkpoint.test_learning_rate import sharded
from tests.checkpoint.test_state_dict import ADAGRAD, assert_same, build, kjt, snapshot, trained
from torchrec_kvemb import checkpoint
from torchrec_kvemb.checkpoint import CheckpointError
from torchrec_kvemb.ops.hashing import route_bucket
from torchrec_kvemb.state_dict import row_sharded_tensor

KINDS = ["plain", "sharded_tensor", "dtensor"]


def as_kind(kind: str, state: dict) -> dict:
    """``state``'s tensors (but ``step``) as ShardedTensors or DTensors holding them
    whole on the one rank (plain: unchanged)."""
    if kind == "plain":
        return state
    out = {}
    for key, value in state.items():
        if not isinstance(value, torch.Tensor) or key.endswith(".step"):
            out[key] = value
        elif kind == "sharded_tensor":
            group = dist.group.WORLD
            out[key] = row_sharded_tensor(value, [value.shape[0]], ["rank:0/cpu"], 0, group)
        else:
            mesh = init_device_mesh("cpu", (1,))
            out[key] = DTensor.from_local(value, mesh, [Shard(0)], run_check=False)
    return out


def target(where: str) -> tuple[nn.Module, nn.Module]:
    """``(KV collection, model)``: a collection (unsharded, or sharded row-wise at world
    size 1, in the model that keeps it alive) trained on other ids than ``trained()``'s."""
    if where == "unsharded":
        model = module = build()
    else:
        model = sharded(ADAGRAD, "row_wise")
        module = model.module.ebc
    for step in range(20, 22):
        out = model(kjt(step))
        (out if isinstance(out, torch.Tensor) else out.values()).sum().backward()
    return module, model


def stock_weight(state: dict) -> dict:
    return {"embedding_bags.user.weight": torch.zeros(5, 6)}


def other_dim(state: dict) -> dict:
    state["embedding_bags.user.weight"] = state["embedding_bags.user.weight"][:, :4]
    return state


def other_optimizer(state: dict) -> dict:
    state["embedding_bags.user.exp_avg"] = state.pop("embedding_bags.user.momentum1")
    return state


def short_scores(state: dict) -> dict:
    state["embedding_bags.item.weight_score"] = state["embedding_bags.item.weight_score"][:-1]
    return state


def _ids(state: dict, change) -> dict:
    ids = state["embedding_bags.item.weight_id"].clone()
    change(ids)
    state["embedding_bags.item.weight_id"] = ids
    return state


def duplicate_id(state: dict) -> dict:
    return _ids(state, lambda ids: ids.__setitem__(1, ids[0]))


def negative_id(state: dict) -> dict:
    return _ids(state, lambda ids: ids.__setitem__(0, -5))


def too_many_rows(state: dict) -> dict:
    """600 rows for ``user`` (capacity 512), bucket counts consistent."""
    ids = torch.arange(600, dtype=torch.int64) * 7
    p = "embedding_bags.user."
    state.update(
        {
            p + "weight_id": ids,
            p + "weight": torch.zeros(600, 6),
            p + "weight_score": torch.zeros(600, dtype=torch.int64),
            p + "momentum1": torch.zeros(600),
            p + "bucket": torch.bincount(route_bucket(ids, 24), minlength=24),
        }
    )
    return state


def not_a_tensor(state: dict) -> dict:
    state["embedding_bags.item.weight_score"] = [1, 2, 3]
    return state


WRONG = {
    "stock weight": (stock_weight, ["'user'", "weight_id", "load_dense_into_kv"]),
    "other dim": (other_dim, ["'user'", "dim 4", "dim 6"]),
    "other optimizer": (other_optimizer, ["'user'", "exp_avg", "momentum1"]),
    "row counts": (short_scores, ["'item'", "weight_score"]),
    "duplicate id": (duplicate_id, ["'item'", "twice"]),
    "negative id": (negative_id, ["'item'", "negative"]),
    "capacity": (too_many_rows, ["'user'", "600 rows", "capacity"]),
    "not a tensor": (not_a_tensor, ["'item'", "weight_score", "tensor"]),
}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where", ["unsharded", "sharded"])
@pytest.mark.parametrize("wrong", list(WRONG))
def test_load_state_dict_refuses_wrong_input_and_changes_nothing(where, kind, wrong, one_rank):
    change, words = WRONG[wrong]
    module, _model = target(where)
    before = snapshot(module)
    state = as_kind(kind, change(dict(trained().state_dict())))
    with pytest.raises(CheckpointError) as info:
        module.load_state_dict(state)
    for word in words:
        assert word in str(info.value), (word, str(info.value))
    assert_same(snapshot(module), before)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where", ["unsharded", "sharded"])
def test_right_input_of_every_kind_loads(where, kind, one_rank):
    source = trained()
    module, _model = target(where)
    module.load_state_dict(as_kind(kind, dict(source.state_dict())))
    assert_same(snapshot(module), snapshot(source))


# ----------------------------------------------------------- checkpoint.load
STOCK = [
    EmbeddingBagConfig(name="user", embedding_dim=6, num_embeddings=50, feature_names=["u"]),
    EmbeddingBagConfig(name="item", embedding_dim=3, num_embeddings=50, feature_names=["i"]),
]


def stock_model(kind: str) -> nn.Module:
    """A stock collection whose tables' weights are plain tensors, ShardedTensors
    (sharded table-wise by DMP) or DTensors."""
    if kind == "plain":
        return EmbeddingBagCollection(STOCK)
    if kind == "sharded_tensor":
        sharders = [EmbeddingBagCollectionSharder()]
        ebc = EmbeddingBagCollection(STOCK, device=torch.device("meta"))
        planner = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cpu"))
        plan = planner.collective_plan(ebc, sharders, dist.GroupMember.WORLD)
        return DistributedModelParallel(
            ebc, device=torch.device("cpu"), plan=plan, sharders=sharders
        )
    mesh = init_device_mesh("cpu", (1,))
    module = nn.Module()
    module.embedding_bags = nn.ModuleDict({c.name: nn.Module() for c in STOCK})
    for c in STOCK:
        local = torch.randn(c.num_embeddings, c.embedding_dim)
        weight = DTensor.from_local(local, mesh, [Shard(0)])
        module.embedding_bags[c.name].weight = nn.Parameter(weight)
    return module


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where", ["unsharded", "sharded"])
def test_a_stock_checkpoint_points_to_migration(where, kind, one_rank, tmp_path):
    stock = stock_model(kind)
    checkpoint.save(stock, tmp_path / "stock")
    module, _model = target(where)
    before = snapshot(module)
    with pytest.raises(CheckpointError, match=r"table '(user|item)'.*load_dense_into_kv"):
        checkpoint.load(module, tmp_path / "stock")
    assert_same(snapshot(module), before)
