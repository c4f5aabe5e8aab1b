"""The in-memory table as a cache over the SSD tier changes nothing but where rows live.

A table whose memory holds about a tenth of the ids a Zipf stream touches,
trained through KVEmbeddingBagCollection, must give the same pooled outputs at
every step, and the same rows, scores and optimizer state for every id at the
end, as a table that holds everything in memory (rows move between tiers bit
for bit). With ``prefetch`` too.
"""

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.modules.embedding_configs import EmbeddingBagConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb import KVEmbeddingBagCollection, KVTableOptions, SSDOptions

STEPS = 30
BATCH = 24  # bags per feature
BAG = 4
ID_RANGE = 20_000
ALPHA = 0.8
CACHE_ROWS = 16 * 16  # 16 buckets: ~10% of the distinct ids the stream touches
DIMS = {"user": 8, "item": 5}


def _zipf_stream(seed: int = 0) -> list[KeyedJaggedTensor]:
    gen = torch.Generator().manual_seed(seed)
    weights = torch.arange(1, ID_RANGE + 1, dtype=torch.float64).pow(-ALPHA)
    rank_to_id = torch.randperm(ID_RANGE, generator=gen) * 7919 + 2**40
    batches = []
    for _ in range(STEPS):
        lengths = torch.randint(1, 2 * BAG, (2 * BATCH,), generator=gen)
        ranks = torch.multinomial(weights, int(lengths.sum()), replacement=True, generator=gen)
        batches.append(
            KeyedJaggedTensor.from_lengths_sync(
                keys=["u", "i"], values=rank_to_id[ranks], lengths=lengths
            )
        )
    return batches


def _ebc(fused_params: dict, capacity: int | None, path=None) -> KVEmbeddingBagCollection:
    configs = [
        EmbeddingBagConfig(
            name=name, embedding_dim=dim, num_embeddings=2**62, feature_names=[feature]
        )
        for (name, dim), feature in zip(DIMS.items(), ("u", "i"))
    ]
    if capacity is None:
        options = KVTableOptions(capacity=16 * 1024)
    else:
        options = {
            name: KVTableOptions(capacity=capacity, ssd=SSDOptions(path=str(path))) for name in DIMS
        }
    return KVEmbeddingBagCollection(configs, options, fused_params=fused_params)


def _train(ebc: KVEmbeddingBagCollection, batches, prefetch: bool) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    outputs = []
    for step, kjt in enumerate(batches):
        if prefetch and step + 1 < len(batches):
            ebc.prefetch(batches[step + 1])
        out = ebc(kjt).values()
        outputs.append(out.detach().clone())
        (out * torch.randn(out.shape, generator=gen)).sum().backward()
    return outputs


OPTIMIZERS = {
    "rowwise_adagrad": {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1},
    "adam": {"optimizer": EmbOptimType.ADAM, "learning_rate": 0.05},
}


@pytest.mark.parametrize("prefetch", [False, True], ids=["sync", "prefetch"])
@pytest.mark.parametrize("optim", list(OPTIMIZERS))
def test_cache_over_ssd_equals_all_in_memory(tmp_path, optim, prefetch):
    batches = _zipf_stream()
    reference = _ebc(OPTIMIZERS[optim], None)
    cached = _ebc(OPTIMIZERS[optim], CACHE_ROWS, tmp_path)
    expected = _train(reference, batches, prefetch=False)
    got = _train(cached, batches, prefetch=prefetch)
    for step, (a, b) in enumerate(zip(got, expected)):
        torch.testing.assert_close(
            a, b, rtol=1e-6, atol=1e-7, msg=lambda m, step=step: f"step {step}: {m}"
        )

    for name in DIMS:
        table, full = cached.table(name), reference.table(name)
        m = table.metrics()
        distinct = full.size
        assert full.metrics()["evictions"] == 0
        assert table.capacity <= 0.15 * distinct, "the cache should hold about 10% of the ids"
        assert m["insert_failures"] == 0, "every id must get a row, as in the reference"
        assert m["demotions"] > distinct and m["promotions"] > distinct / 10, m
        assert m["ssd_evictions"] == 0 and m["ssd_corrupt"] == 0
        assert table.size + m["ssd_size"] == distinct
        if prefetch:
            assert m["ssd_prefetch_hits"] > 0
        exported, want = table.export(), full.export()
        assert exported.keys() == want.keys()
        assert torch.equal(exported["ids"], want["ids"]), f"table {name}: ids differ"
        assert torch.equal(exported["scores"], want["scores"]), f"table {name}: scores differ"
        for key in exported.keys() - {"ids", "scores"}:
            torch.testing.assert_close(
                exported[key],
                want[key],
                rtol=1e-6,
                atol=1e-7,
                msg=lambda m, n=name, k=key: f"{n}.{k}: {m}",
            )
        table.close()
