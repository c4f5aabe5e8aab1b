"""The Triton group lookup (interpreter, CPU tensors) matches the per-table torch path bit for bit.

Each case builds two identical ``KVTableGroup``s and drives them through the
same batches: one by the Triton kernels (``group_lookup_train_triton`` /
``group_lookup_eval_triton``, through dispatch with the ``triton`` backend),
the other table by table (``KVTableGroup.lookup_train_per_table``: each
``KVTable.lookup_train`` on the torch backend). After every step they must
agree exactly on the slots, the index (keys, scores), the admission counter
(keys, scores, counts), every table's metrics and clock, and the rows and
optimizer state of the group (new rows get their initial value and zero
state: bit for bit for UNIFORM tables, to float tolerance for NORMAL ones).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from tests.kernels.checks import assert_same
from torchrec_kvemb.backend import ENV_VAR
from torchrec_kvemb.contracts import INT64_MAX
from torchrec_kvemb.group import KVTableGroup
from torchrec_kvemb.ops.hashing import index_bucket
from torchrec_kvemb.optimizer import FusedOptimConfig, OptimKind
from torchrec_kvemb.options import WAYS, EvictionPolicy, Initializer, KVTableOptions

LRU, LFU = EvictionPolicy.LRU, EvictionPolicy.LFU
CUSTOM, NONE = EvictionPolicy.CUSTOM_SCORE, EvictionPolicy.NONE


def assert_close(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5, msg=lambda m: f"{name}: {m}")


@dataclass(frozen=True)
class Table:
    capacity: int  # rows; a multiple of WAYS: 16 is one bucket
    policy: EvictionPolicy = LRU
    admission: int = 1  # admission threshold
    counter: int | None = None  # admission counter capacity (None: the table's)
    normal: bool = False  # NORMAL initializer (else UNIFORM)


@dataclass(frozen=True)
class Case:
    tables: tuple[Table, ...]
    steps: int
    batch: int  # ids per table per step (drawn with repeats: duplicates)
    universe: int  # each table draws its ids from base + [0, universe)
    base: int = 0
    dim: int = 5
    optim: OptimKind = OptimKind.ROWWISE_ADAGRAD
    max_score: int | None = None  # custom scores in [0, max_score) (None: no custom scores)
    custom_tables: tuple[bool, ...] | None = None  # which tables use them (None: all)
    foreign: int = 0  # ids of table -1 (not the group's) per step, from the same universe
    absent: int | None = None  # this table has no ids in odd steps
    empty_steps: tuple[int, ...] = ()  # steps with no ids at all
    foreign_only_steps: tuple[int, ...] = ()  # steps with only ids of table -1
    expect: tuple[str, ...] = field(default=())  # metrics some table must count


CASES = {
    "lru-3-tables-1-3-5-buckets": Case(
        (Table(16), Table(48, normal=True), Table(80)),
        steps=5, batch=37, universe=150, foreign=7, absent=1, expect=("evictions",),
    ),
    "lfu-3-tables": Case(
        (Table(16, LFU), Table(48, LFU), Table(80, LFU, normal=True)),
        steps=5, batch=41, universe=120, foreign=5, absent=2, expect=("evictions",),
    ),
    "custom-score-ties": Case(
        (Table(16, CUSTOM), Table(48, CUSTOM, normal=True), Table(16, LRU)),
        steps=5, batch=39, universe=130, max_score=4, foreign=3, expect=("evictions",),
    ),
    "custom-score-some-tables": Case(
        (Table(16, CUSTOM), Table(48, CUSTOM), Table(16, LFU)),
        steps=4, batch=33, universe=110, max_score=1000, custom_tables=(True, False, True),
        expect=("evictions",),
    ),
    "none-never-evicts": Case(
        (Table(16, NONE), Table(48, NONE, normal=True), Table(16, LRU)),
        steps=4, batch=35, universe=100, foreign=4, expect=("insert_failures",),
    ),
    "admission-2-and-3": Case(
        (
            Table(48, LRU, admission=2, counter=16),
            Table(16, LFU, admission=3, counter=48),
            Table(16, LRU),
        ),
        steps=6, batch=31, universe=45, foreign=5, absent=0,
        expect=("admission_rejects", "evictions"),
    ),
    "admission-custom-and-none": Case(
        (
            Table(16, CUSTOM, admission=2, counter=16),
            Table(48, NONE, admission=3, normal=True),
            Table(16, LFU, admission=2, counter=16),
        ),
        steps=6, batch=29, universe=40, max_score=5, foreign=3,
        expect=("admission_rejects", "insert_failures"),
    ),
    "one-bucket-over-the-window": Case(
        (Table(16, LRU),), steps=4, batch=90, universe=400, expect=("evictions",),
    ),
    "one-bucket-lfu-admission-window": Case(
        (Table(16, LFU, admission=2, counter=16),),
        steps=4, batch=90, universe=70, expect=("evictions", "admission_rejects"),
    ),
    "near-int64-max": Case(
        (Table(16, LRU), Table(48, LFU, admission=2)),
        steps=4, batch=37, universe=90, base=INT64_MAX - 89, foreign=5,
        expect=("evictions",),
    ),
    "wide-rows-adam-dim130": Case(
        (Table(16, LRU), Table(48, LFU, normal=True)),
        steps=3, batch=27, universe=70, dim=130, optim=OptimKind.ADAM,
        expect=("evictions",),
    ),
    "sgd-empty-and-foreign-only-steps": Case(
        (Table(16, LRU, admission=2), Table(16, CUSTOM)),
        steps=6, batch=23, universe=50, optim=OptimKind.SGD, max_score=3, foreign=4,
        empty_steps=(0, 3), foreign_only_steps=(1, 4),
    ),
}  # fmt: skip


def build(case: Case) -> KVTableGroup:
    """The case's group, its rows and state filled with noise (so that the rows and
    state a lookup writes show)."""
    options = [
        KVTableOptions(
            capacity=t.capacity,
            eviction=t.policy,
            admission_threshold=t.admission,
            admission_counter_capacity=t.counter,
            initializer=Initializer.NORMAL if t.normal else Initializer.UNIFORM,
            init_low=-0.5 + k,
            init_high=0.25 + 2 * k,
            init_mean=0.5 * k,
            init_std=0.3 + k,
            seed=17 * k + 1,
        )
        for k, t in enumerate(case.tables)
    ]
    names = [f"t{k}" for k in range(len(case.tables))]
    group = KVTableGroup(names, options, case.dim, optim=FusedOptimConfig(kind=case.optim))
    gen = torch.Generator().manual_seed(case.dim)
    group.weights.copy_(torch.randn(group.weights.shape, generator=gen))
    group.state.copy_(torch.rand(group.state.shape, generator=gen))
    return group


def batch(case: Case, step: int, gen: torch.Generator):
    """``(ids, table_idx, custom scores or None)`` of one step, tables interleaved."""
    ids, tables = [], []
    if step not in case.empty_steps:
        for k in range(len(case.tables)):
            skip = step in case.foreign_only_steps or (case.absent == k and step % 2 == 1)
            if not skip:
                ids.append(torch.randint(0, case.universe, (case.batch,), generator=gen))
                tables.append(torch.full((case.batch,), k))
        ids.append(torch.randint(0, case.universe, (case.foreign,), generator=gen))
        tables.append(torch.full((case.foreign,), -1))
    ids = case.base + torch.cat(ids) if ids else torch.empty(0, dtype=torch.int64)
    table_idx = torch.cat(tables) if tables else torch.empty(0, dtype=torch.int64)
    order = torch.randperm(ids.numel(), generator=gen)
    ids, table_idx = ids[order], table_idx[order]
    scores = None
    if case.max_score is not None:
        scores = torch.randint(0, case.max_score, (ids.numel(),), generator=gen)
    return ids, table_idx, scores


def check_same(tag: str, case: Case, got: KVTableGroup, want: KVTableGroup) -> None:
    g, w = got.storage, want.storage
    for name in ("keys", "scores", "counter_keys", "counter_scores", "counts", "state"):
        assert_same(f"{tag} {name}", getattr(g, name), getattr(w, name))
    for k, (tg, tw) in enumerate(zip(got.tables, want.tables, strict=True)):
        assert tg.metrics() == tw.metrics(), f"{tag} table {k} metrics"
        assert tg.step == tw.step, f"{tag} table {k} clock {tg.step} != {tw.step}"
        if case.tables[k].normal:
            assert_close(f"{tag} table {k} rows", tg.weights, tw.weights)
        else:
            assert_same(f"{tag} table {k} rows", tg.weights, tw.weights)


def run_case(case: Case, monkeypatch: pytest.MonkeyPatch) -> KVTableGroup:
    """Drive both groups through the case's steps, then an evaluation batch."""
    monkeypatch.setenv(ENV_VAR, "torch")  # the per-table path: torch ops only
    triton_group, torch_group = build(case), build(case)
    gen = torch.Generator().manual_seed(case.steps * 131 + case.batch)
    for step in range(case.steps):
        ids, table_idx, scores = batch(case, step, gen)
        flags = list(case.custom_tables) if case.custom_tables is not None else None
        with monkeypatch.context() as m:
            m.setenv(ENV_VAR, "triton")
            got = triton_group.lookup_train(ids, table_idx, scores, flags)
        want = torch_group.lookup_train_per_table(ids, table_idx, scores, flags)
        tag = f"step {step} ({ids.numel()} ids)"
        assert_same(f"{tag} slots", got.slots, want.slots)
        assert bool((got.slots[table_idx < 0] == -1).all()), f"{tag}: an id of table -1 has a row"
        check_same(tag, case, triton_group, torch_group)

    # Evaluation: stored ids, ids never seen, ids of table -1.
    ids, table_idx, _ = batch(case, case.steps, gen)
    fresh = case.base + case.universe + torch.arange(11)
    foreign = ids[:5]
    ids = torch.cat([ids, fresh, foreign])
    table_idx = torch.cat(
        [table_idx, torch.arange(11) % len(case.tables), torch.full_like(foreign, -1)]
    )
    with monkeypatch.context() as m:
        m.setenv(ENV_VAR, "triton")
        got = triton_group.lookup_eval(ids, table_idx)
    want = torch_group.lookup_eval_per_table(ids, table_idx)
    assert_same("eval slots", got, want)
    check_same("eval", case, triton_group, torch_group)
    return torch_group


@pytest.mark.parametrize("name", list(CASES), ids=list(CASES))
def test_group_lookup_matches_per_table_torch(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    case = CASES[name]
    group = run_case(case, monkeypatch)
    totals = {m: sum(t.metrics()[m] for t in group.tables) for m in case.expect}
    missing = [m for m, v in totals.items() if v == 0]
    assert not missing, f"the case never counts {missing}: it tests less than it claims"


def test_one_bucket_takes_more_than_the_window() -> None:
    """The window case really ranks more than 32 candidates, over 16 new ids, in one bucket."""
    case = CASES["one-bucket-over-the-window"]
    ids, _, _ = batch(case, 0, torch.Generator().manual_seed(case.steps * 131 + case.batch))
    assert torch.unique(ids).numel() > 2 * WAYS


def test_same_id_in_two_tables_gets_two_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """(table, id) is the key: an id in two tables, twice each, takes one row in each."""
    monkeypatch.setenv(ENV_VAR, "torch")
    case = Case((Table(16), Table(48, LFU)), steps=1, batch=1, universe=1)
    got, want = build(case), build(case)
    ids = torch.tensor([INT64_MAX, 5, INT64_MAX, INT64_MAX, 5, INT64_MAX, 0])
    table_idx = torch.tensor([0, 1, 1, 0, -1, 1, -1])
    with monkeypatch.context() as m:
        m.setenv(ENV_VAR, "triton")
        slots = got.lookup_train(ids, table_idx).slots
    assert_same("slots", slots, want.lookup_train_per_table(ids, table_idx, None, None).slots)
    check_same("two tables", case, got, want)
    assert slots[0] == slots[3] and slots[2] == slots[5] and slots[0] != slots[2]
    assert slots[0] < 16 <= slots[2], "each table's rows are its own range"
    bucket = 1 + int(index_bucket(torch.tensor([INT64_MAX]), 3))
    assert int(slots[2]) // WAYS == bucket
    assert got.tables[1].scores.view(-1)[int(slots[2]) - 16] == 2, "LFU counts its 2 sightings"
