"""block_bucketize_2d (torch path) against FBGEMM's block_bucketize ops, bit-exact."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
import pytest
import torch

from torchrec_kvemb.contracts import BucketizeResult
from torchrec_kvemb.dispatch import block_bucketize_2d
from torchrec_kvemb.ops.block_bucketize import block_bucketize_2d_torch


@dataclass(frozen=True)
class Case:
    """One set of arguments for block_bucketize_2d (and for the FBGEMM oracle)."""

    lengths: torch.Tensor
    indices: torch.Tensor
    block_sizes: torch.Tensor
    world_size: int
    weights: torch.Tensor | None = None
    total_num_blocks: torch.Tensor | None = None
    bucketize_pos: bool = False
    keep_orig_idx: bool = False
    batch_size_per_feature: torch.Tensor | None = None

    def kwargs(self) -> dict:
        return dict(
            lengths=self.lengths,
            indices=self.indices,
            block_sizes=self.block_sizes,
            world_size=self.world_size,
            weights=self.weights,
            total_num_blocks=self.total_num_blocks,
            bucketize_pos=self.bucketize_pos,
            keep_orig_idx=self.keep_orig_idx,
            batch_size_per_feature=self.batch_size_per_feature,
        )

    def describe(self) -> str:
        w = "none" if self.weights is None else f"{tuple(self.weights.shape)} {self.weights.dtype}"
        tnb = None if self.total_num_blocks is None else self.total_num_blocks.tolist()
        bpf = None if self.batch_size_per_feature is None else self.batch_size_per_feature.tolist()
        return (
            f"world_size={self.world_size} block_sizes={self.block_sizes.tolist()} "
            f"total_num_blocks={tnb} batch_size_per_feature={bpf} "
            f"lengths={self.lengths.tolist()} ids={self.indices.tolist()} weights={w} "
            f"bucketize_pos={self.bucketize_pos} keep_orig_idx={self.keep_orig_idx}"
        )


def make_case(
    seed: int,
    world_size: int,
    weights: str = "none",
    total_blocks_factor: int | None = None,
    variable_batch: bool = False,
    bucketize_pos: bool = False,
    keep_orig_idx: bool = False,
    num_features: int = 4,
    max_batch: int = 5,
    max_len: int = 6,
    lengths_dtype: torch.dtype = torch.int32,
    indices_dtype: torch.dtype = torch.int64,
) -> Case:
    """Random odd-sized inputs: empty bags, block size 0, ids far beyond the blocks."""
    g = torch.Generator().manual_seed(seed)
    if variable_batch:
        batch_sizes = torch.randint(1, max_batch + 1, (num_features,), generator=g)
        batch_sizes[(seed + 1) % num_features] = 0  # one feature without any bag
    else:
        batch = int(torch.randint(2, max_batch + 1, (1,), generator=g))
        batch_sizes = torch.full((num_features,), batch)
    num_bags = int(batch_sizes.sum())
    lengths = torch.randint(0, max_len + 1, (num_bags,), generator=g)
    if num_bags:
        lengths[torch.rand(num_bags, generator=g) < 0.25] = 0
    block_sizes = torch.randint(2, 24, (num_features,), generator=g)
    block_sizes[seed % num_features] = 0 if seed % 3 == 0 else 1
    if total_blocks_factor is None:
        total_num_blocks = None
        num_blocks = torch.full((num_features,), world_size)
    else:
        total_num_blocks = world_size * torch.randint(
            1, total_blocks_factor + 1, (num_features,), generator=g
        )
        num_blocks = total_num_blocks

    feature_of_bag = torch.repeat_interleave(torch.arange(num_features), batch_sizes)
    feature_of_id = torch.repeat_interleave(feature_of_bag, lengths)
    # With block size 0 every id takes the modulo branch; draw those from a fixed range.
    span = torch.where(block_sizes > 0, block_sizes * num_blocks, 40 * num_blocks)[feature_of_id]
    # Three in four ids inside the blocks, the rest up to 3x past them (the modulo branch).
    limit = torch.where(torch.rand(span.shape, generator=g) < 0.75, span, 3 * span + 11)
    limit = limit.clamp_min(1)
    ids = (torch.rand(span.shape, generator=g, dtype=torch.float64) * limit).long()
    n = ids.numel()
    if weights == "none":
        w = None
    elif weights == "1d":
        w = torch.randn(n, generator=g)
    else:
        w = torch.randn(n, 3, generator=g)
    return Case(
        lengths=lengths.to(lengths_dtype),
        indices=ids.to(indices_dtype),
        block_sizes=block_sizes.to(indices_dtype),
        world_size=world_size,
        weights=w,
        total_num_blocks=None if total_num_blocks is None else total_num_blocks.to(indices_dtype),
        bucketize_pos=bucketize_pos,
        keep_orig_idx=keep_orig_idx,
        batch_size_per_feature=batch_sizes.to(lengths_dtype) if variable_batch else None,
    )


def fbgemm_bucketize(case: Case) -> tuple:
    """The oracle: FBGEMM's op with sequence=True (2-D weights use the _2d_weights op)."""
    idx_dtype = case.indices.dtype
    bpf = case.batch_size_per_feature
    common = dict(
        batch_size_per_feature=None if bpf is None else bpf.to(case.lengths.dtype),
        max_B=-1 if bpf is None else int(bpf.max()),
        keep_orig_idx=case.keep_orig_idx,
        total_num_blocks=None
        if case.total_num_blocks is None
        else case.total_num_blocks.to(idx_dtype),
    )
    args = (
        case.lengths,
        case.indices,
        case.bucketize_pos,
        True,
        case.block_sizes.to(idx_dtype),
        case.world_size,
    )
    if case.weights is not None and case.weights.dim() == 2:
        return torch.ops.fbgemm.block_bucketize_sparse_features_2d_weights(
            *args, case.weights, weights_dim=case.weights.shape[1], **common
        )
    return torch.ops.fbgemm.block_bucketize_sparse_features(*args, weights=case.weights, **common)


def assert_same(actual: BucketizeResult, expected: tuple, context: str) -> None:
    """Field by field, exact: dtype, shape and every element, with the first difference."""
    assert isinstance(actual, BucketizeResult), f"expected a BucketizeResult, got {type(actual)}"
    for name, got, want in zip(BucketizeResult._fields, actual, expected, strict=True):
        if want is None:
            assert got is None, f"{name}: expected None, got {got}\n  case: {context}"
            continue
        assert got is not None, f"{name}: expected a tensor, got None\n  case: {context}"
        assert got.dtype == want.dtype, (
            f"{name}: dtype {got.dtype} != {want.dtype}\n  case: {context}"
        )
        assert got.shape == want.shape, (
            f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}\n  case: {context}"
        )
        if not torch.equal(got, want):
            bad = (got != want).reshape(got.shape[0], -1).any(dim=1).nonzero().flatten()
            first = int(bad[0])
            raise AssertionError(
                f"{name}: {bad.numel()} of {got.shape[0]} rows differ; first at {first}: "
                f"got {got[first].tolist()}, expected {want[first].tolist()}\n"
                f"  got:      {got.tolist()}\n  expected: {want.tolist()}\n  case: {context}"
            )


OPTIONS = list(
    itertools.product(
        ["none", "1d", "2d"],  # weights
        [None, 3],  # total_blocks_factor: total_num_blocks = world_size * randint(1, 3)
        [False, True],  # variable batch size
        [False, True],  # bucketize_pos
        [False, True],  # keep_orig_idx
    )
)


def _option_id(opt: tuple) -> str:
    weights, factor, vbe, pos, keep = opt
    return "-".join(
        [
            f"w_{weights}",
            "tnb" if factor else "no_tnb",
            "vbe" if vbe else "fixed_b",
            "pos" if pos else "no_pos",
            "keep" if keep else "relidx",
        ]
    )


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("world_size", [1, 3, 4], ids=lambda w: f"ws{w}")
@pytest.mark.parametrize("opt", OPTIONS, ids=_option_id)
def test_cpu_dispatch_equals_torch_path(opt: tuple, world_size: int, seed: int) -> None:
    """The CPU dispatch (fbgemm's op where it applies) gives the torch path's bits."""
    weights, factor, vbe, pos, keep = opt
    case = make_case(seed, world_size, weights, factor, vbe, pos, keep)
    expected = block_bucketize_2d_torch(**case.kwargs())
    got = block_bucketize_2d(**case.kwargs())
    assert_same(got, tuple(expected), case.describe())


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("world_size", [1, 3, 4], ids=lambda w: f"ws{w}")
@pytest.mark.parametrize("opt", OPTIONS, ids=_option_id)
def test_matches_fbgemm(opt: tuple, world_size: int, seed: int) -> None:
    weights, factor, vbe, pos, keep = opt
    case = make_case(seed, world_size, weights, factor, vbe, pos, keep)
    assert_same(block_bucketize_2d_torch(**case.kwargs()), fbgemm_bucketize(case), case.describe())


@pytest.mark.parametrize(
    "lengths_dtype,indices_dtype",
    list(itertools.product([torch.int32, torch.int64], repeat=2)),
    ids=lambda d: str(d).removeprefix("torch."),
)
@pytest.mark.parametrize("weights", ["none", "1d", "2d"])
def test_dtypes_follow_inputs(
    lengths_dtype: torch.dtype, indices_dtype: torch.dtype, weights: str
) -> None:
    case = make_case(
        5,
        3,
        weights,
        total_blocks_factor=2,
        bucketize_pos=True,
        lengths_dtype=lengths_dtype,
        indices_dtype=indices_dtype,
    )
    assert_same(block_bucketize_2d_torch(**case.kwargs()), fbgemm_bucketize(case), case.describe())


@pytest.mark.parametrize(
    "weight_dtype", [torch.float16, torch.bfloat16, torch.float64], ids=lambda d: str(d)[6:]
)
def test_2d_weight_dtypes(weight_dtype: torch.dtype) -> None:
    base = make_case(7, 4, "2d", bucketize_pos=True)
    case = Case(**{**base.__dict__, "weights": base.weights.to(weight_dtype)})
    assert_same(block_bucketize_2d_torch(**case.kwargs()), fbgemm_bucketize(case), case.describe())


def _fixed(lengths, ids, block_sizes, world_size, **kw) -> Case:
    return Case(
        lengths=torch.tensor(lengths, dtype=torch.int32),
        indices=torch.tensor(ids, dtype=torch.int64),
        block_sizes=torch.tensor(block_sizes, dtype=torch.int64),
        world_size=world_size,
        **kw,
    )


EDGE_CASES = {
    "all_bags_empty": _fixed([0, 0, 0, 0], [], [3, 5], 2, bucketize_pos=True),
    "no_bags": _fixed([], [], [3, 5, 7], 3, bucketize_pos=True),
    "single_id": _fixed([1], [4], [3], 2, bucketize_pos=True),
    "block_size_zero_is_modulo": _fixed([3, 2], [4, 9, 1, 7, 8], [0], 3, bucketize_pos=True),
    "ids_past_all_blocks": _fixed([4], [6, 7, 100, 1001], [3], 2),
    "huge_ids": _fixed([3, 1], [2**63 - 1, 2**62 + 5, 7, 2**40], [4, 9], 3, bucketize_pos=True),
    "huge_ids_total_blocks": _fixed(
        [3, 1],
        [2**63 - 1, 2**62 + 5, 7, 2**40],
        [4, 9],
        3,
        total_num_blocks=torch.tensor([6, 9]),
    ),
    "world_size_one": _fixed([2, 1], [5, 2, 9], [4], 1, bucketize_pos=True),
    "long_bag": _fixed([90], list(range(0, 270, 3)), [7], 5, bucketize_pos=True),
    "vbe_zero_batch_feature": _fixed(
        [1, 2, 1],
        [4, 9, 1, 7],
        [3, 4, 5],
        2,
        bucketize_pos=True,
        batch_size_per_feature=torch.tensor([2, 0, 1], dtype=torch.int32),
    ),
    "vbe_all_features_empty": _fixed(
        [], [], [3, 4], 2, batch_size_per_feature=torch.tensor([0, 0], dtype=torch.int32)
    ),
    "weights_2d_one_column": _fixed(
        [2, 3], [1, 8, 3, 4, 11], [5], 2, weights=torch.arange(5.0).reshape(5, 1)
    ),
}


@pytest.mark.parametrize("name", list(EDGE_CASES))
def test_edge_cases(name: str) -> None:
    case = EDGE_CASES[name]
    assert_same(block_bucketize_2d_torch(**case.kwargs()), fbgemm_bucketize(case), case.describe())


def test_docstring_example() -> None:
    out = block_bucketize_2d(torch.tensor([2, 1, 3]), torch.tensor([1, 7, 4, 0, 9, 5]), [5], 2)
    assert out.lengths.tolist() == [1, 1, 1, 1, 0, 2]
    assert out.indices.tolist() == [1, 4, 0, 2, 4, 0]
    assert out.unbucketize_permute.tolist() == [0, 3, 1, 2, 4, 5]
    assert out.weights is None and out.pos is None


def test_lists_equal_tensors() -> None:
    case = make_case(3, 4, "1d", total_blocks_factor=2, variable_batch=True, bucketize_pos=True)
    from_lists = block_bucketize_2d_torch(
        **{
            **case.kwargs(),
            "block_sizes": case.block_sizes.tolist(),
            "total_num_blocks": case.total_num_blocks.tolist(),
            "batch_size_per_feature": case.batch_size_per_feature.tolist(),
        }
    )
    assert_same(from_lists, fbgemm_bucketize(case), case.describe())


def test_max_batch_size_accepted() -> None:
    case = make_case(4, 3, variable_batch=True)
    bpf_max = int(case.batch_size_per_feature.max())
    out = block_bucketize_2d_torch(**case.kwargs(), max_batch_size=bpf_max + 2)
    assert_same(out, fbgemm_bucketize(case), case.describe())


def test_unbucketize_permute_restores_order() -> None:
    case = make_case(11, 4, "2d", total_blocks_factor=3, variable_batch=True, keep_orig_idx=True)
    out = block_bucketize_2d_torch(**case.kwargs())
    assert torch.equal(out.indices[out.unbucketize_permute.long()], case.indices)
    assert torch.equal(out.weights[out.unbucketize_permute.long()], case.weights)


def test_non_contiguous_weights_permute_logical_rows() -> None:
    # fbgemm reads 2-D weights as if contiguous; the permutation here is of logical rows.
    case = make_case(6, 3, "2d")
    strided = case.weights.t().contiguous().t()
    assert not strided.is_contiguous()
    out = block_bucketize_2d_torch(**{**case.kwargs(), "weights": strided})
    assert_same(out, fbgemm_bucketize(case), case.describe())


def test_dispatch_uses_torch_path_when_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHREC_KVEMB_BACKEND", "torch")
    case = make_case(8, 3, "1d", bucketize_pos=True)
    assert_same(block_bucketize_2d(**case.kwargs()), fbgemm_bucketize(case), case.describe())


def _good() -> dict:
    return dict(
        lengths=torch.tensor([2, 1, 0, 1]),
        indices=torch.tensor([3, 8, 1, 5]),
        block_sizes=torch.tensor([4, 6]),
        world_size=2,
    )


BAD_INPUTS = {
    "float_indices": ({"indices": torch.tensor([3.0, 8.0, 1.0, 5.0])}, TypeError, "int32 or int64"),
    "int16_indices": (
        {"indices": torch.tensor([3, 8, 1, 5], dtype=torch.int16)},
        TypeError,
        "int32 or int64",
    ),
    "float_lengths": ({"lengths": torch.tensor([2.0, 1.0, 0.0, 1.0])}, TypeError, "lengths"),
    "negative_id": ({"indices": torch.tensor([3, -8, 1, 5])}, ValueError, ">= 0"),
    "negative_length": ({"lengths": torch.tensor([3, -1, 1, 1])}, ValueError, "lengths must be"),
    "lengths_sum_too_small": ({"lengths": torch.tensor([1, 1, 0, 1])}, ValueError, "sum to 3"),
    "lengths_sum_too_large": ({"lengths": torch.tensor([2, 2, 0, 1])}, ValueError, "sum to 5"),
    "weights_wrong_length": ({"weights": torch.ones(3)}, ValueError, "N=4"),
    "weights_3d": ({"weights": torch.ones(4, 2, 2)}, ValueError, r"\[N\] or \[N, k\]"),
    "block_sizes_vs_lengths": (
        {"block_sizes": torch.tensor([4, 6, 8])},
        ValueError,
        "not a multiple of the 3 features",
    ),
    "block_sizes_empty": ({"block_sizes": []}, ValueError, "empty"),
    "block_sizes_negative": ({"block_sizes": [4, -6]}, ValueError, ">= 0"),
    "block_sizes_float": ({"block_sizes": torch.tensor([4.0, 6.0])}, TypeError, "integers"),
    "world_size_zero": ({"world_size": 0}, ValueError, "world_size"),
    "total_blocks_not_multiple": ({"total_num_blocks": [4, 3]}, ValueError, "multiples"),
    "total_blocks_zero": ({"total_num_blocks": [0, 2]}, ValueError, "multiples"),
    "total_blocks_wrong_count": ({"total_num_blocks": [4]}, ValueError, "one per feature"),
    "batch_sizes_wrong_count": (
        {"batch_size_per_feature": [4]},
        ValueError,
        "one per feature",
    ),
    "batch_sizes_wrong_sum": ({"batch_size_per_feature": [1, 2]}, ValueError, "sums to 3"),
    "max_batch_size_without_batch_sizes": ({"max_batch_size": 2}, ValueError, "max_batch_size"),
    "max_batch_size_too_small": (
        {"batch_size_per_feature": [3, 1], "max_batch_size": 2},
        ValueError,
        "max_batch_size",
    ),
    "block_span_overflows_int32": (
        {
            "indices": torch.tensor([3, 8, 1, 5], dtype=torch.int32),
            "block_sizes": [2**30, 6],
        },
        ValueError,
        "fit in torch.int32",
    ),
}


@pytest.mark.parametrize("name", list(BAD_INPUTS))
def test_bad_inputs_raise(name: str) -> None:
    change, error, match = BAD_INPUTS[name]
    with pytest.raises(error, match=match):
        block_bucketize_2d_torch(**{**_good(), **change})
