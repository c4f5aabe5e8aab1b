"""The torch pooled lookup against independent oracles, and fbgemm's fused backward.

Oracles: initial rows built element by element in plain Python, gathered
explicitly and pooled by ``torch.nn.functional.embedding_bag``; gradients by
autograd through that same pooling.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from torchrec_kvemb.ops.hashing import init_rows
from torchrec_kvemb.ops.optimizer_update import (
    fbgemm_supports,
    fused_backward_fbgemm,
    optimizer_update_torch,
)
from torchrec_kvemb.ops.pooled_lookup import (
    InitSpec,
    bag_scale,
    pooled_backward_torch,
    pooled_forward_torch,
)
from torchrec_kvemb.optimizer import FusedOptimConfig, OptimKind, WeightDecay

U64 = (1 << 64) - 1
ATOL = 1e-5
RTOL = 1e-5
INITS = {
    "uniform": InitSpec(seed=11, normal=False, a=-0.25, b=0.75),
    "normal": InitSpec(seed=3, normal=True, a=0.5, b=2.0),
}


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


def make_bags(dim: int, seed: int, weighted: bool, capacity: int = 9):
    """Bags with empty ones, duplicate slots and -1 slots."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([0, 3, 1, 0, 6, 2, 0])
    n = int(lengths.sum())
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    slots = torch.randint(0, capacity, (n,), generator=g)
    slots[4:6] = slots[3]  # the same slot three times in one bag
    slots[torch.tensor([1, 7, 9])] = -1
    ids = torch.randint(0, 2**63 - 1, (n,), generator=g)
    ids[9] = 2**63 - 1
    weights = torch.randn(capacity, dim, generator=g)
    psw = torch.rand(n, generator=g) * 2 - 0.5 if weighted else None
    return weights, slots, ids, offsets, psw


def oracle_pool(weights, slots, ids, offsets, psw, mean, init):
    """embedding_bag over explicitly gathered rows (Python-built rows where slot is -1)."""
    dim = weights.shape[1]
    stored = (slots >= 0).unsqueeze(1)
    made = torch.tensor([init_row_python(int(i), dim, init) for i in ids], dtype=torch.float32)
    made = made.reshape(-1, dim)
    gathered = torch.where(stored, weights[slots.clamp(min=0)], made)
    if psw is not None:
        gathered = gathered * psw.unsqueeze(1)
    return F.embedding_bag(
        torch.arange(slots.numel()),
        gathered,
        offsets,
        mode="mean" if mean else "sum",
        include_last_offset=True,
    )


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


POOLINGS = [
    pytest.param(
        mean, weighted, id=f"{'mean' if mean else 'sum'}-{'weighted' if weighted else 'unweighted'}"
    )
    for mean in (False, True)
    for weighted in (False, True)
]


@pytest.mark.parametrize("init", list(INITS))
def test_init_rows_match_python_recipe(init: str) -> None:
    ids = torch.tensor([0, 1, 12345, 2**40 + 7, 2**63 - 1])
    expected = torch.tensor([init_row_python(int(i), 7, INITS[init]) for i in ids])
    spec = INITS[init]
    actual = init_rows(ids, 7, spec.seed, spec.normal, spec.a, spec.b)
    close(actual, expected.to(torch.float32), "initial rows")


@pytest.mark.parametrize("init", list(INITS))
@pytest.mark.parametrize("mean, weighted", POOLINGS)
@pytest.mark.parametrize("dim", [5, 33], ids=lambda d: f"dim{d}")
def test_forward_matches_embedding_bag(dim: int, mean: bool, weighted: bool, init: str) -> None:
    weights, slots, ids, offsets, psw = make_bags(dim, seed=dim, weighted=weighted)
    expected = oracle_pool(weights, slots, ids, offsets, psw, mean, INITS[init])
    actual = pooled_forward_torch(weights, slots, ids, offsets, psw, mean, INITS[init])
    close(actual, expected, "pooled forward")


@pytest.mark.parametrize("mean, weighted", POOLINGS)
@pytest.mark.parametrize("dim", [5, 33], ids=lambda d: f"dim{d}")
def test_backward_matches_autograd(dim: int, mean: bool, weighted: bool) -> None:
    weights, slots, ids, offsets, psw = make_bags(dim, seed=dim + 1, weighted=weighted)
    weights.requires_grad_(True)
    grad_out = torch.randn(offsets.numel() - 1, dim, generator=torch.Generator().manual_seed(0))
    oracle_pool(weights, slots, ids, offsets, psw, mean, INITS["uniform"]).backward(grad_out)
    expected_slots = torch.tensor(sorted({int(s) for s in slots if s >= 0}))
    untouched = torch.ones(weights.shape[0], dtype=torch.bool)
    untouched[expected_slots] = False
    assert torch.equal(weights.grad[untouched], torch.zeros(int(untouched.sum()), dim))

    got_slots, got_grads = pooled_backward_torch(grad_out, slots, offsets, psw, mean)
    assert torch.equal(got_slots, expected_slots), f"{got_slots} != {expected_slots}"
    close(got_grads, weights.grad[expected_slots], "row gradients")


def test_empty_inputs() -> None:
    weights = torch.randn(4, 5)
    empty = torch.zeros(0, dtype=torch.int64)
    offsets = torch.zeros(3, dtype=torch.int64)
    out = pooled_forward_torch(weights, empty, empty, offsets, None, True, INITS["normal"])
    assert torch.equal(out, torch.zeros(2, 5))
    slots, grads = pooled_backward_torch(torch.randn(2, 5), empty, offsets, None, True)
    assert slots.numel() == 0 and grads.shape == (0, 5)


@pytest.mark.parametrize("mean, weighted", POOLINGS)
@pytest.mark.parametrize("kind", [OptimKind.SGD, OptimKind.ROWWISE_ADAGRAD], ids=lambda k: k.value)
def test_fbgemm_fused_backward_matches_reference(
    kind: OptimKind, mean: bool, weighted: bool
) -> None:
    dim = 7
    config = FusedOptimConfig(kind=kind, learning_rate=0.1, weight_decay_mode=WeightDecay.NONE)
    weights, slots, _, offsets, psw = make_bags(dim, seed=3, weighted=weighted)
    assert fbgemm_supports(config, weights)
    state = torch.rand(weights.shape[0], config.state_dim(dim))
    grad_out = torch.randn(offsets.numel() - 1, dim, generator=torch.Generator().manual_seed(1))
    fb_weights, fb_state = weights.clone(), state.clone()

    uniq, grads = pooled_backward_torch(grad_out, slots, offsets, psw, mean)
    optimizer_update_torch(weights, state, uniq, grads, config, step=1)

    # fbgemm sees only stored ids: drop the -1 slots and re-cut the bags around them
    bags, scale = bag_scale(offsets, psw, mean, slots.numel())
    stored = slots >= 0
    stored_offsets = torch.zeros_like(offsets)
    stored_offsets[1:] = torch.bincount(bags[stored], minlength=offsets.numel() - 1).cumsum(0)
    fused_backward_fbgemm(
        grad_out, fb_weights, fb_state, slots[stored], stored_offsets, scale[stored], config
    )
    close(fb_weights, weights, "weights")
    close(fb_state, state, "optimizer state")
