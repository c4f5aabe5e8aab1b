"""Triton pooled lookup (interpreter) against the torch path."""

from __future__ import annotations

import pytest
import torch

from torchrec_kvemb.kernels.pooled_lookup import pooled_backward_triton, pooled_forward_triton
from torchrec_kvemb.ops.pooled_lookup import InitSpec, pooled_backward_torch, pooled_forward_torch

ATOL = 1e-5
RTOL = 1e-5
INITS = {
    "uniform": InitSpec(seed=11, normal=False, a=-0.25, b=0.75),
    "normal": InitSpec(seed=3, normal=True, a=0.5, b=2.0),
}


def make_bags(dim: int, seed: int = 0, capacity: int = 9, weighted: bool = True):
    """Bags with empty ones (first and last), a long one, duplicate slots and -1 slots."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 6, (7,), generator=g)
    lengths[0] = 0
    lengths[-1] = 0
    lengths[3] = 37  # longer than the kernels' BLOCK_N: several steps of the bag loop
    n = int(lengths.sum())
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    offsets[1:] = lengths.cumsum(0)
    # a small capacity makes slots repeat, within bags and across them
    slots = torch.randint(0, capacity, (n,), generator=g)
    slots[torch.rand(n, generator=g) < 0.3] = -1
    ids = torch.randint(0, 2**63 - 1, (n,), generator=g)
    ids[:2] = torch.tensor([0, 2**63 - 1])
    missing = (slots < 0).nonzero().squeeze(1)
    if missing.numel() > 1:
        ids[missing[1]] = ids[missing[0]]  # one id twice without a row
    weights = torch.randn(capacity, dim, generator=g)
    psw = torch.rand(n, generator=g) * 2 - 0.5 if weighted else None
    return weights, slots, ids, offsets, psw


def close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")


CASES = [
    pytest.param(dim, mean, weighted, init, id=f"dim{dim}-{pool}-{w}-{init}")
    for dim in (5, 7, 33, 130)
    for mean, pool in ((False, "sum"), (True, "mean"))
    for weighted, w in ((False, "unweighted"), (True, "weighted"))
    for init in INITS
]


@pytest.mark.parametrize("dim, mean, weighted, init", CASES)
def test_forward_matches_torch(dim: int, mean: bool, weighted: bool, init: str) -> None:
    weights, slots, ids, offsets, psw = make_bags(dim, seed=dim, weighted=weighted)
    expected = pooled_forward_torch(weights, slots, ids, offsets, psw, mean, INITS[init])
    actual = pooled_forward_triton(weights, slots, ids, offsets, psw, mean, INITS[init])
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    close(actual, expected, "pooled forward")
    assert torch.equal(actual[0], torch.zeros(dim)), "empty bag must pool to zeros"


BWD_CASES = [
    pytest.param(dim, mean, weighted, id=f"dim{dim}-{pool}-{w}")
    for dim in (5, 7, 33, 130)
    for mean, pool in ((False, "sum"), (True, "mean"))
    for weighted, w in ((False, "unweighted"), (True, "weighted"))
]


@pytest.mark.parametrize("dim, mean, weighted", BWD_CASES)
def test_backward_matches_torch(dim: int, mean: bool, weighted: bool) -> None:
    _, slots, _, offsets, psw = make_bags(dim, seed=dim + 1, weighted=weighted)
    grad_out = torch.randn(offsets.numel() - 1, dim, generator=torch.Generator().manual_seed(dim))
    exp_slots, exp_grads = pooled_backward_torch(grad_out, slots, offsets, psw, mean)
    got_slots, got_grads = pooled_backward_triton(grad_out, slots, offsets, psw, mean)
    assert torch.equal(got_slots, exp_slots), f"unique slots: {got_slots} != {exp_slots}"
    close(got_grads, exp_grads, "row gradients")
    again = pooled_backward_triton(grad_out, slots, offsets, psw, mean)[1]
    assert torch.equal(again, got_grads), "backward must be deterministic"


def test_forward_on_a_column_slice_of_value_rows() -> None:
    weights, slots, ids, offsets, psw = make_bags(7, seed=5)
    value_rows = torch.cat([weights, torch.full((weights.shape[0], 3), 1e6)], dim=1)
    view = value_rows[:, :7]  # row stride 10: the optimizer state sits beside the row
    expected = pooled_forward_torch(weights, slots, ids, offsets, psw, False, INITS["normal"])
    actual = pooled_forward_triton(view, slots, ids, offsets, psw, False, INITS["normal"])
    close(actual, expected, "pooled forward on a strided view")


@pytest.mark.parametrize("mean", [False, True], ids=["sum", "mean"])
def test_no_ids_and_no_bags(mean: bool) -> None:
    weights = torch.randn(4, 5)
    empty = torch.zeros(0, dtype=torch.int64)
    offsets = torch.zeros(4, dtype=torch.int64)  # three empty bags
    out = pooled_forward_triton(weights, empty, empty, offsets, None, mean, INITS["uniform"])
    assert torch.equal(out, torch.zeros(3, 5))
    none = pooled_forward_triton(weights, empty, empty, offsets[:1], None, mean, INITS["uniform"])
    assert none.shape == (0, 5)
    slots, grads = pooled_backward_triton(torch.randn(3, 5), empty, offsets, None, mean)
    assert slots.numel() == 0 and grads.shape == (0, 5)


def test_backward_without_stored_rows() -> None:
    slots = torch.full((4,), -1, dtype=torch.int64)
    offsets = torch.tensor([0, 1, 4])
    got_slots, got_grads = pooled_backward_triton(torch.randn(2, 7), slots, offsets, None, True)
    assert got_slots.numel() == 0 and got_grads.shape == (0, 7)
