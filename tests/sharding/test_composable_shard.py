"""TorchRec's composable sharding API (``torchrec.distributed.shard``: ``shard_modules``
for a model, ``shard`` for one module) with the KV sharders, for bag and sequence
collections: its FQN check (a module's ``named_modules``, parameters and buffers
unchanged by sharding) accepts them, for a stock module given KV tables by the sharder
and for a KV module alike, and the sharded model trains exactly as
``DistributedModelParallel``'s with the same plan, stock tables beside the KV ones.
One process, a world-size-1 gloo group."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology
from torchrec.distributed.shard import shard, shard_modules
from torchrec.distributed.types import ShardingPlan
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.checkpoint.ckpt_worker import (
    ADAGRAD,
    ADAM,
    ITEM,
    ITEM_OPTIONS,
    STOCK,
    USER_OPTIONS,
    Model,
    global_batch,
    kjt,
    user_config,
)
from torchrec_kvemb import (
    KVEmbeddingBagCollection,
    KVEmbeddingBagCollectionSharder,
    KVEmbeddingCollection,
    KVEmbeddingCollectionSharder,
)

CPU, META = torch.device("cpu"), torch.device("meta")
DIM = 4


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


class SequenceModel(nn.Module):
    """A stock ``EmbeddingCollection`` (KV table ``user`` by the sharder, stock table
    ``stock``), a ``KVEmbeddingCollection`` (``item``) and a dense layer."""

    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingCollection(
            [
                EmbeddingConfig(
                    name="user", embedding_dim=DIM, num_embeddings=2**40, feature_names=["u1", "u2"]
                ),
                EmbeddingConfig(
                    name="stock", embedding_dim=DIM, num_embeddings=100, feature_names=["s"]
                ),
            ],
            device=META,
        )
        item = EmbeddingConfig(
            name="item", embedding_dim=DIM, num_embeddings=2**63 - 1, feature_names=["i"]
        )
        self.kv = KVEmbeddingCollection([item], {"item": ITEM_OPTIONS}, fused_params=ADAM)
        torch.manual_seed(0)
        self.dense = nn.Linear(DIM, 1)

    def forward(self, ebc_kjt: KeyedJaggedTensor, kv_kjt: KeyedJaggedTensor):
        a, b = self.ebc(ebc_kjt), self.kv(kv_kjt)
        outputs = {k: a[k].values() for k in ("u1", "u2", "s")} | {"i": b["i"].values()}
        return outputs, self.dense(torch.cat(list(outputs.values()))).squeeze(1)


def build(kind: str) -> tuple[nn.Module, list]:
    """A model of ``kind`` and its sharders (a stock collection with KV table ``user``,
    a KV collection)."""
    if kind == "bags":
        ebc = EmbeddingBagCollection([user_config(), STOCK], device=META)
        model = Model(
            ebc, KVEmbeddingBagCollection([ITEM], {"item": ITEM_OPTIONS}, fused_params=ADAM)
        )
        return model, [
            KVEmbeddingBagCollectionSharder({"user": USER_OPTIONS}, fused_params=ADAGRAD),
            KVEmbeddingBagCollectionSharder(module_type=KVEmbeddingBagCollection),
        ]
    return SequenceModel(), [
        KVEmbeddingCollectionSharder({"user": USER_OPTIONS}, fused_params=ADAGRAD),
        KVEmbeddingCollectionSharder(module_type=KVEmbeddingCollection),
    ]


def plan_for(model: nn.Module, sharders: list, sharding: str) -> ShardingPlan:
    constraints = {
        "user": ParameterConstraints(sharding_types=[sharding]),
        "item": ParameterConstraints(sharding_types=[sharding]),
        "stock": ParameterConstraints(sharding_types=["table_wise"]),
    }
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=1, compute_device="cpu"), constraints=constraints
    )
    return planner.collective_plan(model, sharders, dist.GroupMember.WORLD)


def train(kind: str, model: nn.Module, steps: range) -> list[torch.Tensor]:
    """Steps over the whole global batch: the fused optimizers in backward, SGD over
    the dense layer."""
    dense = model.module.dense if isinstance(model, DistributedModelParallel) else model.dense
    optimizer = torch.optim.SGD(dense.parameters(), lr=0.05)
    bags = slice(0, 12)
    outputs = []
    for step in steps:
        batch = global_batch(step)
        ebc_in, kv_in = kjt(batch, ["u1", "u2", "s"], bags), kjt(batch, ["i"], bags)
        if kind == "bags":
            a, b, out = model(ebc_in, kv_in)
            pooled = {k: a[k] for k in ("u1", "u2", "s")} | {"i": b["i"]}
            loss = sum((pooled[k] * batch[k][2][bags]).sum() for k in pooled) + out.sum()
        else:
            rows, out = model(ebc_in, kv_in)
            loss = sum(
                (v * torch.linspace(-1, 1, v.numel()).view_as(v)).sum() for v in rows.values()
            )
            loss = loss + out.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        outputs.append(out.detach())
    return outputs


def local_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every state_dict entry as this rank's tensor."""
    out = {}
    for key, value in module.state_dict().items():
        if hasattr(value, "local_shards"):
            shards = value.local_shards()
            value = shards[0].tensor if shards else torch.empty(0)
        out[key] = value.detach().clone()
    return out


def composable(kind: str, api: str, sharding: str, plan: ShardingPlan) -> nn.Module:
    model, sharders = build(kind)
    if api == "shard_modules":
        return shard_modules(model, plan=plan, sharders=sharders, device=CPU)
    for name, sharder in zip(("ebc", "kv"), sharders, strict=True):
        sharded = shard(
            getattr(model, name), plan.get_plan_for_module(name), device=CPU, sharder=sharder
        )
        setattr(model, name, sharded)
    return model


@pytest.mark.parametrize("api", ["shard_modules", "shard"])
@pytest.mark.parametrize("sharding", ["row_wise", "table_wise"])
@pytest.mark.parametrize("kind", ["bags", "sequences"])
def test_composable_sharding_trains_as_dmp(kind, sharding, api, one_rank):
    model, sharders = build(kind)
    plan = plan_for(model, sharders, sharding)
    dmp = DistributedModelParallel(model, device=CPU, plan=plan, sharders=sharders)
    sharded = composable(kind, api, sharding, plan)
    assert type(sharded.ebc) is type(dmp.module.ebc)
    assert type(sharded.kv) is type(dmp.module.kv)
    # The same starting rows: the stock table's are drawn at random when sharded.
    sharded.load_state_dict(dmp.module.state_dict())
    for a, b in zip(train(kind, dmp, range(4)), train(kind, sharded, range(4)), strict=True):
        assert torch.equal(a, b)
    want, got = local_state(dmp.module), local_state(sharded)
    assert list(got) == list(want)
    assert got[
        "kv.embedding_bags.item.weight_id" if kind == "bags" else "kv.embeddings.item.weight_id"
    ].numel()
    for key, value in want.items():
        assert torch.equal(got[key], value), key
