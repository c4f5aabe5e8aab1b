"""What one training and one evaluation step of a KV EBC or EC costs a GPU, counted on CPU.

On the Triton backend (kernels run in the interpreter), a hook counts Triton
launches and a TorchDispatchMode counts every aten op dispatched outside a
launch (on a GPU most of them launch a kernel of their own), and among them
the ops that make the host wait for the device (``.item()``, ``nonzero``,
``unique``, ...). The batch (a KeyedJaggedTensor that knows its ids per key)
and the output's gradient are made before counting starts. Launches and syncs
are exact and do not depend on the number of tables: the tables of one dim and
optimizer are one group, looked up in one call per step; the aten ops are held
to a budget.
"""

import collections
import contextlib

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch.utils._python_dispatch import TorchDispatchMode
from torchrec import EmbeddingBagConfig, EmbeddingConfig, KeyedJaggedTensor

from torchrec_kvemb import (
    EvictionPolicy,
    KVEmbeddingBagCollection,
    KVEmbeddingCollection,
    KVTableOptions,
)
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
#: The budget of aten ops outside the Triton launches, per step.
MAX_TRAIN_OPS = 120
MAX_EVAL_OPS = 30
DIM = 8


class _Launches:
    """Triton launches by kernel name, and whether one is running now."""

    def __init__(self) -> None:
        self.counts: collections.Counter = collections.Counter()
        self.running = 0


class _Ops(TorchDispatchMode):
    """Every aten op dispatched outside a Triton launch (what the interpreter runs
    inside one is the kernel's own work, not the step's)."""

    def __init__(self, launches: _Launches) -> None:
        super().__init__()
        self.launches = launches
        self.ops: collections.Counter = collections.Counter()
        self.synced: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.launches.running:
            name = func.overloadpacket.__name__
            self.ops[name] += 1
            # ``repeat_interleave`` given its output size does not wait for the device.
            if name in SYNCING and not (name == "repeat_interleave" and kwargs.get("output_size")):
                self.synced[name] += 1
        return func(*args, **kwargs)

    def syncs(self) -> dict[str, int]:
        return dict(self.synced)


@pytest.fixture
def launches(monkeypatch) -> _Launches:
    """Counts Triton launches (the interpreter's run) and marks when one runs."""
    import triton.runtime.interpreter as interpreter

    state = _Launches()
    run = interpreter.InterpretedFunction.run

    def counting(self, *args, **kwargs):
        state.counts[self.fn.__name__] += 1
        state.running += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            state.running -= 1

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", counting)
    return state


def _collection(kind: str, num_tables: int, options: dict) -> torch.nn.Module:
    """A KV EBC (``"bags"``) or EC (``"sequences"``) of tables ``t<i>`` reading ``f<i>``."""
    config = EmbeddingBagConfig if kind == "bags" else EmbeddingConfig
    module = KVEmbeddingBagCollection if kind == "bags" else KVEmbeddingCollection
    configs = [
        config(name=f"t{i}", embedding_dim=DIM, num_embeddings=2**40, feature_names=[f"f{i}"])
        for i in range(num_tables)
    ]
    return module(
        configs,
        {c.name: options.get(c.name, KVTableOptions(capacity=64)) for c in configs},
        fused_params={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.01},
    )


def _batch(num_tables: int, seed: int) -> KeyedJaggedTensor:
    gen = torch.Generator().manual_seed(seed)
    batch, bag = 16, 3
    values = torch.randint(0, 200, (num_tables * batch * bag,), generator=gen)
    return KeyedJaggedTensor.from_lengths_sync(
        keys=[f"f{i}" for i in range(num_tables)],
        values=values,
        lengths=torch.full((num_tables * batch,), bag),
    )


def _step(module: torch.nn.Module, kjt: KeyedJaggedTensor, train: bool, mode=None) -> None:
    """One step, its output's gradient all ones; ``mode`` (a dispatch mode) is on for
    the step's own work only."""
    module.train(train)
    if isinstance(module, KVEmbeddingBagCollection):
        grads = [torch.ones(kjt.stride(), DIM * len(kjt.keys()))]
    else:
        grads = [torch.ones(n, DIM) for n in kjt.length_per_key()]
    with mode if mode is not None else contextlib.nullcontext():
        if train:
            out = module(kjt)
            if isinstance(out, dict):  # sequences: a JaggedTensor per feature
                torch.autograd.backward([jt.values() for jt in out.values()], grads)
            else:
                out.values().backward(grads[0])
        else:
            with torch.no_grad():
                module(kjt)


def _measure(module, num_tables, launches: _Launches, train: bool) -> tuple[dict, _Ops]:
    kjt = _batch(num_tables, 99 if train else 98)
    launches.counts.clear()
    ops = _Ops(launches)
    _step(module, kjt, train, ops)
    return dict(launches.counts), ops


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
@pytest.mark.parametrize("kind", ["bags", "sequences"])
def test_a_step_costs_the_same_launches_and_syncs_whatever_the_tables(
    kind: str, num_tables: int, options: str, launches, monkeypatch
) -> None:
    monkeypatch.setenv(ENV_VAR, "triton")
    module = _collection(kind, num_tables, POLICIES[options])
    for seed in range(3):  # tables fill and evict before the measured step
        _step(module, _batch(num_tables, seed), train=True)
    admission = options == "mixed-policies-admission"  # t0, in every case, admits

    train_launches, train_ops = _measure(module, num_tables, launches, train=True)
    assert train_launches == {
        "group_find_kernel": 1,
        "group_insert_kernel": 2 if admission else 1,
        "group_pooled_fwd_kernel": 1,
        "group_fused_bwd_kernel": 1,
    }
    assert train_ops.syncs() == {"_local_scalar_dense": 1}, "one read of the batch's checks"
    total = sum(train_ops.ops.values())
    assert total <= MAX_TRAIN_OPS, f"train: {total} aten ops: {dict(train_ops.ops)}"

    eval_launches, eval_ops = _measure(module, num_tables, launches, train=False)
    assert eval_launches == {"group_probe_kernel": 1, "group_pooled_fwd_kernel": 1}
    assert eval_ops.syncs() == {"_local_scalar_dense": 1}
    total = sum(eval_ops.ops.values())
    assert total <= MAX_EVAL_OPS, f"eval: {total} aten ops: {dict(eval_ops.ops)}"

    metrics = module.metrics()
    assert sum(m["inserts"] for m in metrics.values()) > 0
    if num_tables > 1:
        assert sum(m["evictions"] for m in metrics.values()) > 0, "no bucket filled"
