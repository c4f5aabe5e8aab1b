"""A sequence collection's evaluation in pieces of whole keys (``EVAL_PIECE_BYTES``)
gives exactly what one call for the whole batch gives: the same rows (zeros for ids
without a row), the same hit and miss counters; keys read by no table, empty keys
and a key alone above the piece size included."""

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb import KVEmbeddingCollection, KVTableOptions, sequence_lookup
from torchrec_kvemb.backend import ENV_VAR

DIM = 7
KEYS = ("h", "skip", "c", "u", "e")


def _ec() -> KVEmbeddingCollection:
    configs = [
        EmbeddingConfig(name="items", embedding_dim=DIM, num_embeddings=10**9,
                        feature_names=["h", "c"]),
        EmbeddingConfig(name="users", embedding_dim=DIM, num_embeddings=10**9,
                        feature_names=["u", "e"]),
    ]  # fmt: skip
    options = {
        "items": KVTableOptions(capacity=64, seed=3, init_low=-0.1, init_high=0.1),
        "users": KVTableOptions(capacity=32, init_low=-0.1, init_high=0.1),
    }
    fused = {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.1}
    return KVEmbeddingCollection(configs, options, fused_params=fused)


def _kjt(seed: int, empty_key: str | None = None) -> KeyedJaggedTensor:
    """5 keys x 3 bags; ``skip`` is read by no table; ``empty_key`` has no ids."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, 6, (len(KEYS) * 3,), generator=gen)
    if empty_key is not None:
        k = KEYS.index(empty_key)
        lengths[3 * k : 3 * k + 3] = 0
    values = torch.randint(0, 90, (int(lengths.sum()),), generator=gen)
    return KeyedJaggedTensor.from_lengths_sync(keys=list(KEYS), values=values, lengths=lengths)


def _eval(ec: KVEmbeddingCollection, kjt: KeyedJaggedTensor) -> tuple[dict, dict]:
    with torch.no_grad():
        out = ec(kjt)
    return {k: jt.values().clone() for k, jt in out.items()}, ec.metrics()


@pytest.mark.parametrize("backend", ["auto", "torch"])
@pytest.mark.parametrize(
    "piece_bytes", [1, DIM * 4 * 9, DIM * 4 * 23], ids=["a-key-a-call", "keys-of-9", "keys-of-23"]
)
@pytest.mark.parametrize("empty_key", [None, "c"], ids=["all-keys", "empty-key"])
def test_eval_in_pieces_equals_one_call(monkeypatch, backend, piece_bytes, empty_key):
    monkeypatch.setenv(ENV_VAR, backend)
    whole, pieces = _ec(), _ec()
    for step in range(3):  # the same training on both: rows, some ids evicted
        kjt = _kjt(step)
        for ec in (whole, pieces):
            out = ec(kjt)
            rows = torch.cat([jt.values() for jt in out.values()])
            rows.backward(torch.randn(rows.shape, generator=torch.Generator().manual_seed(step)))
    whole.eval(), pieces.eval()
    calls = []
    original = sequence_lookup.pooled_eval

    def counted(*args, **kwargs):
        calls.append(args[1].numel())
        return original(*args, **kwargs)

    monkeypatch.setattr(sequence_lookup, "pooled_eval", counted)
    kjt = _kjt(10, empty_key)
    monkeypatch.setattr(sequence_lookup, "EVAL_PIECE_BYTES", 1 << 40)
    want, want_metrics = _eval(whole, kjt)
    assert len(calls) == 1  # below the piece size: one call for the batch
    calls.clear()
    monkeypatch.setattr(sequence_lookup, "EVAL_PIECE_BYTES", piece_bytes)
    got, got_metrics = _eval(pieces, kjt)
    assert len(calls) > 1, "the batch was not cut into pieces"
    assert sum(calls) == kjt.values().numel()
    assert list(got) == list(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    assert got_metrics == want_metrics
    missing = [v for v in got.values() if v.numel() and bool((v == 0).all(dim=1).any())]
    assert missing, "no id without a row in the evaluation batch: nothing checks the zeros"


def test_training_is_never_cut(monkeypatch):
    """Training takes one call per group whatever the size (pieces are eval only)."""
    monkeypatch.setattr(sequence_lookup, "EVAL_PIECE_BYTES", 1)
    ec = _ec()
    calls = []
    original = sequence_lookup.pooled_train
    monkeypatch.setattr(
        sequence_lookup, "pooled_train", lambda *a, **k: calls.append(1) or original(*a, **k)
    )
    ec(_kjt(1))
    assert len(calls) == 1
