"""Pruning at publish (``torchrec_kvemb.prune``) against a Python count of the stream.

Tables with room for every id (nothing evicted), so each id's row holds its
sightings since its first lookup: the reference counts each id's occurrences
and its last step in the stream, and the kept rows must be exactly those with
``count >= k`` / ``last step > step - n`` (both: both), their rows as the table
exports them, the dropped count the rest.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torchrec.inference.modules import quantize_inference_model
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb import EvictionPolicy, KVEmbeddingBagCollection, KVTableOptions
from torchrec_kvemb.options import WAYS, SSDOptions, TTLOptions
from torchrec_kvemb.prune import Pruned, prune_export, prune_table, prune_tables
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
