"""Triton fused optimizer update (interpreter) against the torch path."""

from __future__ import annotations

import pytest
import torch

from torchrec_kvemb.kernels.optimizer_update import optimizer_update_triton
from torchrec_kvemb.ops.optimizer_update import optimizer_update_torch
from torchrec_kvemb.optimizer import FusedOptimConfig, OptimKind, WeightDecay

ATOL = 1e-5
RTOL = 1e-5
CAPACITY = 13


def value_rows(dim: int, config: FusedOptimConfig, seed: int) -> torch.Tensor:
    """One table's rows ``[capacity, dim + state]``, state non-negative like a real one."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.randn(CAPACITY, dim, generator=g)
    state = torch.rand(CAPACITY, config.state_dim(dim), generator=g) * 0.1
    return torch.cat([weights, state], dim=1)


def split(rows: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return rows[:, :dim], rows[:, dim:]


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


CASES = [
    pytest.param(kind, mode, clip, dim, id=f"{kind.value}-decay_{mode.name.lower()}-{c}-dim{dim}")
    for kind in OptimKind
    for mode in WeightDecay
    for clip, c in ((False, "noclip"), (True, "clip"))
    for dim in (5, 33)
]


@pytest.mark.parametrize("kind, mode, clip, dim", CASES)
def test_steps_match_torch(kind: OptimKind, mode: WeightDecay, clip: bool, dim: int) -> None:
    config = FusedOptimConfig(
        kind=kind,
        learning_rate=0.05,
        eps=1e-6,
        weight_decay=0.0 if mode == WeightDecay.NONE else 0.1,
        weight_decay_mode=mode,
        gradient_clipping=clip,
        max_gradient=0.5,
    )
    expected = value_rows(dim, config, seed=dim)
    actual = expected.clone()
    g = torch.Generator().manual_seed(7)
    for step in (1, 2, 3):  # Adam's bias correction changes every step
        slots = torch.randperm(CAPACITY, generator=g)[:6]  # unique, unsorted, some rows untouched
        grads = torch.randn(slots.numel(), dim, generator=g) * 2.0  # clipping at 0.5 bites
        optimizer_update_torch(*split(expected, dim), slots, grads, config, step)
        optimizer_update_triton(*split(actual, dim), slots, grads, config, step)
        close(actual, expected, f"value rows after step {step}")


@pytest.mark.parametrize("kind", [OptimKind.ROWWISE_ADAGRAD, OptimKind.ADAM], ids=lambda k: k.value)
def test_wide_rows_span_several_column_blocks(kind: OptimKind) -> None:
    dim = 130  # > the kernel's 128-column block: Adagrad's row mean spans two blocks
    config = FusedOptimConfig(kind=kind, learning_rate=0.1, weight_decay=0.01)
    expected = value_rows(dim, config, seed=1)
    actual = expected.clone()
    slots = torch.tensor([12, 0, 5])
    grads = torch.randn(3, dim, generator=torch.Generator().manual_seed(2))
    optimizer_update_torch(*split(expected, dim), slots, grads, config, 3)
    optimizer_update_triton(*split(actual, dim), slots, grads, config, 3)
    close(actual, expected, "value rows")


def test_separate_contiguous_tensors_and_no_rows() -> None:
    dim = 7
    config = FusedOptimConfig(kind=OptimKind.ADAM, learning_rate=0.01)
    weights, state = torch.randn(CAPACITY, dim), torch.rand(CAPACITY, 2 * dim)
    w2, s2 = weights.clone(), state.clone()
    slots, grads = torch.tensor([3, 1]), torch.randn(2, dim)
    optimizer_update_torch(weights, state, slots, grads, config, 1)
    optimizer_update_triton(w2, s2, slots, grads, config, 1)
    close(w2, weights, "weights")
    close(s2, state, "state")
    before = w2.clone()
    optimizer_update_triton(w2, s2, slots[:0], grads[:0], config, 2)
    assert torch.equal(w2, before)


def test_rejects_too_little_state() -> None:
    config = FusedOptimConfig(kind=OptimKind.ADAM)
    with pytest.raises(ValueError, match="state"):
        optimizer_update_triton(
            torch.zeros(4, 3), torch.zeros(4, 1), torch.tensor([0]), torch.ones(1, 3), config, 1
        )
