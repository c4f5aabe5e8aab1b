"""The native training lookup gives the same bits on 1, 2 and 3 threads.

``kv_lookup_train_group`` orders a batch by bucket in parts of 1024 buckets
(counted and scattered per slice of the batch) and settles part by part,
threads taking parts in any order. Each scenario below runs a few batches
of over 32k ids (several slices and parts) through three copies of one
group, with 1, 2 and 3 threads, and compares every output (slots, unique
order and flags, counts, evictions, metrics) and every array after the
batches. One scenario's 1-thread run (new rows written by non-temporal
stores, dim 8) is also checked against the per-table ``KVTable.lookup_train``
at every batch (``train_both``; every policy is held to it in test_native.py,
on fewer ids).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.ops.test_native import (
    CUSTOM,
    LFU,
    LRU,
    NONE,
    Batch,
    Group,
    Spec,
    assert_same_lookup,
    random_batch,
    train_both,
)
from torchrec_kvemb.ops import native

THREADS = (1, 2, 3)


@pytest.fixture(autouse=True)
def build(native_build: str) -> str:
    """Every test runs on each build of the library (tests/ops/conftest.py)."""
    return native_build


@dataclass(frozen=True)
class Scenario:
    specs: tuple[Spec, ...]
    sizes: tuple[int | None, ...]  # ids per table and batch (None: absent)
    id_range: int
    dim: int = 3
    shuffle: bool = False  # tables interleaved in the batch, else table by table
    steps: int = 2
    against_torch: bool = False  # the 1-thread run checked by train_both
    distinct: bool = False  # no id repeats within a table's batch


SCENARIOS = {
    # Ids split unevenly: one table holds most of them.
    "four-policies-uneven": Scenario(
        (
            Spec(16 * 700, LRU),
            Spec(16 * 61 + 3, LFU, seed=1),
            Spec(16 * 300, CUSTOM, seed=2),
            Spec(16 * 90, NONE, seed=3),
        ),
        (30011, 2503, 7001, 513),
        40_000,
    ),
    "admission-shuffled": Scenario(
        (
            Spec(16 * 450 + 5, LFU, threshold=2, seed=1),
            Spec(16 * 300, CUSTOM, threshold=3),
            Spec(16 * 90, NONE, threshold=2, counter=700, seed=3),
            Spec(16 * 200, LRU, seed=4),
        ),
        (9001, 12007, 5003, 9999),
        30_000,
        shuffle=True,
    ),
    "admission-repeating-ids": Scenario(
        (
            Spec(16 * 60, LFU, threshold=2, seed=1),
            Spec(16 * 40 + 3, CUSTOM, threshold=3, counter=300),
            Spec(16 * 50, LRU, threshold=2, seed=4),
        ),
        (15013, 11003, 9001),
        2500,
        shuffle=True,
    ),
    # Thousands of ids over tables of 39 to 80 rows: every bucket full, heavy duplicates.
    "full-buckets-heavy-duplicates": Scenario(
        (Spec(16 * 5, LRU), Spec(16 * 3, LFU, seed=1), Spec(16 * 2 + 7, CUSTOM, seed=2)),
        (20011, 9001, 7003),
        3000,
        shuffle=True,
    ),
    "one-table-rows-streamed": Scenario(
        (Spec(16 * 1500, LRU, seed=5),),
        (36007,),
        60_000,
        dim=8,
        against_torch=True,
        distinct=True,
    ),
    "absent-table-odd-dim": Scenario(
        (Spec(16 * 400, LFU), Spec(16 * 30, LRU, seed=1), Spec(16 * 700, NONE, seed=2)),
        (21001, None, 14003),
        25_000,
        dim=7,
        shuffle=True,
    ),
}


def run_scenario(scenario: Scenario, threads: int, against_torch: bool):
    """Every output of every step and the arrays after the last one."""
    group = Group(list(scenario.specs), dim=scenario.dim)
    gen = torch.Generator().manual_seed(7)
    outputs = []
    for step in range(1, scenario.steps + 1):
        batch = random_batch(group, gen, list(scenario.sizes), id_range=scenario.id_range)
        if scenario.distinct:
            batch.ids = [
                None if n is None else torch.randperm(scenario.id_range, generator=gen)[:n]
                for n in scenario.sizes
            ]
        order = torch.Generator().manual_seed(step) if scenario.shuffle else None
        if against_torch:
            out, _, _ = train_both(group, batch, threads, gen=order)
        else:
            ids, table_idx, custom, _ = batch.flat(order)
            out = native.lookup_train_group(
                group.layout, group.keys, group.scores, group.weights, group.state,
                ids, table_idx, [step] * len(group.tables), custom,
                [c is not None for c in batch.custom], group.counter, num_threads=threads,
            )  # fmt: skip
        outputs.append(out)
    return outputs, group.clone_arrays()


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_threads_give_identical_lookups(name: str) -> None:
    scenario = SCENARIOS[name]
    runs = {t: run_scenario(scenario, t, scenario.against_torch and t == 1) for t in THREADS}
    outputs_1, arrays_1 = runs[1]
    assert sum(int(out.evicted_ids.numel()) for out in outputs_1) > 0, "the batches evict"
    for threads in THREADS[1:]:
        outputs, arrays = runs[threads]
        for step, (a, b) in enumerate(zip(outputs_1, outputs, strict=True)):
            assert_same_lookup(a, b, f"{name}, step {step}, 1 vs {threads} threads")
        for array in arrays_1:
            assert torch.equal(arrays_1[array], arrays[array]), (
                f"{name}: {array} after the batches, 1 vs {threads} threads"
            )


def tier_batch(group: Group, gen: torch.Generator, sizes: list[int]) -> tuple[Batch, ...]:
    """A batch and, per table, ids its lower tier holds (ascending) with scores."""
    batch = random_batch(group, gen, sizes, id_range=20_000)
    promote, scores, offsets = [], [], [0]
    for t, ids in enumerate(batch.ids):
        held = torch.unique(ids[torch.rand(ids.numel(), generator=gen) < 0.3])
        promote.append(held)
        scores.append(torch.randint(0, 9, (held.numel(),), generator=gen) + 10 * t)
        offsets.append(offsets[-1] + held.numel())
    return batch, native.TierPromotion(
        torch.cat(promote), torch.cat(scores), torch.tensor(offsets, dtype=torch.int64)
    )


def test_threads_give_identical_promotions() -> None:
    """Tables over lower tiers: promoted ids outrank stored ones; flags, scores and
    evicted scores are the same on every thread count."""
    specs = [Spec(16 * 400, LRU), Spec(16 * 150 + 9, LFU, seed=1), Spec(16 * 250, CUSTOM, seed=2)]
    results = {}
    for threads in THREADS:
        group = Group(specs)
        gen = torch.Generator().manual_seed(3)
        outputs = []
        for step in range(1, 4):
            batch, tier = tier_batch(group, gen, [17011, 6007, 11003])
            ids, table_idx, custom, _ = batch.flat(torch.Generator().manual_seed(step))
            outputs.append(
                native.lookup_train_group(
                    group.layout,
                    group.keys,
                    group.scores,
                    group.weights,
                    group.state,
                    ids,
                    table_idx,
                    [step] * 3,
                    custom,
                    [False, False, True],
                    num_threads=threads,
                    tier=tier,
                )  # fmt: skip
            )
        results[threads] = outputs, group.clone_arrays()
    outputs_1, arrays_1 = results[1]
    promoted = (outputs_1[-1].unique_flags & native.UNIQUE_PROMOTED) != 0
    assert int(promoted.sum()) > 1000, "the batches promote ids"
    assert int(outputs_1[-1].evicted_ids.numel()) > 0, "the batches evict"
    for threads in THREADS[1:]:
        outputs, arrays = results[threads]
        for step, (a, b) in enumerate(zip(outputs_1, outputs, strict=True)):
            assert_same_lookup(a, b, f"promotions, step {step}, 1 vs {threads} threads")
        for array in arrays_1:
            assert torch.equal(arrays_1[array], arrays[array]), f"{array}: 1 vs {threads} threads"


def test_one_workspace_across_groups_and_thread_counts() -> None:
    """Scratch a workspace keeps between calls leaves no trace: calls alternating
    two groups of other sizes, with and without the workspace, on 1 and 3
    threads, give what fresh scratch gives."""
    specs = [Spec(16 * 300, LRU), Spec(16 * 200, LFU, seed=1)]
    shared, alone = [Group(specs), Group(specs)], [Group(specs), Group(specs)]
    workspace = native.Workspace()
    gen = torch.Generator().manual_seed(11)
    for step in range(1, 7):
        g = step % 2
        ids = torch.randint(0, 9000 if g else 30_000, (20_011,), generator=gen)
        table_idx = (torch.rand(ids.numel(), generator=gen) < 0.6).to(torch.int64)
        threads = 1 if step % 3 else 3
        outs = [
            native.lookup_train_group(
                group.layout,
                group.keys,
                group.scores,
                group.weights,
                group.state,
                ids,
                table_idx,
                [step, step],
                num_threads=threads,
                workspace=ws,
            )  # fmt: skip
            for group, ws in ((shared[g], workspace), (alone[g], None))
        ]
        assert_same_lookup(outs[0], outs[1], f"step {step}")
    for a, b in zip(shared, alone, strict=True):
        for name, value in a.clone_arrays().items():
            assert torch.equal(value, b.clone_arrays()[name]), name
