"""The scratch pad: every id of a batch gets a row for the batch, even in a full bucket.

Batches are built so that many of their ids (new ones, ones held in memory, ones
held by the SSD tier) share a bucket of a small in-memory table: more than the
bucket's 16 ways. With an SSD tier, the ids that find no memory row get scratch
rows: they pool their stored (or initial) row, get their gradient and optimizer
step, and then live on the SSD tier. So a table holding a tenth of the ids in
memory must give the same outputs at every step, and hold the same ids with the
same rows, optimizer state and scores, as a table large enough never to evict.
"""

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb import EvictionPolicy, KVEmbeddingBagCollection, KVTableOptions, SSDOptions
from torchrec_kvemb.ops.hashing import index_bucket
from torchrec_kvemb.options import WAYS
from torchrec_kvemb.ssd import KVStorageError

DIM = 7
SMALL = 5 * WAYS  # 5 buckets of the in-memory tier
BIG = 512 * WAYS  # the reference: never evicts, no bucket ever overflows
STEPS = 14
POOL = 900  # distinct ids over the run: the small table holds about a tenth
FULL_BUCKETS = 2  # buckets each batch overfills
PER_FULL_BUCKET = 27  # ids of a batch in each of those buckets (16 ways)
SPREAD = 20  # further ids of a batch, anywhere


def _id_pool(seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(50_000, generator=gen)[:POOL] * 104_729 + 2**41


def _batches(seed: int = 1) -> list[torch.Tensor]:
    """Id lists whose ids fill ``FULL_BUCKETS`` buckets of the small table past their
    ways, drawn half from ids seen before (in memory or on SSD by now), half new."""
    gen = torch.Generator().manual_seed(seed)
    pool = _id_pool()
    buckets = index_bucket(pool, SMALL // WAYS)
    seen: set[int] = set()
    batches = []
    for _ in range(STEPS):
        chosen = []
        for bucket in torch.randperm(SMALL // WAYS, generator=gen)[:FULL_BUCKETS].tolist():
            members = pool[buckets == bucket].tolist()
            old = [i for i in members if i in seen]
            new = [i for i in members if i not in seen]
            take_old = min(len(old), PER_FULL_BUCKET // 2)
            picks = [old[j] for j in torch.randperm(len(old), generator=gen)[:take_old].tolist()]
            picks += new[: PER_FULL_BUCKET - take_old]
            chosen += picks
        chosen += pool[torch.randint(0, POOL, (SPREAD,), generator=gen)].tolist()
        seen.update(chosen)
        batches.append(torch.tensor(chosen))
    return batches


def _kjt(ids: torch.Tensor, gen: torch.Generator) -> KeyedJaggedTensor:
    """Two features over the same table's ids, bags of 1 to 4 ids (ids repeat too)."""
    ids = torch.cat([ids, ids[torch.randperm(ids.numel(), generator=gen)[:9]]])
    ids = ids[torch.randperm(ids.numel(), generator=gen)]
    lengths = []
    left = ids.numel()
    while left:
        n = min(left, int(torch.randint(1, 5, (1,), generator=gen)))
        lengths.append(n)
        left -= n
    if len(lengths) % 2:
        lengths.append(0)
    return KeyedJaggedTensor.from_lengths_sync(
        keys=["a", "b"], values=ids, lengths=torch.tensor(lengths)
    )


def _ebc(fused: dict, options: KVTableOptions) -> KVEmbeddingBagCollection:
    config = EmbeddingBagConfig(
        name="t", embedding_dim=DIM, num_embeddings=2**62, feature_names=["a", "b"]
    )
    return KVEmbeddingBagCollection([config], options, fused_params=fused)


OPTIMIZERS = {
    "rowwise_adagrad": {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1},
    "adam": {"optimizer": EmbOptimType.ADAM, "learning_rate": 0.05},
    "sgd": {"optimizer": EmbOptimType.EXACT_SGD, "learning_rate": 0.3},
}


def _assert_same_content(table, full) -> None:
    got, want = table.export(), full.export()
    assert torch.equal(got["ids"], want["ids"]), "the tiered table lost or gained ids"
    assert torch.equal(got["scores"], want["scores"]), "scores differ"
    for key in want.keys() - {"ids", "scores"}:
        torch.testing.assert_close(
            got[key], want[key], rtol=1e-6, atol=1e-7, msg=lambda m, k=key: f"{k}: {m}"
        )


@pytest.mark.parametrize("policy", [EvictionPolicy.LRU, EvictionPolicy.LFU], ids=["lru", "lfu"])
@pytest.mark.parametrize("optim", list(OPTIMIZERS))
def test_overfull_buckets_train_as_if_all_in_memory(tmp_path, optim, policy):
    reference = _ebc(OPTIMIZERS[optim], KVTableOptions(capacity=BIG, eviction=policy))
    ssd = SSDOptions(path=str(tmp_path))
    cached = _ebc(OPTIMIZERS[optim], KVTableOptions(capacity=SMALL, eviction=policy, ssd=ssd))
    table, full = cached.table("t"), reference.table("t")
    gen = torch.Generator().manual_seed(2)
    for step, ids in enumerate(_batches()):
        kjt = _kjt(ids, gen)
        grad = torch.randn(kjt.stride(), 2 * DIM, generator=gen)
        outs = []
        for ebc in (cached, reference):
            out = ebc(kjt).values()
            (out * grad).sum().backward()
            outs.append(out.detach())
        torch.testing.assert_close(
            outs[0], outs[1], rtol=1e-6, atol=1e-7, msg=lambda m, s=step: f"step {s}: {m}"
        )
        if step % 5 == 4:  # reading the content settles the pad mid-run, too
            _assert_same_content(table, full)

    m, ref = table.metrics(), full.metrics()
    assert ref["evictions"] == 0 and ref["insert_failures"] == 0
    assert m["scratch_rows"] > STEPS * FULL_BUCKETS, m  # every batch overflowed its buckets
    assert m["promotions"] > 0 and m["demotions"] > 0, m
    assert m["ssd_evictions"] == 0 and m["ssd_corrupt"] == 0
    assert table.capacity <= 0.15 * full.size, "the memory tier should hold about 10% of the ids"
    _assert_same_content(table, full)
    assert table.size + table.metrics()["ssd_size"] == full.size

    # Eval of an overfull batch of ids the SSD tier holds: their trained rows, not zeros.
    cached.eval()
    reference.eval()
    kjt = _kjt(_batches(seed=5)[0], gen)
    torch.testing.assert_close(cached(kjt).values(), reference(kjt).values(), rtol=1e-6, atol=1e-7)
    _assert_same_content(table, full)
    table.close()


def test_pending_scratch_rows_are_found_flushed_and_restored(tmp_path):
    """Between a batch and the next call, the pad's rows are the trained ones: ``find``
    reads them, ``flush`` makes them durable, and reopening restores them."""
    fused = OPTIMIZERS["rowwise_adagrad"]
    ssd = SSDOptions(path=str(tmp_path))
    cached = _ebc(fused, KVTableOptions(capacity=SMALL, ssd=ssd))
    reference = _ebc(fused, KVTableOptions(capacity=BIG))
    gen = torch.Generator().manual_seed(3)
    ids = _batches()[0]
    kjt = _kjt(ids, gen)
    grad = torch.randn(kjt.stride(), 2 * DIM, generator=gen)
    for ebc in (cached, reference):
        (ebc(kjt).values() * grad).sum().backward()
    table = cached.table("t")
    assert table.metrics()["scratch_rows"] > 0
    want, _ = reference.table("t").find(ids)
    got, found = table.find(ids)
    assert bool(found.all()), "an id in the scratch pad must be found"
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    table.flush()
    table.ssd.close()  # as a crash right after the flush: the pad is never written back
    reopened = _ebc(fused, KVTableOptions(capacity=SMALL, ssd=ssd)).table("t")
    got, found = reopened.find(ids)
    assert bool(found.all())
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    reopened.close()


def test_full_disk_when_the_pad_is_written_back_loses_nothing(tmp_path, monkeypatch):
    """A full disk when the scratch rows go to the SSD tier raises ``KVStorageError``
    (naming the table) before anything changes: the pad keeps its trained rows,
    the previous flush stays whole, and once there is room training goes on as if
    nothing had happened."""
    fused = OPTIMIZERS["rowwise_adagrad"]
    ssd = SSDOptions(path=str(tmp_path))
    cached = _ebc(fused, KVTableOptions(capacity=SMALL, ssd=ssd))
    reference = _ebc(fused, KVTableOptions(capacity=BIG))
    table = cached.table("t")
    gen = torch.Generator().manual_seed(4)
    batches = [_kjt(ids, gen) for ids in _batches()]
    grads = [torch.randn(k.stride(), 2 * DIM, generator=gen) for k in batches]

    def step(ebc, i):
        out = ebc(batches[i]).values()
        (out * grads[i]).sum().backward()
        return out.detach()

    for i in range(4):
        step(cached, i), step(reference, i)
    table.flush()
    flushed = reference.table("t").export()
    step(cached, 4), step(reference, 4)
    assert table.metrics()["scratch_rows"] > 0
    pending = table.metrics()["ssd_size"]
    ids = reference.table("t").export()["ids"]
    before, _ = table.find(ids)

    def no_space(n):
        raise KVStorageError(f"table {table.name!r}: no space left on device (injected)")

    monkeypatch.setattr(table.ssd, "reserve", no_space)
    with pytest.raises(KVStorageError, match="table 't'.*no space"):
        step(cached, 5)
    assert table.metrics()["ssd_size"] == pending
    after, found = table.find(ids)
    assert bool(found.all()) and torch.equal(after, before), "a failed write-back lost rows"
    monkeypatch.undo()
    for i in range(5, 8):
        torch.testing.assert_close(step(cached, i), step(reference, i), rtol=1e-6, atol=1e-7)
    _assert_same_content(table, reference.table("t"))

    table.ssd.close()  # a crash: the flush before the fault is what reopening finds
    reopened = _ebc(fused, KVTableOptions(capacity=SMALL, ssd=ssd)).table("t")
    got = reopened.export()
    assert torch.equal(got["ids"], flushed["ids"])
    torch.testing.assert_close(got["weights"], flushed["weights"], rtol=1e-6, atol=1e-7)
    reopened.close()
