"""The native fused backward over float16 and bfloat16 rows.

A half-precision row is read to float32, takes the float32 update the native
backward computes for float32 rows, and is stored rounded to nearest even
(``csrc/row_dtype.h``). Checked here, on each build of the library:

* against the torch reference (``pooled_backward_update_torch``: the gradient by
  ``index_add_``, then ``optimizer_update_torch``, which rounds on store), table
  by table over the same gradient: SGD and Adam rows and state bit for bit;
  row-wise Adagrad within one unit of the row dtype (why: below);
* against the native float32 backward on the same rows, rounded by torch's
  ``.to(dtype)``: bit for bit for every optimizer (rows and state);
* the conversions on hand-picked values (ties, subnormals, overflow, NaN,
  negative zero) and random bit patterns against torch's tensor conversion,
  through the kernel's own store; every float16 and bfloat16 bit pattern read
  and stored back unchanged;
* a half-precision collection's training runs the native backward (spies).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from torchrec_kvemb.contracts import Bags
from torchrec_kvemb.ops import native
from torchrec_kvemb.ops.optimizer_update import optimizer_update_torch
from torchrec_kvemb.ops.pooled_lookup import pooled_backward_update_torch
from torchrec_kvemb.optimizer import FusedOptimConfig, OptimKind, WeightDecay

from ..spies import run_on

HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}
DIMS = [1, 7, 13, 33]
POOLINGS = ["sum", "mean", "weighted-sum", "weighted-mean"]
OPTIMIZERS = {
    "sgd": FusedOptimConfig(kind=OptimKind.SGD),
    "sgd-l2-clip": FusedOptimConfig(
        kind=OptimKind.SGD, weight_decay=0.1, gradient_clipping=True, max_gradient=0.5
    ),
    "sgd-decoupled": FusedOptimConfig(
        kind=OptimKind.SGD, weight_decay=0.3, weight_decay_mode=WeightDecay.DECOUPLE
    ),
    "adagrad": FusedOptimConfig(kind=OptimKind.ROWWISE_ADAGRAD, eps=1e-4),
    "adagrad-l2-clip": FusedOptimConfig(
        kind=OptimKind.ROWWISE_ADAGRAD, weight_decay=0.05, gradient_clipping=True, max_gradient=0.7
    ),
    "adagrad-decoupled": FusedOptimConfig(
        kind=OptimKind.ROWWISE_ADAGRAD, weight_decay=0.05, weight_decay_mode=WeightDecay.DECOUPLE
    ),
    "adam": FusedOptimConfig(kind=OptimKind.ADAM),
    "adam-l2-clip": FusedOptimConfig(
        kind=OptimKind.ADAM,
        weight_decay=0.01,
        gradient_clipping=True,
        max_gradient=0.2,
        beta1=0.8,
        beta2=0.99,
    ),
    "adam-decoupled": FusedOptimConfig(
        kind=OptimKind.ADAM, weight_decay=0.02, weight_decay_mode=WeightDecay.DECOUPLE
    ),
}

ROWS = (40, 29)  # rows of the two tables of a case's group
IDS = 24  # distinct ids per table; ids 0-2 have no row (slot -1)
BAGS = 6  # bags per table (and of the foreign ids)
LEARNING_RATES = (0.05, 0.2)


@pytest.fixture(autouse=True)
def build(native_build: str, half_conversion: str) -> str:
    """Every test runs on each build of the library, float16 rows converted by F16C
    and by integer code (tests/ops/conftest.py)."""
    return native_build


# ------------------------------------------------------------------ harness
@dataclass
class Case:
    """One backward of a two-table group: its arrays and, per table, the same
    occurrences as the torch reference sees them (table-local slots and bags)."""

    weights: torch.Tensor  # [sum(ROWS), dim], the row dtype
    state: torch.Tensor  # [sum(ROWS), state_dim] float32
    keyed_grad: torch.Tensor  # [BAGS, 3 * dim]: a KeyedTensor's gradient (2 tables + foreign)
    offsets: torch.Tensor
    per_sample_weights: torch.Tensor | None
    mean: bool
    unique_index: torch.Tensor
    unique_slots: torch.Tensor
    unique_table: torch.Tensor
    local_slots: list[torch.Tensor]
    local_offsets: list[torch.Tensor]
    local_weights: list[torch.Tensor | None]
    steps: list[int]

    @property
    def dim(self) -> int:
        return self.weights.shape[1]

    def grad(self) -> torch.Tensor:
        """``[3, BAGS, dim]`` view of the keyed gradient (bag b of part g at [g, b])."""
        return self.keyed_grad.view(BAGS, 3, self.dim).transpose(0, 1)

    def row_range(self, t: int) -> slice:
        return slice(sum(ROWS[:t]), sum(ROWS[: t + 1]))


def cuts(n: int, gen: torch.Generator) -> torch.Tensor:
    """Offsets ``[BAGS + 1]`` cutting n occurrences into bags (some empty)."""
    inner = torch.sort(torch.randint(0, n + 1, (BAGS - 1,), generator=gen)).values
    return torch.cat([torch.tensor([0]), inner, torch.tensor([n])])


def initial_state(config: FusedOptimConfig, rows: int, dim: int, gen: torch.Generator):
    if config.kind == OptimKind.ROWWISE_ADAGRAD:
        return torch.rand(rows, 1, generator=gen) * 0.5
    if config.kind == OptimKind.ADAM:
        m = torch.randn(rows, dim, generator=gen) * 0.1
        return torch.cat([m, torch.rand(rows, dim, generator=gen) * 0.01], dim=1)
    return torch.zeros(rows, 0)


def make_case(
    config: FusedOptimConfig,
    dtype: torch.dtype,
    dim: int,
    pooling: str,
    seed: int,
    scale: float = 1.0,
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    total = sum(ROWS)
    weights = ((torch.rand(total, dim, generator=gen) * 2 - 1) * scale).to(dtype)
    state = initial_state(config, total, dim, gen)
    weighted, mean = "weighted" in pooling, "mean" in pooling
    pairs, local_slots, local_offsets, parts = [], [], [], []
    for t, rows in enumerate(ROWS):
        slot_of_id = torch.randperm(rows, generator=gen)[:IDS]
        slot_of_id[:3] = -1  # ids without a row: their unique has slot -1
        ids = torch.randint(
            0, IDS, (int(torch.randint(25, 45, (1,), generator=gen)),), generator=gen
        )
        local_slots.append(slot_of_id[ids])
        local_offsets.append(cuts(ids.numel(), gen))
        parts.append((t, ids, slot_of_id))
        pairs += [(t, i) for i in torch.unique(ids).tolist()]
    # uniques in a shuffled order: the kernel must not rely on their order
    order = torch.randperm(len(pairs), generator=gen).tolist()
    pairs = [pairs[k] for k in order]
    position = {p: k for k, p in enumerate(pairs)}
    unique_slots = torch.tensor(
        [int(parts[t][2][i]) + sum(ROWS[:t]) if parts[t][2][i] >= 0 else -1 for t, i in pairs]
    )
    unique_table = torch.tensor([t for t, _ in pairs])
    foreign = 9  # ids of no table of the group: unique index -1
    unique_index = torch.cat(
        [torch.tensor([position[(t, i)] for i in ids.tolist()]) for t, ids, _ in parts]
        + [torch.full((foreign,), -1)]
    )
    foreign_offsets = cuts(foreign, gen)
    n = unique_index.numel()
    offsets, start = [torch.tensor([0])], 0
    for local in [*local_offsets, foreign_offsets]:
        offsets.append(local[1:] + start)
        start += int(local[-1])
    psw = torch.rand(n, generator=gen) if weighted else None
    local_weights, start = [], 0
    for slots in local_slots:
        local_weights.append(None if psw is None else psw[start : start + slots.numel()])
        start += slots.numel()
    return Case(
        weights=weights,
        state=state,
        keyed_grad=torch.randn(BAGS, 3 * dim, generator=gen) * scale,
        offsets=torch.cat(offsets),
        per_sample_weights=psw,
        mean=mean,
        unique_index=unique_index,
        unique_slots=unique_slots,
        unique_table=unique_table,
        local_slots=local_slots,
        local_offsets=local_offsets,
        local_weights=local_weights,
        steps=[3, 1],
    )


def run_native(
    case: Case, config: FusedOptimConfig, weights: torch.Tensor, state: torch.Tensor, threads=2
) -> None:
    native.fused_backward_group(
        weights,
        state,
        case.grad(),
        case.offsets,
        case.unique_index,
        case.unique_slots,
        case.unique_table,
        config,
        learning_rate=list(LEARNING_RATES),
        optim_step=case.steps,
        per_sample_weights=case.per_sample_weights,
        mean=case.mean,
        num_threads=threads,
    )


def run_reference(
    case: Case, config: FusedOptimConfig, weights: torch.Tensor, state: torch.Tensor
) -> None:
    """The torch reference, table by table, on the table's own rows (views)."""
    dim = case.dim
    for t in range(len(ROWS)):
        rows = case.row_range(t)
        slots = case.local_slots[t]
        bags = Bags.build(case.local_offsets[t], slots.numel(), case.local_weights[t], case.mean)
        pooled_backward_update_torch(
            weights[rows],
            state[rows],
            case.keyed_grad[:, t * dim : (t + 1) * dim],
            slots,
            bags,
            config.with_learning_rate(LEARNING_RATES[t]),
            case.steps[t],
        )


def ordered(bits: torch.Tensor) -> torch.Tensor:
    """16-bit float patterns as integers in the order of their values (-0 and +0
    both 0): neighbouring representable values differ by 1."""
    b = bits.view(torch.int16).to(torch.int32) & 0xFFFF
    magnitude = b & 0x7FFF
    return torch.where(b >= 0x8000, -magnitude, magnitude)


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, at: str) -> None:
    assert got.dtype == want.dtype, at
    same = got.view(torch.int16) == want.view(torch.int16)
    if not bool(same.all()):
        r, c = (~same).nonzero()[0].tolist()
        raise AssertionError(
            f"{at}: {int((~same).sum())} of {same.numel()} values differ, first at [{r}, {c}]: "
            f"{got[r, c].item()!r} (bits {int(got.view(torch.int16)[r, c]) & 0xFFFF:#06x}) vs "
            f"{want[r, c].item()!r} (bits {int(want.view(torch.int16)[r, c]) & 0xFFFF:#06x})"
        )


# ------------------------------------------------------- against the torch reference
@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("pooling", POOLINGS)
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", list(HALF.values()), ids=list(HALF))
def test_half_backward_matches_torch_reference(
    dtype: torch.dtype, optimizer: str, pooling: str, dim: int
) -> None:
    config = OPTIMIZERS[optimizer]
    adagrad = config.kind == OptimKind.ROWWISE_ADAGRAD
    for step in range(3):
        # step 2: tiny rows and gradients, float16 subnormals (below 2**-14) in and out
        scale = 2.0**-15 if step == 2 else 1.0
        case = make_case(config, dtype, dim, pooling, seed=100 * step + dim, scale=scale)
        weights, state = case.weights.clone(), case.state.clone()
        run_native(case, config, weights, state)
        want_w, want_s = case.weights.clone(), case.state.clone()
        run_reference(case, config, want_w, want_s)
        at = f"{optimizer} {pooling} dim {dim} step {step}"
        assert not torch.equal(want_w, case.weights), f"{at}: the reference left the rows"
        if not adagrad:
            # Same float32 ops in the same order (the gradient summed in occurrence
            # order, as index_add_ does): rows and state bit for bit.
            assert_same_bits(weights, want_w, at)
            assert torch.equal(state, want_s), f"{at}: state differs"
            continue
        # Row-wise Adagrad: the native kernel takes the mean square in double and
        # divides the learning rate by sqrt(sum) + eps; torch takes a float32 mean
        # and computes lr / x as reciprocal(x) * lr. The float32 results may differ
        # in their last bit, so a row value on a rounding boundary of its dtype can
        # land on the neighbouring value: one unit of the row dtype at most.
        distance = (ordered(weights) - ordered(want_w)).abs()
        assert int(distance.max()) <= 1, f"{at}: rows differ by {int(distance.max())} units"
        assert float((distance == 0).float().mean()) >= 0.9, f"{at}: too many rows differ"
        torch.testing.assert_close(state, want_s, rtol=1e-6, atol=0, msg=at)


# --------------------------------------------- against the float32 kernel, rounded
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", list(HALF.values()), ids=list(HALF))
def test_half_backward_is_the_float32_update_rounded(
    dtype: torch.dtype, optimizer: str, dim: int, threads: int
) -> None:
    config = OPTIMIZERS[optimizer]
    for pooling in ("weighted-mean", "sum"):
        case = make_case(config, dtype, dim, pooling, seed=dim + 11)
        weights, state = case.weights.clone(), case.state.clone()
        run_native(case, config, weights, state, threads)
        wide, wide_state = case.weights.float(), case.state.clone()  # exact: every half is a float
        run_native(case, config, wide, wide_state, threads)
        at = f"{optimizer} {pooling} dim {dim}"
        assert_same_bits(weights, wide.to(dtype), at)
        assert torch.equal(state, wide_state), f"{at}: state differs"


# ------------------------------------------------------------------ conversions
def stored(values: torch.Tensor, dtype: torch.dtype, dim: int = 16) -> torch.Tensor:
    """What the backward stores for float32 ``values`` (``[rows, dim]``): one SGD step
    with learning rate 1 from rows of zeros, each row its own bag and unique, with
    gradient -value: the float32 update is 0 - 1 * (-value) = value exactly.
    Negative zero: the row starts at -0 and takes gradient +0 (-0 - 0 = -0). NaN:
    the gradient is the NaN itself, which the sum, the product and the difference
    carry through with its sign and payload (quieted)."""
    rows = values.shape[0]
    negative_zero = (values == 0) & torch.signbit(values)
    weights = torch.where(negative_zero, -0.0, 0.0).to(dtype)
    grad = torch.where(torch.isnan(values), values, -values)
    native.fused_backward_group(
        weights,
        torch.zeros(rows, 0),
        grad,
        torch.arange(rows + 1),
        torch.arange(rows),
        torch.arange(rows),
        torch.zeros(rows, dtype=torch.int64),
        FusedOptimConfig(kind=OptimKind.SGD),
        learning_rate=[1.0],
        optim_step=[1],
    )
    return weights


def from_bits(bits: list[int]) -> torch.Tensor:
    return torch.tensor(bits, dtype=torch.int64).to(torch.int32).view(torch.float32)


FP16_VALUES = [
    0.0, -0.0, 1.0, -1.0, 65504.0, -65504.0,
    65519.99609375,  # just below the tie between 65504 and inf
    65520.0, -65520.0,  # the tie: rounds to the even side, inf
    65536.0, 1e10, -1e30, float("inf"), float("-inf"),
    2.0**-14, -(2.0**-14),  # smallest normal
    2.0**-14 - 2.0**-24,  # largest subnormal
    2.0**-14 - 2.0**-25,  # tie between it and 2**-14: to 2**-14 (even)
    2.0**-24, -(2.0**-24),  # smallest subnormal
    2.0**-25,  # tie between 0 and 2**-24: to 0
    -(2.0**-25),  # to -0
    2.0**-25 + 2.0**-40,  # just above the tie: 2**-24
    3 * 2.0**-25,  # tie between 1 and 2 units: 2 units
    5 * 2.0**-25,  # tie between 2 and 3 units: 2 units
    2.0**-26, 1e-45, -1e-45,  # float subnormals: to +-0
    1 + 2.0**-11,  # tie between 1 and 1 + 2**-10: 1
    1 + 3 * 2.0**-11,  # tie: 1 + 2**-9 (even)
    1 + 2.0**-11 + 2.0**-23,  # above the tie
    2049.0, 2051.0, -2051.0,  # ties at ulp 2: 2048, 2052, -2052
    0.1, -0.3, 3.14159265, 1000.5,
]  # fmt: skip
BF16_BITS = [
    0x7F7FFFFF,  # float max: rounds up to inf
    0x7F7F8000,  # tie below inf, odd: to inf
    0x7F7F7FFF,  # just below the tie: bfloat16 max
    0x3F808000,  # tie, even: stays 0x3F80
    0x3F818000,  # tie, odd: 0x3F82
    0x3F818001,  # above the tie
    0x00008000,  # float subnormal tie: to 0
    0x00018000,  # to 0x0002
    0x807FFFFF,  # largest negative float subnormal: to -2**-126 (0x8080)
    0x00000001, 0x80000000, 0x00000000, 0x7F800000, 0xFF800000,
]  # fmt: skip
NAN_BITS = [0x7FC00000, 0xFFC00000, 0x7FC02000, 0xFFFFFFFF, 0x7FFFFFFF, 0x7FD55555, 0xFFA00001]


def expected_bits(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torch's tensor conversion of ``values``. Where torch's CPU kernels have no
    AVX2 (capability DEFAULT), torch's scalar bfloat16 conversion gives NaN as
    0x7FC0; its vectorized one, which the kernel follows, 0xFFFF."""
    want = values.to(dtype)
    if dtype == torch.bfloat16 and torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        want = torch.where(
            torch.isnan(values), torch.tensor(-1, dtype=torch.int16).view(dtype), want
        )
    return want


@pytest.mark.parametrize("dtype", list(HALF.values()), ids=list(HALF))
def test_store_conversion_on_hand_picked_values(dtype: torch.dtype) -> None:
    values = torch.cat(
        [torch.tensor(FP16_VALUES, dtype=torch.float32), from_bits(BF16_BITS), from_bits(NAN_BITS)]
    )
    # each value alone in a row (the scalar tail of a row loop) and 16 to a row
    for dim in (1, 16):
        column = values.repeat_interleave(dim).view(-1, dim)
        got, want = stored(column, dtype, dim), expected_bits(column, dtype)
        assert_same_bits(got, want, f"dim {dim}")
    # a few pinned by hand: the tie rules and the NaN encodings themselves
    pinned = {
        torch.float16: {65520.0: 0x7C00, 2.0**-25: 0x0000, 3 * 2.0**-25: 0x0002, 2051.0: 0x6802},
        torch.bfloat16: {from_bits([0x3F818000]).item(): 0x3F82, 2.0**-149: 0x0000},
    }[dtype]
    got = stored(torch.tensor(list(pinned)).unsqueeze(1), dtype, 1).view(torch.int16)
    assert [int(b) & 0xFFFF for b in got.flatten()] == list(pinned.values())
    nan = stored(from_bits(NAN_BITS[:4]).unsqueeze(1), dtype, 1).view(torch.int16)
    want_nan = [0x7E00, 0xFE00, 0x7E01, 0xFFFF] if dtype == torch.float16 else [0xFFFF] * 4
    assert [int(b) & 0xFFFF for b in nan.flatten()] == want_nan


@pytest.mark.parametrize("dtype", list(HALF.values()), ids=list(HALF))
def test_store_conversion_on_random_bit_patterns(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    bits = torch.randint(-(2**31), 2**31, (64 * 1024,), generator=gen, dtype=torch.int64)
    # and dense around the row dtype's range: float16's exponents, bfloat16's subnormals
    near = torch.randint(0x33000000 - 2**20, 0x47800000 + 2**20, (64 * 1024,), generator=gen)
    tiny = torch.randint(0, 2**24, (16 * 1024,), generator=gen)
    negative = near + 2**31  # the same magnitudes, sign bit set
    values = torch.cat([bits, near, tiny, negative]).to(torch.int32).view(torch.float32)
    column = values.view(-1, 64)
    assert_same_bits(stored(column, dtype, 64), expected_bits(column, dtype), "random bits")


@pytest.mark.parametrize("dtype", list(HALF.values()), ids=list(HALF))
def test_every_bit_pattern_is_read_and_stored_back(dtype: torch.dtype) -> None:
    """A zero gradient: every row comes back unchanged (w - 1 * 0 = w, subnormals and
    -0 included); NaN rows as the torch reference stores them (quieted)."""
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    weights = patterns.view(-1, 64).clone()
    rows = weights.shape[0]
    config = FusedOptimConfig(kind=OptimKind.SGD, learning_rate=1.0)
    grad = torch.zeros(rows, 64)
    native.fused_backward_group(
        weights, torch.zeros(rows, 0), grad, torch.arange(rows + 1), torch.arange(rows),
        torch.arange(rows), torch.zeros(rows, dtype=torch.int64), config, [1.0], [1],
    )  # fmt: skip
    want = patterns.view(-1, 64).clone()
    optimizer_update_torch(want, torch.zeros(rows, 0), torch.arange(rows), grad, config, 1)
    assert_same_bits(weights, want, "every pattern")
    finite = ~torch.isnan(patterns.view(-1, 64).float())
    assert torch.equal(
        weights.view(torch.int16)[finite], patterns.view(-1, 64).view(torch.int16)[finite]
    )


# ------------------------------------------------------------------ arguments
@pytest.mark.parametrize("dtype", [torch.float64, torch.int16, torch.float8_e4m3fn])
def test_other_row_dtypes_are_refused(dtype: torch.dtype) -> None:
    config = OPTIMIZERS["sgd"]
    case = make_case(config, torch.float16, 7, "sum", seed=1)
    weights = case.weights.to(dtype)
    before = weights.clone()
    with pytest.raises(ValueError, match="weights must be float32, float16 or bfloat16"):
        run_native(case, config, weights, case.state)
    assert torch.equal(weights.view(torch.uint8), before.view(torch.uint8))


def test_a_bad_dtype_code_is_refused_by_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    config = OPTIMIZERS["adam"]
    case = make_case(config, torch.bfloat16, 7, "sum", seed=2)
    weights, state = case.weights.clone(), case.state.clone()

    class BadCode(native.BackwardArgs):
        def __init__(self, **fields):
            super().__init__(**{**fields, "weights_dtype": 3})

    monkeypatch.setattr(native, "BackwardArgs", BadCode)
    with pytest.raises(native.NativeOpError, match="inconsistent arguments"):
        run_native(case, config, weights, state)
    assert torch.equal(weights, case.weights) and torch.equal(state, case.state)


# ------------------------------------------------------------------ collections
@pytest.mark.parametrize("optim", ["adagrad", "adam"])
@pytest.mark.parametrize("dtype", list(HALF.values()), ids=list(HALF))
def test_half_collection_trains_on_the_native_backward(
    dtype: torch.dtype, optim: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from fbgemm_gpu.split_embedding_configs import EmbOptimType
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    from torchrec_kvemb import KVEmbeddingBagCollection, KVTableOptions

    kinds = {"adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "adam": EmbOptimType.ADAM}

    def train() -> dict[str, torch.Tensor]:
        tables = [
            EmbeddingBagConfig(name=f"t{i}", embedding_dim=13, num_embeddings=50,
                               feature_names=[f"f{i}"])
            for i in range(2)
        ]  # fmt: skip
        ebc = KVEmbeddingBagCollection(
            tables,
            KVTableOptions(capacity=64, seed=4, weights_dtype=dtype),
            fused_params={"optimizer": kinds[optim], "learning_rate": 0.1, "eps": 1e-4},
        )
        gen = torch.Generator().manual_seed(9)
        for _ in range(3):
            lengths = torch.randint(0, 4, (2 * 5,), generator=gen)
            values = torch.randint(0, 80, (int(lengths.sum()),), generator=gen)
            kjt = KeyedJaggedTensor.from_lengths_sync(["f0", "f1"], values, lengths)
            out = ebc(kjt).values()
            (out * torch.arange(out.numel()).view_as(out).sin()).sum().backward()
        return {name: t.export() for name, t in ebc.kv_tables().items()}

    monkeypatch.setenv("TORCHREC_KVEMB_BACKEND", "torch")
    want = train()
    ran = run_on(monkeypatch, "native")
    got = train()
    ran.check()  # the native lookup and backward ran, the torch optimizer never
    for name in want:
        assert torch.equal(got[name]["ids"], want[name]["ids"]), name
        assert got[name]["weights"].dtype == dtype
        # Adam bit for bit; row-wise Adagrad one unit of the dtype per step at most
        # (see test_half_backward_matches_torch_reference)
        distance = (ordered(got[name]["weights"]) - ordered(want[name]["weights"])).abs()
        assert int(distance.max()) <= (0 if optim == "adam" else 3), f"{name}: {distance.max()}"
