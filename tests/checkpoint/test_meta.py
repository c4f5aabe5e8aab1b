"""KV modules whose tables live on the ``meta`` device (a model built for planning or
before materializing): ``state_dict()`` and ``fused_optimizer.state_dict()`` hold empty
KV entries of the right dims and dtypes, on meta; loading rows into them is refused
with a ``CheckpointError`` (docs/checkpoint-format.md, "Tables on the meta device")."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torchrec import EmbeddingBagCollection
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, ParameterConstraints, Topology

from tests.checkpoint.test_optimizer_state import CONFIGS, KV, STOCK, sharded, train
from tests.checkpoint.test_state_dict import ADAGRAD, OPTIONS, configs, trained
from torchrec_kvemb import KVEmbeddingBagCollection, KVEmbeddingBagCollectionSharder, checkpoint
from torchrec_kvemb.checkpoint import CheckpointError

META = torch.device("meta")
DIMS = {"user": 6, "item": 3}


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection([*CONFIGS, STOCK], device=META)
        self.dense = nn.Linear(13, 1, device=META)


def meta_model(sharding: str) -> DistributedModelParallel:
    """KV tables ``user`` and ``item`` and a stock table in one collection, sharded on
    the meta device (no data parallel wrapping: its parameters are meta tensors)."""
    model = Model()
    sharders = [KVEmbeddingBagCollectionSharder({t: OPTIONS[t] for t in KV}, ADAGRAD)]
    constraints = {t: ParameterConstraints(sharding_types=[sharding]) for t in KV}
    constraints["stock"] = ParameterConstraints(sharding_types=["table_wise"])
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=1, compute_device="cpu"), constraints=constraints
    )
    plan = planner.collective_plan(model, sharders, dist.GroupMember.WORLD)
    return DistributedModelParallel(
        model, device=META, plan=plan, sharders=sharders, init_data_parallel=False
    )


def shards(value) -> list[torch.Tensor]:
    return [s.tensor for s in value.local_shards()]


@pytest.mark.parametrize("sharding", ["row_wise", "table_wise"])
def test_state_dict_of_meta_tables_is_empty_with_the_right_dims(sharding, one_rank):
    model = meta_model(sharding)
    assert {t.device for t in model.module.ebc.kv_tables().values()} == {META}
    state = model.state_dict()
    for table, dim in DIMS.items():
        p = f"ebc.embedding_bags.{table}."
        want = {
            "weight": ((0, dim), torch.float32),
            "weight_id": ((0,), torch.int64),
            "weight_score": ((0,), torch.int64),
            "momentum1": ((0,), torch.float32),
            "bucket": ((OPTIONS[table].total_num_buckets,), torch.int64),
        }
        for key, (shape, dtype) in want.items():
            value = state[p + key]
            assert (tuple(value.size()), value.dtype) == (shape, dtype), key
            assert all(t.is_meta for t in shards(value)), key
        assert state[p + "step"].tolist() == [0, 0]
    by_id = model.fused_optimizer.state_dict()["state"]["ebc.embedding_bags.user.weight"]["by_id"]
    assert tuple(by_id["momentum1"].size()) == (0,)
    assert all(t.is_meta for t in shards(by_id["weight_id"]))
    # Its own (empty) state_dict loads back: nothing to put in the tables.
    model.load_state_dict(state)


def test_loading_rows_into_meta_tables_is_refused(one_rank, tmp_path):
    source = sharded("adagrad", "row_wise")
    train(source, range(2))
    model = meta_model("row_wise")
    with pytest.raises(CheckpointError, match="table '(user|item)'.*meta device"):
        model.load_state_dict(source.state_dict())
    checkpoint.save(source, tmp_path / "ckpt")
    with pytest.raises(CheckpointError, match="table '(user|item)'.*meta device"):
        checkpoint.load(model, tmp_path / "ckpt", strict=False)


def test_unsharded_collection_on_meta():
    ebc = KVEmbeddingBagCollection(configs(), OPTIONS, device=META, fused_params=ADAGRAD)
    state = ebc.state_dict()
    assert tuple(state["embedding_bags.user.weight"].shape) == (0, 6)
    assert state["embedding_bags.user.weight"].is_meta
    assert state["embedding_bags.user.admission_id"].is_meta  # user has admission
    with pytest.raises(CheckpointError, match="'user'.*meta device"):
        ebc.load_state_dict(trained().state_dict())
