"""The registered ops (``torch.ops.kvemb.*``): ``torch.library.opcheck`` on the CPU
kernels, the fake kernels against the Triton kernels (interpreter), which kernel
the dispatcher picks, and clear errors for bad input through an op.

``opcheck`` runs each op's schema test (declared mutations and aliasing), its
fake kernel against the real one (shapes, dtypes, strides) and AOT dispatch with
dynamic shapes. Inputs are small and odd-sized; a mutating op gets fresh copies.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

import torchrec_kvemb  # noqa: F401  (registers the ops)
from torchrec_kvemb import library
from torchrec_kvemb.contracts import Bags
from torchrec_kvemb.group import KVTableGroup
from torchrec_kvemb.ops.block_bucketize import prepare_inputs
from torchrec_kvemb.options import EvictionPolicy, Initializer, KVTableOptions
from torchrec_kvemb.validation import KVInputError

N = 29  # ids per batch
DIM = 5


def _group() -> KVTableGroup:
    options = [
        KVTableOptions(capacity=64, init_low=-0.5, init_high=0.5),
        KVTableOptions(capacity=48, eviction=EvictionPolicy.LFU, admission_threshold=2),
        KVTableOptions(capacity=32, initializer=Initializer.NORMAL, init_std=0.1),
    ]
    group = KVTableGroup(["a", "b", "c"], options, dim=DIM)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):  # some stored rows, some evictions
        ids = torch.randint(0, 120, (N,), generator=gen)
        group.lookup_train(ids, torch.randint(-1, 3, (N,), generator=gen))
    return group


def _batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 120, (N,), generator=gen), torch.randint(-1, 3, (N,), generator=gen)


def _bags() -> Bags:
    offsets = torch.tensor([0, 3, 3, 9, 14, 20, 27, N])
    return Bags.build(offsets, N, torch.rand(N, generator=torch.Generator().manual_seed(2)))


def _train_args(group: KVTableGroup) -> tuple:
    ids, table_idx = _batch()
    layout = group.layout
    return (
        *(t.clone() for t in group.storage),
        *layout.tensors(),
        layout.has_admission,
        layout.has_normal,
        ids,
        table_idx,
        group.clocks[0].clone(),
        group.metrics.clone(),
        None,
        None,
    )


def _backward_args(group: KVTableGroup) -> tuple:
    ids, table_idx = _batch()
    look = group.lookup_train(ids, table_idx)
    bags = _bags()
    grad = torch.randn(bags.offsets.numel() - 1, DIM, generator=torch.Generator().manual_seed(3))
    return (
        group.weights.clone(),
        group.state.clone(),
        grad,
        bags.offsets,
        bags.bag_of,
        bags.scale,
        look.slots,
        look.unique_index,
        look.unique_slots,
        look.unique_table,
        group.learning_rate_tensor(),
        group.clocks[1].clone(),
        group.optim.kind.code,
        1e-8,
        0.9,
        0.999,
        0.01,
        1,
        True,
        0.5,
    )


def _forward_args(group: KVTableGroup, pooled: bool, missing_as_zero: bool) -> tuple:
    ids, table_idx = _batch()
    slots = group.lookup_eval(ids, table_idx)
    layout = group.layout
    init = (layout.seed, layout.seed_mix, layout.init_normal, layout.init_a, layout.init_b,
            layout.init_col)  # fmt: skip
    if not pooled:
        return (group.weights, slots, ids, table_idx, *init, missing_as_zero)
    bags = _bags()
    bag_list = torch.arange(bags.offsets.numel() - 1)
    return (group.weights, slots, ids, table_idx, bags.offsets, bags.bag_of, bags.scale,
            bag_list, *init, missing_as_zero)  # fmt: skip


def _eval_args(group: KVTableGroup) -> tuple:
    """Bags of the three tables and one bag of another group's (-1), weighted, some
    by MEAN, each bag's row at a row of its own of a ``[6, DIM]`` output."""
    ids, _ = _batch()
    offsets = torch.tensor([0, 3, 3, 9, 14, 20, 27, N])
    table_of_bag = torch.tensor([0, 1, -1, 2, 0, 1, 2])
    weights = torch.rand(N, generator=torch.Generator().manual_seed(5))
    mean_of_bag = torch.tensor([True, False, False, True, False, True, False])
    out_offset = torch.tensor([5, 0, -1, 1, 4, 2, 3]) * DIM
    out_offset[2] = -1
    bag_list = torch.tensor([1, 3, 5, 6, 4, 0])  # by output row
    layout = group.layout
    init = (layout.seed, layout.seed_mix, layout.init_normal, layout.init_a, layout.init_b,
            layout.init_col)  # fmt: skip
    return (group.storage.keys, layout.bucket_offset, layout.num_buckets, group.weights, ids,
            offsets, table_of_bag, weights, mean_of_bag, bag_list, out_offset, 6, DIM, *init,
            group.metrics.clone(), False)  # fmt: skip


def _bucketize_args() -> tuple:
    gen = torch.Generator().manual_seed(4)
    lengths = torch.randint(0, 5, (3 * 7,), generator=gen)
    ids = torch.randint(0, 200, (int(lengths.sum()),), generator=gen)
    weights = torch.rand(ids.numel(), 3, generator=gen)
    return tuple(prepare_inputs(lengths, ids, [11, 7, 50], 3, weights, bucketize_pos=True))


def _insert_args(group: KVTableGroup) -> tuple:
    """Unique ids, one score each (LRU: the step), into a copy of table ``a``'s index."""
    ids = torch.unique(_batch()[0])
    return (*_index(group), ids, torch.full_like(ids, 7), False, False)


def _index(group: KVTableGroup) -> tuple[torch.Tensor, torch.Tensor]:
    table = group.tables[0]
    return table.keys.clone(), table.scores.clone()


def _host_exchange_args() -> tuple:
    """A host tier of 8 records (ids 100 and 101 held at main slots 5 and 20, the
    other records free) and a table of 11 rows: rows 3 and 9 go down to slots 7
    (main) and 51 (stash, placed), ids 100 and 101 come up (100 to row 3, 101 not
    copied)."""
    main_keys, stash_keys = torch.full((3, 16), -1), torch.full((1, 16), -1)
    main_keys.view(-1)[torch.tensor([5, 20, 7])] = torch.tensor([100, 101, 200])
    stash_keys.view(-1)[3] = 201  # global slot 48 + 3
    main_record = torch.full((48,), -1)
    main_record[torch.tensor([5, 20])] = torch.tensor([0, 1])
    record_ids = torch.full((8,), -1)
    record_ids[:2] = torch.tensor([100, 101])
    return (
        torch.rand(11, DIM), torch.rand(11, 1), torch.rand(8, DIM + 1), record_ids,
        torch.arange(8), torch.tensor([7, 6, 5, 4, 3, 2, 0, 0]), torch.tensor([6]),
        main_keys, torch.zeros(3, 16, dtype=torch.int64), main_record,
        stash_keys, torch.zeros(1, 16, dtype=torch.int64), torch.full((16,), -1),
        torch.tensor([3, 9]), torch.tensor([200, 201]), torch.tensor([4, 5]),
        torch.tensor([7, 51]), torch.tensor([5, 20]), torch.tensor([3, -1]),
    )  # fmt: skip


CASES: dict[str, Callable[[KVTableGroup], tuple]] = {
    "index_bucket": lambda g: (_batch()[0], 13),
    "probe": lambda g: (_index(g)[0], _batch()[0]),
    "insert": lambda g: _insert_args(g),
    "place": lambda g: (_index(g)[0], torch.arange(1000, 1000 + N)),
    "bulk_load": lambda g: (
        torch.full((5, 16), -1),
        torch.zeros(5, 16, dtype=torch.int64),
        torch.arange(3, 3 + 3 * N, 3),
        torch.arange(N),
    ),  # fmt: skip
    "export_order": lambda g: (_index(g)[0], 37),
    "scatter_rows": lambda g: (torch.zeros(11, DIM), torch.tensor([3, 0, 9]), torch.rand(3, DIM)),
    "gather_rows": lambda g: (torch.rand(11, DIM), torch.tensor([3, 0, 9]), torch.zeros(3, DIM)),
    "init_rows": lambda g: (_batch()[0], DIM, 17, False, -0.1, 0.1),
    "lookup_train_group": _train_args,
    "lookup_eval_group": lambda g: (
        g.storage.keys,
        g.layout.bucket_offset,
        g.layout.num_buckets,
        *_batch(),
        g.metrics.clone(),
    ),  # fmt: skip
    "pooled_eval_group": _eval_args,
    "pooled_forward": lambda g: _forward_args(g, pooled=True, missing_as_zero=False),
    "rows_forward": lambda g: _forward_args(g, pooled=False, missing_as_zero=False),
    "fused_backward": _backward_args,
    "block_bucketize": lambda g: _bucketize_args(),
    "host_exchange": lambda g: _host_exchange_args(),
}


def _args(name: str) -> tuple:
    return CASES[name](_group())


def test_every_op_is_registered_and_checked():
    assert set(library.kernel_names()) == set(CASES)
    assert set(CASES) <= set(dir(torch.ops.kvemb))


def _on(device: torch.device, args: tuple) -> tuple:
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize("name", sorted(CASES))
def test_opcheck(name, device):
    """On the device under test: the native kernels on the CPU, Triton on CUDA
    (``make test-gpu``)."""
    torch.library.opcheck(getattr(torch.ops.kvemb, name), _on(device, _args(name)))


#: Ops whose CUDA kernel is Triton (the others run the torch path there).
TRITON = sorted(n for n, k in library.kernel_names().items() if k["cuda"] == "triton")


def _described(real, fake) -> None:
    """``fake`` (from the fake kernel) describes ``real``: structure, dtypes, dims;
    sizes too except where the fake's are data-dependent (unbacked)."""
    if real is None:
        assert fake is None
        return
    if isinstance(real, torch.Tensor):
        assert real.dtype == fake.dtype and real.dim() == fake.dim(), (real.shape, fake.shape)
        for r, f in zip(real.shape, fake.shape, strict=True):
            if isinstance(f, int):
                assert r == f, (real.shape, fake.shape)
        return
    assert len(real) == len(fake)
    for r, f in zip(real, fake, strict=True):
        _described(r, f)


@pytest.mark.parametrize("name", TRITON)
def test_fake_kernel_describes_the_triton_kernel(name):
    """The Triton kernels (Triton's interpreter on CPU tensors) give outputs of the
    structure, dtypes and sizes the fake kernel says."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    args = _args(name)
    real = library.cuda_kernel(name)(*[a.clone() if isinstance(a, torch.Tensor) else a
                                       for a in args])  # fmt: skip
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        fake = getattr(torch.ops.kvemb, name)(*fake_args)
    _described(real, fake)


def _storages(value) -> list[int]:
    """The storages of every tensor in an op's output (nested tuples)."""
    if value is None:
        return []
    if isinstance(value, torch.Tensor):
        return [value.untyped_storage().data_ptr()] if value.numel() else []
    return [p for v in value for p in _storages(v)]


#: Where each lookup op takes its ids and their tables (an empty batch empties both).
_BATCH_ARGS = {"lookup_train_group": (21, 22), "lookup_eval_group": (3, 4)}
_ALIAS_CASES = [(n, False) for n in TRITON] + [(n, True) for n in sorted(_BATCH_ARGS)]


@pytest.mark.parametrize(
    ("name", "empty"), _ALIAS_CASES, ids=[n + ("-no-ids" if e else "") for n, e in _ALIAS_CASES]
)
def test_triton_kernel_outputs_alias_nothing(name, empty):
    """A registered op's outputs may share no storage with each other or with its
    inputs (torch refuses such an op at run time on the device): the Triton kernels
    (interpreter, CPU tensors), on a batch and on a batch of no ids."""
    args = [a.clone() if isinstance(a, torch.Tensor) else a for a in _args(name)]
    if empty:
        for i in _BATCH_ARGS[name]:
            args[i] = args[i][:0]
    out = library.cuda_kernel(name)(*args)
    outputs = _storages(out)
    assert len(outputs) == len(set(outputs)), f"{name}: two outputs share a storage"
    inputs = set(_storages([a for a in args if isinstance(a, torch.Tensor)]))
    assert not inputs & set(outputs), f"{name}: an output is an input's storage"


def test_the_dispatcher_picks_the_kernel_by_device(monkeypatch):
    """CPU tensors run the op's CPU kernel (the native library); meta tensors its fake
    kernel (shapes only, nothing native runs)."""
    from torchrec_kvemb.ops import native

    calls = []
    real = native.lookup_eval_group
    monkeypatch.setattr(
        native, "lookup_eval_group", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    group = _group()
    ids, table_idx = _batch()
    torch.ops.kvemb.probe(group.tables[0].keys, ids)
    assert calls == [1]
    meta = torch.ops.kvemb.probe(group.tables[0].keys.to("meta"), ids.to("meta"))
    assert meta.device.type == "meta" and meta.shape == ids.shape
    assert calls == [1]


def test_bad_ids_keep_their_clear_error_through_an_op():
    group = _group()
    args = list(_train_args(group))
    ids_at = 7 + len(group.layout.tensors()) + 2
    args[ids_at] = torch.tensor([3, -4, 5])
    args[ids_at + 1] = torch.tensor([0, 0, 1])
    before = [t.clone() for t in args[:7]]
    with pytest.raises(KVInputError, match="ids must be >= 0"):
        torch.ops.kvemb.lookup_train_group(*args)
    assert all(torch.equal(b, a) for b, a in zip(before, args[:7], strict=True)), "state changed"


def test_export_order_orders_by_the_routing_hash():
    """The op's CPU kernel orders by the routing hash (``ROUTE_SALT``, which the op
    passes the native kernel), as the torch path does."""
    from torchrec_kvemb.ops.export_order import export_order_torch

    keys = _index(_group())[0]
    got = torch.ops.kvemb.export_order(keys, 37)
    want = export_order_torch(keys, 37)
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
