"""KV tables' optimizer state in ``fused_optimizer.state_dict()`` / ``load_state_dict()``
(docs/checkpoint-format.md, "Optimizer state"): keyed by id, in the row order of the
model's state_dict, applied by id, refused for other ids. One process with a
world-size-1 gloo group; two ranks: test_plain_dcp.py."""

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.checkpoint.test_state_dict import ADAGRAD, ADAM, OPTIONS, assert_same, snapshot
from torchrec_kvemb import (
    KVEmbeddingBagCollection,
    KVEmbeddingBagCollectionSharder,
    KVTable,
    KVTableOptions,
    checkpoint,
)
from torchrec_kvemb.checkpoint import CheckpointError
from torchrec_kvemb.optimizer import FusedOptimConfig, OptimKind
from torchrec_kvemb.sharding import KVFusedOptimizer

KV = ("user", "item")
CONFIGS = [
    EmbeddingBagConfig(name="user", embedding_dim=6, num_embeddings=2**40, feature_names=["u"]),
    EmbeddingBagConfig(name="item", embedding_dim=3, num_embeddings=2**40, feature_names=["i"]),
]
STOCK = EmbeddingBagConfig(name="stock", embedding_dim=4, num_embeddings=100, feature_names=["s"])
FUSED = {"adagrad": ADAGRAD, "adam": ADAM}
STATE = {"adagrad": ("momentum1",), "adam": ("exp_avg", "exp_avg_sq")}


class Model(nn.Module):
    """KV tables ``user`` (dim 6) and ``item`` (dim 3) in a KV collection, a stock
    table ``stock`` (dim 4; fused TBE, row-wise Adagrad: fbgemm's CPU TBE has no
    Adam) in a stock one, and a dense layer."""

    def __init__(self, optim: str) -> None:
        super().__init__()
        self.ebc = KVEmbeddingBagCollection(CONFIGS, OPTIONS, fused_params=FUSED[optim])
        self.stock = EmbeddingBagCollection([STOCK], device=torch.device("meta"))
        torch.manual_seed(0)
        self.dense = nn.Linear(13, 1)

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        jts = features.to_dict()
        kv = KeyedJaggedTensor.from_jt_dict({k: jts[k] for k in ("u", "i")})
        stock = KeyedJaggedTensor.from_jt_dict({"s": jts["s"]})
        return self.dense(torch.cat([self.ebc(kv).values(), self.stock(stock).values()], 1))


def sharded(optim: str, sharding: str) -> DistributedModelParallel:
    """The model under DMP at world size 1, KV tables ``sharding``, the stock table
    table-wise."""
    model = Model(optim)
    sharders = [
        KVEmbeddingBagCollectionSharder(module_type=KVEmbeddingBagCollection),
        EmbeddingBagCollectionSharder(fused_params=ADAGRAD),
    ]
    constraints = {t: ParameterConstraints(sharding_types=[sharding]) for t in KV}
    constraints["stock"] = ParameterConstraints(sharding_types=["table_wise"])
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=1, compute_device="cpu"), constraints=constraints
    )
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    return DistributedModelParallel(model, device=torch.device("cpu"), plan=plan, sharders=sharders)


def batch(step: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(1, 6, (3 * 4,), generator=g)
    n = lengths.view(3, 4).sum(1).tolist()
    values = [
        torch.randint(0, 60, (n[0],), generator=g) + 2**41,
        torch.randint(0, 40, (n[1],), generator=g),
        torch.randint(0, 100, (n[2],), generator=g),
    ]
    return KeyedJaggedTensor.from_lengths_sync(
        keys=["u", "i", "s"], values=torch.cat(values), lengths=lengths
    )


def dense_sgd(model: DistributedModelParallel) -> torch.optim.Optimizer:
    """Plain SGD (stateless) over the dense layer: two models stay comparable."""
    return torch.optim.SGD(model.module.dense.parameters(), lr=0.05)


def train(model: DistributedModelParallel, steps: range) -> list[torch.Tensor]:
    optimizer = dense_sgd(model)
    outputs = []
    for step in steps:
        out = model(batch(step))
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        outputs.append(out.detach())
    return outputs


def kv(model: DistributedModelParallel) -> nn.Module:
    return model.module.ebc


def stock_rows(model: DistributedModelParallel) -> dict[str, torch.Tensor]:
    """The stock table's rows and fused optimizer state (one rank holds all)."""
    weight = model.state_dict()["stock.embedding_bags.stock.weight"].local_shards()[0].tensor
    state = model.fused_optimizer.state_dict()["state"]["stock.embedding_bags.stock.weight"]
    return {"weight": weight.clone(), **{k: v.local_shards()[0].tensor for k, v in state.items()}}


def local(value) -> torch.Tensor:
    return value.local_shards()[0].tensor


PARAMS = pytest.mark.parametrize(
    "optim, sharding",
    [("adagrad", "row_wise"), ("adam", "row_wise"), ("adagrad", "table_wise")],
)


# ------------------------------------------------------------------ layout
@PARAMS
def test_fused_optimizer_state_is_by_id_in_the_model_state_dicts_row_order(
    optim, sharding, one_rank
):
    model = sharded(optim, sharding)
    train(model, range(3))
    state = model.state_dict()
    fused = model.fused_optimizer.state_dict()["state"]
    for table in KV:
        prefix = f"ebc.embedding_bags.{table}."
        by_id = fused[f"{prefix}weight"]["by_id"]
        assert set(by_id) == {"weight_id", *STATE[optim]}
        ids = local(by_id["weight_id"])
        assert ids.numel() == kv(model).kv_tables()[table].size > 0
        assert torch.equal(ids, local(state[f"{prefix}weight_id"]))
        for name in STATE[optim]:
            assert torch.equal(local(by_id[name]), local(state[f"{prefix}{name}"]))


# ------------------------------------------------------- load into another
@PARAMS
def test_fused_optimizer_state_of_another_model_loads_exactly_per_id(optim, sharding, one_rank):
    """``m1.fused_optimizer.load_state_dict(m2.fused_optimizer.state_dict())``: m1 holds
    m2's ids in other storage slots (loaded, not trained) and no optimizer state; after
    the load every id has m2's state (slot-indexed state would scramble it)."""
    m2 = sharded(optim, sharding)
    train(m2, range(4))
    m1 = sharded(optim, sharding)
    rows = m2.state_dict()
    for key, value in rows.items():
        if key.endswith(STATE[optim]):
            local(value).zero_()
    m1.load_state_dict(rows)
    for table in KV:
        for name in STATE[optim]:
            assert not local(m1.state_dict()[f"ebc.embedding_bags.{table}.{name}"]).any()

    m1.fused_optimizer.load_state_dict(m2.fused_optimizer.state_dict())
    assert_same(snapshot(kv(m1)), snapshot(kv(m2)))
    assert torch.equal(stock_rows(m1)["stock.momentum1"], stock_rows(m2)["stock.momentum1"])


@pytest.mark.parametrize("sharding", ["row_wise", "table_wise"])
def test_optimizer_state_for_other_ids_is_refused_and_changes_nothing(sharding, one_rank):
    m2 = sharded("adagrad", sharding)
    train(m2, range(4))
    saved = m2.fused_optimizer.state_dict()
    other = sharded("adagrad", sharding)
    train(other, range(10, 12))  # other ids than m2's
    before = snapshot(kv(other))
    with pytest.raises(CheckpointError, match=r"table '(user|item)': .*other ids"):
        other.fused_optimizer.load_state_dict(saved)
    assert_same(snapshot(kv(other)), before)
    fresh = sharded("adagrad", sharding)  # no ids yet: the model's state_dict comes first
    with pytest.raises(CheckpointError, match="load the model's state_dict .* first"):
        fresh.fused_optimizer.load_state_dict(saved)


def test_optimizer_state_of_another_optimizer_is_refused(one_rank):
    adagrad, adam = sharded("adagrad", "row_wise"), sharded("adam", "row_wise")
    train(adagrad, range(3))
    train(adam, range(3))  # the same ids
    by_id = adagrad.fused_optimizer.state_dict()["state"]["ebc.embedding_bags.user.weight"]
    state = adam.fused_optimizer.state_dict()
    state["state"]["ebc.embedding_bags.user.weight"] = by_id
    with pytest.raises(CheckpointError, match=r"table 'user': optimizer state \['momentum1'\]"):
        adam.fused_optimizer.load_state_dict(state)


# ------------------------------------------- a round trip, training goes on
@PARAMS
def test_model_and_fused_optimizer_state_dicts_resume_training_bit_identically(
    optim, sharding, one_rank, tmp_path
):
    """``model.state_dict()`` and ``fused_optimizer.state_dict()`` saved with
    ``torch.save``, loaded into a fresh model: its next steps equal those of the
    model that never stopped, bit for bit, for KV and stock tables alike."""
    model = sharded(optim, sharding)
    train(model, range(4))
    torch.save(
        {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()},
        tmp_path / "state.pt",
    )
    fresh = sharded(optim, sharding)
    saved = torch.load(tmp_path / "state.pt", weights_only=False)
    fresh.load_state_dict(saved["model"])
    fresh.fused_optimizer.load_state_dict(saved["optim"])

    for a, b in zip(train(model, range(4, 8)), train(fresh, range(4, 8)), strict=True):
        assert torch.equal(a, b)
    assert_same(snapshot(kv(fresh)), snapshot(kv(model)))
    for name, value in stock_rows(model).items():
        assert torch.equal(stock_rows(fresh)[name], value), name


# --------------------------------------------------------- checkpoint.save
def test_checkpoints_keep_kv_optimizer_state_with_the_rows_only(one_rank, tmp_path):
    """The checkpoint format is unchanged: ``fused_optim.state`` holds the stock
    table's state, KV tables' state is in ``model.*`` (by id, beside the rows)."""
    model = sharded("adagrad", "row_wise")
    train(model, range(3))
    checkpoint.save(model, tmp_path / "ckpt")
    keys = set(dcp.FileSystemReader(tmp_path / "ckpt").read_metadata().state_dict_metadata)
    fused = sorted(k for k in keys if k.startswith("fused_optim.state."))
    assert fused == ["fused_optim.state.stock.embedding_bags.stock.weight.stock.momentum1"]
    assert "model.ebc.embedding_bags.user.momentum1" in keys
    fresh = sharded("adagrad", "row_wise")
    checkpoint.load(fresh, tmp_path / "ckpt")
    assert_same(snapshot(kv(fresh)), snapshot(kv(model)))
    for a, b in zip(train(model, range(3, 5)), train(fresh, range(3, 5)), strict=True):
        assert torch.equal(a, b)


# ------------------------------------------------- without a process group
def test_a_kernel_without_a_process_group_gives_plain_tensors():
    adagrad = FusedOptimConfig(kind=OptimKind.ROWWISE_ADAGRAD)
    table = KVTable("t", 4, KVTableOptions(capacity=64, total_num_buckets=8), adagrad)
    optimizer = KVFusedOptimizer([table])
    ids = torch.tensor([5, 2**50, 17])
    table.insert(ids, torch.ones(3, 4), torch.tensor([[1.0], [2.0], [3.0]]))
    by_id = optimizer.state_dict()["state"]["t.weight"]["by_id"]
    assert torch.equal(by_id["weight_id"], table.export(route_buckets=8)["ids"])
    want = {5: 1.0, 2**50: 2.0, 17: 3.0}
    assert by_id["momentum1"].tolist() == [want[i] for i in by_id["weight_id"].tolist()]

    other = KVTable("t", 4, KVTableOptions(capacity=64, total_num_buckets=8), adagrad)
    other.insert(ids.flip(0), torch.ones(3, 4))  # same ids, other slots, no state
    loaded = KVFusedOptimizer([other])
    loaded.load_state_dict({"state": {"t.weight": {"by_id": by_id}}})
    assert torch.equal(other.export()["momentum1"], table.export()["momentum1"])
    other.insert(torch.tensor([9]), torch.ones(1, 4))
    with pytest.raises(CheckpointError, match="table 't'"):
        loaded.load_state_dict({"state": {"t.weight": {"by_id": by_id}}})
