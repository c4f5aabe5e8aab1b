"""``KVEmbeddingBagCollection`` on the meta device, as TorchRec users build large
models before materialising them: built inside ``with torch.device("meta"):`` or with
``device="meta"`` its tables allocate nothing but meta tensors; a forward on meta
gives meta outputs of the stock module's shape; sharding such a model with DMP onto
CPU gives the same training as a model built on CPU."""

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.modules.embedding_configs import PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.checkpoint.one_rank_dmp import shard_on_one_rank
from torchrec_kvemb import (
    KVEmbeddingBagCollection,
    KVEmbeddingBagCollectionSharder,
    KVTableOptions,
    SSDOptions,
)
from torchrec_kvemb.validation import KVInputError

META = torch.device("meta")
CONFIGS = [
    EmbeddingBagConfig(name="a", embedding_dim=6, num_embeddings=2**40, feature_names=["x", "y"]),
    EmbeddingBagConfig(
        name="b", embedding_dim=3, num_embeddings=2**40, feature_names=["x"],
        pooling=PoolingType.MEAN,
    ),
]  # fmt: skip
OPTIONS = KVTableOptions(capacity=1 << 16, total_num_buckets=24)
FUSED = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1}


def tensors_of(obj, seen=None, depth=0):
    """Every tensor reachable from ``obj``'s attributes (a few levels down)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 4:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, list | tuple):
        children = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        children = list(vars(obj).values())
    else:
        return []
    return [t for child in children for t in tensors_of(child, seen, depth + 1)]


def batch(step: int) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 4, (2 * 5,), generator=g)
    values = torch.randint(0, 30, (int(lengths.sum()),), generator=g) * 2**35
    return KeyedJaggedTensor.from_lengths_sync(keys=["y", "x"], values=values, lengths=lengths)


def on_meta(how: str) -> KVEmbeddingBagCollection:
    if how == "context":
        with torch.device("meta"):
            return KVEmbeddingBagCollection(CONFIGS, OPTIONS, fused_params=FUSED)
    return KVEmbeddingBagCollection(CONFIGS, OPTIONS, device="meta", fused_params=FUSED)


HOW = pytest.mark.parametrize("how", ["context", "device-arg"])


@HOW
def test_tables_allocate_on_meta_only(how):
    ebc = on_meta(how)
    assert ebc.device == META
    for name, table in ebc.kv_tables().items():
        found = tensors_of(table)
        assert found, f"table {name!r}: no tensors found"
        on = {t.device.type for t in found}
        assert on == {"meta"}, f"table {name!r} has tensors on {on}"
        big = [t for t in found if t.numel() >= OPTIONS.capacity]
        assert big, f"table {name!r}: its rows were not found"


@HOW
@pytest.mark.parametrize("training", [True, False], ids=["train", "eval"])
def test_forward_on_meta_gives_the_stock_modules_shape(how, training):
    ebc = on_meta(how).train(training)
    stock = EmbeddingBagCollection(CONFIGS, device=META).train(training)
    for kjt in (batch(0), batch(1).to(META)):
        got, want = ebc(kjt), stock(kjt)
        assert got.keys() == want.keys()
        assert got.length_per_key() == want.length_per_key()
        assert got.values().device == META
        assert got.values().shape == want.values().shape
        assert got.values().requires_grad == training
        if training:
            got.values().sum().backward()


def test_forward_on_meta_refuses_a_missing_feature():
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["y"], values=torch.tensor([1]), lengths=torch.tensor([1])
    )
    with pytest.raises(KVInputError, match="table 'a': feature 'x' is missing"):
        on_meta("device-arg")(kjt)


def test_an_ssd_tier_on_meta_is_refused(tmp_path):
    options = KVTableOptions(capacity=64, ssd=SSDOptions(path=str(tmp_path)))
    with pytest.raises(ValueError, match="table 'a'.*meta"):
        KVEmbeddingBagCollection(CONFIGS[:1], options, device="meta")


class Model(nn.Module):
    def __init__(self, ebc: nn.Module) -> None:
        super().__init__()
        self.ebc = ebc

    def forward(self, features: KeyedJaggedTensor) -> torch.Tensor:
        return self.ebc(features).values()


def shard(model: nn.Module, sharding: str) -> DistributedModelParallel:
    sharders = [KVEmbeddingBagCollectionSharder(module_type=KVEmbeddingBagCollection)]
    return shard_on_one_rank(model, sharders, [c.name for c in CONFIGS], sharding)


@pytest.mark.parametrize("sharding", ["row_wise", "table_wise"])
def test_a_model_built_on_meta_shards_onto_cpu(sharding, one_rank):
    from_meta = shard(Model(on_meta("context")), sharding)
    from_cpu = shard(
        Model(KVEmbeddingBagCollection(CONFIGS, OPTIONS, fused_params=FUSED)), sharding
    )
    for model in (from_meta, from_cpu):
        assert {t.device.type for t in model.module.ebc.kv_tables().values()} == {"cpu"}
    for step in range(4):
        outs = []
        for model in (from_meta, from_cpu):
            out = model(batch(step))
            (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
            outs.append(out.detach())
        assert torch.equal(outs[0], outs[1]), f"step {step}"
