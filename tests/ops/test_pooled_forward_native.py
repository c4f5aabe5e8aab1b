"""The native pooled forward by slot and the fused eval lookup (``csrc/pooled_forward.cpp``)
against the torch path, bit for bit.

``native.pooled_forward`` against ``group_pooled_forward_torch`` /
``group_rows_forward_torch``; ``native.pooled_eval`` (probe and pool in one pass)
against the per-table lookup, then the torch forward; the whole collection's
eval and training forward on the native kernels against
``TORCHREC_KVEMB_BACKEND=torch``. Float32, float16 and bfloat16 rows; plain,
weighted and MEAN bags; empty bags, missing ids, ids of no table of the group;
1, 2 and 3 threads give the same bytes.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb import KVEmbeddingBagCollection, KVTableOptions, native_lib
from torchrec_kvemb.backend import ENV_VAR
from torchrec_kvemb.bag_lookup import BagTable, KVBagLookup
from torchrec_kvemb.contracts import Bags
from torchrec_kvemb.group import KVTableGroup
from torchrec_kvemb.ops import native
from torchrec_kvemb.ops.pooled_lookup import group_pooled_forward_torch, group_rows_forward_torch
from torchrec_kvemb.optimizer import FusedOptimConfig

pytestmark = pytest.mark.skipif(not native.available(), reason="native library not built")

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
BAGS = ["sum", "weighted", "mean", "weighted-mean"]
THREADS = (1, 2, 3)


class Batch:
    """Bags of some kind: ``offsets``, ``n`` ids, per-sample ``weights`` and ``mean``
    (a bool per bag) or None, and their ``Bags``."""

    def __init__(self, kind: str, gen: torch.Generator) -> None:
        lengths = torch.randint(0, 7, (41,), generator=gen)
        lengths[[0, 9, 40]] = 0  # empty bags, the first and last among them
        self.n = int(lengths.sum())
        self.offsets = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
        self.weights = torch.rand(self.n, generator=gen) if "weighted" in kind else None
        self.mean = torch.rand(41, generator=gen) < 0.6 if "mean" in kind else None
        mean = self.mean if self.mean is not None else False
        self.bags = Bags.build(self.offsets, self.n, self.weights, mean)


@pytest.mark.parametrize("dim", [13, 32, 64, 128], ids=lambda d: f"dim{d}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", BAGS)
def test_pooled_forward_is_the_torch_forward(dtype, kind, dim, half_conversion):
    """Dims 32, 64 and 128 run the kernel's fixed-width sums, 13 its general one;
    float16 rows converted by F16C and by integer code."""
    gen = torch.Generator().manual_seed(11)
    weights = torch.randn(103, dim, generator=gen).to(dtype)
    batch = Batch(kind, gen)
    offsets, n, bags = batch.offsets, batch.n, batch.bags
    table_idx = torch.randint(-1, 3, (n,), generator=gen)
    slots = torch.randint(-1, 103, (n,), generator=gen)
    slots[table_idx < 0] = -1
    want = group_pooled_forward_torch(weights, slots, slots, table_idx, bags, (), True)
    for threads in THREADS:
        got, missing = native.pooled_forward(
            weights, slots, offsets, bags.scale, table_idx, threads
        )
        assert torch.equal(got, want), (threads, (got - want).abs().max())
        assert missing == int(((slots < 0) & (table_idx >= 0)).sum())
    rows, _ = native.pooled_forward(weights, slots, None, num_threads=2)
    assert torch.equal(rows, group_rows_forward_torch(weights, slots, slots, table_idx, (), True))


@pytest.mark.parametrize("dim", [13, 64], ids=lambda d: f"dim{d}")
@pytest.mark.parametrize("kind", ["sum", "weighted"])
def test_float16_sums_of_every_bit_pattern(kind, dim):
    """Every float16 pattern (subnormals, -0, inf, NaN of every payload) in rows
    that bags sum: F16C and the integer conversion give the torch forward's bytes,
    NaN compared as NaN (which of two NaNs a sum carries is the compiler's
    choice of operand order, not a contract)."""
    gen = torch.Generator().manual_seed(3)
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    rows = -(-patterns.numel() // dim)
    weights = torch.cat([patterns, patterns[: rows * dim - patterns.numel()]])
    weights = weights.view(torch.float16).view(rows, dim)
    lengths = torch.randint(1, 4, (rows,), generator=gen)
    lengths[::5] = 0  # empty bags
    n = int(lengths.sum())
    offsets = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    slots = torch.randint(0, rows, (n,), generator=gen)
    slots[:rows] = torch.randperm(rows, generator=gen)  # every pattern summed
    weights_of = torch.rand(n, generator=gen) if kind == "weighted" else None
    bags = Bags.build(offsets, n, weights_of, False)
    table_idx = torch.zeros(n, dtype=torch.int64)
    lib = native_lib.library()
    got = {}
    try:
        for use in (True, False):
            if native_lib.set_f16c(use, lib) != use:
                continue  # no F16C on this CPU: the integer code alone
            got[use], _ = native.pooled_forward(weights, slots, offsets, bags.scale, table_idx, 2)
    finally:
        native_lib.set_f16c(True, lib)
    assert False in got
    want = group_pooled_forward_torch(weights, slots, slots, table_idx, bags, (), True)
    nan = torch.isnan(want)
    assert bool(nan.any()) and bool(torch.isinf(want).any())
    for use, out in got.items():
        assert torch.equal(torch.isnan(out), nan), f"f16c={use}"
        assert torch.equal(out[~nan].view(torch.int32), want[~nan].view(torch.int32)), f"f16c={use}"


def _group(dtype: torch.dtype, dim: int = 7) -> KVTableGroup:
    options = [
        KVTableOptions(capacity=80, weights_dtype=dtype, init_low=-1.0, init_high=1.0),
        KVTableOptions(capacity=48, weights_dtype=dtype, seed=5),
        KVTableOptions(capacity=112, weights_dtype=dtype, init_low=-3.0, init_high=2.0),
    ]
    group = KVTableGroup(["a", "b", "c"], options, dim=dim)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):  # stored rows, and some ids left out by eviction
        ids = torch.randint(0, 300, (150,), generator=gen)
        group.lookup_train(ids, torch.randint(-1, 3, (150,), generator=gen))
    return group


@pytest.mark.parametrize("dim", [7, 64], ids=lambda d: f"dim{d}")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", BAGS)
def test_pooled_eval_is_the_lookup_then_the_torch_forward(dtype, kind, dim):
    group = _group(dtype, dim)
    gen = torch.Generator().manual_seed(4)
    batch = Batch(kind, gen)
    offsets, n, bags = batch.offsets, batch.n, batch.bags
    ids = torch.randint(0, 400, (n,), generator=gen)  # about half stored
    table_of_bag = torch.randint(-1, 3, (41,), generator=gen)
    table_idx = table_of_bag[bags.bag_of]
    layout, keys = group.layout, group.storage.keys
    slots = group.lookup_eval_per_table(ids, table_idx)
    pooled = group_pooled_forward_torch(group.weights, slots, ids, table_idx, bags, (), True)
    bag_list = (table_of_bag >= 0).nonzero().squeeze(1)
    bag_list = bag_list[torch.randperm(bag_list.numel(), generator=gen)]  # by output row
    out_offset = torch.full((41,), -1)
    out_offset[bag_list] = torch.arange(bag_list.numel()) * dim
    shape = (bag_list.numel() // 3, 3 * dim)
    want = pooled.index_select(0, bag_list[: shape[0] * 3]).view(shape)
    out_offset[bag_list[shape[0] * 3 :]] = -1  # bags not written
    seen = torch.bincount(table_idx[table_idx >= 0], minlength=3)
    hits = torch.bincount(table_idx[slots >= 0], minlength=3)
    for threads in THREADS:
        got, got_hits, got_seen = native.pooled_eval(
            keys, layout.bucket_offset, layout.num_buckets, group.weights, ids, offsets,
            table_of_bag, batch.weights, batch.mean, out_offset, shape, num_threads=threads,
        )  # fmt: skip
        assert torch.equal(got, want), (threads, (got - want).abs().max())
        assert torch.equal(got_hits, hits) and torch.equal(got_seen, seen)
    rows, _, _ = native.pooled_eval(
        keys, layout.bucket_offset, layout.num_buckets, group.weights, ids, None, table_idx
    )
    want_rows = group_rows_forward_torch(group.weights, slots, ids, table_idx, (), True)
    assert torch.equal(rows, want_rows)
    for threads in THREADS:  # unpooled: the bags give each id's table only
        got, _, _ = native.pooled_eval(
            keys, layout.bucket_offset, layout.num_buckets, group.weights, ids, offsets,
            table_of_bag, num_threads=threads, unpooled=True,
        )  # fmt: skip
        assert torch.equal(got, want_rows), threads


def test_pooled_eval_refuses_bad_ids_and_offsets():
    group = _group(torch.float32)
    layout, keys = group.layout, group.storage.keys
    args = (keys, layout.bucket_offset, layout.num_buckets, group.weights)
    with pytest.raises(Exception, match="ids must be >= 0"):
        native.pooled_eval(*args, torch.tensor([4, -2]), torch.tensor([0, 2]), torch.tensor([1]))
    with pytest.raises(native.NativeOpError, match="inconsistent"):
        native.pooled_eval(*args, torch.tensor([4, 2]), torch.tensor([0, 3]), torch.tensor([1]))
    with pytest.raises(ValueError, match="table_idx"):
        native.pooled_eval(*args, torch.tensor([4, 2]), torch.tensor([0, 2]), torch.tensor([3]))


# ----------------------------------------------------------- whole collections
def _ebc(dtype: torch.dtype, pooling: PoolingType, weighted: bool) -> KVEmbeddingBagCollection:
    configs = [
        EmbeddingBagConfig(name="a", embedding_dim=5, num_embeddings=2**40,
                           feature_names=["x", "y"], pooling=pooling),
        EmbeddingBagConfig(name="b", embedding_dim=3, num_embeddings=2**40,
                           feature_names=["z", "x"], pooling=pooling),
        EmbeddingBagConfig(name="c", embedding_dim=5, num_embeddings=2**40,
                           feature_names=["w"], pooling=PoolingType.SUM),
    ]  # fmt: skip
    options = {
        "a": KVTableOptions(capacity=64, weights_dtype=dtype, init_low=-1.0, init_high=1.0),
        "b": KVTableOptions(capacity=32, weights_dtype=dtype, admission_threshold=2),
        "c": KVTableOptions(capacity=48, weights_dtype=dtype, init_low=-0.5, init_high=0.5),
    }
    return KVEmbeddingBagCollection(configs, options, is_weighted=weighted)


def _batches(weighted: bool, steps: int = 3, batch: int = 9):
    gen = torch.Generator().manual_seed(8)
    for _ in range(steps):
        lengths = torch.randint(0, 6, (4 * batch,), generator=gen)
        values = torch.randint(0, 90, (int(lengths.sum()),), generator=gen) * 7919
        weights = torch.rand(values.numel(), generator=gen) if weighted else None
        yield KeyedJaggedTensor.from_lengths_sync(
            keys=["w", "x", "y", "z"], values=values, lengths=lengths, weights=weights
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("pooling", [PoolingType.SUM, PoolingType.MEAN], ids=lambda p: p.name)
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_collection_forward_is_the_torch_path(dtype, pooling, weighted, monkeypatch):
    """Two groups (dims 5 and 3), a feature read by two tables, admission (training
    ids without a row pool their initial rows): training and eval outputs and the
    eval metrics of the native kernels equal the torch path's, for 1 and 3 threads."""
    calls = []
    real = native.pooled_eval
    monkeypatch.setattr(native, "pooled_eval", lambda *a, **k: calls.append(1) or real(*a, **k))
    runs = {}
    before = torch.get_num_threads()
    try:
        for backend, threads in (("torch", 1), ("auto", 1), ("auto", 3)):
            monkeypatch.setenv(ENV_VAR, backend)
            torch.set_num_threads(threads)
            ebc = _ebc(dtype, pooling, weighted)
            outs = []
            for kjt in _batches(weighted):
                ebc.train()
                outs.append(ebc(kjt).values().detach())  # stores rows
                ebc.eval()
                outs.append(ebc(kjt).values())
            metrics = [ebc.table(n).metrics() for n in "abc"]
            runs[(backend, threads)] = outs, [(m["hits"], m["misses"]) for m in metrics]
    finally:
        torch.set_num_threads(before)
    assert len(calls) == 2 * 2 * 3, "the native eval runs once per group and batch"
    want = runs[("torch", 1)]
    for key, got in runs.items():
        for step, (g, w) in enumerate(zip(got[0], want[0], strict=True)):
            assert torch.equal(g, w), (key, step, (g - w).abs().max())
        assert got[1] == want[1], key


def _lookup_eval(backend: str, kjt: KeyedJaggedTensor, monkeypatch) -> torch.Tensor:
    monkeypatch.setenv(ENV_VAR, backend)
    options = KVTableOptions(capacity=64, init_low=-1.0, init_high=1.0)
    lookup = KVBagLookup(
        [BagTable("a", 4, ("x", "y")), BagTable("b", 3, ("z",), mean=True)],
        {"a": options, "b": replace(options, capacity=32)},
        FusedOptimConfig(),
    )
    vbe = kjt.variable_stride_per_key()
    lookup.pooled(kjt, training=True, variable_batch=vbe).sum().backward()
    return lookup.pooled(kjt, training=False, variable_batch=vbe)


@pytest.mark.parametrize("case", ["variable-batch", "no-ids"])
def test_lookup_eval_of_variable_batches_and_empty_bags_is_the_torch_path(case, monkeypatch):
    """A batch size per feature and rank (VBE: the groups' ``[B, dim]`` put in VBE
    order) and a batch whose every bag is empty (zeros) give the torch path's bytes."""
    gen = torch.Generator().manual_seed(0)
    if case == "variable-batch":
        per_rank = [[2, 3], [1, 2], [3, 1]]
        lengths = torch.randint(0, 4, (sum(map(sum, per_rank)),), generator=gen)
        values = torch.randint(0, 50, (int(lengths.sum()),), generator=gen)
        kjt = KeyedJaggedTensor(
            keys=["x", "y", "z"], values=values, lengths=lengths, stride_per_key_per_rank=per_rank
        )
    else:
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=["x", "y", "z"], values=torch.empty(0, dtype=torch.int64),
            lengths=torch.zeros(15, dtype=torch.int64),
        )  # fmt: skip
    got = _lookup_eval("auto", kjt, monkeypatch)
    assert torch.equal(got, _lookup_eval("torch", kjt, monkeypatch))
