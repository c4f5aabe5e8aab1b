"""Half-precision rows (``KVTableOptions(weights_dtype=...)``).

* float16 against FBGEMM's CPU TBE with ``weights_precision=SparseType.FP16``
  (pooled and sequence), same rows and batches: outputs and rows after several
  row-wise Adagrad / SGD steps.
* bfloat16 (FBGEMM's CPU TBE has none) against a float32 KV table on the same
  batches, within the tolerance docs/precision.md documents.
* Every backend on the same batches: Triton (under the interpreter) and the
  native kernels (``auto`` on the CPU: lookup and fused backward for every row
  dtype) against the torch path; ids and scores bit-exact, float values within
  the rounding of their dtype (sums in another order).
* Memory: half the weight bytes per row, in the table, the planner and the SSD
  estimate. Checkpoints record the dtype and convert (saying so) into another.
"""

import collections
import math

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb import (
    FusedOptimConfig,
    KVEmbeddingBagCollection,
    KVEmbeddingCollection,
    KVTable,
    KVTableOptions,
    SSDOptions,
    checkpoint,
)
from torchrec_kvemb.backend import ENV_VAR
from torchrec_kvemb.ops import native
from torchrec_kvemb.sharding.planner import kv_table_bytes
from torchrec_kvemb.ssd import storage_estimate

ROWS = (37, 23)
DIM = 12  # FBGEMM: a multiple of 4
BATCH = 7
LR = 0.2
EPS = 1e-4
STEPS = 5
HALF = (torch.float16, torch.bfloat16)
OPTIMIZERS = {
    "sgd": EmbOptimType.EXACT_SGD,
    "adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    "adam": EmbOptimType.ADAM,
}


def _fused(optim: EmbOptimType) -> dict:
    return {"optimizer": optim, "learning_rate": LR, "eps": EPS}


def _bag_configs() -> list[EmbeddingBagConfig]:
    return [
        EmbeddingBagConfig(
            name=f"t{i}", embedding_dim=DIM, num_embeddings=n, feature_names=[f"f{i}"]
        )
        for i, n in enumerate(ROWS)
    ]


def _batch(gen: torch.Generator) -> KeyedJaggedTensor:
    lengths = torch.randint(0, 5, (len(ROWS) * BATCH,), generator=gen)
    values = torch.cat(
        [
            torch.randint(0, n, (int(lengths[i * BATCH : (i + 1) * BATCH].sum()),), generator=gen)
            for i, n in enumerate(ROWS)
        ]
    )
    return KeyedJaggedTensor.from_lengths_sync(keys=["f0", "f1"], values=values, lengths=lengths)


def _tbe(optim: EmbOptimType, pooling: PoolingMode) -> SplitTableBatchedEmbeddingBagsCodegen:
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(n, DIM, EmbeddingLocation.HOST, ComputeDevice.CPU) for n in ROWS],
        optimizer=optim,
        learning_rate=LR,
        eps=EPS,
        weights_precision=SparseType.FP16,
        pooling_mode=pooling,
    )
    gen = torch.Generator().manual_seed(3)
    for w in tbe.split_embedding_weights():
        w.copy_(torch.randn(w.shape, generator=gen).to(w.dtype))
    return tbe


def _fill(tables: dict[str, KVTable], rows: list[torch.Tensor]) -> None:
    for i, w in enumerate(rows):
        tables[f"t{i}"].insert(torch.arange(ROWS[i]), w.detach().float())


def _fp16_ulp(rows: list[torch.Tensor]) -> float:
    """One float16 ulp at the largest magnitude of ``rows``. An update may land one
    ulp from FBGEMM's per step: FBGEMM sums a row's gradient in another order, so an
    fp32 update on a rounding boundary can round to the neighbouring half."""
    top = max(float(r.detach().float().abs().max()) for r in rows)
    return 2.0 ** (math.floor(math.log2(top)) - 10)


def _rows(table: KVTable, n: int) -> torch.Tensor:
    export = table.export()
    assert torch.equal(export["ids"], torch.arange(n)), f"table {table.name!r} lost ids"
    return export["weights"]


@pytest.mark.parametrize("optim", ["sgd", "adagrad"])
def test_fp16_bags_match_fbgemm_fp16_tbe(optim):
    tbe = _tbe(OPTIMIZERS[optim], PoolingMode.SUM)
    kv = KVEmbeddingBagCollection(
        _bag_configs(),
        KVTableOptions(capacity=1024, weights_dtype=torch.float16),
        fused_params=_fused(OPTIMIZERS[optim]),
    )
    _fill(kv.kv_tables(), tbe.split_embedding_weights())
    ulp = _fp16_ulp(tbe.split_embedding_weights())
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        kjt = _batch(gen)
        got = kv(kjt).values()
        want = tbe(kjt.values(), kjt.offsets())
        # FBGEMM's own FP16 tests compare at 1e-3; a bag pools up to 4 rows, each
        # up to one ulp per step from FBGEMM's (``_fp16_ulp``).
        atol = max(1e-3, 4 * step * ulp)
        torch.testing.assert_close(got, want, atol=atol, rtol=1e-3, msg=f"step {step}")
        grad = torch.randn(got.shape, generator=gen)
        got.backward(grad)
        want.backward(grad)
    for i, w in enumerate(tbe.split_embedding_weights()):
        rows = _rows(kv.table(f"t{i}"), ROWS[i])
        assert rows.dtype == torch.float16
        torch.testing.assert_close(rows, w, atol=max(1e-3, STEPS * ulp), rtol=1e-3)


def test_fp16_sequences_match_fbgemm_fp16_sequence_tbe():
    tbe = _tbe(EmbOptimType.EXACT_ROWWISE_ADAGRAD, PoolingMode.NONE)
    configs = [
        EmbeddingConfig(name=f"t{i}", embedding_dim=DIM, num_embeddings=n, feature_names=[f"f{i}"])
        for i, n in enumerate(ROWS)
    ]
    kv = KVEmbeddingCollection(
        configs,
        KVTableOptions(capacity=1024, weights_dtype=torch.float16),
        fused_params=_fused(EmbOptimType.EXACT_ROWWISE_ADAGRAD),
    )
    _fill(kv.kv_tables(), tbe.split_embedding_weights())
    gen = torch.Generator().manual_seed(2)
    for step in range(STEPS):
        kjt = _batch(gen)
        got = torch.cat([jt.values() for jt in kv(kjt).values()])
        want = tbe(kjt.values(), kjt.offsets())
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3, msg=f"step {step}")
        grad = torch.randn(got.shape, generator=gen)
        got.backward(grad)
        want.backward(grad)
    for i, w in enumerate(tbe.split_embedding_weights()):
        torch.testing.assert_close(_rows(kv.table(f"t{i}"), ROWS[i]), w, atol=1e-3, rtol=1e-3)


def _train(dtype: torch.dtype, optim: str, backend: str, monkeypatch, steps: int = STEPS):
    """A KV EBC of ``dtype`` rows trained on new and stored ids: outputs, rows, state."""
    monkeypatch.setenv(ENV_VAR, backend)
    kv = KVEmbeddingBagCollection(
        _bag_configs(),
        KVTableOptions(capacity=64, weights_dtype=dtype, seed=5),
        fused_params=_fused(OPTIMIZERS[optim]),
    )
    gen = torch.Generator().manual_seed(4)
    outs = []
    for _ in range(steps):
        out = kv(_batch(gen)).values()
        outs.append(out.detach())
        out.backward(torch.randn(out.shape, generator=gen))
    return torch.cat(outs), {n: t.export() for n, t in kv.kv_tables().items()}


def test_bf16_stays_close_to_float32(monkeypatch):
    out16, rows16 = _train(torch.bfloat16, "adagrad", "torch", monkeypatch)
    out32, rows32 = _train(torch.float32, "adagrad", "torch", monkeypatch)

    # docs/precision.md: bfloat16 keeps 8 bits of mantissa (a rounding is within 2**-9
    # of the value); after 5 steps outputs and rows stay within 2**-7 of the largest
    # float32 value.
    def within(got: torch.Tensor, want: torch.Tensor) -> bool:
        return float((got.float() - want).abs().max()) <= 2**-7 * float(want.abs().max())

    assert within(out16, out32)
    for name in rows32:
        assert torch.equal(rows16[name]["ids"], rows32[name]["ids"]), name
        assert rows16[name]["weights"].dtype == torch.bfloat16
        assert within(rows16[name]["weights"], rows32[name]["weights"]), name
    # ... and bfloat16 really rounds: the rows are not float32's.
    assert not torch.equal(rows16["t0"]["weights"].float(), rows32["t0"]["weights"])


def _spy_lookups(monkeypatch) -> collections.Counter:
    """Counts the training lookups that reach the native library and the Triton
    kernels, by backend (both serve half-precision rows)."""
    from torchrec_kvemb.kernels import group_lookup

    calls = collections.Counter()
    for backend, owner, name in (
        ("native", native, "lookup_train_group"),
        ("triton", group_lookup, "group_lookup_train_triton"),
    ):
        monkeypatch.setattr(owner, name, _counted(calls, backend, getattr(owner, name)))
    return calls


def _counted(calls: collections.Counter, backend: str, real):
    def spy(*args, **kwargs):
        calls[backend] += 1
        return real(*args, **kwargs)

    return spy


@pytest.mark.parametrize("backend", ["native", "triton"])
@pytest.mark.parametrize("optim", list(OPTIMIZERS))
@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
def test_backends_match_the_torch_path(dtype, optim, backend, monkeypatch):
    if backend == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        assert native.available(), native.unavailable_reason()  # make test builds it
    calls = _spy_lookups(monkeypatch)
    want_out, want_rows = _train(dtype, optim, "torch", monkeypatch, steps=3)
    assert not calls, f"the torch path reached {dict(calls)}"
    got_out, got_rows = _train(dtype, optim, "auto" if backend == "native" else backend,
                               monkeypatch, steps=3)  # fmt: skip
    # the backend named ran every step's lookup (one group: one dim, one dtype)
    assert calls == {backend: 3}, f"{backend}: {dict(calls)}"

    # Ids and scores bit-exact. Float values as close as their dtype rounds: the
    # backends sum a row's gradient (and Adagrad its mean square) in their own order,
    # so a result may differ by a unit of its dtype at the scale of the values (a
    # row keeps the difference of a step where it was larger).
    def close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
        scale = float(want.abs().max()) if want.numel() else 0.0
        return float((got.float() - want.float()).abs().max()) <= 4 * torch.finfo(dtype).eps * scale

    for name, want in want_rows.items():
        got = got_rows[name]
        for key in want:
            assert got[key].dtype == want[key].dtype, (name, key)
            if want[key].is_floating_point():
                assert close(got[key], want[key], want[key].dtype), (name, key)
            else:
                assert torch.equal(got[key], want[key]), (name, key)
    assert close(got_out, want_out, dtype)


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
def test_memory_per_row_halves_its_weights(dtype, tmp_path):
    optim = FusedOptimConfig()
    full = KVTableOptions(capacity=4096)
    half = KVTableOptions(capacity=4096, weights_dtype=dtype)
    rows = 4096
    saved = rows * DIM * 2  # 2 of the 4 bytes of each weight
    assert (
        KVTable("a", DIM, full, optim).memory_bytes()
        - KVTable("b", DIM, half, optim).memory_bytes()
        == saved
    )
    assert kv_table_bytes(full, DIM, optim) - kv_table_bytes(half, DIM, optim) == saved
    ssd = SSDOptions(str(tmp_path), capacity=100_000)
    est_full = storage_estimate(KVTableOptions(capacity=4096, ssd=ssd), DIM, optim)
    est_half = storage_estimate(
        KVTableOptions(capacity=4096, ssd=ssd, weights_dtype=dtype), DIM, optim
    )
    # the SSD tier's scratch rows (memory.SCRATCH_RESERVE_ROWS) halve theirs too
    assert est_full["memory_bytes"] - est_half["memory_bytes"] == saved + 256 * DIM * 2
    # The same memory budget holds more rows.
    budget = 1 << 20
    big = KVTable("c", DIM, KVTableOptions(memory_budget_bytes=budget, weights_dtype=dtype))
    small = KVTable("d", DIM, KVTableOptions(memory_budget_bytes=budget))
    assert big.capacity > small.capacity


def test_bad_dtype_is_refused():
    with pytest.raises(ValueError, match="weights_dtype must be one of"):
        KVTableOptions(capacity=8, weights_dtype=torch.float64)


def test_tables_of_two_dtypes_look_up_together(monkeypatch):
    """Tables of one collection with different row dtypes: separate groups, one lookup."""
    kv = KVEmbeddingBagCollection(
        _bag_configs(),
        {
            "t0": KVTableOptions(capacity=64, weights_dtype=torch.float16),
            "t1": KVTableOptions(capacity=64),
        },
        fused_params=_fused(EmbOptimType.EXACT_ROWWISE_ADAGRAD),
    )
    assert kv.table("t0").weights.dtype == torch.float16
    assert kv.table("t1").weights.dtype == torch.float32
    kjt = _batch(torch.Generator().manual_seed(0))
    out = kv(kjt)
    out.values().sum().backward()
    for i in range(2):
        ids = kjt[f"f{i}"].values().unique()
        rows, found = kv.table(f"t{i}").find(ids)
        assert bool(found.all()) and rows.dtype == torch.float32


def test_checkpoint_records_and_converts_the_dtype(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "torch")

    def build(dtype: torch.dtype) -> KVEmbeddingBagCollection:
        return KVEmbeddingBagCollection(
            _bag_configs(),
            KVTableOptions(capacity=64, weights_dtype=dtype),
            fused_params=_fused(EmbOptimType.EXACT_ROWWISE_ADAGRAD),
        )

    source = build(torch.float16)
    gen = torch.Generator().manual_seed(6)
    for _ in range(3):
        source(_batch(gen)).values().sum().backward()
    checkpoint.save(source, tmp_path / "ckpt")
    tables = checkpoint.read_marker(tmp_path / "ckpt")["tables"]
    assert {t["weights_dtype"] for t in tables.values()} == {"float16"}

    same = build(torch.float16)
    checkpoint.load(same, tmp_path / "ckpt")
    for name, table in source.kv_tables().items():
        want, got = table.export(), same.table(name).export()
        for key in want:
            assert torch.equal(got[key], want[key]), (name, key)

    wider = build(torch.float32)
    with pytest.warns(UserWarning, match="rows are torch.float16, the table stores torch.float32"):
        checkpoint.load(wider, tmp_path / "ckpt")
    for name, table in source.kv_tables().items():
        want, got = table.export(), wider.table(name).export()
        assert got["weights"].dtype == torch.float32
        assert torch.equal(got["weights"], want["weights"].float()), name


def test_ssd_tier_keeps_half_rows(tmp_path):
    options = KVTableOptions(
        capacity=32, weights_dtype=torch.bfloat16, ssd=SSDOptions(str(tmp_path), capacity=4096)
    )
    table = KVTable("t", DIM, options, FusedOptimConfig())
    ids = torch.arange(0, 3000, 7)
    rows = torch.randn(ids.numel(), DIM, generator=torch.Generator().manual_seed(0))
    table.insert(ids, rows)
    table.flush()
    assert table.metrics()["ssd_size"] > 0  # most rows live on the SSD tier
    got, found = table.find(ids)
    assert bool(found.all())
    assert torch.equal(got, rows.to(torch.bfloat16).float())
    export = table.export()
    assert export["weights"].dtype == torch.bfloat16
    table.close()
