"""New rows of float16 and bfloat16 groups, written by the native training lookup.

The lookup draws a uniform table's initial row in float32 (``init_rows``) and
stores it in the rows' dtype, rounded to nearest even (``csrc/row_dtype.h``):
bit for bit the torch path's ``init_rows(...).to(dtype)``. NORMAL tables and
column shards keep their rows from the torch path's own draw, rounded the same
way. Checked on each build of the library, for dims whose rows are streamed
(whole 16-byte blocks) and dims whose rows are not, on 1, 2 and 3 threads (the
same bytes), with ranges that round to float16 subnormals and to infinity; the
index, slots and optimizer state equal a float32 group's on the same batch.
"""

from __future__ import annotations

import pytest
import torch

from torchrec_kvemb.contracts import INIT_NORMAL, INIT_UNIFORM, GroupLayout, InitSpec
from torchrec_kvemb.ops import native
from torchrec_kvemb.ops.hashing import init_rows
from torchrec_kvemb.options import WAYS, EvictionPolicy

HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}
#: 1, 7, 13, 33: no row is whole 16-byte blocks; 8, 16 and 64: every half row is
#: (streamed), and float32 rows of 8, 16 and 64 are too.
DIMS = [1, 7, 8, 13, 16, 33, 64]
#: Initial ranges [low, high): ordinary; float16 subnormals (below 2**-14); past
#: float16's largest value (inf after rounding); a constant.
RANGES = {
    "ordinary": (-0.3, 0.7),
    "subnormal": (-3e-5, 3e-5),
    "overflow": (-9e4, 9e4),
    "constant": (0.1, 0.1),
}
BUCKETS = (3, 5)  # per table: small, so a batch evicts


@pytest.fixture(autouse=True)
def build(native_build: str, half_conversion: str) -> str:
    """Every test runs on each build of the library, float16 rows converted by F16C
    and by integer code (tests/ops/conftest.py)."""
    return native_build


def layout(init: list[InitSpec]) -> GroupLayout:
    policies = [EvictionPolicy.LRU, EvictionPolicy.LFU]
    return GroupLayout.of(list(BUCKETS), policies, init)


def arrays(dtype: torch.dtype, dim: int, state_dim: int = 1):
    rows = sum(BUCKETS) * WAYS
    keys = torch.full((sum(BUCKETS), WAYS), -1, dtype=torch.int64)
    scores = torch.zeros(sum(BUCKETS), WAYS, dtype=torch.int64)
    # Rows and state hold garbage: every new row must be written.
    weights = torch.full((rows, dim), 7.0).to(dtype)
    state = torch.full((rows, state_dim), 3.0)
    return keys, scores, weights, state


def batches(seed: int, steps: int = 3):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        n = 150
        ids = torch.randint(0, 200, (n,), generator=gen)
        ids[::7] += 2**62  # large ids
        table_idx = torch.randint(-1, 2, (n,), generator=gen)
        out.append((ids, table_idx))
    return out


def train(layout_: GroupLayout, dtype: torch.dtype, dim: int, threads: int, seed: int):
    """Three lookups on fresh arrays; the arrays and each step's outputs."""
    keys, scores, weights, state = arrays(dtype, dim)
    outs = []
    for step, (ids, table_idx) in enumerate(batches(seed), start=1):
        out = native.lookup_train_group(
            layout_, keys, scores, weights, state, ids, table_idx, [step, step],
            num_threads=threads,
        )  # fmt: skip
        outs.append(out)
    return (keys, scores, weights, state), outs


def expected_rows(layout_: GroupLayout, outs, dtype: torch.dtype, dim: int) -> dict[int, tuple]:
    """Slot -> (id, the torch path's initial row in ``dtype``) of the last new row
    written to each slot."""
    rows = {}
    for out in outs:
        for t, spec in enumerate(layout_.init_specs):
            mask = out.unique_inserted & (out.unique_table == t)
            ids = out.unique_ids[mask]
            if ids.numel() == 0:
                continue
            drawn = init_rows(ids, dim, spec.seed, spec.normal, spec.a, spec.b, spec.first_col)
            for slot, i, row in zip(out.unique_slots[mask].tolist(), ids.tolist(), drawn):
                rows[slot] = (i, row.to(dtype))
    return rows


def assert_new_rows(layout_: GroupLayout, result, outs, dtype: torch.dtype, dim: int) -> None:
    keys, _, weights, state = result
    want = expected_rows(layout_, outs, dtype, dim)
    assert want, "the batches inserted nothing"
    for slot, (i, row) in want.items():
        if keys.view(-1)[slot] != i:
            continue  # evicted by a later step (its new owner is checked)
        assert torch.equal(weights[slot].view(torch.int16), row.view(torch.int16)), (
            f"slot {slot} (id {i}): {weights[slot].tolist()} != {row.tolist()}"
        )
        assert state[slot].tolist() == [0.0]
    assert bool((keys.view(-1) >= 0).any())
    untouched = (keys.view(-1) < 0).nonzero().view(-1)
    assert bool((weights[untouched] == 7.0).all()), "a row without an id was written"


@pytest.mark.parametrize("span", list(RANGES))
@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("dtype", list(HALF.values()), ids=list(HALF))
def test_new_half_rows_are_init_rows_rounded(dtype: torch.dtype, dim: int, span: str) -> None:
    low, high = RANGES[span]
    group = layout([InitSpec(11, INIT_UNIFORM, low, high), InitSpec(12, INIT_UNIFORM, -1.0, 2.5)])
    results = {}
    for threads in (1, 2, 3):
        result, outs = train(group, dtype, dim, threads, seed=dim)
        assert_new_rows(group, result, outs, dtype, dim)
        results[threads] = result
    for threads in (2, 3):
        for got, want in zip(results[threads], results[1]):
            assert torch.equal(got.view(-1).view(torch.uint8), want.view(-1).view(torch.uint8))
    if span == "overflow" and dtype == torch.float16:
        assert bool(results[1][2].isinf().any()), "no row rounded to infinity"
    if span == "subnormal" and dtype == torch.float16:
        tiny = results[1][2].abs()
        assert bool(((tiny > 0) & (tiny < 2**-14)).any()), "no subnormal row value"


@pytest.mark.parametrize("dim", [7, 16])
@pytest.mark.parametrize("dtype", list(HALF.values()), ids=list(HALF))
def test_normal_tables_and_column_shards_beside_uniform_ones(dtype: torch.dtype, dim: int) -> None:
    group = layout([InitSpec(5, INIT_NORMAL, 0.1, 0.3), InitSpec(6, INIT_UNIFORM, -0.5, 0.5, 3)])
    for threads in (1, 3):
        result, outs = train(group, dtype, dim, threads, seed=3)
        assert_new_rows(group, result, outs, dtype, dim)


@pytest.mark.parametrize("dim", [7, 64])
@pytest.mark.parametrize("dtype", list(HALF.values()), ids=list(HALF))
def test_half_lookup_is_the_float32_lookup_rounded(dtype: torch.dtype, dim: int) -> None:
    """Same index, scores, slots, uniques, evictions and state as a float32
    group; rows equal the float32 group's rows rounded by ``.to(dtype)``."""
    group = layout([InitSpec(1, INIT_UNIFORM, -0.3, 0.7), InitSpec(2, INIT_UNIFORM, 0.0, 1.0)])
    half, half_outs = train(group, dtype, dim, 2, seed=9)
    full, full_outs = train(group, torch.float32, dim, 2, seed=9)
    for name, a, b in zip(("keys", "scores", "weights", "state"), half, full):
        if name == "weights":
            b = b.to(dtype)
        assert torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)), name
    for a, b in zip(half_outs, full_outs):
        for name, x, y in zip(a._fields, a, b):
            if isinstance(x, torch.Tensor):
                assert torch.equal(x, y), name


def test_a_bad_row_dtype_code_is_refused_by_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    group = layout([InitSpec(1, INIT_UNIFORM, 0.0, 1.0)] * 2)
    keys, scores, weights, state = arrays(torch.float16, 4)
    monkeypatch.setattr(native, "_row_dtype", lambda weights, op: 3)
    with pytest.raises(native.NativeOpError):
        native.lookup_train_group(
            group, keys, scores, weights, state, torch.tensor([1, 2]), torch.tensor([0, 1]), [1, 1]
        )
    assert bool((keys == -1).all()), "the refused call changed the index"


@pytest.mark.parametrize("dtype", [torch.float64, torch.int16])
def test_other_row_dtypes_are_refused(dtype: torch.dtype) -> None:
    group = layout([InitSpec(1, INIT_UNIFORM, 0.0, 1.0)] * 2)
    keys, scores, _, state = arrays(torch.float32, 4)
    weights = torch.zeros(sum(BUCKETS) * WAYS, 4, dtype=dtype)
    with pytest.raises(ValueError, match="float32, float16 or bfloat16"):
        native.lookup_train_group(
            group, keys, scores, weights, state, torch.tensor([1, 2]), torch.tensor([0, 1]), [1, 1]
        )
