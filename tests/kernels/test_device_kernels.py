"""The Triton launchers of ``kernels/`` on the device under test against the torch
paths on the CPU, on the same inputs.

The other tests of this folder are the model (their input builders are reused);
they run the kernels in Triton's interpreter, where programs run one after
another. Here ``make test-gpu`` runs them compiled on CUDA, where programs run at
once: the inputs grow by ``scale(device)`` there (many programs, many duplicate
ids and rows racing for the same buckets and rows), and stay interpreter-sized on
CPU (``make test``). Integer results (slots, keys, scores, counters, routing)
must be equal bit for bit; rows and optimizer state to a float tolerance.
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels.checks import assert_same as same
from tests.kernels.test_group_lookup import CASES as GROUP_CASES
from tests.kernels.test_group_lookup import Case as GroupCase
from tests.kernels.test_group_lookup import Table, batch
from tests.kernels.test_group_lookup import build as build_group
from tests.kernels.test_group_pooled import (
    CODES,
    DECAYS,
    KINDS,
    LEARNING_RATES,
    LENGTHS,
    OPTIM_STEPS,
    ROWS,
    SCALES,
    STARTS,
    bags_of,
    make_batch,
)
from tests.kernels.test_group_pooled import LAYOUT as POOLED_LAYOUT
from tests.kernels.test_insert import CASES as INSERT_CASES
from tests.kernels.test_insert import Case as InsertCase
from tests.kernels.test_probe import fill_table
from tests.ops.test_block_bucketize import make_case
from torchrec_kvemb import block_bucketize_2d
from torchrec_kvemb.backend import ENV_VAR
from torchrec_kvemb.contracts import INT64_MAX, BucketizeResult
from torchrec_kvemb.group import KVTableGroup
from torchrec_kvemb.kernels.group_pooled import (
    group_fused_backward_triton,
    group_pooled_forward_triton,
)
from torchrec_kvemb.kernels.insert import insert_triton
from torchrec_kvemb.kernels.probe import probe_triton
from torchrec_kvemb.ops.block_bucketize import block_bucketize_2d_torch
from torchrec_kvemb.ops.hashing import index_bucket
from torchrec_kvemb.ops.insert import insert_torch
from torchrec_kvemb.ops.optimizer_update import clip_output_gradient, optimizer_update_torch
from torchrec_kvemb.ops.pooled_lookup import (
    group_pooled_backward_torch,
    group_pooled_forward_torch,
)
from torchrec_kvemb.ops.probe import probe_torch
from torchrec_kvemb.optimizer import FusedOptimConfig, WeightDecay
from torchrec_kvemb.options import WAYS, EvictionPolicy

ATOL = 1e-5
RTOL = 1e-5


def scale(device: torch.device) -> int:
    """How much larger the inputs are on ``device``: 1 on CPU (interpreted), 64 on CUDA."""
    return 1 if device.type == "cpu" else 64


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ops the tests reach through a module (group lookups, bucketization) run the
    Triton kernels, interpreted on CPU (the reference runs are told ``torch``)."""
    monkeypatch.setenv(ENV_VAR, "triton")


def assert_same(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit, ``got`` from the device, ``want`` from the CPU."""
    same(name, got, want, labels=("device", "cpu"))


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(
        got.cpu(), want, atol=ATOL, rtol=RTOL, msg=lambda m, name=name: f"{name}: {m}"
    )


# --------------------------------------------------------------------- probe
@pytest.mark.parametrize("fill", [0.5, 1.0], ids=["half-full", "full"])
def test_probe(device: torch.device, fill: float) -> None:
    s = scale(device)
    num_buckets, n = 7 * s, 301 * s
    gen = torch.Generator().manual_seed(n)
    universe = INT64_MAX - torch.randperm(4 * num_buckets * WAYS, generator=gen)
    keys = fill_table(universe, num_buckets, WAYS, fill, seed=n)
    fresh = torch.randint(0, INT64_MAX, (n // 2,), generator=gen)
    ids = torch.cat([universe[: n - n // 2], fresh])[torch.randperm(n, generator=gen)]
    want = probe_torch(keys, ids)
    assert bool((want >= 0).any()) and bool((want < 0).any())
    assert_same("slots", probe_triton(keys.to(device), ids.to(device)), want)


# -------------------------------------------------------------------- insert
def insert_cases(device: torch.device) -> dict[str, InsertCase]:
    s = scale(device)
    picked = ("churn-ties-3x16", "one-bucket-overflow")
    cases = {name: INSERT_CASES[name] for name in picked}
    cases["churn-many-buckets"] = InsertCase(7 * s, 150 * s, 4, 500 * s, 50, prefill=0.5)
    return cases


@pytest.mark.parametrize("keep_existing", [False, True], ids=["evict", "keep-existing"])
@pytest.mark.parametrize("accumulate", [False, True], ids=["assign", "accumulate"])
def test_insert(device: torch.device, accumulate: bool, keep_existing: bool) -> None:
    for name, case in insert_cases(device).items():
        gen = torch.Generator().manual_seed(len(name))
        shape = (case.num_buckets, case.ways)
        keys = torch.full(shape, -1, dtype=torch.int64)
        scores = torch.zeros(shape, dtype=torch.int64)
        if case.prefill:
            fill = case.base + torch.randperm(case.universe, generator=gen)
            buckets = index_bucket(fill, case.num_buckets)
            for b in range(case.num_buckets):
                mine = fill[buckets == b][: int(case.prefill * case.ways)]
                keys[b, : mine.numel()] = mine
                scores[b, : mine.numel()] = torch.randint(0, 100, (mine.numel(),), generator=gen)
        dev_keys, dev_scores = keys.to(device, copy=True), scores.to(device, copy=True)
        evicted = 0
        for r in range(case.rounds):
            ids = case.base + torch.randperm(case.universe, generator=gen)[: case.batch]
            values = torch.randint(0, max(case.max_score, 1), (ids.numel(),), generator=gen)
            want = insert_torch(keys, scores, ids, values, accumulate, keep_existing)
            got = insert_triton(
                dev_keys, dev_scores, ids.to(device), values.to(device), accumulate, keep_existing
            )
            tag = f"{name} round {r}"
            for field in ("slots", "hit", "inserted"):
                assert_same(f"{tag} {field}", getattr(got, field), getattr(want, field))
            got_order = torch.argsort(got.evicted_slots.cpu())
            want_order = torch.argsort(want.evicted_slots)
            assert_same(f"{tag} evicted_slots", got.evicted_slots.cpu()[got_order],
                        want.evicted_slots[want_order])  # fmt: skip
            assert_same(f"{tag} evicted_ids", got.evicted_ids.cpu()[got_order],
                        want.evicted_ids[want_order])  # fmt: skip
            assert_same(f"{tag} keys", dev_keys, keys)
            assert_same(f"{tag} scores", dev_scores, scores)
            evicted += want.evicted_ids.numel()
        if keep_existing:
            assert evicted == 0, f"{name}: keep_existing evicted"
        elif not accumulate:
            assert evicted > 0, f"{name}: the case never evicts"


# -------------------------------------------------------------- group lookup
#: Cases of test_group_lookup.py, then one that grows with the device.
GROUP_NAMES = (
    "admission-custom-and-none",
    "one-bucket-over-the-window",
    "near-int64-max",
    "wide-rows-adam-dim130",
    "many-programs",
)


def group_cases(device: torch.device) -> dict[str, GroupCase]:
    s = scale(device)
    cases = {name: GROUP_CASES[name] for name in GROUP_NAMES[:-1]}
    lfu = EvictionPolicy.LFU
    cases["many-programs"] = GroupCase(
        (Table(16 * s), Table(48 * s, lfu, admission=2, counter=16 * s), Table(80 * s)),
        steps=3, batch=37 * s, universe=150 * s, foreign=7 * s, absent=2,
        expect=("evictions", "admission_rejects"),
    )  # fmt: skip
    return cases


def check_group(tag: str, case: GroupCase, got: KVTableGroup, want: KVTableGroup) -> None:
    g, w = got.storage, want.storage
    for name in ("keys", "scores", "counter_keys", "counter_scores", "counts", "state"):
        assert_same(f"{tag} {name}", getattr(g, name), getattr(w, name))
    for k, (tg, tw) in enumerate(zip(got.tables, want.tables, strict=True)):
        assert tg.metrics() == tw.metrics(), f"{tag} table {k} metrics"
        assert tg.step == tw.step, f"{tag} table {k} clock"
        if case.tables[k].normal:
            assert_close(f"{tag} table {k} rows", tg.weights, tw.weights)
        else:
            assert_same(f"{tag} table {k} rows", tg.weights, tw.weights)


@pytest.mark.parametrize("name", GROUP_NAMES)
def test_group_lookup(device: torch.device, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A group on the device (the Triton group lookup) against the same group on the
    CPU looked up table by table (torch), step by step, then an evaluation batch."""
    case = group_cases(device)[name]
    with monkeypatch.context() as m:
        m.setenv(ENV_VAR, "torch")
        want = build_group(case)
    got = KVTableGroup(
        [t.name for t in want.tables],
        [t.options for t in want.tables],
        case.dim,
        optim=want.optim,
        device=device,
    )
    got.weights.copy_(want.weights)
    got.state.copy_(want.state)
    gen = torch.Generator().manual_seed(case.steps * 131 + case.batch)
    flags = list(case.custom_tables) if case.custom_tables is not None else None
    for step in range(case.steps):
        ids, table_idx, scores = batch(case, step, gen)
        dev_scores = None if scores is None else scores.to(device)
        slots = got.lookup_train(ids.to(device), table_idx.to(device), dev_scores, flags).slots
        with monkeypatch.context() as m:
            m.setenv(ENV_VAR, "torch")
            ref = want.lookup_train_per_table(ids, table_idx, scores, flags).slots
        tag = f"step {step} ({ids.numel()} ids)"
        assert slots.device.type == device.type
        assert_same(f"{tag} slots", slots, ref)
        check_group(tag, case, got, want)
    ids, table_idx, _ = batch(case, case.steps, gen)
    fresh = case.base + case.universe + torch.arange(11)
    ids = torch.cat([ids, fresh])
    table_idx = torch.cat([table_idx, torch.arange(11) % len(case.tables)])
    slots = got.lookup_eval(ids.to(device), table_idx.to(device))
    with monkeypatch.context() as m:
        m.setenv(ENV_VAR, "torch")
        ref = want.lookup_eval_per_table(ids, table_idx)
    assert_same("eval slots", slots, ref)
    check_group("eval", case, got, want)
    totals = {m: sum(t.metrics()[m] for t in want.tables) for m in case.expect}
    assert all(totals.values()), f"the case never counts {totals}"


# ------------------------------------------------------------ pooled forward
def on_device(bags, device: torch.device):
    return type(bags)(*(None if t is None else t.to(device) for t in bags))


@pytest.mark.parametrize("missing_as_zero", [False, True], ids=["missing-init", "missing-zero"])
@pytest.mark.parametrize("scale_mode", ["sum", "weighted-mixed-mean"])
@pytest.mark.parametrize("dim", [5, 130], ids=lambda d: f"dim{d}")
def test_pooled_forward(
    device: torch.device, dim: int, scale_mode: str, missing_as_zero: bool
) -> None:
    b = make_batch(dim, seed=dim, weighted=SCALES[scale_mode][0], lengths=LENGTHS * scale(device))
    bags = bags_of(b, scale_mode)
    num_bags = b.offsets.numel() - 1
    bag_list = torch.arange(0, num_bags, 2)  # every other bag: the others stay zeros
    want = group_pooled_forward_torch(
        b.weights, b.slots, b.ids, b.table_idx, bags, POOLED_LAYOUT.init_specs, missing_as_zero
    )
    got = group_pooled_forward_triton(
        POOLED_LAYOUT.to(device),
        b.weights.to(device),
        b.slots.to(device),
        b.ids.to(device),
        b.table_idx.to(device),
        on_device(bags, device),
        bag_list.to(device),
        missing_as_zero,
    ).cpu()
    assert got.shape == want.shape
    assert_close("pooled rows", got[bag_list], want[bag_list])
    others = torch.ones(num_bags, dtype=torch.bool)
    others[bag_list] = False
    assert torch.equal(got[others], torch.zeros_like(got[others])), "bags not listed are zeros"


# ------------------------------------------------------------ fused backward
BACKWARD = {
    "adagrad-plain-sum": ("rowwise-adagrad", "plain", "sum"),
    "adam-l2-clipped-mixed": ("adam", "l2-clipped", "weighted-mixed-mean"),
    "sgd-decoupled-clipped-weighted": ("sgd", "decoupled-clipped", "weighted"),
}


@pytest.mark.parametrize("name", list(BACKWARD))
@pytest.mark.parametrize("dim", [5, 257], ids=lambda d: f"dim{d}")
def test_fused_backward(device: torch.device, dim: int, name: str) -> None:
    kind, decay, scale_mode = BACKWARD[name]
    config = FusedOptimConfig(kind=KINDS[kind], **DECAYS[decay])
    b = make_batch(dim, seed=dim + 3, weighted=SCALES[scale_mode][0],
                   lengths=LENGTHS * scale(device))  # fmt: skip
    bags = bags_of(b, scale_mode)
    g = torch.Generator().manual_seed(dim)
    state = torch.rand(sum(ROWS), config.state_dim(dim), generator=g)
    grad_out = torch.randn(b.offsets.numel() - 1, dim, generator=g)

    weights, want_state = b.weights.clone(), state.clone()
    uniq, grads = group_pooled_backward_torch(clip_output_gradient(grad_out, config), b.slots, bags)
    for t, start in enumerate(STARTS.tolist()):
        mine = ((uniq >= start) & (uniq < start + ROWS[t])).nonzero().squeeze(1)
        optimizer_update_torch(
            weights[start : start + ROWS[t]],
            want_state[start : start + ROWS[t]],
            uniq[mine] - start,
            grads[mine],
            config.with_learning_rate(LEARNING_RATES[t]),
            OPTIM_STEPS[t],
        )

    dev_weights, dev_state = b.weights.to(device, copy=True), state.to(device, copy=True)
    slots = b.slots.to(device)
    steps = torch.tensor(OPTIM_STEPS, dtype=torch.float64)
    decay_value = config.weight_decay
    group_fused_backward_triton(
        dev_weights,
        dev_state,
        grad_out.to(device),
        slots,
        torch.searchsorted(STARTS.to(device), slots.clamp(min=0), right=True) - 1,
        on_device(bags, device),
        CODES[config.kind],
        torch.tensor(LEARNING_RATES, dtype=torch.float32, device=device),
        (1.0 - config.beta1**steps).to(torch.float32).to(device),
        (1.0 - config.beta2**steps).to(torch.float32).to(device),
        config.eps,
        config.beta1,
        config.beta2,
        decay_value,
        bool(decay_value) and config.weight_decay_mode == WeightDecay.L2,
        bool(decay_value) and config.weight_decay_mode == WeightDecay.DECOUPLE,
        config.gradient_clipping,
        config.max_gradient,
    )
    assert not torch.equal(weights, b.weights), "the update changed no row"
    assert_close("weights", dev_weights, weights)
    assert_close("optimizer state", dev_state, want_state)


# ------------------------------------------------------------- bucketization
BUCKETIZE = {
    "2d-weights-vbe-pos": dict(seed=13, world_size=4, weights="2d", total_blocks_factor=2,
                               variable_batch=True, bucketize_pos=True, num_features=5),
    "1d-weights-keep-ids": dict(seed=4, world_size=3, weights="1d", keep_orig_idx=True,
                                num_features=3),
    "no-weights-int32-one-rank": dict(seed=7, world_size=1, indices_dtype=torch.int32),
}  # fmt: skip


@pytest.mark.parametrize("name", list(BUCKETIZE))
def test_block_bucketize(device: torch.device, name: str) -> None:
    s = scale(device)
    case = make_case(**BUCKETIZE[name], max_batch=5 * s, max_len=6 + s // 8)
    kwargs = case.kwargs()
    want = block_bucketize_2d_torch(**kwargs)
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    got = block_bucketize_2d(**moved)
    for field, g, w in zip(BucketizeResult._fields, got, want, strict=True):
        if w is None:
            assert g is None, f"{field}: expected None"
            continue
        assert g.device.type == device.type, f"{field} on {g.device}"
        assert_same(field, g, w)
