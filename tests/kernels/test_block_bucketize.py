"""The block_bucketize Triton kernels (interpreter, CPU tensors) against the torch path."""

from __future__ import annotations

import itertools

import pytest
import torch

import torchrec_kvemb.kernels.block_bucketize as kernel
from tests.ops.test_block_bucketize import EDGE_CASES, OPTIONS, Case, _option_id, make_case
from torchrec_kvemb.contracts import BucketizeResult
from torchrec_kvemb.dispatch import block_bucketize_2d
from torchrec_kvemb.ops.block_bucketize import block_bucketize_2d_torch

# Tiny blocks make small inputs span several programs and scatter windows.
BLOCKS = {
    "default": (kernel.ROUTE_BLOCK, kernel.SCATTER_BLOCK, kernel.MAX_WEIGHT_BLOCK),
    "tiny": (16, 8, 2),
}


@pytest.fixture(params=list(BLOCKS))
def blocks(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    route, scatter, cols = BLOCKS[request.param]
    monkeypatch.setattr(kernel, "ROUTE_BLOCK", route)
    monkeypatch.setattr(kernel, "SCATTER_BLOCK", scatter)
    monkeypatch.setattr(kernel, "MAX_WEIGHT_BLOCK", cols)
    return request.param


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHREC_KVEMB_BACKEND", "triton")


def assert_triton_matches_torch(case: Case, **extra) -> None:
    kwargs = {**case.kwargs(), **extra}
    want = block_bucketize_2d_torch(**kwargs)
    got = block_bucketize_2d(**kwargs)
    context = case.describe()
    for name, g, w in zip(BucketizeResult._fields, got, want, strict=True):
        if w is None:
            assert g is None, f"{name}: expected None\n  case: {context}"
            continue
        assert g.dtype == w.dtype and g.shape == w.shape, (
            f"{name}: got {g.dtype} {tuple(g.shape)}, expected {w.dtype} {tuple(w.shape)}"
            f"\n  case: {context}"
        )
        if not torch.equal(g, w):
            bad = (g != w).reshape(g.shape[0], -1).any(dim=1).nonzero().flatten()
            raise AssertionError(
                f"{name}: {bad.numel()} of {g.shape[0]} rows differ, first at {int(bad[0])}\n"
                f"  triton: {g.tolist()}\n  torch:  {w.tolist()}\n  case: {context}"
            )


@pytest.mark.parametrize("opt", OPTIONS, ids=_option_id)
def test_options(opt: tuple, blocks: str) -> None:
    weights, factor, vbe, pos, keep = opt
    assert_triton_matches_torch(make_case(1, 3, weights, factor, vbe, pos, keep))


@pytest.mark.parametrize("world_size", [1, 2, 5], ids=lambda w: f"ws{w}")
@pytest.mark.parametrize("seed", [0, 2])
def test_world_sizes(world_size: int, seed: int) -> None:
    case = make_case(seed, world_size, "2d", 2, True, True, False, num_features=3, max_len=9)
    assert_triton_matches_torch(case)


@pytest.mark.parametrize(
    "lengths_dtype,indices_dtype",
    list(itertools.product([torch.int32, torch.int64], repeat=2)),
    ids=lambda d: str(d).removeprefix("torch."),
)
def test_dtypes(lengths_dtype: torch.dtype, indices_dtype: torch.dtype) -> None:
    case = make_case(
        4,
        4,
        "1d",
        total_blocks_factor=2,
        bucketize_pos=True,
        lengths_dtype=lengths_dtype,
        indices_dtype=indices_dtype,
    )
    assert_triton_matches_torch(case)


@pytest.mark.parametrize("name", list(EDGE_CASES))
def test_edge_cases(name: str, blocks: str) -> None:
    assert_triton_matches_torch(EDGE_CASES[name])


@pytest.mark.parametrize(
    "dtype",
    [torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int8, torch.bool],
    ids=lambda d: str(d).removeprefix("torch."),
)
def test_weight_dtypes(dtype: torch.dtype, blocks: str) -> None:
    base = make_case(9, 3, "2d", bucketize_pos=True)
    weights = torch.randn(base.indices.numel(), 5, generator=torch.Generator().manual_seed(0)) * 9
    case = Case(**{**base.__dict__, "weights": weights.to(dtype)})
    assert_triton_matches_torch(case)


def test_zero_width_weights_and_strided_inputs() -> None:
    base = make_case(10, 3, "none", bucketize_pos=True)
    n = base.indices.numel()
    strided_ids = torch.stack([base.indices, base.indices]).t().reshape(-1)[::2]
    assert not strided_ids.is_contiguous() or n <= 1
    assert_triton_matches_torch(
        Case(**{**base.__dict__, "indices": strided_ids, "weights": torch.empty(n, 0)})
    )


def test_long_bags_span_many_windows(blocks: str) -> None:
    g = torch.Generator().manual_seed(3)
    lengths = torch.tensor([37, 0, 61, 5], dtype=torch.int32)
    ids = torch.randint(0, 90, (int(lengths.sum()),), generator=g)
    case = Case(
        lengths=lengths,
        indices=ids,
        block_sizes=torch.tensor([11, 7]),
        world_size=3,
        weights=torch.randn(ids.numel(), 3, generator=g),
        bucketize_pos=True,
    )
    assert_triton_matches_torch(case)


def test_several_route_programs() -> None:
    case = make_case(13, 4, "1d", 2, True, True, False, num_features=5, max_batch=60, max_len=14)
    assert case.indices.numel() > kernel.ROUTE_BLOCK
    assert_triton_matches_torch(case)


def test_launcher_is_called(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    launcher = kernel.block_bucketize_triton

    def spy(inp):
        calls.append(inp.indices.numel())
        return launcher(inp)

    monkeypatch.setattr(kernel, "block_bucketize_triton", spy)
    assert_triton_matches_torch(make_case(2, 2, "none"))
    assert calls, "block_bucketize_2d did not dispatch to the Triton launcher"
