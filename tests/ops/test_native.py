"""The native group kernels against the per-table torch path, bit for bit.

Each test builds T ``KVTable``s, assembles their arrays into one group
(keys, scores, weights, state and admission counters concatenated, as
``GroupLayout`` lays them out), then runs the same batches through
``KVTable.lookup_train`` / ``lookup_eval`` / the torch backward (``apply_gradients``
below) per table and through the native group op, and compares every array and
output.
Integer outputs and rows written by lookups must be equal (``torch.equal``);
rows after an optimizer step within ``BACKWARD_TOLERANCE``.

The library must be built (``make test`` builds it): these tests fail, not
skip, without it. ``test_fallback_*`` force the unavailable path.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest
import torch

from torchrec_kvemb import native_lib
from torchrec_kvemb.backend import implementation
from torchrec_kvemb.contracts import KERNEL_METRICS, METRIC_NAMES, Bags, GroupLayout, InitSpec
from torchrec_kvemb.group import KVTableGroup
from torchrec_kvemb.ops import native
from torchrec_kvemb.ops.hashing import INT64_MAX, index_bucket, init_rows
from torchrec_kvemb.ops.insert import insert_torch
from torchrec_kvemb.ops.pooled_lookup import pooled_backward_update_torch
from torchrec_kvemb.optimizer import FusedOptimConfig, OptimKind, WeightDecay
from torchrec_kvemb.options import WAYS, EvictionPolicy, Initializer, KVTableOptions
from torchrec_kvemb.table import KVTable
from torchrec_kvemb.validation import KVInputError

LRU, LFU, CUSTOM, NONE = (
    EvictionPolicy.LRU,
    EvictionPolicy.LFU,
    EvictionPolicy.CUSTOM_SCORE,
    EvictionPolicy.NONE,
)

#: Rows after one optimizer step: the native update runs the torch path's
#: float32 ops in the same order, but torch's row mean (Adagrad) rounds
#: differently in the last bits.
BACKWARD_TOLERANCE = dict(rtol=1e-5, atol=1e-7)


def apply_gradients(table, grad_out, slots, offsets, per_sample_weights, mean) -> None:
    """The torch backward of one table: gradient per stored row, one optimizer step."""
    table.optim_step += 1
    bags = Bags.build(offsets, slots.numel(), per_sample_weights, mean)
    pooled_backward_update_torch(
        table.weights, table.state, grad_out, slots, bags, table.optim, table.optim_step
    )


@pytest.fixture(autouse=True)
def build(native_build: str) -> str:
    """Every test runs on each build of the library (tests/ops/conftest.py)."""
    return native_build


# ------------------------------------------------------------------ harness
@dataclass(frozen=True)
class Spec:
    """One table of a test group."""

    capacity: int
    eviction: EvictionPolicy = LRU
    threshold: int = 1
    counter: int | None = None  # admission counter capacity (None: the table's)
    normal: bool = False
    seed: int = 0
    learning_rate: float = 0.05

    def options(self) -> KVTableOptions:
        return KVTableOptions(
            capacity=self.capacity,
            eviction=self.eviction,
            admission_threshold=self.threshold,
            admission_counter_capacity=self.counter,
            initializer=Initializer.NORMAL if self.normal else Initializer.UNIFORM,
            init_low=-0.3,
            init_high=0.7,
            init_std=0.2,
            seed=self.seed,
        )


class Group:
    """T KV tables and a copy of their arrays laid out as one native group."""

    def __init__(self, specs: list[Spec], dim: int = 5, optim: FusedOptimConfig | None = None):
        optim = optim or FusedOptimConfig()
        self.tables = [
            KVTable(f"t{i}", dim, s.options(), optim.with_learning_rate(s.learning_rate))
            for i, s in enumerate(specs)
        ]
        self.optim = optim
        self.layout = GroupLayout.of(
            num_buckets=[t.keys.shape[0] for t in self.tables],
            policies=[s.eviction for s in specs],
            init=[t.init_spec for t in self.tables],
            admission_thresholds=[s.threshold for s in specs],
            counter_num_buckets=[
                t.counter.keys.shape[0] if t.counter is not None else 0 for t in self.tables
            ],
        )
        self.keys = torch.cat([t.keys for t in self.tables]).clone()
        self.scores = torch.cat([t.scores for t in self.tables]).clone()
        self.weights = torch.cat([t.weights for t in self.tables]).clone()
        self.state = torch.cat([t.state for t in self.tables]).clone()
        counted = self.counted_tables
        self.counter = (
            native.CounterIndex(
                torch.cat([t.counter.keys for t in counted]).clone(),
                torch.cat([t.counter.scores for t in counted]).clone(),
                torch.cat([t.counts for t in counted]).clone(),
            )
            if counted
            else None
        )

    @property
    def counted_tables(self) -> list[KVTable]:
        return [t for t in self.tables if t.counter is not None]

    def buckets(self, t: int) -> slice:
        first = int(self.layout.bucket_offset[t])
        return slice(first, first + self.tables[t].keys.shape[0])

    def rows(self, t: int) -> slice:
        b = self.buckets(t)
        return slice(b.start * WAYS, b.stop * WAYS)

    def clone_arrays(self) -> dict[str, torch.Tensor]:
        arrays = dict(keys=self.keys, scores=self.scores, weights=self.weights, state=self.state)
        if self.counter is not None:
            arrays.update(zip(("ckeys", "cscores", "ccounts"), self.counter))
        return {k: v.clone() for k, v in arrays.items()}

    def sync_rows_from_tables(self) -> None:
        """Copy the tables' rows and state into the group (after a tolerance check)."""
        for t, table in enumerate(self.tables):
            self.weights[self.rows(t)] = table.weights
            self.state[self.rows(t)] = table.state

    def assert_matches_tables(self, where: str, rows_exact: bool = True) -> None:
        for t, table in enumerate(self.tables):
            at = f"{where}, table {t} ({table.options.eviction.name})"
            assert torch.equal(self.keys[self.buckets(t)], table.keys), f"{at}: keys differ"
            assert torch.equal(self.scores[self.buckets(t)], table.scores), f"{at}: scores differ"
            if rows_exact:
                assert torch.equal(self.weights[self.rows(t)], table.weights), (
                    f"{at}: weights differ"
                )
                assert torch.equal(self.state[self.rows(t)], table.state), f"{at}: state differs"
            else:
                torch.testing.assert_close(
                    self.weights[self.rows(t)], table.weights, **BACKWARD_TOLERANCE, msg=at
                )
                torch.testing.assert_close(
                    self.state[self.rows(t)], table.state, **BACKWARD_TOLERANCE, msg=at
                )
        if self.counter is not None:
            counted = self.counted_tables
            expect = (
                torch.cat([t.counter.keys for t in counted]),
                torch.cat([t.counter.scores for t in counted]),
                torch.cat([t.counts for t in counted]),
            )
            for name, got, want in zip(("keys", "scores", "counts"), self.counter, expect):
                assert torch.equal(got, want), f"{where}: admission counter {name} differ"


@dataclass
class Batch:
    """One training batch of a group: per table ids (None: the table is absent)
    and custom scores; ``foreign`` ids belong to another group (table_idx -1)."""

    ids: list[torch.Tensor | None]
    custom: list[torch.Tensor | None]
    foreign: torch.Tensor

    def flat(self, generator: torch.Generator | None = None):
        """``(ids, table_idx, custom_scores, within)`` of the group op, ``within``
        the index of each id in its table's ids; shuffled across tables when a
        generator is given, else table by table, then the foreign ids."""
        ids, table_idx, custom, within = [], [], [], []
        for t, part in enumerate([*self.ids, self.foreign]):
            if part is None:
                continue
            ids.append(part)
            table_idx.append(torch.full_like(part, t if t < len(self.ids) else -1))
            scores = self.custom[t] if t < len(self.ids) else None
            custom.append(scores if scores is not None else torch.zeros_like(part))
            within.append(torch.arange(part.numel()))
        ids, table_idx, custom, within = (torch.cat(x) for x in (ids, table_idx, custom, within))
        order = (
            torch.randperm(ids.numel(), generator=generator)
            if generator is not None
            else torch.arange(ids.numel())
        )
        return ids[order], table_idx[order], custom[order], within[order]


def random_batch(
    group: Group,
    gen: torch.Generator,
    sizes: list[int | None],
    id_range: int = 300,
    custom_for: tuple[EvictionPolicy, ...] = (CUSTOM,),
) -> Batch:
    """Ids drawn with repeats from a small range (buckets fill up) plus a few
    huge ids up to 2**63 - 1."""
    huge = torch.tensor([INT64_MAX, INT64_MAX - 1, 2**62 + 3, 2**40 + 7], dtype=torch.int64)
    ids, custom = [], []
    for t, n in enumerate(sizes):
        if n is None:
            ids.append(None)
            custom.append(None)
            continue
        part = torch.randint(0, id_range, (n,), generator=gen)
        swap = torch.rand(n, generator=gen) < 0.05
        part[swap] = huge[torch.randint(0, huge.numel(), (int(swap.sum()),), generator=gen)]
        ids.append(part)
        if group.tables[t].options.eviction in custom_for:
            custom.append(torch.randint(-50, 50, (n,), generator=gen))
        else:
            custom.append(None)
    foreign = torch.randint(-5, id_range, (int(torch.randint(0, 9, (1,), generator=gen)),))
    return Batch(ids, custom, foreign)


def train_both(group: Group, batch: Batch, num_threads: int, gen: torch.Generator | None = None):
    """The batch through every table's lookup_train and through the group op;
    checks slots, uniques, evictions, metrics and every array."""
    keys_before = group.keys.clone()
    expected, deltas = {}, {}
    for t, table in enumerate(group.tables):
        if batch.ids[t] is None:
            continue
        before = table.metrics()
        expected[t] = table.lookup_train(batch.ids[t], batch.custom[t])
        after = table.metrics()
        deltas[t] = [after[m] - before[m] for m in METRIC_NAMES[:KERNEL_METRICS]]

    ids, table_idx, custom, within = batch.flat(gen)
    out = native.lookup_train_group(
        group.layout,
        group.keys,
        group.scores,
        group.weights,
        group.state,
        ids,
        table_idx,
        step=[t.step for t in group.tables],
        custom_scores=custom,
        custom_tables=[c is not None for c in batch.custom],
        counter=group.counter,
        num_threads=num_threads,
    )
    check_lookup(group, batch, ids, table_idx, within, out, expected, deltas, keys_before)
    return out, ids, table_idx


def check_lookup(group, batch, ids, table_idx, within, out, expected, deltas, keys_before):
    T = len(group.tables)
    foreign = table_idx < 0
    assert bool((out.slots[foreign] == -1).all()), "ids of another group got slots"
    assert bool((out.unique_index[foreign] == -1).all()), "ids of another group got uniques"
    for t in range(T):
        mine = table_idx == t
        if t not in expected:
            assert not bool(mine.any())
            assert out.metrics[t].tolist() == [0] * 6, f"absent table {t} has metrics"
            continue
        rows = group.rows(t)
        got = torch.empty_like(out.slots[mine])
        got[within[mine]] = out.slots[mine]  # back in the order the table saw
        stored = got >= 0
        assert bool(((got[stored] >= rows.start) & (got[stored] < rows.stop)).all()), (
            f"table {t}: slots outside its rows"
        )
        local = torch.where(stored, got - rows.start, -1)
        assert torch.equal(local, expected[t]), (
            f"table {t} ({group.tables[t].options.eviction.name}): slots differ\n"
            f"ids {batch.ids[t].tolist()}\nnative {local.tolist()}\ntorch  {expected[t].tolist()}"
        )
        metrics = dict(zip(METRIC_NAMES[:KERNEL_METRICS], out.metrics[t].tolist()))
        assert metrics == dict(zip(METRIC_NAMES[:KERNEL_METRICS], deltas[t])), (
            f"table {t}: metrics differ"
        )

    # Uniques: one per (table, id), consistent with the occurrences.
    mine = ~foreign
    u = out.unique_index[mine]
    assert torch.equal(out.unique_ids[u], ids[mine]), "unique ids do not match occurrences"
    assert torch.equal(out.unique_table[u], table_idx[mine]), "unique tables do not match"
    assert torch.equal(out.unique_slots[u], out.slots[mine]), "unique slots do not match"
    pairs = set(zip(out.unique_table.tolist(), out.unique_ids.tolist()))
    assert len(pairs) == out.unique_ids.numel(), "a (table, id) pair appears twice"
    assert int(out.unique_inserted.sum()) == int(out.metrics[:, 2].sum())
    assert torch.equal(torch.bincount(table_idx[mine], minlength=T), out.metrics[:, :2].sum(1))

    # Evictions: exactly the (id, slot) pairs that left the index, by slot.
    before = {(k, s) for s, k in enumerate(keys_before.view(-1).tolist()) if k >= 0}
    after = {(k, s) for s, k in enumerate(group.keys.view(-1).tolist()) if k >= 0}
    evicted = list(zip(out.evicted_ids.tolist(), out.evicted_slots.tolist()))
    assert set(evicted) == before - after and len(evicted) == len(before - after)
    assert out.evicted_slots.tolist() == sorted(out.evicted_slots.tolist())
    assert int(out.metrics[:, 3].sum()) == len(evicted)
    group.assert_matches_tables("after lookup_train_group")


# ----------------------------------------------------------- group configs
GROUPS = {
    "lru-lfu-custom-none": [
        Spec(48, LRU),
        Spec(37, LFU, seed=3),
        Spec(21, CUSTOM, seed=5),
        Spec(16, NONE, seed=9),
    ],
    "admission-thresholds-1-2-3": [
        Spec(37, LRU, threshold=2, seed=1),
        Spec(53, LFU, threshold=3, counter=20, seed=2),
        Spec(16, CUSTOM, threshold=2, counter=40),
        Spec(70, NONE, threshold=3),
        Spec(33, LRU),
    ],
    "normal-and-uniform-init": [
        Spec(40, LRU, normal=True, seed=4),
        Spec(40, LFU, threshold=2, normal=True, seed=8),
        Spec(17, LRU, seed=6),
    ],
    "one-bucket-tables": [Spec(16, LRU), Spec(16, LFU, threshold=2), Spec(16, CUSTOM)],
}


@pytest.mark.parametrize("name", list(GROUPS))
def test_lookup_train_matches_tables(name: str) -> None:
    group = Group(GROUPS[name])
    gen = torch.Generator().manual_seed(len(name))
    T = len(group.tables)
    for step in range(10):
        sizes = [int(torch.randint(0, 70, (1,), generator=gen)) for _ in range(T)]
        if step == 3:
            sizes[0] = None  # a table absent from the batch
        if step == 4:
            sizes = [0] * T  # every table present with no ids
        id_range = 60 if step % 2 else 300  # odd steps: mostly stored ids (hits)
        train_both(group, random_batch(group, gen, sizes, id_range), num_threads=2, gen=gen)


def test_empty_batch() -> None:
    group = Group(GROUPS["lru-lfu-custom-none"])
    empty = torch.empty(0, dtype=torch.int64)
    out = native.lookup_train_group(
        group.layout, group.keys, group.scores, group.weights, group.state, empty, empty, [1] * 4
    )
    assert out.slots.numel() == 0 and out.unique_ids.numel() == 0
    assert out.evicted_ids.numel() == 0 and out.metrics.abs().sum() == 0
    group.assert_matches_tables("after an empty batch")


def test_more_new_ids_than_ways_in_one_bucket() -> None:
    """One-bucket tables get 40 new ids at once: the 16 best ranked win (LFU:
    the most frequent; LRU: the smallest ids), the rest fail."""
    group = Group([Spec(16, LRU), Spec(16, LFU), Spec(16, CUSTOM), Spec(16, NONE)])
    gen = torch.Generator().manual_seed(3)
    ids = torch.arange(1000, 1040)
    repeated = torch.repeat_interleave(ids, torch.randint(1, 5, (40,), generator=gen))
    batch = Batch(
        ids=[ids, repeated, ids, ids],
        custom=[None, None, torch.randint(0, 6, (40,), generator=gen), None],
        foreign=torch.tensor([1000, 1001]),
    )
    out, _, _ = train_both(group, batch, num_threads=1)
    assert out.metrics[:, 2].tolist() == [16] * 4  # inserts
    assert out.metrics[:, 5].tolist() == [24] * 4  # insert failures


def test_full_bucket_protects_hit_ids() -> None:
    """A full LRU bucket hit by some of its ids while more new ids arrive than
    it has ways: the hit ids keep their rows, the others are evicted."""
    group = Group([Spec(16, LRU), Spec(16, LFU)])
    stored = torch.arange(100, 116)
    train_both(group, Batch([stored, stored], [None, None], torch.empty(0, dtype=torch.int64)), 1)
    hits = stored[::3]
    fresh = torch.arange(500, 530)
    batch = Batch([torch.cat([hits, fresh])] * 2, [None, None], torch.empty(0, dtype=torch.int64))
    out, ids, table_idx = train_both(group, batch, num_threads=2)
    kept = set(group.keys[group.buckets(0)].view(-1).tolist())
    assert set(hits.tolist()) <= kept
    assert int(out.metrics[0, 3]) == WAYS - hits.numel()  # every unhit stored id left


def test_keep_existing_never_evicts() -> None:
    group = Group([Spec(16, NONE)])
    gen = torch.Generator().manual_seed(5)
    for _ in range(4):
        out, _, _ = train_both(group, random_batch(group, gen, [40], id_range=100), 1)
        assert int(out.metrics[0, 3]) == 0


# ------------------------------------------------------------------ threads
def run_threads(num_threads: int, seed: int = 0):
    """A group large enough for several parts (>1024 buckets) and slices
    (>16384 ids), trained for a few steps; returns every output and array."""
    group = Group(
        [
            Spec(16 * 700, LRU),
            Spec(16 * 450 + 5, LFU, threshold=2, seed=1),
            Spec(16 * 300, CUSTOM, seed=2),
            Spec(16 * 90, NONE, threshold=3, seed=3),
        ],
        dim=3,
    )
    gen = torch.Generator().manual_seed(seed)
    outputs = []
    for _ in range(3):
        batch = random_batch(group, gen, [9000, 7000, 5000, 2001], id_range=40_000)
        out, _, _ = train_both(group, batch, num_threads, gen=torch.Generator().manual_seed(1))
        outputs.append(out)
    return outputs, group.clone_arrays()


def assert_same_lookup(a: native.TrainLookup, b: native.TrainLookup, at: str) -> None:
    for field in native.TrainLookup._fields:
        x, y = getattr(a, field), getattr(b, field)
        if x is None or y is None:  # the tier outputs, given only with a tier
            assert x is None and y is None, f"{at}: {field}"
        else:
            assert torch.equal(x, y), f"{at}: {field} differs"


def test_threads_give_identical_results() -> None:
    runs = {threads: run_threads(threads) for threads in (1, 2, 3)}
    outputs_1, arrays_1 = runs[1]
    for threads in (2, 3):
        outputs, arrays = runs[threads]
        for step, (a, b) in enumerate(zip(outputs_1, outputs)):
            assert_same_lookup(a, b, f"step {step}, 1 vs {threads} threads")
        for name in arrays_1:
            assert torch.equal(arrays_1[name], arrays[name]), f"{name}: 1 vs {threads} threads"


# --------------------------------------------------------------------- eval
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_lookup_eval_matches_tables(threads: int) -> None:
    group = Group(GROUPS["admission-thresholds-1-2-3"])
    gen = torch.Generator().manual_seed(11)
    for _ in range(3):
        train_both(group, random_batch(group, gen, [60] * 5), num_threads=threads)
    batch = random_batch(group, gen, [50, 0, None, 40_000, 33])
    ids, table_idx, _, within = batch.flat(gen)
    slots, hits = native.lookup_eval_group(
        group.keys, group.layout.bucket_offset, group.layout.num_buckets, ids, table_idx, threads
    )
    assert bool((slots[table_idx < 0] == -1).all())
    for t, table in enumerate(group.tables):
        mine = table_idx == t
        before = table.metrics()["hits"]
        expected = table.lookup_eval(batch.ids[t]) if batch.ids[t] is not None else None
        got = torch.empty_like(slots[mine])
        got[within[mine]] = slots[mine]
        if expected is None:
            assert got.numel() == 0 and int(hits[t]) == 0
            continue
        local = torch.where(got >= 0, got - group.rows(t).start, -1)
        assert torch.equal(local, expected), f"table {t}: eval slots differ"
        assert int(hits[t]) == table.metrics()["hits"] - before, f"table {t}: hits differ"


# ----------------------------------------------------------------- backward
OPTIMIZERS = {
    "sgd": FusedOptimConfig(kind=OptimKind.SGD),
    "rowwise-adagrad": FusedOptimConfig(kind=OptimKind.ROWWISE_ADAGRAD),
    "adam": FusedOptimConfig(kind=OptimKind.ADAM),
    "sgd-l2-clip": FusedOptimConfig(
        kind=OptimKind.SGD, weight_decay=0.1, gradient_clipping=True, max_gradient=0.05
    ),
    "adagrad-decoupled": FusedOptimConfig(
        kind=OptimKind.ROWWISE_ADAGRAD,
        weight_decay=0.05,
        weight_decay_mode=WeightDecay.DECOUPLE,
    ),
    "adam-l2-clip": FusedOptimConfig(
        kind=OptimKind.ADAM,
        weight_decay=0.01,
        gradient_clipping=True,
        max_gradient=0.2,
        beta1=0.8,
        beta2=0.99,
    ),
}

BACKWARD_SPECS = [
    Spec(48, LRU, learning_rate=0.05),
    Spec(37, LFU, threshold=2, seed=3, learning_rate=0.2),
    Spec(21, CUSTOM, seed=5, learning_rate=0.01),
]


def bags_for(batch: Batch, batch_size: int, gen: torch.Generator):
    """Bag lengths per table (some empty) whose sums match the batch's ids."""
    lengths = []
    for part in [*batch.ids, batch.foreign]:
        n = part.numel()
        cuts = torch.sort(torch.randint(0, n + 1, (batch_size - 1,), generator=gen)).values
        bounds = torch.cat([torch.tensor([0]), cuts, torch.tensor([n])])
        lengths.append(bounds[1:] - bounds[:-1])
    return lengths


@pytest.mark.parametrize("grad_layout", ["keyed", "flat"])
@pytest.mark.parametrize("pooling", ["sum", "mean", "weighted-sum", "weighted-mean"])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_fused_backward_matches_apply_gradients(
    optimizer: str, pooling: str, grad_layout: str
) -> None:
    config = OPTIMIZERS[optimizer]
    group = Group(BACKWARD_SPECS, dim=7, optim=config)
    T, B, dim = len(group.tables), 9, 7
    mean, weighted = "mean" in pooling, "weighted" in pooling
    gen = torch.Generator().manual_seed(7)
    for step in range(4):
        batch = random_batch(group, gen, [40, 33, 27])
        out, ids, table_idx = train_both(group, batch, num_threads=2)
        lengths = bags_for(batch, B, gen)
        offsets = torch.cat([torch.tensor([0]), torch.cumsum(torch.cat(lengths), 0)])
        psw = torch.rand(ids.numel(), generator=gen) if weighted else None
        keyed_grad = torch.randn(B, (T + 1) * dim, generator=gen)  # a KeyedTensor's gradient
        by_table = keyed_grad.view(B, T + 1, dim).transpose(0, 1)  # [T + 1, B, dim] view
        grad = by_table if grad_layout == "keyed" else by_table.contiguous().view(-1, dim)

        start = 0
        for t, table in enumerate(group.tables):
            n = batch.ids[t].numel()
            local = torch.cat([torch.tensor([0]), torch.cumsum(lengths[t], 0)])
            slots = out.slots[start : start + n]
            slots = torch.where(slots >= 0, slots - group.rows(t).start, -1)
            apply_gradients(
                table,
                keyed_grad[:, t * dim : (t + 1) * dim],
                slots,
                local,
                None if psw is None else psw[start : start + n],
                mean,
            )
            start += n
        native.fused_backward_group(
            group.weights,
            group.state,
            grad,
            offsets,
            out.unique_index,
            out.unique_slots,
            out.unique_table,
            config,
            learning_rate=[t.optim.learning_rate for t in group.tables],
            optim_step=[t.optim_step for t in group.tables],
            per_sample_weights=psw,
            mean=mean,
            num_threads=2,
        )
        group.assert_matches_tables(f"{optimizer} step {step}", rows_exact=False)
        group.sync_rows_from_tables()


def test_fused_backward_threads_identical() -> None:
    config = OPTIMIZERS["adam-l2-clip"]
    results = []
    for threads in (1, 2, 3):
        group = Group([Spec(16 * 200, LRU), Spec(16 * 150, LFU, seed=2)], dim=4, optim=config)
        gen = torch.Generator().manual_seed(1)
        batch = random_batch(group, gen, [6000, 5000], id_range=5000)
        out, ids, _ = train_both(group, batch, num_threads=threads)
        offsets = torch.arange(0, ids.numel() + 1, 5)
        offsets[-1] = ids.numel()
        grad = torch.randn(offsets.numel() - 1, 4, generator=gen)
        native.fused_backward_group(
            group.weights,
            group.state,
            grad,
            offsets,
            out.unique_index,
            out.unique_slots,
            out.unique_table,
            config,
            [0.1, 0.2],
            [1, 1],
            num_threads=threads,
        )
        results.append((group.weights, group.state))
    for threads, (weights, state) in zip((2, 3), results[1:]):
        assert torch.equal(weights, results[0][0]), f"weights: 1 vs {threads} threads"
        assert torch.equal(state, results[0][1]), f"state: 1 vs {threads} threads"


# ------------------------------------------------------------------ hashing
@pytest.mark.parametrize(
    "num_buckets", [1, 2, 3, 7, 16, 1000, 65537, 2**31 - 1, 2**32 + 15, 2**62 + 1, INT64_MAX]
)
def test_index_bucket_matches_torch(num_buckets: int) -> None:
    gen = torch.Generator().manual_seed(num_buckets % 1000)
    ids = torch.cat(
        [torch.randint(0, INT64_MAX, (5000,), generator=gen), torch.tensor([0, 1, INT64_MAX])]
    )
    assert torch.equal(native.index_bucket(ids, num_buckets), index_bucket(ids, num_buckets))


@pytest.mark.parametrize("low,high", [(-0.01, 0.01), (-1 / 3, 0.7), (1e-5, 3.3e-5), (2.0, 2.0)])
def test_init_uniform_bit_exact(low: float, high: float) -> None:
    ids = torch.cat([torch.arange(0, 3000) * 7919, torch.tensor([INT64_MAX, 2**62])])
    for seed in (0, 17, 2**40):
        want = init_rows(ids, 37, seed, False, low, high)
        assert torch.equal(native.init_uniform(ids, 37, seed, low, high, num_threads=2), want)


# ------------------------------------------------------------ bad arguments
def test_negative_id_is_refused_and_nothing_changes() -> None:
    group = Group(GROUPS["lru-lfu-custom-none"])
    before = group.clone_arrays()
    ids = torch.tensor([3, 4, -7, 5])
    with pytest.raises(KVInputError, match=">= 0"):
        native.lookup_train_group(
            group.layout, group.keys, group.scores, group.weights, group.state,
            ids, torch.tensor([0, 1, 2, 3]), [1] * 4,
        )  # fmt: skip
    for name, value in group.clone_arrays().items():
        assert torch.equal(value, before[name]), f"{name} changed"
    with pytest.raises(KVInputError, match=">= 0"):
        native.lookup_eval_group(
            group.keys, group.layout.bucket_offset, group.layout.num_buckets,
            ids, torch.tensor([0, 1, 2, 3]),
        )  # fmt: skip


def test_bad_table_index_and_tensors_are_refused() -> None:
    group = Group(GROUPS["admission-thresholds-1-2-3"])
    ids = torch.tensor([3, 4])
    args = (group.layout, group.keys, group.scores, group.weights, group.state)
    with pytest.raises(ValueError, match="table_idx"):
        native.lookup_train_group(*args, ids, torch.tensor([0, 5]), [1] * 5, counter=group.counter)
    with pytest.raises(ValueError, match="counter"):
        native.lookup_train_group(*args, ids, torch.tensor([0, 1]), [1] * 5)
    with pytest.raises(ValueError, match="ids must be torch.int64"):
        native.lookup_train_group(
            *args, ids.int(), torch.tensor([0, 1]), [1] * 5, counter=group.counter
        )
    with pytest.raises(ValueError, match="contiguous"):
        native.lookup_eval_group(
            group.keys.t().contiguous().t(),
            group.layout.bucket_offset,
            group.layout.num_buckets,
            ids,
            torch.tensor([0, 1]),
        )
    with pytest.raises(ValueError, match="step must have 5 entries"):
        native.lookup_train_group(*args, ids, torch.tensor([0, 1]), [1] * 4, counter=group.counter)


# ----------------------------------------------------------------- fallback
def test_fallback_when_the_library_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the library (no compiler at install) nothing native runs, the
    ops say why, and KV tables keep working on the torch path."""
    monkeypatch.setattr(native_lib, "load", lambda: (None, "forced by a test"))
    assert not native_lib.available()
    assert native_lib.unavailable_reason() == "forced by a test"
    assert implementation("cpu") == "torch"
    with pytest.raises(native.NativeOpError, match="forced by a test"):
        native.index_bucket(torch.tensor([1]), 3)
    with pytest.raises(native.NativeOpError, match="forced by a test"):
        torch.ops.kvemb.index_bucket(torch.tensor([1]), 3)
    table = KVTable("t", 4, KVTableOptions(capacity=32))
    slots = table.lookup_train(torch.tensor([5, 6, 5]))
    assert slots[0] == slots[2] and bool((slots >= 0).all())
    group = KVTableGroup(["a", "b"], [KVTableOptions(capacity=32)] * 2, dim=4)
    assert group.backend(torch.device("cpu")) == "torch"
    slots = group.lookup_train(torch.tensor([5, 6, 5]), torch.tensor([0, 1, 0]))
    assert slots.unique_index is None, "the torch path looked the group up"
    assert slots.slots[0] == slots.slots[2] and bool((slots.slots >= 0).all())


def test_implementation_follows_the_backend_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCHREC_KVEMB_BACKEND", "torch")
    assert implementation("cpu") == "torch"
    monkeypatch.setenv("TORCHREC_KVEMB_BACKEND", "triton")
    assert implementation("cpu") == "triton"
    monkeypatch.setenv("TORCHREC_KVEMB_BACKEND", "auto")
    assert implementation("cpu") == "native"
    assert implementation("cuda") == "triton"
    assert implementation("meta") == "torch"


# ---------------------------------------------------------------- workspace
def test_one_workspace_serves_two_groups() -> None:
    """Two groups of different sizes take turns on one Workspace: the same
    results as calls that allocate their own scratch."""
    specs_a = GROUPS["admission-thresholds-1-2-3"]
    specs_b = [Spec(16 * 80, LFU), Spec(16 * 3, LRU, threshold=2)]
    shared = native.Workspace()
    runs = {}
    for workspace in (None, shared):
        groups = [Group(specs_a), Group(specs_b)]
        gen = torch.Generator().manual_seed(2)
        outputs = []
        for step in range(6):
            group = groups[step % 2]
            batch = random_batch(group, gen, [300] * len(group.tables), id_range=3000)
            ids, table_idx, custom, _ = batch.flat(gen)
            outputs.append(
                native.lookup_train_group(
                    group.layout,
                    group.keys,
                    group.scores,
                    group.weights,
                    group.state,
                    ids,
                    table_idx,
                    [step + 1] * len(group.tables),
                    custom,
                    counter=group.counter,
                    num_threads=2,
                    workspace=workspace,
                )  # fmt: skip
            )
        runs[workspace is None] = (outputs, [g.clone_arrays() for g in groups])
    assert shared.nbytes > 0
    (out_own, arrays_own), (out_shared, arrays_shared) = runs[True], runs[False]
    for step, (a, b) in enumerate(zip(out_own, out_shared)):
        assert_same_lookup(a, b, f"step {step}")
    for own, shared_arrays in zip(arrays_own, arrays_shared):
        for name in own:
            assert torch.equal(own[name], shared_arrays[name]), name


def test_overlapping_table_ranges_are_refused() -> None:
    group = Group([Spec(32, LRU), Spec(32, LFU)])
    layout = dataclasses.replace(group.layout, bucket_offset=torch.tensor([0, 1]))
    with pytest.raises(native.NativeOpError, match="inconsistent"):
        native.lookup_train_group(
            layout, group.keys, group.scores, group.weights, group.state,
            torch.tensor([1, 2]), torch.tensor([0, 1]), [1, 1],
        )  # fmt: skip


# --------------------------------------------------------- ties, bucket by bucket
@pytest.mark.parametrize("policy", [LRU, LFU, CUSTOM, NONE], ids=lambda p: p.name)
def test_tie_heavy_buckets_match_insert_torch(policy: EvictionPolicy) -> None:
    """Crafted one- and two-bucket indexes with scores in 0..3 (ties everywhere)
    and batches of repeated ids: the group op against ``insert_torch`` on the
    de-duplicated batch, the values computed as ``KVTable.lookup_train`` does."""
    gen = torch.Generator().manual_seed(list(EvictionPolicy).index(policy))
    pool = torch.arange(400)
    spec = InitSpec(0, False, 0.0, 1.0)
    layout = {nb: GroupLayout.of([nb], [policy], [spec]) for nb in (1, 2)}
    for trial in range(80):
        nb = 1 + trial % 2
        keys = torch.full((nb, WAYS), -1, dtype=torch.int64)
        scores = torch.zeros_like(keys)
        home = index_bucket(pool, nb)
        for b in range(nb):
            mine = pool[home == b]
            k = int(torch.randint(0, WAYS + 1, (1,), generator=gen))
            ways = torch.randperm(WAYS, generator=gen)[:k]
            keys[b, ways] = mine[torch.randperm(mine.numel(), generator=gen)[:k]]
            scores[b, ways] = torch.randint(0, 4, (k,), generator=gen)
        n = int(torch.randint(0, 50, (1,), generator=gen))
        ids = pool[torch.randint(0, 120, (n,), generator=gen)]
        custom = torch.randint(0, 4, ids.shape, generator=gen)
        step = int(torch.randint(0, 5, (1,), generator=gen))
        uniq, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
        if policy == LFU:
            values = counts
        elif policy == CUSTOM:
            values = torch.full_like(uniq, -(2**63)).scatter_reduce_(0, inverse, custom, "amax")
        else:
            values = torch.full_like(uniq, step)
        want_keys, want_scores = keys.clone(), scores.clone()
        want = insert_torch(want_keys, want_scores, uniq, values, policy == LFU, policy == NONE)
        out = native.lookup_train_group(
            layout[nb], keys, scores, torch.zeros(nb * WAYS, 2), torch.zeros(nb * WAYS, 0),
            ids, torch.zeros_like(ids), [step], custom, num_threads=1,
        )  # fmt: skip
        at = f"trial {trial}"
        assert torch.equal(keys, want_keys) and torch.equal(scores, want_scores), at
        assert torch.equal(out.slots, want.slots[inverse]), at
        assert sorted(out.evicted_ids.tolist()) == sorted(want.evicted_ids.tolist()), at


def test_promotions_are_per_table() -> None:
    """An id in one table's promotions is promoted in that table only; the same id
    looked up in another table is a new id there."""
    group = Group(GROUPS["lru-lfu-custom-none"])
    args = (group.layout, group.keys, group.scores, group.weights, group.state)
    ids = torch.tensor([11, 11, 23, 40, 23, 11, 7])
    table_idx = torch.tensor([0, 1, 1, 0, 3, 2, 1])
    # table 0 holds 40 and 11 below; table 1 holds 23; tables 2 and 3 none
    promote = native.TierPromotion(
        torch.tensor([11, 40, 23]), torch.tensor([5, 6, 7]), torch.tensor([0, 2, 3, 3, 3])
    )
    out = native.lookup_train_group(
        *args, ids, table_idx, [1] * 4, torch.arange(7), None, tier=promote
    )
    promoted = (out.unique_flags & native.UNIQUE_PROMOTED) != 0
    got = sorted(
        (int(t), int(i))
        for t, i in zip(out.unique_table[promoted], out.unique_ids[promoted], strict=True)
    )
    assert got == [(0, 11), (0, 40), (1, 23)]
    inserted = (out.unique_flags & native.UNIQUE_INSERTED) != 0
    assert sorted(
        (int(t), int(i))
        for t, i in zip(out.unique_table[inserted], out.unique_ids[inserted], strict=True)
    ) == [(1, 7), (1, 11), (2, 11), (3, 23)]


@pytest.mark.parametrize(
    "offsets, match",
    [
        (None, "offsets"),
        ([0, 2, 1, 3, 3], "inconsistent"),  # a table's range ends before it starts
        ([0, 1, 3, 3, 4], "inconsistent"),  # past the promotions
        ([0, 3, 3, 3, 3], "inconsistent"),  # table 0's ids not ascending
    ],
    ids=["missing", "decreasing", "past-the-end", "not-ascending"],
)
def test_bad_promotion_offsets_are_refused_and_nothing_changes(offsets, match) -> None:
    group = Group(GROUPS["lru-lfu-custom-none"])
    before = group.clone_arrays()
    offsets = None if offsets is None else torch.tensor(offsets)
    promote = native.TierPromotion(torch.tensor([11, 40, 23]), torch.tensor([5, 6, 7]), offsets)
    with pytest.raises((ValueError, native.NativeOpError), match=match):
        native.lookup_train_group(
            group.layout, group.keys, group.scores, group.weights, group.state,
            torch.tensor([11, 23]), torch.tensor([0, 1]), [1] * 4, tier=promote,
        )  # fmt: skip
    for name, value in group.clone_arrays().items():
        assert torch.equal(value, before[name]), f"{name} changed"
