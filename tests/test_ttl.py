"""TTL eviction (``KVTableOptions(ttl=TTLOptions(...))``) against a reference.

The reference is a table of the same options without a TTL, run on the torch
path, beside a Python model of the rule: an id's last step is the last step it
was looked up in training; after each training lookup, the sweep window (the
buckets at a cursor that walks the table, ``sweep_buckets_per_step`` of them)
loses the ids held whose last step is at least ``steps`` steps ago (or whose
step's time is at least ``seconds`` ago). The model removes those from the
reference (``BucketIndex.remove``). Every step, the ids held by the TTL table
(on each backend, grouped) equal the reference's, and ``ttl_evictions`` counts
the removed ones; so a row freed too early or too late, or the wrong row, fails.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.torchrun_jobs import assert_scenarios_passed, read_result, run_job, torchrun_command
from torchrec_kvemb import EvictionPolicy, KVEmbeddingBagCollection, KVTableOptions, checkpoint
from torchrec_kvemb.backend import ENV_VAR
from torchrec_kvemb.group import KVTableGroup
from torchrec_kvemb.options import WAYS, SSDOptions, TTLOptions
from torchrec_kvemb.sharding.planner import kv_table_bytes
from torchrec_kvemb.state_dict.rows import TableRows, restore_table, table_state
from torchrec_kvemb.table import KVTable
from torchrec_kvemb.ttl import LAST_SEEN_KEY

BUCKETS = 2  # 32 rows: the stream's 64 ids overflow them (capacity eviction)
POLICIES = [EvictionPolicy.LRU, EvictionPolicy.LFU, EvictionPolicy.NONE]
STEPS = 13


class Reference:
    """A TTL-free table (torch path) and the TTL rule in Python over it."""

    def __init__(self, options: KVTableOptions, times: list[float] | None = None) -> None:
        self.ttl = options.ttl
        self.table = KVTable("ref", 3, replace(options, ttl=None))
        self.last: dict[int, int] = {}
        self.cursor = 0
        self.times = times  # the wall time of each step (index: step)
        self.freed = 0

    def held(self) -> set[int]:
        return set(self.table.export()["ids"].tolist())

    def step(self, ids: torch.Tensor, custom: torch.Tensor | None = None) -> None:
        self.table.lookup_train(ids, custom)
        now = self.table.step
        for i in ids.tolist():
            self.last[i] = now
        buckets = self.table.index.num_buckets
        per_step = self.ttl.sweep_buckets_per_step
        if per_step is None:
            period = self.ttl.steps or TTLOptions.SWEEP_STEPS
            per_step = -(-buckets // period)
        per_step = min(per_step, buckets)
        window = {(self.cursor + k) % buckets for k in range(per_step)}
        self.cursor = (self.cursor + per_step) % buckets
        held = torch.tensor(sorted(self.held()), dtype=torch.int64)
        bucket = self.table.index.buckets_of(held).tolist()
        gone = [
            i
            for i, b in zip(held.tolist(), bucket, strict=True)
            if b in window and self._expired(self.last[i], now)
        ]
        if gone:
            self.table.index.remove(self.table.index.probe(torch.tensor(gone)))
        self.freed += len(gone)

    def _expired(self, last: int, now: int) -> bool:
        if self.ttl.steps is not None:
            return now - last >= self.ttl.steps
        return self.times[now] - self.times[last] >= self.ttl.wall_seconds


def _stream(seed: int, tables: int) -> list[list[torch.Tensor]]:
    """Per step, per table: a batch of ids (repeats included) from 64 ids whose
    popularity differs, so rows age at different rates."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        batch = []
        for t in range(tables):
            n = int(torch.randint(15, 28, (1,), generator=gen))
            hot = torch.randint(0, 12, (n // 2,), generator=gen)
            cold = torch.randint(12, 64, (n - n // 2,), generator=gen)
            batch.append(torch.cat([hot, cold]) * 7919 + 2**33 * t + 5)
        out.append(batch)
    return out


def _custom(ids: torch.Tensor) -> torch.Tensor:
    """A custom score per id (the same at every step)."""
    return ids * 2_654_435_761 % 1_009


def _run_group(
    options: list[KVTableOptions], backend: str, monkeypatch, seed: int = 3
) -> KVTableGroup:
    """A group of TTL tables under ``backend`` against one reference per table (custom
    scores for CUSTOM_SCORE tables)."""
    custom = options[0].eviction == EvictionPolicy.CUSTOM_SCORE
    monkeypatch.setenv(ENV_VAR, {"native": "auto"}.get(backend, backend))
    group = KVTableGroup([f"t{t}" for t in range(len(options))], options, dim=3)
    refs = [Reference(o) for o in options]
    for s, batch in enumerate(_stream(seed, len(options))):
        ids = torch.cat(batch)
        table_idx = torch.cat([torch.full_like(b, t) for t, b in enumerate(batch)])
        assert group.backend(ids.device) == backend
        group.lookup_train(ids, table_idx, _custom(ids) if custom else None)
        for t, (table, ref) in enumerate(zip(group.tables, refs, strict=True)):
            ref.step(batch[t], _custom(batch[t]) if custom else None)
            held = set(table.export()["ids"].tolist())
            assert held == ref.held(), f"step {s + 1}, table {t}"
            assert table.metrics()["ttl_evictions"] == ref.freed, f"step {s + 1}, table {t}"
    assert sum(r.freed for r in refs) > 0, "the stream never expired a row"
    full = sum(t.metrics()["evictions"] + t.metrics()["insert_failures"] for t in group.tables)
    assert full > 0, "the tables never ran out of room"
    return group


def _options(policy: EvictionPolicy, admission: int, steps: int, sweep: int | None):
    return KVTableOptions(
        capacity=BUCKETS * WAYS,
        eviction=policy,
        admission_threshold=admission,
        admission_counter_capacity=40,
        ttl=TTLOptions(steps=steps, sweep_buckets_per_step=sweep),
    )


@pytest.mark.parametrize("admission", [1, 2], ids=["admit_all", "admit_2"])
@pytest.mark.parametrize(
    "policy",
    [EvictionPolicy.LRU, EvictionPolicy.LFU, EvictionPolicy.CUSTOM_SCORE, EvictionPolicy.NONE],
    ids=lambda p: p.name,
)
@pytest.mark.parametrize("backend", ["torch", "native"])
def test_ttl_table_frees_exactly_the_rows_past_their_ttl(monkeypatch, backend, policy, admission):
    # one table swept whole every step, one a bucket per step (rows outlive their TTL
    # until the cursor reaches them; a lookup before that keeps them)
    options = [_options(policy, admission, 3, 99), _options(policy, admission, 2, 1)]
    _run_group(options, backend, monkeypatch)


def test_ttl_on_the_triton_kernels(monkeypatch):
    options = [
        _options(EvictionPolicy.LFU, 2, 3, 99),
        _options(EvictionPolicy.LRU, 1, 2, None),
    ]
    _run_group(options, "triton", monkeypatch, seed=4)


def test_a_lone_table_frees_as_its_reference():
    options = _options(EvictionPolicy.LFU, 1, 2, 2)
    table, ref = KVTable("t", 3, options), Reference(options)
    for batch in _stream(5, 1):
        table.lookup_train(batch[0])
        ref.step(batch[0])
        assert set(table.export()["ids"].tolist()) == ref.held()
    assert ref.freed > 0 and table.metrics()["ttl_evictions"] == ref.freed


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_a_growing_table_frees_as_its_reference(policy):
    # the reference grows too (TTL-free); whole sweeps, whatever the bucket count; a
    # table that keeps last_seen moves it with the rows when it grows
    options = replace(_options(policy, 1, 2, 99), initial_capacity=WAYS)
    table, ref = KVTable("t", 3, options), Reference(options)
    for s, batch in enumerate(_stream(9, 1), start=1):
        table.lookup_train(batch[0])
        ref.step(batch[0])
        assert set(table.export()["ids"].tolist()) == ref.held(), f"step {s}"
    assert table.metrics()["growths"] > 0 and ref.freed > 0
    assert table.metrics()["ttl_evictions"] == ref.freed


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_a_growing_group_frees_as_its_reference(monkeypatch, backend):
    # two LFU tables of a group growing unequally: their last_seen moves with the rows
    # when the group reallocates (whole sweeps)
    options = replace(_options(EvictionPolicy.LFU, 1, 2, 99), initial_capacity=WAYS)
    group = _run_group([options, replace(options, capacity=4 * WAYS)], backend, monkeypatch)
    assert all(t.metrics()["growths"] > 0 for t in group.tables)


@pytest.mark.parametrize("grouped", [False, True], ids=["lone", "native_group"])
@pytest.mark.parametrize("policy", [EvictionPolicy.LRU, EvictionPolicy.LFU], ids=lambda p: p.name)
def test_wall_time_ttl_frees_by_the_steps_times(monkeypatch, policy, grouped):
    # irregular step times from an injected clock: a row lives 4.0 s without a lookup
    monkeypatch.setenv(ENV_VAR, "auto")
    times = [0.0] + [0.7 * s + (1.9 if s > 6 else 0.0) for s in range(1, STEPS + 1)]
    now = {"t": 0.0}
    ttl = TTLOptions(seconds=4.0, sweep_buckets_per_step=99, clock=lambda: now["t"])
    options = replace(_options(policy, 1, 1, None), ttl=ttl)
    group = KVTableGroup(["t"], [options], dim=3) if grouped else None
    assert not grouped or group.backend(torch.device("cpu")) == "native"
    table = group.tables[0] if grouped else KVTable("t", 3, options)
    ref = Reference(options, times)
    for s, batch in enumerate(_stream(7, 1), start=1):
        now["t"] = times[s]
        if grouped:
            group.lookup_train(batch[0], torch.zeros_like(batch[0]))
        else:
            table.lookup_train(batch[0])
        ref.step(batch[0])
        assert set(table.export()["ids"].tolist()) == ref.held(), f"step {s}"
    assert ref.freed > 0 and table.metrics()["ttl_evictions"] == ref.freed


def test_eviction_ttl_mins_is_sixty_seconds_a_minute():
    assert TTLOptions(eviction_ttl_mins=3).wall_seconds == 180.0
    assert TTLOptions(seconds=2.5).wall_seconds == 2.5
    assert TTLOptions(steps=4).wall_seconds is None


def test_default_sweep_covers_the_table_once_per_ttl():
    table = KVTable("t", 3, KVTableOptions(capacity=37 * WAYS, ttl=TTLOptions(steps=5)))
    assert table.ttl.buckets_per_step() == 8  # ceil(37 / 5)
    wall = KVTable("w", 3, KVTableOptions(capacity=200 * WAYS, ttl=TTLOptions(seconds=9.0)))
    assert wall.ttl.buckets_per_step() == 4  # ceil(200 / SWEEP_STEPS = 64)


def test_insert_counts_as_seen():
    ttl = TTLOptions(steps=2, sweep_buckets_per_step=1)
    options = KVTableOptions(capacity=WAYS, eviction=EvictionPolicy.LFU, ttl=ttl)
    table = KVTable("t", 3, options)
    table.lookup_train(torch.tensor([1]))  # step 1
    table.insert(torch.tensor([2]), torch.ones(1, 3))  # seen at step 1
    table.lookup_train(torch.tensor([1]))  # step 2
    assert set(table.export()["ids"].tolist()) == {1, 2}
    table.lookup_train(torch.tensor([1]))  # step 3: 2 unseen for 2 steps
    assert set(table.export()["ids"].tolist()) == {1}
    assert table.metrics()["ttl_evictions"] == 1


def _ebc(policy: EvictionPolicy) -> KVEmbeddingBagCollection:
    config = EmbeddingBagConfig(
        name="t",
        embedding_dim=3,
        num_embeddings=2**40,
        feature_names=["f"],
        weight_init_min=-0.1,
        weight_init_max=0.1,
    )
    options = replace(_options(policy, 1, 3, 99), capacity=8 * WAYS)
    return KVEmbeddingBagCollection([config], options)


def _kjt(ids: torch.Tensor) -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(["f"], ids, torch.ones_like(ids, dtype=torch.int32))


def _train_on(saved, loaded, stream, first_step: int) -> None:
    """Both models train on ``stream``: at every step they hold the same ids and the
    sweep frees as many rows in each."""
    a, b = saved.table("t"), loaded.table("t")
    assert b.step == a.step
    freed = b.metrics()["ttl_evictions"] - a.metrics()["ttl_evictions"]
    for s, ids in enumerate(stream, start=first_step):
        saved(_kjt(ids))
        loaded(_kjt(ids))
        assert torch.equal(a.export()["ids"], b.export()["ids"]), f"step {s}"
        now = b.metrics()["ttl_evictions"] - a.metrics()["ttl_evictions"]
        assert now == freed, f"step {s}: the loaded table freed other rows"
    assert a.metrics()["ttl_evictions"] > 0


@pytest.mark.parametrize("policy", POLICIES, ids=lambda p: p.name)
def test_state_dict_round_trip_keeps_the_last_steps(policy):
    ebc, other = _ebc(policy), _ebc(policy)
    stream = [b[0] for b in _stream(11, 1)]
    for ids in stream[:6]:
        ebc(_kjt(ids))
    state = ebc.state_dict()
    # an LRU table's last steps are its scores; any other policy saves them beside
    assert (LAST_SEEN_KEY.join(["t.", ""]) in "".join(state)) == (policy != EvictionPolicy.LRU)
    other.load_state_dict(state)
    _train_on(ebc, other, stream[6:], 7)


@pytest.mark.parametrize("target", ["fresh", "trained"])
@pytest.mark.parametrize("policy", POLICIES[1:], ids=lambda p: p.name)
def test_a_checkpoint_round_trip_keeps_the_last_steps(tmp_path, policy, target):
    # checkpoint.load places rows without load_rows; a trained target holds last steps
    # above the restored step, a fresh one zeros: both take the saved ones
    source, loaded = _ebc(policy), _ebc(policy)
    stream = [b[0] for b in _stream(17, 1)]
    for ids in stream[:5]:
        source(_kjt(ids))
    checkpoint.save(source, tmp_path / "ckpt")
    if target == "trained":
        for ids in stream[5:11]:
            loaded(_kjt(ids))
    checkpoint.load(loaded, tmp_path / "ckpt")
    _train_on(source, loaded, stream[5:], 6)


def test_a_table_of_custom_scores_keeps_its_last_steps_through_load_rows():
    options = replace(_options(EvictionPolicy.CUSTOM_SCORE, 1, 3, 99), capacity=8 * WAYS)
    table, loaded = KVTable("t", 3, options), KVTable("u", 3, options)
    stream = [b[0] for b in _stream(19, 1)]
    for ids in stream[:5]:
        table.lookup_train(ids, _custom(ids))
    saved = table_state(table)
    step = tuple(saved["step"].tolist())
    rows = TableRows(saved["weight_id"], saved["weight"], saved["weight_score"], step=step)
    restore_table(loaded, replace(rows, last_seen=saved[LAST_SEEN_KEY]))
    before = table.metrics()["ttl_evictions"]
    for s, ids in enumerate(stream[5:], start=6):
        table.lookup_train(ids, _custom(ids))
        loaded.lookup_train(ids, _custom(ids))
        assert torch.equal(table.export()["ids"], loaded.export()["ids"]), f"step {s}"
        freed = table.metrics()["ttl_evictions"] - before
        assert freed == loaded.metrics()["ttl_evictions"], f"step {s}"
    assert table.metrics()["ttl_evictions"] > before


def _without_last_seen(state: dict) -> dict:
    return {k: v for k, v in state.items() if not k.endswith(LAST_SEEN_KEY)}


def test_a_state_dict_without_last_steps_warns_and_counts_its_rows_seen_at_the_load():
    # a state_dict saved before the last steps were: every row it restores counts as
    # seen at the restored step, with a warning naming the table
    source, loaded = _ebc(EvictionPolicy.LFU), _ebc(EvictionPolicy.LFU)
    for ids in [b[0] for b in _stream(13, 1)][:5]:
        source(_kjt(ids))
    with pytest.warns(UserWarning, match="table 't': the loaded rows have no weight_last_seen"):
        loaded.load_state_dict(_without_last_seen(source.state_dict()))
    table = loaded.table("t")
    held = set(table.export()["ids"].tolist())
    assert held == set(source.table("t").export()["ids"].tolist()) and table.step == 5
    loaded(_kjt(torch.tensor([1])))  # steps 6, 7: nothing is 3 steps old
    loaded(_kjt(torch.tensor([1])))
    assert set(table.export()["ids"].tolist()) == held | {1}
    loaded(_kjt(torch.tensor([1])))  # step 8: every loaded row but 1's expires
    assert set(table.export()["ids"].tolist()) == {1}
    assert table.metrics()["ttl_evictions"] == len(held - {1})


@pytest.mark.parametrize("target", ["fresh", "trained"])
def test_an_older_checkpoint_warns_and_counts_its_rows_seen_at_the_restored_step(
    tmp_path, target, monkeypatch
):
    source, loaded = _ebc(EvictionPolicy.LFU), _ebc(EvictionPolicy.LFU)
    stream = [b[0] for b in _stream(17, 1)]
    for ids in stream[:4]:
        source(_kjt(ids))
    with monkeypatch.context() as m:  # written as before the last steps were saved
        m.setattr("torchrec_kvemb.state_dict.rows.uses_last_seen", lambda options: False)
        checkpoint.save(source, tmp_path / "ckpt")
    if target == "trained":
        for ids in stream[4:11]:
            loaded(_kjt(ids))
    with pytest.warns(UserWarning, match="table 't': the loaded rows have no weight_last_seen"):
        checkpoint.load(loaded, tmp_path / "ckpt")
    table = loaded.table("t")
    held = set(table.export()["ids"].tolist())
    assert held == set(source.table("t").export()["ids"].tolist()) and table.step == 4
    before = table.metrics()["ttl_evictions"]
    probe = torch.tensor([stream[0][0].item()])
    loaded(_kjt(probe))  # steps 5, 6: nothing is 3 steps old
    loaded(_kjt(probe))
    assert set(table.export()["ids"].tolist()) == held
    loaded(_kjt(probe))  # step 7: every restored row but the probe's expires
    assert set(table.export()["ids"].tolist()) == set(probe.tolist())
    assert table.metrics()["ttl_evictions"] - before == len(held) - 1


@pytest.mark.parametrize(
    ("ttl", "message"),
    [
        (dict(), "exactly one of steps, seconds or eviction_ttl_mins"),
        (dict(steps=2, seconds=1.0), "exactly one"),
        (dict(steps=0), "steps must be an int >= 1"),
        (dict(seconds=-1.0), "seconds must be > 0"),
        (dict(eviction_ttl_mins=0), "eviction_ttl_mins must be > 0"),
        (dict(steps=2, sweep_buckets_per_step=0), "sweep_buckets_per_step must be >= 1"),
    ],
    ids=["none", "two", "zero_steps", "negative_seconds", "zero_minutes", "zero_sweep"],
)
def test_bad_ttl_options_are_refused(ttl, message):
    with pytest.raises(ValueError, match=message):
        TTLOptions(**ttl)


def test_ttl_over_a_tier_of_another_policy_is_refused(tmp_path):
    # tests/test_tiered_ttl.py: an LRU table's TTL over lower tiers
    with pytest.raises(ValueError, match="ttl with a lower tier .* needs eviction=LRU"):
        KVTableOptions(
            capacity=64,
            eviction=EvictionPolicy.LFU,
            ttl=TTLOptions(steps=2),
            ssd=SSDOptions(str(tmp_path)),
        )
    with pytest.raises(TypeError, match="ttl must be a TTLOptions"):
        KVTableOptions(capacity=64, ttl=3)


@pytest.mark.parametrize("policy", [EvictionPolicy.LRU, EvictionPolicy.LFU], ids=lambda p: p.name)
def test_a_memory_budget_and_the_planner_hold_the_last_steps_too(policy):
    budget = 10_007
    ttl = TTLOptions(steps=3)
    table = KVTable("t", 5, KVTableOptions(memory_budget_bytes=budget, eviction=policy, ttl=ttl))
    table.lookup_train(torch.tensor([4, 9]))  # the last steps allocated, where kept
    arrays = [table.weights, table.state, table.keys, table.scores]
    if policy != EvictionPolicy.LRU:  # an LRU table's scores are its last steps
        arrays.append(table.ttl.last_seen)
    allocated = sum(a.numel() * a.element_size() for a in arrays)
    assert allocated == table.memory_bytes() == kv_table_bytes(table.options, 5, table.optim)
    assert allocated <= budget
    per_row = 5 * 4 + 16 + (8 if policy != EvictionPolicy.LRU else 0)
    assert table.capacity == budget // per_row // WAYS * WAYS


def test_sharded_ttl_tables_free_as_the_unsharded_one(tmp_path):
    # one 2-rank job: row-wise and table-wise (tests/sharding/ttl_worker.py), and a
    # row-wise checkpoint that loads at world size 1 with its last steps
    from tests.sharding import dist_worker as base
    from tests.sharding.ttl_worker import MORE, OPTIONS, STEPS, unsharded_steps

    result_path = tmp_path / "result.json"
    job = run_job(
        torchrun_command(2, "-m", "tests.sharding.ttl_worker", str(result_path), str(tmp_path))
    )
    result = read_result(result_path, job)
    scenarios = {"ttl_row_wise", "ttl_table_wise", "ttl_checkpoint_row_wise"}
    assert_scenarios_passed(result, job, scenarios)
    model = base.EBCModel(
        KVEmbeddingBagCollection(base.kv_configs(2**40), OPTIONS, fused_params=base.ADAGRAD)
    )
    checkpoint.load(model, tmp_path / "ckpt")
    freed = model.ebc.table("user").metrics()["ttl_evictions"]
    want = torch.load(tmp_path / "held.pt")
    got = unsharded_steps(model, STEPS, MORE)
    for step, (g, w) in enumerate(zip(got, want, strict=True), start=STEPS + 1):
        for name in OPTIONS:
            assert torch.equal(g[name], w[name]), f"step {step} table {name}"
    assert model.ebc.table("user").metrics()["ttl_evictions"] > freed
