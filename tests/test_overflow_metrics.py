"""Bucket overflow without an SSD tier: an id that finds no memory row in its batch
(more of the batch's ids share a bucket than it has ways) pools its initial value
and gets no gradient; every backend counts it in ``metrics()["insert_failures"]``,
and the demo's progress bar shows the sum as ``overflow=``."""

import collections

import pytest
import torch
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.examples.helpers import load_example
from torchrec_kvemb import EvictionPolicy, KVEmbeddingBagCollection, KVTableOptions
from torchrec_kvemb.ops import native
from torchrec_kvemb.ops.hashing import index_bucket
from torchrec_kvemb.options import WAYS

BUCKETS = 3
IN_ONE_BUCKET = 37  # distinct ids of the batch in one bucket: 37 - 16 find no row
ELSEWHERE = 5  # distinct ids in the other buckets (room for all)


def _ids() -> tuple[torch.Tensor, torch.Tensor]:
    pool = torch.arange(5000, dtype=torch.int64) * 7_919 + 2**35
    buckets = index_bucket(pool, BUCKETS)
    return pool[buckets == 1][:IN_ONE_BUCKET], pool[buckets != 1][:ELSEWHERE]


def _ebc(policy: EvictionPolicy) -> KVEmbeddingBagCollection:
    configs = [
        EmbeddingBagConfig(name=n, embedding_dim=d, num_embeddings=2**62, feature_names=[f])
        for n, d, f in (("t", 5, "a"), ("u", 5, "b"))
    ]
    options = KVTableOptions(capacity=BUCKETS * WAYS, eviction=policy)
    return KVEmbeddingBagCollection(configs, options)


BACKENDS = {"native": "auto", "torch": "torch", "triton": "triton"}


def _training_entries() -> dict[str, list[tuple[object, str]]]:
    """Each backend's training lookup and fused backward: (module, function name)."""
    from torchrec_kvemb.kernels import group_lookup, group_pooled

    return {
        "native": [(native, "lookup_train_group"), (native, "fused_backward_group")],
        "triton": [
            (group_lookup, "group_lookup_train_triton"),
            (group_pooled, "group_fused_backward_triton"),
        ],
    }


def _spy_training(monkeypatch: pytest.MonkeyPatch) -> collections.Counter:
    """Counts the calls of every backend's ``_training_entries``, by (backend, name)."""
    calls = collections.Counter()
    for backend, points in _training_entries().items():
        for owner, name in points:
            monkeypatch.setattr(owner, name, _counted(calls, (backend, name), getattr(owner, name)))
    return calls


def _counted(calls: collections.Counter, key: tuple[str, str], real):
    def spy(*args, **kwargs):
        calls[key] += 1
        return real(*args, **kwargs)

    return spy


@pytest.mark.parametrize("policy", [EvictionPolicy.LRU, EvictionPolicy.LFU], ids=["lru", "lfu"])
@pytest.mark.parametrize("backend", list(BACKENDS))
def test_overflow_is_counted_on_every_backend(monkeypatch, backend, policy):
    if backend == "native":
        assert native.available(), native.unavailable_reason()  # make test builds it
    monkeypatch.setenv("TORCHREC_KVEMB_BACKEND", BACKENDS[backend])
    calls = _spy_training(monkeypatch)
    full, other = _ids()
    ebc = _ebc(policy)
    values = torch.cat([full, full[:4], other, other[:2]])  # repeats count once
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["a", "b"], values=values, lengths=torch.tensor([values.numel() - 3, 3])
    )
    out = ebc(kjt).values()
    out.sum().backward()
    m = ebc.table("t").metrics()
    assert m["insert_failures"] == IN_ONE_BUCKET - WAYS, m
    assert m["size"] == WAYS + 4, m  # feature "a" holds other[:4] beside the full bucket
    # the ids without a row hold none afterwards either
    _, found = ebc.table("t").find(full)
    assert int(found.sum()) == WAYS
    assert ebc.table("u").metrics()["insert_failures"] == 0

    ebc(kjt).values().sum().backward()  # the same batch again: as many fail again
    assert ebc.table("t").metrics()["insert_failures"] == 2 * (IN_ONE_BUCKET - WAYS)
    # the backend the test names ran both steps (one group: both tables' dim is 5),
    # no other did
    want = {(backend, name): 2 for _, name in _training_entries().get(backend, [])}
    assert dict(calls) == want, f"{backend}: {dict(calls)}"


def test_progress_bar_shows_overflow():
    kv_metrics = load_example("common.kv_metrics")
    ebc = _ebc(EvictionPolicy.LRU)
    full, _ = _ids()
    kjt = KeyedJaggedTensor.from_lengths_sync(
        keys=["a", "b"], values=full, lengths=torch.tensor([IN_ONE_BUCKET, 0])
    )
    ebc(kjt).values().sum().backward()
    counters = dict.fromkeys(kv_metrics.KV_COUNTERS, 0.0)
    for metrics in ebc.kv_tables().values():
        for key in counters:
            counters[key] += metrics.metrics()[key]
    text = kv_metrics.describe_kv(counters)
    assert f"overflow={IN_ONE_BUCKET - WAYS}" in text, text
