"""The torch pooled lookup of a group of tables against independent oracles, and
fbgemm's fused backward against the torch reference.

Oracles: initial rows built element by element in plain Python, gathered
explicitly and pooled by ``torch.nn.functional.embedding_bag``; gradients by
autograd through that same pooling. A group is one row array cut into tables
(each with its own init spec); an id of table -1 is not the group's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import fbgemm_gpu.split_table_batched_embeddings_ops_training  # noqa: F401  (the fbgemm CPU ops)
import pytest
import torch
import torch.nn.functional as F

from torchrec_kvemb.contracts import INT64_MAX, Bags, InitSpec
from torchrec_kvemb.ops.hashing import init_rows
from torchrec_kvemb.ops.optimizer_update import (
    optimizer_update_torch,
)
from torchrec_kvemb.ops.pooled_lookup import (
    group_pooled_backward_torch,
    group_pooled_forward_torch,
)
from torchrec_kvemb.optimizer import FusedOptimConfig, OptimKind, WeightDecay

U64 = (1 << 64) - 1
ATOL = 1e-5
RTOL = 1e-5
INITS = {
    "uniform": InitSpec(seed=11, normal=False, a=-0.25, b=0.75),
    "normal": InitSpec(seed=3, normal=True, a=0.5, b=2.0),
    "uniform-wide": InitSpec(seed=11, normal=False, a=-3.0, b=-1.5),
}


@dataclass(frozen=True)
class Layout:
    """Tables of a group: each one's rows in the group's row array and init spec."""

    rows: tuple[int, ...]
    inits: tuple[InitSpec, ...]

    @property
    def starts(self) -> list[int]:
        return [sum(self.rows[:t]) for t in range(len(self.rows))]

    @property
    def capacity(self) -> int:
        return sum(self.rows)


LAYOUTS = {
    "one-table-uniform": Layout((9,), (INITS["uniform"],)),
    "one-table-normal": Layout((9,), (INITS["normal"],)),
    "three-tables": Layout((9, 5, 7), (INITS["uniform"], INITS["normal"], INITS["uniform-wide"])),
}
#: Bag lengths: empty bags first, last and inside.
LENGTHS = (0, 3, 1, 0, 6, 2, 0, 5, 1, 0)


def _fmix64(x: int) -> int:
    x &= U64
    x ^= x >> 33
    x = (x * 0xFF51AFD7ED558CCD) & U64
    x ^= x >> 33
    x = (x * 0xC4CEB9FE1A85EC53) & U64
    return x ^ (x >> 33)


def init_row_python(id_: int, dim: int, init: InitSpec) -> list[float]:
    """One initial row, from the documented recipe, in float64 Python arithmetic."""
    base = _fmix64(id_ ^ _fmix64(init.seed ^ 0x5851F42D4C957F2D))
    row = []
    for col in range(dim):
        bits = _fmix64(base + (col + 1) * 0x9E3779B97F4A7C15)
        u1 = ((bits >> 40) & 0xFFFFFF) / float(1 << 24)
        if not init.normal:
            row.append(init.a + (init.b - init.a) * u1)
            continue
        u2 = ((bits >> 16) & 0xFFFFFF) / float(1 << 24)
        radius = math.sqrt(-2.0 * math.log(1.0 - u1))
        row.append(init.a + init.b * radius * math.cos(2.0 * math.pi * u2))
    return row


@dataclass
class Batch:
    weights: torch.Tensor  # [capacity, dim], the group's rows
    slots: torch.Tensor  # [n] global slots, -1: no row
    ids: torch.Tensor  # [n]
    table_idx: torch.Tensor  # [n], -1: not the group's
    offsets: torch.Tensor  # [B + 1]
    psw: torch.Tensor | None  # [n] per-sample weights


def make_batch(layout: Layout, dim: int, seed: int, weighted: bool) -> Batch:
    """A batch with empty bags, one row three times in a bag, missing ids (slot -1,
    one of them 2**63 - 1) and, in a group of several tables, ids of table -1."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(LENGTHS)
    n = int(lengths.sum())
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    tables = len(layout.rows)
    table_idx = torch.randint(0, tables, (n,), generator=g)
    if tables > 1:
        table_idx[torch.tensor([2, 8, 12, 13])] = -1  # bag 7 ([12, 17)) has two of them
        table_idx[torch.tensor([0, 3, 9, 14])] = torch.tensor([0, 1, 2, 2])  # each table used
    starts = torch.tensor(layout.starts)
    rows = torch.tensor(layout.rows)
    t = table_idx.clamp(min=0)
    slots = starts[t] + torch.randint(0, 1 << 20, (n,), generator=g) % rows[t]
    ids = torch.randint(0, INT64_MAX, (n,), generator=g)
    slots[5:7], ids[5:7], table_idx[5:7] = slots[4], ids[4], table_idx[4]  # one row x3 in bag 4
    slots[torch.tensor([1, 7, 9, 15])] = -1  # missing: their table's initial value
    ids[9] = INT64_MAX
    slots[table_idx < 0] = -1
    weights = torch.randn(layout.capacity, dim, generator=g)
    psw = torch.rand(n, generator=g) * 2 - 0.5 if weighted else None
    return Batch(weights, slots, ids, table_idx, offsets, psw)


def mean_of(pooling: str, num_bags: int) -> bool | torch.Tensor:
    """``Bags.build``'s ``mean``: no bag, every bag, or every other bag pools by MEAN."""
    if pooling == "mixed":
        return torch.arange(num_bags) % 2 == 1
    return pooling == "mean"


def oracle_pool(b: Batch, layout: Layout, mean: bool | torch.Tensor, missing_as_zero: bool):
    """embedding_bag over explicitly gathered rows: Python-built rows where the slot
    is -1 (zeros with ``missing_as_zero``), zeros for ids of table -1; the length
    that MEAN divides by counts every id of the bag."""
    dim = b.weights.shape[1]
    made = torch.zeros(b.slots.numel(), dim)
    for i, (id_, t) in enumerate(zip(b.ids.tolist(), b.table_idx.tolist(), strict=True)):
        if t >= 0 and not missing_as_zero:
            made[i] = torch.tensor(init_row_python(id_, dim, layout.inits[t]))
    stored = (b.slots >= 0).unsqueeze(1)
    gathered = torch.where(stored, b.weights[b.slots.clamp(min=0)], made)
    if b.psw is not None:
        gathered = gathered * b.psw.unsqueeze(1)
    positions = torch.arange(b.slots.numel())

    def pool(mode: str) -> torch.Tensor:
        return F.embedding_bag(positions, gathered, b.offsets, mode=mode, include_last_offset=True)

    if isinstance(mean, torch.Tensor):
        return torch.where(mean.unsqueeze(1), pool("mean"), pool("sum"))
    return pool("mean" if mean else "sum")


def bags_of(b: Batch, mean: bool | torch.Tensor) -> Bags:
    return Bags.build(b.offsets, b.slots.numel(), b.psw, mean)


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


def assert_same(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.equal(got, want), f"{name}: {got.tolist()} != {want.tolist()}"


POOLINGS = [
    pytest.param(pooling, weighted, id=f"{pooling}-{'weighted' if weighted else 'unweighted'}")
    for pooling in ("sum", "mean", "mixed")
    for weighted in (False, True)
]


@pytest.mark.parametrize("init", list(INITS))
def test_init_rows_match_python_recipe(init: str) -> None:
    ids = torch.tensor([0, 1, 12345, 2**40 + 7, 2**63 - 1])
    expected = torch.tensor([init_row_python(int(i), 7, INITS[init]) for i in ids])
    spec = INITS[init]
    actual = init_rows(ids, 7, spec.seed, spec.normal, spec.a, spec.b)
    close(actual, expected.to(torch.float32), "initial rows")


def test_bags_build_mean_mask() -> None:
    """MEAN divides a bag's ids by its length (weights too); a bool per bag picks it."""
    offsets = torch.tensor([0, 2, 2, 5, 6])
    psw = torch.tensor([2.0, 4.0, 3.0, 6.0, 9.0, 5.0])
    bags = Bags.build(offsets, 6, psw, torch.tensor([True, True, False, True]))
    assert_same("bag_of", bags.bag_of, torch.tensor([0, 0, 2, 2, 2, 3]))
    close(bags.scale, torch.tensor([1.0, 2.0, 3.0, 6.0, 9.0, 5.0]), "mean-mask scale")
    plain = Bags.build(offsets, 6)
    assert plain.scale is None
    close(Bags.build(offsets, 6, mean=True).scale, 1 / torch.tensor([2, 2, 3, 3, 3, 1.0]), "mean")


@pytest.mark.parametrize("missing_as_zero", [False, True], ids=["missing-init", "missing-zero"])
@pytest.mark.parametrize("pooling, weighted", POOLINGS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dim", [5, 33], ids=lambda d: f"dim{d}")
def test_forward_matches_embedding_bag(
    dim: int, layout: str, pooling: str, weighted: bool, missing_as_zero: bool
) -> None:
    spec = LAYOUTS[layout]
    b = make_batch(spec, dim, seed=dim, weighted=weighted)
    mean = mean_of(pooling, len(LENGTHS))
    expected = oracle_pool(b, spec, mean, missing_as_zero)
    actual = group_pooled_forward_torch(
        b.weights, b.slots, b.ids, b.table_idx, bags_of(b, mean), spec.inits, missing_as_zero
    )
    close(actual, expected, "pooled forward")


def test_forward_all_stored_unweighted_sum() -> None:
    """The fast path (every id stored, no scale) pools the same as the general one."""
    spec = LAYOUTS["three-tables"]
    b = make_batch(spec, 7, seed=2, weighted=False)
    b.table_idx = b.table_idx.clamp(min=0)
    b.slots = torch.tensor(spec.starts)[b.table_idx] + 1
    expected = oracle_pool(b, spec, False, False)
    bags = bags_of(b, False)
    assert bags.scale is None
    actual = group_pooled_forward_torch(
        b.weights, b.slots, b.ids, b.table_idx, bags, spec.inits, False
    )
    close(actual, expected, "pooled forward, all stored")


@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "weighted"])
def test_ids_of_no_table_pool_nothing(weighted: bool) -> None:
    """Ids of table -1 add nothing, whatever their id; a bag of only such ids is zeros."""
    spec = LAYOUTS["three-tables"]
    b = make_batch(spec, 6, seed=4, weighted=weighted)
    bags = bags_of(b, False)
    out = group_pooled_forward_torch(
        b.weights, b.slots, b.ids, b.table_idx, bags, spec.inits, False
    )
    others = b.table_idx < 0
    b.ids[others] = torch.arange(int(others.sum())) * 1_000_003
    again = group_pooled_forward_torch(
        b.weights, b.slots, b.ids, b.table_idx, bags, spec.inits, False
    )
    assert_same("pooled rows with other ids of table -1", again, out)
    b.table_idx[b.offsets[7] : b.offsets[8]] = -1
    b.slots[b.offsets[7] : b.offsets[8]] = -1
    lone = group_pooled_forward_torch(
        b.weights, b.slots, b.ids, b.table_idx, bags, spec.inits, False
    )
    assert_same("bag of ids of table -1", lone[7], torch.zeros(6))


def test_missing_ids_pool_their_tables_initial_value() -> None:
    """A missing id pools its own table's initial row: the same id in two tables
    pools two different rows."""
    spec = LAYOUTS["three-tables"]
    ids = torch.tensor([77, 77, 77, 2**63 - 1])
    table_idx = torch.tensor([0, 1, 2, 1])
    slots = torch.full((4,), -1)
    weights = torch.zeros(spec.capacity, 5)
    bags = Bags.build(torch.tensor([0, 1, 2, 3, 4]), 4)
    out = group_pooled_forward_torch(weights, slots, ids, table_idx, bags, spec.inits, False)
    for i in range(4):
        want = torch.tensor([init_row_python(int(ids[i]), 5, spec.inits[int(table_idx[i])])])
        close(out[i : i + 1], want, f"missing id {int(ids[i])} of table {int(table_idx[i])}")
    zero = group_pooled_forward_torch(weights, slots, ids, table_idx, bags, spec.inits, True)
    assert_same("missing as zero", zero, torch.zeros(4, 5))


@pytest.mark.parametrize("pooling, weighted", POOLINGS)
@pytest.mark.parametrize("layout", ["one-table-uniform", "three-tables"])
@pytest.mark.parametrize("dim", [5, 33], ids=lambda d: f"dim{d}")
def test_backward_matches_autograd(dim: int, layout: str, pooling: str, weighted: bool) -> None:
    spec = LAYOUTS[layout]
    b = make_batch(spec, dim, seed=dim + 1, weighted=weighted)
    mean = mean_of(pooling, len(LENGTHS))
    b.weights.requires_grad_(True)
    grad_out = torch.randn(len(LENGTHS), dim, generator=torch.Generator().manual_seed(0))
    oracle_pool(b, spec, mean, False).backward(grad_out)
    expected_slots = torch.tensor(sorted({int(s) for s in b.slots if s >= 0}))
    untouched = torch.ones(spec.capacity, dtype=torch.bool)
    untouched[expected_slots] = False
    assert torch.equal(b.weights.grad[untouched], torch.zeros(int(untouched.sum()), dim))

    got_slots, got_grads = group_pooled_backward_torch(grad_out, b.slots, bags_of(b, mean))
    assert_same("gradient slots", got_slots, expected_slots)
    close(got_grads, b.weights.grad[expected_slots], "row gradients")


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_empty_inputs(pooling: str) -> None:
    weights = torch.randn(4, 5)
    empty = torch.zeros(0, dtype=torch.int64)
    offsets = torch.zeros(3, dtype=torch.int64)
    bags = Bags.build(offsets, 0, mean=pooling == "mean")
    out = group_pooled_forward_torch(
        weights, empty, empty, empty, bags, (INITS["normal"],), missing_as_zero=False
    )
    assert_same("pooled rows of no ids", out, torch.zeros(2, 5))
    slots, grads = group_pooled_backward_torch(torch.randn(2, 5), empty, bags)
    assert slots.numel() == 0 and grads.shape == (0, 5)


def reference_update(b: Batch, layout: Layout, grad_out, bags, config, state) -> None:
    """The torch reference of a group's fused backward: row gradients, then each
    table's optimizer over its own rows (views), its slots local."""
    uniq, grads = group_pooled_backward_torch(grad_out, b.slots, bags)
    for start, rows in zip(layout.starts, layout.rows, strict=True):
        mine = ((uniq >= start) & (uniq < start + rows)).nonzero().squeeze(1)
        optimizer_update_torch(
            b.weights[start : start + rows],
            state[start : start + rows],
            uniq[mine] - start,
            grads[mine],
            config,
            step=1,
        )


@pytest.mark.parametrize("pooling, weighted", POOLINGS)
@pytest.mark.parametrize("layout", ["one-table-uniform", "three-tables"])
@pytest.mark.parametrize("kind", [OptimKind.SGD, OptimKind.ROWWISE_ADAGRAD], ids=lambda k: k.value)
def test_fbgemm_fused_backward_matches_reference(
    kind: OptimKind, layout: str, pooling: str, weighted: bool
) -> None:
    dim = 7
    spec = LAYOUTS[layout]
    config = FusedOptimConfig(kind=kind, learning_rate=0.1, weight_decay_mode=WeightDecay.NONE)
    b = make_batch(spec, dim, seed=3, weighted=weighted)
    mean = mean_of(pooling, len(LENGTHS))
    bags = bags_of(b, mean)
    state = torch.rand(spec.capacity, config.state_dim(dim))
    grad_out = torch.randn(len(LENGTHS), dim, generator=torch.Generator().manual_seed(1))
    fb_weights, fb_state = b.weights.clone(), state.clone()

    reference_update(b, spec, grad_out, bags, config, state)

    # fbgemm sees only stored ids: drop the -1 slots and re-cut the bags around them
    stored = b.slots >= 0
    stored_offsets = torch.zeros_like(b.offsets)
    stored_offsets[1:] = torch.bincount(bags.bag_of[stored], minlength=len(LENGTHS)).cumsum(0)
    scale = bags.scale[stored] if bags.scale is not None else None
    fused_backward_fbgemm(
        grad_out, fb_weights, fb_state, b.slots[stored], stored_offsets, scale, config
    )
    close(fb_weights, b.weights, "weights")
    close(fb_state, state, "optimizer state")


@pytest.mark.parametrize("kind", [OptimKind.SGD, OptimKind.ROWWISE_ADAGRAD], ids=lambda k: k.value)
def test_fbgemm_fused_backward_mean_pooling_mode(kind: OptimKind) -> None:
    """``mean=True`` without a scale (fbgemm's MEAN pooling mode, every id stored)
    updates as the reference with ``Bags.build(mean=True)``."""
    dim = 9
    spec = LAYOUTS["three-tables"]
    config = FusedOptimConfig(kind=kind, learning_rate=0.05, weight_decay_mode=WeightDecay.NONE)
    b = make_batch(spec, dim, seed=8, weighted=False)
    b.table_idx = b.table_idx.clamp(min=0)
    b.slots = torch.tensor(spec.starts)[b.table_idx] + b.ids % torch.tensor(spec.rows)[b.table_idx]
    state = torch.rand(spec.capacity, config.state_dim(dim))
    grad_out = torch.randn(len(LENGTHS), dim, generator=torch.Generator().manual_seed(2))
    fb_weights, fb_state = b.weights.clone(), state.clone()
    reference_update(b, spec, grad_out, bags_of(b, True), config, state)
    fused_backward_fbgemm(grad_out, fb_weights, fb_state, b.slots, b.offsets, None, config, True)
    close(fb_weights, b.weights, "weights")
    close(fb_state, state, "optimizer state")


def fused_backward_fbgemm(
    grad_out: torch.Tensor,
    weights: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    offsets: torch.Tensor,
    scale: torch.Tensor | None,
    config: FusedOptimConfig,
    mean: bool = False,
) -> None:
    """Gradient reduction and optimizer update by fbgemm's CPU TBE backward, in place:
    the outside reference the torch path is held to (SGD and row-wise Adagrad).

    ``slots`` holds only stored rows (no -1); ``offsets`` its bags; ``scale`` the
    per-id multiplier (sample weight, / length for mean pooling), or ``None``
    for unweighted bags pooled by sum, or by mean when ``mean``.
    """
    capacity, dim = weights.shape
    i32 = dict(dtype=torch.int32)
    i64 = dict(dtype=torch.int64)
    common = dict(
        grad_output=grad_out.contiguous(),
        host_weights=weights.view(-1),
        weights_placements=torch.zeros(1, **i32),
        weights_offsets=torch.zeros(1, **i64),
        D_offsets=torch.tensor([0, dim], **i32),
        max_D=dim,
        hash_size_cumsum=torch.tensor([0, capacity], **i64),
        total_hash_size_bits=max(1, int(capacity).bit_length()),
        indices=slots,
        offsets=offsets,
        # With a scale, SUM: a mean's 1/length is in the scale.
        pooling_mode=1 if (mean and scale is None) else 0,
        indice_weights=torch.empty(0) if scale is None else scale.to(torch.float32),
        stochastic_rounding=False,
        learning_rate_tensor=torch.tensor(config.learning_rate, dtype=torch.float32),
    )
    if config.kind == OptimKind.SGD:
        torch.ops.fbgemm.split_embedding_backward_codegen_sgd_cpu(**common)
    else:
        torch.ops.fbgemm.split_embedding_backward_codegen_rowwise_adagrad_cpu(
            **common,
            momentum1_host=state.view(-1),
            momentum1_placements=torch.zeros(1, **i32),
            momentum1_offsets=torch.zeros(1, **i64),
            eps=config.eps,
        )
