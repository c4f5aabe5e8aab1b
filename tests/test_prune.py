"""Pruning at publish (``torchrec_kvemb.prune``) against a Python count of the stream.

Tables with room for every id (nothing evicted), so each id's row holds its
sightings since its first lookup: the reference counts each id's occurrences
and its last step in the stream, and the kept rows must be exactly those with
``count >= k`` / ``last step > step - n`` (both: both), their rows as the table
exports them, the dropped count the rest.
"""

from __future__ import annotations

import collections
from dataclasses import replace

import pytest
import torch
from torchrec.inference.modules import quantize_inference_model
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb import EvictionPolicy, KVEmbeddingBagCollection, KVTableOptions
from torchrec_kvemb.backend import ENV_VAR
from torchrec_kvemb.group import KVTableGroup
from torchrec_kvemb.options import WAYS, HostTierOptions, SSDOptions, TTLOptions
from torchrec_kvemb.prune import Pruned, prune_export, prune_table, prune_tables
from torchrec_kvemb.sharding.planner import kv_table_bytes
from torchrec_kvemb.state_dict.rows import TableRows, restore_table
from torchrec_kvemb.table import KVTable

STEPS = 9


def _stream(seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(STEPS):
        hot = torch.randint(0, 6, (7,), generator=gen)
        cold = torch.randint(6, 70, (9,), generator=gen)
        out.append(torch.cat([hot, cold]) * 104_729 + 3)
    return out


class Seen:
    """Each id's occurrences and last step in the stream."""

    def __init__(self) -> None:
        self.count: collections.Counter = collections.Counter()
        self.last: dict[int, int] = {}
        self.step = 0

    def add(self, ids: torch.Tensor) -> None:
        self.step += 1
        for i in ids.tolist():
            self.count[i] += 1
            self.last[i] = self.step

    def kept(self, min_count: int | None, within: int | None) -> set[int]:
        return {
            i
            for i in self.count
            if (min_count is None or self.count[i] >= min_count)
            and (within is None or self.last[i] > self.step - within)
        }


def _trained(options: KVTableOptions, seed: int = 1) -> tuple[KVTable, Seen]:
    table, seen = KVTable("t", 5, options), Seen()
    for ids in _stream(seed):
        table.lookup_train(ids)
        seen.add(ids)
    assert table.metrics()["evictions"] == 0 and table.size == len(seen.count)
    return table, seen


def _check(table: KVTable, seen: Seen, min_count: int | None, within: int | None) -> None:
    before = table.export()
    kept, dropped = prune_export(table, min_count=min_count, seen_within_steps=within)
    want = seen.kept(min_count, within)
    assert set(kept["ids"].tolist()) == want
    assert 0 < len(want) < len(seen.count), "the rule keeps all or nothing: a weak test"
    assert dropped == len(seen.count) - len(want)
    rows = torch.isin(before["ids"], kept["ids"])
    for name, value in before.items():
        assert torch.equal(kept[name], value[rows]), name
    assert torch.equal(table.export()["ids"], before["ids"]), "prune_export changed the table"


@pytest.mark.parametrize(
    ("min_count", "within"), [(3, None), (2, 4), (1, 2)], ids=["count", "both", "recent"]
)
def test_lfu_table_keeps_the_rows_seen_often_enough(min_count, within):
    ttl = TTLOptions(steps=100) if within is not None else None  # its last steps
    options = KVTableOptions(capacity=12 * WAYS, eviction=EvictionPolicy.LFU, ttl=ttl)
    _check(*_trained(options), min_count, within)


@pytest.mark.parametrize("within", [1, 3, 6])
def test_lru_table_keeps_the_rows_seen_recently(within):
    options = KVTableOptions(capacity=12 * WAYS, eviction=EvictionPolicy.LRU)
    _check(*_trained(options, seed=2), None, within)


def test_prune_table_frees_the_dropped_rows_and_keeps_the_others():
    options = KVTableOptions(capacity=12 * WAYS, eviction=EvictionPolicy.LFU)
    table, seen = _trained(options)
    expected = prune_export(table, min_count=2).rows
    result = prune_table(table, min_count=2)
    assert result == Pruned(len(seen.kept(2, None)), len(seen.count) - len(seen.kept(2, None)))
    after = table.export()
    assert after.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(after[name], value), name


def test_prune_table_drops_rows_of_the_ssd_tier_too(tmp_path):
    options = KVTableOptions(
        capacity=2 * WAYS, eviction=EvictionPolicy.LRU, ssd=SSDOptions(str(tmp_path))
    )
    table, seen = KVTable("t", 5, options), Seen()
    for ids in _stream(3):
        table.lookup_train(ids)
        seen.add(ids)
    assert table.metrics()["ssd_size"] > 0, "no row in the SSD tier: a weak test"
    expected = prune_export(table, seen_within_steps=3).rows
    assert set(expected["ids"].tolist()) == seen.kept(None, 3)
    result = prune_table(table, seen_within_steps=3)
    assert result.dropped == len(seen.count) - len(seen.kept(None, 3))
    after = table.export()
    for name, value in expected.items():
        assert torch.equal(after[name], value), name
    table.close()


def _ebc() -> KVEmbeddingBagCollection:
    configs = [
        EmbeddingBagConfig(
            name=name,
            embedding_dim=4,
            num_embeddings=2**40,
            feature_names=[name + "_f"],
            weight_init_min=-0.5,
            weight_init_max=0.5,
        )
        for name in ("user", "item")
    ]
    options = KVTableOptions(capacity=12 * WAYS, eviction=EvictionPolicy.LFU)
    return KVEmbeddingBagCollection(configs, options)


def _kjt(user: torch.Tensor, item: torch.Tensor) -> KeyedJaggedTensor:
    ids = torch.cat([user, item])
    return KeyedJaggedTensor.from_lengths_sync(
        ["user_f", "item_f"], ids, torch.ones_like(ids, dtype=torch.int32)
    )


def test_a_pruned_collection_publishes_only_its_kept_rows():
    ebc = _ebc()
    seen = {"user": Seen(), "item": Seen()}
    for user, item in zip(_stream(4), _stream(5), strict=True):
        ebc(_kjt(user, item))
        seen["user"].add(user)
        seen["item"].add(item)
    report = prune_tables(ebc, min_count=2)
    for name, table_seen in seen.items():
        kept = table_seen.kept(2, None)
        assert report[name] == Pruned(len(kept), len(table_seen.count) - len(kept))
    ebc.eval()
    quant = quantize_inference_model(ebc, quantization_dtype=torch.float16)
    for name, table in quant.kv_tables().items():
        assert set(table.export()["ids"].tolist()) == seen[name].kept(2, None), name


def test_rules_a_table_cannot_read_are_refused():
    lru = KVTable("u", 5, KVTableOptions(capacity=WAYS))
    with pytest.raises(ValueError, match="'u': min_count needs each row's sightings"):
        prune_export(lru, min_count=2)
    lfu = KVTable("f", 5, KVTableOptions(capacity=WAYS, eviction=EvictionPolicy.LFU))
    with pytest.raises(ValueError, match="'f': seen_within_steps needs each row's last"):
        prune_export(lfu, seen_within_steps=2)
    with pytest.raises(ValueError, match="give min_count, seen_within_steps or both"):
        prune_export(lfu)
    with pytest.raises(ValueError, match="min_count must be >= 1"):
        prune_export(lfu, min_count=0)
    with pytest.raises(ValueError, match=r"no KV table\(s\) \['nope'\]"):
        prune_tables(_ebc(), min_count=2, tables=["nope"])
    with pytest.raises(TypeError, match="unsharded KV collection"):
        prune_tables(torch.nn.Linear(2, 2), min_count=2)


# ------------------------------------------------------------------ sightings
class Counted:
    """Each held id's sightings since it got its row: a batch adds its occurrences to
    an id held before and after it, and starts a new row's count at them."""

    def __init__(self) -> None:
        self.count: dict[int, int] = {}

    def step(self, ids: torch.Tensor, held_before: set[int], held_after: set[int]) -> None:
        occurrences = collections.Counter(ids.tolist())
        self.count = {i: c for i, c in self.count.items() if i in held_after}
        for i, n in occurrences.items():
            if i in held_after:
                self.count[i] = (self.count[i] if i in held_before else 0) + n


def _sightings(table: KVTable) -> dict[int, int]:
    ids, slots = table.export_order()
    return dict(zip(ids.tolist(), table.ttl.sightings_of(slots).tolist(), strict=True))


#: (policy, admission threshold) cases, each on the torch path and the native kernels;
#: the Triton interpreter (slow) runs the first.
COUNT_CASES = {
    "lru": (EvictionPolicy.LRU, 1),
    "none": (EvictionPolicy.NONE, 1),
    "custom": (EvictionPolicy.CUSTOM_SCORE, 1),
    "lru_admit_2": (EvictionPolicy.LRU, 2),
}
COUNT_RUNS = [(b, c) for b in ("torch", "native") for c in COUNT_CASES] + [("triton", "lru")]


@pytest.mark.parametrize(("backend", "case"), COUNT_RUNS, ids=[f"{b}-{c}" for b, c in COUNT_RUNS])
def test_count_sightings_counts_each_rows_occurrences_since_it_was_stored(
    monkeypatch, backend, case
):
    # small tables: rows are evicted (LRU, custom) or fail (NONE) and freed by a TTL,
    # so slots change hands and counts start again; with admission, a row's count
    # starts at the batch that admits it
    policy, admission = COUNT_CASES[case]
    monkeypatch.setenv(ENV_VAR, {"native": "auto"}.get(backend, backend))
    options = KVTableOptions(
        capacity=2 * WAYS,
        eviction=policy,
        count_sightings=True,
        ttl=TTLOptions(steps=3, sweep_buckets_per_step=1),
        admission_threshold=admission,
    )
    group = KVTableGroup(["a", "b"], [options, options], dim=5)
    assert group.backend(torch.device("cpu")) == backend
    refs = [Counted(), Counted()]
    for a, b in zip(_stream(6), _stream(7), strict=True):
        ids = torch.cat([a, b + 1])
        table_idx = torch.cat([torch.zeros_like(a), torch.ones_like(b)])
        before = [set(t.export()["ids"].tolist()) for t in group.tables]
        scores = ids % 1_013 if policy == EvictionPolicy.CUSTOM_SCORE else None
        group.lookup_train(ids, table_idx, scores)
        for t, (table, part) in enumerate(zip(group.tables, (a, b + 1), strict=True)):
            refs[t].step(part, before[t], set(table.export()["ids"].tolist()))
            assert _sightings(table) == refs[t].count, f"table {t}"
    stats = [t.metrics() for t in group.tables]
    assert sum(m["ttl_evictions"] for m in stats) > 0
    full = sum(m["evictions"] + m["insert_failures"] for m in stats)
    assert full > 0 if admission == 1 else sum(m["admission_rejects"] for m in stats) > 0


@pytest.mark.parametrize("backend", ["torch", "native"])
def test_a_growing_table_keeps_its_counts_when_it_grows(monkeypatch, backend):
    # the counts move with their rows into the grown table's slots
    monkeypatch.setenv(ENV_VAR, {"native": "auto"}.get(backend, backend))
    options = KVTableOptions(
        capacity=8 * WAYS,
        initial_capacity=WAYS,
        count_sightings=True,
        ttl=TTLOptions(steps=3, sweep_buckets_per_step=1),
    )
    table, ref = KVTable("t", 5, options), Counted()
    for ids in _stream(8):
        before = set(table.export()["ids"].tolist())
        table.lookup_train(ids)
        ref.step(ids, before, set(table.export()["ids"].tolist()))
        assert _sightings(table) == ref.count, f"capacity {table.capacity}"
    assert table.metrics()["growths"] > 0 and max(ref.count.values()) > 1


def test_an_lru_table_counting_sightings_prunes_by_min_count():
    options = KVTableOptions(capacity=12 * WAYS, count_sightings=True)
    table, seen = _trained(options)
    table.insert(torch.tensor([5]), torch.ones(1, 5))  # a new row: one sighting
    seen.count[5] += 1
    seen.last[5] = seen.step
    _check(table, seen, 3, None)
    _check(table, seen, 2, 4)


def test_a_load_starts_the_counts_again():
    options = KVTableOptions(capacity=12 * WAYS, count_sightings=True)
    table, _ = _trained(options)
    rows = table.export()
    restore_table(table, TableRows(rows["ids"], rows["weights"], rows["scores"]))
    assert set(_sightings(table).values()) == {0}
    ids = rows["ids"][:3]
    table.lookup_train(torch.cat([ids, ids[:1]]))
    counts = _sightings(table)
    assert [counts[i] for i in ids.tolist()] == [2, 1, 1]
    assert sum(counts.values()) == 4


@pytest.mark.parametrize("ttl", [None, TTLOptions(steps=4)], ids=["counts", "counts_and_ttl"])
def test_memory_budget_and_planner_hold_the_counts(ttl):
    budget = 20_011
    options = KVTableOptions(
        memory_budget_bytes=budget, eviction=EvictionPolicy.NONE, count_sightings=True, ttl=ttl
    )
    table = KVTable("t", 5, options)
    table.lookup_train(torch.tensor([3, 8]))
    arrays = [table.weights, table.state, table.keys, table.scores, *table.ttl.arrays()]
    allocated = sum(a.numel() * a.element_size() for a in arrays)
    assert allocated == table.memory_bytes() == kv_table_bytes(options, 5, table.optim) <= budget
    per_row = 5 * 4 + 16 + 16 + (8 if ttl else 0)
    assert table.capacity == budget // per_row // WAYS * WAYS
    lfu = KVTable("f", 5, replace(options, eviction=EvictionPolicy.LFU, ttl=None))
    assert lfu.ttl is None  # an LFU table's scores count its sightings


def test_count_sightings_with_a_lower_tier_is_refused(tmp_path):
    # the error says what to do instead: an LFU table, whose scores count sightings
    with pytest.raises(ValueError, match="count_sightings with a lower tier .*EvictionPolicy.LFU"):
        KVTableOptions(capacity=64, count_sightings=True, ssd=SSDOptions(str(tmp_path)))
    with pytest.raises(ValueError, match="count_sightings with a lower tier .*EvictionPolicy.LFU"):
        KVTableOptions(capacity=64, count_sightings=True, host_tier=HostTierOptions())
    # what it points to: an LFU table over tiers counts, and prunes by min_count
    KVTableOptions(
        capacity=64, eviction=EvictionPolicy.LFU, count_sightings=True, host_tier=HostTierOptions()
    )
