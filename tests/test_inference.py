"""TorchRec's ``quantize_inference_model`` on models with KV collections
(``torchrec_kvemb/inference.py``, docs/inference.md).

* float16 / bfloat16: each KV collection becomes a read-only quantized copy whose
  rows are the float rows in that dtype; its outputs equal a stock
  ``EmbeddingBagCollection`` / ``EmbeddingCollection`` holding those rounded rows
  (ids below ``num_embeddings``, rows set equal by id), and the float module's to
  the dtype's rounding. Rows on an SSD tier come along.
* int8 (the function's default): row-wise int8 codes with a scale and bias per row
  (``inference_int8``); outputs equal a stock collection holding the dequantized
  rows, and the float model's to half a quantization step per id.
* int4, int2: refused, naming the tables.
* A sharded model: refused, saying to quantize the unsharded one.
"""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn
from torchrec import (
    EmbeddingBagCollection,
    EmbeddingBagConfig,
    EmbeddingCollection,
    EmbeddingConfig,
)
from torchrec.inference.modules import DEFAULT_QUANT_MAPPING, quantize_inference_model
from torchrec.modules.embedding_configs import PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from tests.checkpoint.conftest import one_rank  # noqa: F401 (fixture)
from tests.checkpoint.one_rank_dmp import shard_on_one_rank
from torchrec_kvemb import (
    KVEmbeddingBagCollection,
    KVEmbeddingBagCollectionSharder,
    KVEmbeddingCollection,
    KVTableOptions,
    SSDOptions,
)
from torchrec_kvemb.inference import (
    KV_QUANT_MAPPING,
    QuantKVEmbeddingBagCollection,
    QuantKVEmbeddingCollection,
)
from torchrec_kvemb.inference_int8 import Int8KVEmbeddingBagCollection, Int8KVEmbeddingCollection

ROWS = 101  # num_embeddings: ids of the batches are below it
BAG_CONFIGS = [
    EmbeddingBagConfig(name="t1", embedding_dim=5, num_embeddings=ROWS, feature_names=["f1", "f2"],
                       weight_init_min=-1.0, weight_init_max=1.0),
    EmbeddingBagConfig(name="t2", embedding_dim=3, num_embeddings=ROWS, feature_names=["f2"],
                       pooling=PoolingType.MEAN, weight_init_min=-0.5, weight_init_max=2.0),
]  # fmt: skip
SEQ_CONFIGS = [
    EmbeddingConfig(name="s1", embedding_dim=7, num_embeddings=ROWS, feature_names=["f1"],
                    weight_init_min=-1.0, weight_init_max=1.0),
    EmbeddingConfig(name="s2", embedding_dim=7, num_embeddings=ROWS, feature_names=["f3"],
                    weight_init_min=-3.0, weight_init_max=3.0),
]  # fmt: skip
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
TOL = {torch.float16: 2e-3, torch.bfloat16: 2e-2}  # relative rounding of a row, pooled


class Model(nn.Module):
    def __init__(self, ebc: nn.Module, ec: nn.Module) -> None:
        super().__init__()
        self.ebc = ebc
        self.ec = ec

    def forward(self, kjt: KeyedJaggedTensor) -> dict[str, torch.Tensor]:
        pooled = self.ebc(kjt).to_dict()
        seq = self.ec(kjt)
        return {**pooled, **{f"seq_{k}": v.values() for k, v in seq.items()}}


def batch(seed: int, n_bags: int = 9) -> KeyedJaggedTensor:
    g = torch.Generator().manual_seed(seed)
    keys = ["f1", "f2", "f3"]
    lengths = torch.randint(0, 4, (len(keys) * n_bags,), generator=g)
    values = torch.randint(0, ROWS, (int(lengths.sum()),), generator=g)
    return KeyedJaggedTensor.from_lengths_sync(keys, values, lengths)


def trained_model(options: KVTableOptions | None = None) -> Model:
    """KV collections whose tables hold rows (training forwards store ids; a backward
    moves the rows off their initial values), in eval mode."""
    options = options or KVTableOptions(capacity=256, seed=3)
    fused = {"learning_rate": 0.5}
    model = Model(
        KVEmbeddingBagCollection(BAG_CONFIGS, options, fused_params=fused),
        KVEmbeddingCollection(SEQ_CONFIGS, options, fused_params=fused),
    )
    for step in range(3):
        out = model(batch(step))
        sum(v.square().sum() for v in out.values()).backward()
    return model.eval()


def all_tables(model: Model) -> dict:
    return {**model.ebc.kv_tables(), **model.ec.kv_tables()}


def stock_twin(model: Model, dtype: torch.dtype) -> Model:
    """Stock collections whose row ``i`` is id ``i``'s KV row rounded to ``dtype``
    (zeros for ids without a row: what a read-only KV table pools for them)."""
    rows = {n: t.export() for n, t in all_tables(model).items()}
    return stock_twin_of_rows(
        {n: (r["ids"], r["weights"].to(dtype).to(torch.float32)) for n, r in rows.items()}
    )


def stock_twin_of_rows(rows: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> Model:
    """Stock collections whose row ``i`` is the given row of id ``i`` (else zeros)."""
    ebc, ec = EmbeddingBagCollection(BAG_CONFIGS), EmbeddingCollection(SEQ_CONFIGS)
    weights = {**dict(ebc.embedding_bags.items()), **dict(ec.embeddings.items())}
    with torch.no_grad():
        for name, module in weights.items():
            ids, values = rows[name]
            module.weight.zero_()
            module.weight[ids] = values
    return Model(ebc, ec)


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_float_rows_quantize_to_a_read_only_copy(dtype: str) -> None:
    dt = DTYPES[dtype]
    model = trained_model()
    kjt = batch(7)
    float_rows = {n: t.export() for n, t in all_tables(model).items()}
    with torch.no_grad():
        want_float = model(kjt)
        want = stock_twin(model, dt)(kjt)
    quantize_inference_model(model, quantization_dtype=dt)
    assert type(model.ebc) is QuantKVEmbeddingBagCollection
    assert type(model.ec) is QuantKVEmbeddingCollection
    for name, table in all_tables(model).items():
        assert table.weights.dtype == dt, name
        rows = table.export()
        assert torch.equal(rows["ids"], float_rows[name]["ids"]), name
        assert torch.equal(rows["weights"], float_rows[name]["weights"].to(dt)), name
    model.train()  # an inference table stays read-only
    assert not model.ebc.training and not model.ec.training
    with torch.no_grad():
        got = model(kjt)
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=1e-6, msg=key)
        scale = want_float[key].abs().max().item() + 1e-6
        torch.testing.assert_close(got[key], want_float[key], atol=TOL[dt] * scale, rtol=0)


def test_per_table_dtypes() -> None:
    """``per_table_weight_dtype`` by table name; the default dtype for the others."""
    model = trained_model()
    per_table = {"t1": torch.float16, "t2": torch.bfloat16, "s1": torch.bfloat16}
    quantize_inference_model(
        model, per_table_weight_dtype=per_table, quantization_dtype=torch.float16
    )
    dtypes = {n: t.weights.dtype for n, t in model.ebc.kv_tables().items()}
    dtypes.update({n: t.weights.dtype for n, t in model.ec.kv_tables().items()})
    assert dtypes == {**per_table, "s2": torch.float16}


def test_int8_rows_quantize_row_wise() -> None:
    """int8 (the function's default): each row as uint8 codes with a scale and a bias;
    outputs equal a stock collection holding the dequantized rows, and the float
    model's to half a quantization step per id."""
    model = trained_model()
    kjt = batch(7)
    with torch.no_grad():
        want_float = model(kjt)
    float_rows = {n: t.export() for n, t in all_tables(model).items()}
    quantize_inference_model(model, per_table_weight_dtype={"s2": torch.float16})
    assert type(model.ebc) is Int8KVEmbeddingBagCollection
    assert type(model.ec) is Int8KVEmbeddingCollection
    tables = {**dict(model.ebc.tables.items()), **dict(model.ec.tables.items())}
    assert {n: t.dtype for n, t in tables.items()} == {
        "t1": torch.int8, "t2": torch.int8, "s1": torch.int8, "s2": torch.float16,
    }  # fmt: skip
    assert tables["t1"].rows.dtype == torch.uint8
    step = 0.0
    for name, table in tables.items():
        want = float_rows[name]
        assert torch.equal(table.ids, want["ids"]), name
        error = (table.dequantized() - want["weights"]).abs()
        if table.dtype == torch.int8:
            half_step = table.scale_bias[:, :1] / 2
            assert bool((error <= half_step * (1 + 1e-5) + 1e-7).all()), name
            step = max(step, float(table.scale_bias[:, 0].max()))
    twin = stock_twin_of_rows({n: (t.ids, t.dequantized()) for n, t in tables.items()})
    with torch.no_grad():
        got, want = model(kjt), twin(kjt)
    assert got.keys() == want.keys() == want_float.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=1e-6, msg=key)
        # a bag pools at most 3 ids, each within half a step
        torch.testing.assert_close(got[key], want_float[key], atol=1.5 * step + 1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.quint4x2, torch.quint2x4], ids=["int4", "int2"])
def test_other_dtypes_are_refused_naming_the_tables(dtype: torch.dtype) -> None:
    model = trained_model()
    words = "KVEmbeddingBagCollection: KV table(s) 't1' ({0}), 't2' ({0}) cannot be quantized"
    with pytest.raises(ValueError, match=re.escape(words.format(dtype))):
        quantize_inference_model(model, quantization_dtype=dtype)
    sequence_only = Model(nn.Identity(), trained_model().ec)
    sequence_only.forward = lambda kjt: sequence_only.ec(kjt)
    with pytest.raises(ValueError, match=r"KVEmbeddingCollection: KV table\(s\) 's1'"):
        quantize_inference_model(
            sequence_only, quantization_dtype=dtype, per_table_weight_dtype={"s2": torch.int8}
        )


def test_rows_on_the_ssd_tier_come_along(tmp_path) -> None:
    options = KVTableOptions(capacity=16, seed=3, ssd=SSDOptions(str(tmp_path), resume=False))
    model = Model(
        KVEmbeddingBagCollection(BAG_CONFIGS[:1], options, fused_params={"learning_rate": 0.5}),
        KVEmbeddingCollection(SEQ_CONFIGS[:1], KVTableOptions(capacity=256)),
    )
    for step in range(3):
        sum(v.square().sum() for v in model(batch(step)).values()).backward()
    table = model.ebc.kv_tables()["t1"]
    stored = table.export()["ids"].numel()
    assert stored > table.capacity, "the test needs rows on the SSD tier"
    model.eval()
    kjt = batch(7)
    with torch.no_grad():
        want = model(kjt)
    quantize_inference_model(model, quantization_dtype=torch.float16)
    assert model.ebc.kv_tables()["t1"].size == stored
    with torch.no_grad():
        got = model(kjt)
    for key in want:
        torch.testing.assert_close(got[key], want[key], atol=2e-3 * 4, rtol=2e-3, msg=key)


def test_the_mapping_is_torchrecs_default() -> None:
    assert KV_QUANT_MAPPING.items() <= DEFAULT_QUANT_MAPPING.items()
    assert DEFAULT_QUANT_MAPPING["torchrec_kvemb.ebc.KVEmbeddingBagCollection"] is (
        QuantKVEmbeddingBagCollection
    )


def test_a_sharded_model_is_refused(one_rank) -> None:  # noqa: F811
    model = Model(EmbeddingBagCollection(BAG_CONFIGS, device=torch.device("meta")), nn.Identity())
    sharder = KVEmbeddingBagCollectionSharder({"t1": KVTableOptions(capacity=64)})
    dmp = shard_on_one_rank(model, [sharder], ["t1"], "row_wise")
    with pytest.raises(ValueError, match="ShardedKVEmbeddingBagCollection: quantize_inference"):
        quantize_inference_model(dmp, quantization_dtype=torch.float16)


def test_a_collection_on_meta_quantizes_on_meta() -> None:
    """TorchRec's inference flow builds the model on meta, quantizes, then shards."""

    def on_meta() -> Model:
        return Model(
            KVEmbeddingBagCollection(BAG_CONFIGS, KVTableOptions(capacity=64), device="meta"),
            KVEmbeddingCollection(SEQ_CONFIGS, KVTableOptions(capacity=64), device="meta"),
        )

    model = on_meta()
    quantize_inference_model(model, quantization_dtype=torch.bfloat16)
    for name, table in all_tables(model).items():
        assert (table.weights.device.type, table.weights.dtype) == ("meta", torch.bfloat16), name
    assert type(model.ebc) is QuantKVEmbeddingBagCollection
    model = on_meta()
    quantize_inference_model(model)
    assert type(model.ec) is Int8KVEmbeddingCollection
    for name, table in model.ec.tables.items():
        assert (table.rows.device.type, table.rows.shape) == ("meta", (0, 7)), name


def test_weighted_bags_quantize_to_int8() -> None:
    """Per-sample weights scale each id's dequantized row: the SUM table as a stock
    weighted collection holding the dequantized rows (stock has no weighted MEAN on
    the CPU), both tables as the float model to the quantization step."""
    ebc = KVEmbeddingBagCollection(BAG_CONFIGS, KVTableOptions(capacity=256), is_weighted=True)
    kjt = batch(5)
    weights = torch.rand(kjt.values().numel(), generator=torch.Generator().manual_seed(2))
    kjt = KeyedJaggedTensor.from_lengths_sync(kjt.keys(), kjt.values(), kjt.lengths(), weights)
    model = nn.Sequential()
    model.add_module("ebc", ebc)
    ebc(kjt)  # store the ids
    model.eval()
    with torch.no_grad():
        want_float = ebc(kjt).values()
    quantize_inference_model(model)
    quant = model.ebc
    assert type(quant) is Int8KVEmbeddingBagCollection and quant.is_weighted()
    stock = EmbeddingBagCollection(BAG_CONFIGS[:1], is_weighted=True)
    with torch.no_grad():
        table = quant.tables["t1"]
        stock.embedding_bags["t1"].weight.zero_()
        stock.embedding_bags["t1"].weight[table.ids] = table.dequantized()
        got, want = quant(kjt), stock(kjt).to_dict()
    for key, stock_key in (("f1", "f1"), ("f2@t1", "f2")):
        torch.testing.assert_close(got[key], want[stock_key], atol=1e-6, rtol=1e-6)
    step = max(float(t.scale_bias[:, 0].max()) for t in quant.tables.values())
    torch.testing.assert_close(got.values(), want_float, atol=1.5 * step + 1e-5, rtol=0)
