"""The Triton pooled forward and fused backward of a group (interpreter, CPU tensors)
against the torch path, to float tolerance.

Forward: ``group_pooled_forward_triton`` vs ``group_pooled_forward_torch`` on the
bags of ``bag_list`` (the other bags' rows must stay zeros). Backward:
``group_fused_backward_triton`` vs ``group_pooled_backward_torch`` then
``optimizer_update_torch`` table by table (each table's own rows, learning rate
and optimizer step), on the weights and the optimizer state.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from torchrec_kvemb.contracts import INT64_MAX, Bags, GroupLayout
from torchrec_kvemb.kernels.group_pooled import (
    ADAM,
    ROWWISE_ADAGRAD,
    SGD,
    group_fused_backward_triton,
    group_pooled_forward_triton,
)
from torchrec_kvemb.ops.optimizer_update import clip_output_gradient, optimizer_update_torch
from torchrec_kvemb.ops.pooled_lookup import (
    group_pooled_backward_torch,
    group_pooled_forward_torch,
)
from torchrec_kvemb.optimizer import FusedOptimConfig, OptimKind, WeightDecay
from torchrec_kvemb.options import WAYS, Initializer, KVTableOptions

ATOL = 1e-5
RTOL = 1e-5
#: Rows of each table of the group (whole buckets).
ROWS = (16, 32, 48)
#: Bag lengths: empty bags first, inside and last; two bags longer than a block of ids.
LENGTHS = (0, 3, 1, 0, 21, 2, 0, 5, 17, 1, 0)
#: Per table: a uniform, a normal and another uniform initializer, each its own seed.
OPTIONS = (
    KVTableOptions(capacity=ROWS[0], seed=11, init_low=-0.25, init_high=0.75),
    KVTableOptions(
        capacity=ROWS[1], seed=3, initializer=Initializer.NORMAL, init_mean=0.5, init_std=2.0
    ),
    KVTableOptions(capacity=ROWS[2], seed=11, init_low=-3.0, init_high=-1.5),
)
LAYOUT = GroupLayout.build(
    num_buckets=[r // WAYS for r in ROWS], counter_num_buckets=[0] * len(ROWS), options=OPTIONS
)
STARTS = torch.tensor([sum(ROWS[:t]) for t in range(len(ROWS))])


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


@dataclass
class Batch:
    weights: torch.Tensor  # [sum(ROWS), dim]
    slots: torch.Tensor  # [n] global slots, -1: no row
    ids: torch.Tensor
    table_idx: torch.Tensor  # -1: not the group's
    offsets: torch.Tensor
    psw: torch.Tensor | None


def make_batch(dim: int, seed: int, weighted: bool, lengths=LENGTHS) -> Batch:
    """Ids of the three tables and of table -1; about a fifth missing (slot -1, one
    of them 2**63 - 1), rows repeated inside a bag and across bags."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths, dtype=torch.int64)
    n = int(lengths.sum())
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    table_idx = torch.randint(-1, len(ROWS), (n,), generator=g)
    t = table_idx.clamp(min=0)
    # why a few rows per table: the same row comes back often (duplicate slots).
    slots = STARTS[t] + torch.randint(0, 5, (n,), generator=g) * 3
    ids = torch.randint(0, INT64_MAX, (n,), generator=g)
    slots[torch.rand(n, generator=g) < 0.2] = -1
    if n > 2:
        slots[n // 2] = -1
        ids[n // 2] = INT64_MAX
        table_idx[n // 2] = 1
    slots[table_idx < 0] = -1
    weights = torch.randn(sum(ROWS), dim, generator=g)
    psw = torch.rand(n, generator=g) * 2 - 0.5 if weighted else None
    return Batch(weights, slots, ids, table_idx, offsets, psw)


SCALES = {
    "sum": (False, False),  # no scale
    "weighted": (True, False),
    "mean": (False, True),
    "weighted-mixed-mean": (True, "mixed"),
}


def bags_of(b: Batch, scale: str) -> Bags:
    weighted, mean = SCALES[scale]
    if mean == "mixed":
        mean = torch.arange(b.offsets.numel() - 1) % 3 != 1
    return Bags.build(b.offsets, b.slots.numel(), b.psw if weighted else None, mean)


def check_forward(b: Batch, bags: Bags, bag_list: torch.Tensor, missing_as_zero: bool) -> None:
    want = group_pooled_forward_torch(
        b.weights, b.slots, b.ids, b.table_idx, bags, LAYOUT.init_specs, missing_as_zero
    )
    got = group_pooled_forward_triton(
        LAYOUT, b.weights, b.slots, b.ids, b.table_idx, bags, bag_list, missing_as_zero
    )
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    close(got[bag_list], want[bag_list], "pooled rows of bag_list")
    others = torch.ones(got.shape[0], dtype=torch.bool)
    others[bag_list] = False
    assert torch.equal(got[others], torch.zeros_like(got[others])), "bags not listed are zeros"


@pytest.mark.parametrize("missing_as_zero", [False, True], ids=["missing-init", "missing-zero"])
@pytest.mark.parametrize("scale", list(SCALES))
@pytest.mark.parametrize("dim", [1, 5, 33, 130], ids=lambda d: f"dim{d}")
def test_forward_matches_torch(dim: int, scale: str, missing_as_zero: bool) -> None:
    b = make_batch(dim, seed=dim, weighted=SCALES[scale][0])
    bag_list = torch.arange(len(LENGTHS))
    check_forward(b, bags_of(b, scale), bag_list, missing_as_zero)


BAG_LISTS = {
    "every-other": lambda bags: torch.arange(1, bags, 2),
    "reversed": lambda bags: torch.arange(bags).flip(0),
    "one-long-bag": lambda bags: torch.tensor([4]),
    "none": lambda bags: torch.empty(0, dtype=torch.int64),
}


@pytest.mark.parametrize("bag_list", list(BAG_LISTS))
@pytest.mark.parametrize("dim", [5, 130], ids=lambda d: f"dim{d}")
def test_forward_bag_list_subsets(dim: int, bag_list: str) -> None:
    b = make_batch(dim, seed=dim + 7, weighted=True)
    check_forward(b, bags_of(b, "weighted-mixed-mean"), BAG_LISTS[bag_list](len(LENGTHS)), False)


@pytest.mark.parametrize(
    "lengths", [(0, 0, 0), (), (1,)], ids=["only-empty-bags", "no-bags", "one-id"]
)
def test_forward_no_ids(lengths: tuple[int, ...]) -> None:
    b = make_batch(7, seed=1, weighted=False, lengths=lengths)
    for scale in ("sum", "mean"):
        check_forward(b, bags_of(b, scale), torch.arange(len(lengths)), False)


# ------------------------------------------------------------------ backward
LEARNING_RATES = (0.1, 0.03, 0.2)
OPTIM_STEPS = (1, 4, 9)
KINDS = {"sgd": OptimKind.SGD, "rowwise-adagrad": OptimKind.ROWWISE_ADAGRAD, "adam": OptimKind.ADAM}
CODES = {OptimKind.SGD: SGD, OptimKind.ROWWISE_ADAGRAD: ROWWISE_ADAGRAD, OptimKind.ADAM: ADAM}
DECAYS = {
    "plain": dict(),
    "l2": dict(weight_decay=0.05, weight_decay_mode=WeightDecay.L2),
    "decoupled-clipped": dict(
        weight_decay=0.05,
        weight_decay_mode=WeightDecay.DECOUPLE,
        gradient_clipping=True,
        max_gradient=0.3,
    ),
    "l2-clipped": dict(
        weight_decay=0.02,
        weight_decay_mode=WeightDecay.L2,
        gradient_clipping=True,
        max_gradient=0.5,
    ),
}


def fused_backward_both(b: Batch, bags: Bags, config: FusedOptimConfig, seed: int):
    """One fused backward by each path from the same rows and state: ``(triton
    weights, state), (torch weights, state)``."""
    dim = b.weights.shape[1]
    g = torch.Generator().manual_seed(seed)
    # Adagrad's accumulator and Adam's second moment are >= 0.
    state = torch.rand(sum(ROWS), config.state_dim(dim), generator=g)
    grad_out = torch.randn(b.offsets.numel() - 1, dim, generator=g)
    weights_t, state_t = b.weights.clone(), state.clone()
    weights_k, state_k = b.weights.clone(), state.clone()

    uniq, grads = group_pooled_backward_torch(clip_output_gradient(grad_out, config), b.slots, bags)
    for t, start in enumerate(STARTS.tolist()):
        mine = ((uniq >= start) & (uniq < start + ROWS[t])).nonzero().squeeze(1)
        optimizer_update_torch(
            weights_t[start : start + ROWS[t]],
            state_t[start : start + ROWS[t]],
            uniq[mine] - start,
            grads[mine],
            config.with_learning_rate(LEARNING_RATES[t]),
            OPTIM_STEPS[t],
        )

    steps = torch.tensor(OPTIM_STEPS, dtype=torch.float64)
    decay = config.weight_decay
    group_fused_backward_triton(
        weights_k,
        state_k,
        grad_out,
        b.slots,
        torch.searchsorted(STARTS, b.slots.clamp(min=0), right=True) - 1,
        bags,
        CODES[config.kind],
        torch.tensor(LEARNING_RATES, dtype=torch.float32),
        (1.0 - config.beta1**steps).to(torch.float32),
        (1.0 - config.beta2**steps).to(torch.float32),
        config.eps,
        config.beta1,
        config.beta2,
        decay,
        bool(decay) and config.weight_decay_mode == WeightDecay.L2,
        bool(decay) and config.weight_decay_mode == WeightDecay.DECOUPLE,
        config.gradient_clipping,
        config.max_gradient,
    )
    return (weights_k, state_k), (weights_t, state_t)


@pytest.mark.parametrize("scale", ["sum", "weighted-mixed-mean"])
@pytest.mark.parametrize("decay", list(DECAYS))
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dim", [5, 130], ids=lambda d: f"dim{d}")
def test_fused_backward_matches_torch(dim: int, kind: str, decay: str, scale: str) -> None:
    config = FusedOptimConfig(kind=KINDS[kind], **DECAYS[decay])
    b = make_batch(dim, seed=dim + len(kind), weighted=SCALES[scale][0])
    (w_k, s_k), (w_t, s_t) = fused_backward_both(b, bags_of(b, scale), config, seed=dim)
    assert not torch.equal(w_t, b.weights), "the update changed no row"
    close(w_k, w_t, "weights")
    close(s_k, s_t, "optimizer state")


@pytest.mark.parametrize("kind", list(KINDS))
def test_fused_backward_three_column_blocks(kind: str) -> None:
    """Rows of 257 columns: three column blocks, every optimizer."""
    config = FusedOptimConfig(kind=KINDS[kind], **DECAYS["l2-clipped"])
    b = make_batch(257, seed=5, weighted=True, lengths=(2, 0, 6, 3, 17))
    (w_k, s_k), (w_t, s_t) = fused_backward_both(b, bags_of(b, "weighted-mixed-mean"), config, 2)
    close(w_k, w_t, "weights")
    close(s_k, s_t, "optimizer state")


def test_clipping_clips() -> None:
    """The clipped cases clip: the same update without clipping differs."""
    clipped = FusedOptimConfig(kind=OptimKind.SGD, **DECAYS["decoupled-clipped"])
    free = FusedOptimConfig(
        kind=OptimKind.SGD, weight_decay=0.05, weight_decay_mode=WeightDecay.DECOUPLE
    )
    b = make_batch(5, seed=3, weighted=False)
    (w_clipped, _), _ = fused_backward_both(b, bags_of(b, "sum"), clipped, seed=5)
    (w_free, _), _ = fused_backward_both(b, bags_of(b, "sum"), free, seed=5)
    assert not torch.allclose(w_clipped, w_free)


@pytest.mark.parametrize("kind", list(KINDS))
def test_fused_backward_without_rows_changes_nothing(kind: str) -> None:
    """Only slots -1 (missing ids, ids of table -1), or no ids at all: nothing moves."""
    config = FusedOptimConfig(kind=KINDS[kind], **DECAYS["l2"])
    for lengths in ((3, 0, 4), (0, 0)):
        b = make_batch(6, seed=4, weighted=True, lengths=lengths)
        b.slots.fill_(-1)
        (w_k, s_k), (w_t, s_t) = fused_backward_both(b, bags_of(b, "weighted"), config, seed=1)
        assert torch.equal(w_k, b.weights) and torch.equal(w_t, b.weights), f"{lengths}: weights"
        assert torch.equal(s_k, s_t), f"{lengths}: optimizer state"
