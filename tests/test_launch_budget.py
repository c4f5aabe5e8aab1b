"""What one training and one evaluation step of a KV EBC costs a GPU, counted on CPU.

On the Triton backend (kernels run in the interpreter), a TorchDispatchMode
counts the aten ops that make the host wait for the device (``.item()``,
``nonzero``, ``unique``, ...) and a hook counts Triton launches. The counts are
exact and do not depend on the number of tables: the tables of one dim and
optimizer are one group, looked up in one call per step.
"""

import collections

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch.utils._python_dispatch import TorchDispatchMode
from torchrec import EmbeddingBagConfig, KeyedJaggedTensor

from torchrec_kvemb import EvictionPolicy, KVEmbeddingBagCollection, KVTableOptions
from torchrec_kvemb.backend import ENV_VAR

#: aten ops that wait for the device (their result's size or value goes to the host).
SYNCING = {
    "_local_scalar_dense",
    "nonzero",
    "unique_dim",
    "_unique2",
    "_unique",
    "unique_consecutive",
    "masked_select",
    "repeat_interleave",
    "item",
    "_assert_async",
    "index_put_",
    "equal",
    "is_nonzero",
    "tolist",
}
#: The budget the hot path is held to (the counts below are what it uses).
MAX_TRAIN_LAUNCHES, MAX_TRAIN_SYNCS = 8, 2
MAX_EVAL_LAUNCHES, MAX_EVAL_SYNCS = 3, 1


class _Syncs(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNCING:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture
def launches(monkeypatch):
    """A counter of Triton launches by kernel name (the interpreter's run)."""
    import triton.runtime.interpreter as interpreter

    counts = collections.Counter()
    run = interpreter.InterpretedFunction.run

    def counting(self, *args, **kwargs):
        counts[self.fn.__name__] += 1
        return run(self, *args, **kwargs)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", counting)
    return counts


def _ebc(num_tables: int, options: dict) -> KVEmbeddingBagCollection:
    configs = [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=8, num_embeddings=2**40, feature_names=[f"f{i}"]
        )
        for i in range(num_tables)
    ]
    return KVEmbeddingBagCollection(
        configs,
        {c.name: options.get(c.name, KVTableOptions(capacity=64)) for c in configs},
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.01},
    )


def _step(ebc: KVEmbeddingBagCollection, num_tables: int, seed: int, train: bool) -> None:
    gen = torch.Generator().manual_seed(seed)
    batch, bag = 16, 3
    values = torch.randint(0, 200, (num_tables * batch * bag,), generator=gen)
    kjt = KeyedJaggedTensor(
        keys=[f"f{i}" for i in range(num_tables)],
        values=values,
        lengths=torch.full((num_tables * batch,), bag),
    )
    ebc.train(train)
    if train:
        ebc(kjt).values().sum().backward()
    else:
        with torch.no_grad():
            ebc(kjt)


def _measure(ebc, num_tables, launches, train: bool) -> tuple[dict, dict]:
    launches.clear()
    with _Syncs() as syncs:
        _step(ebc, num_tables, 99 if train else 98, train)
    return dict(launches), dict(syncs.ops)


POLICIES = {
    "lru": {},
    "mixed-policies-admission": {
        "t0": KVTableOptions(capacity=64, eviction=EvictionPolicy.LFU, admission_threshold=2),
        "t1": KVTableOptions(capacity=37, eviction=EvictionPolicy.NONE),
        "t2": KVTableOptions(capacity=48, admission_threshold=3),
    },
}


@pytest.mark.parametrize("num_tables", [1, 4, 9], ids=lambda t: f"{t}-tables")
@pytest.mark.parametrize("options", list(POLICIES), ids=str)
def test_a_step_costs_the_same_launches_and_syncs_whatever_the_tables(
    num_tables: int, options: str, launches, monkeypatch
) -> None:
    monkeypatch.setenv(ENV_VAR, "triton")
    ebc = _ebc(num_tables, POLICIES[options])
    for seed in range(3):  # tables fill and evict before the measured step
        _step(ebc, num_tables, seed, train=True)
    admission = options == "mixed-policies-admission"  # t0, in every case, admits

    train_launches, train_syncs = _measure(ebc, num_tables, launches, train=True)
    assert train_launches == {
        "group_find_kernel": 1,
        "group_insert_kernel": 2 if admission else 1,
        "group_pooled_fwd_kernel": 1,
        "group_fused_bwd_kernel": 1,
    }
    assert train_syncs == {"_local_scalar_dense": 1}, "one read of the batch's checks"
    assert sum(train_launches.values()) <= MAX_TRAIN_LAUNCHES
    assert sum(train_syncs.values()) <= MAX_TRAIN_SYNCS

    eval_launches, eval_syncs = _measure(ebc, num_tables, launches, train=False)
    assert eval_launches == {"group_probe_kernel": 1, "group_pooled_fwd_kernel": 1}
    assert eval_syncs == {"_local_scalar_dense": 1}
    assert sum(eval_launches.values()) <= MAX_EVAL_LAUNCHES
    assert sum(eval_syncs.values()) <= MAX_EVAL_SYNCS

    metrics = ebc.metrics()
    assert sum(m["inserts"] for m in metrics.values()) > 0
    if num_tables > 1:
        assert sum(m["evictions"] for m in metrics.values()) > 0, "no bucket filled"
