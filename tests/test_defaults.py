"""Defaults on TorchRec's terms: what a KV table does when an argument is left out is
what the stock module / sharder (fbgemm's TBE) does with the same arguments, or the
difference is refused with an error naming the table; docs/usage.md's defaults are
the code's."""

import inspect
import math
import re
import warnings
from functools import partial
from pathlib import Path

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb import KVEmbeddingBagCollection, KVTableOptions
from torchrec_kvemb.optimizer import FusedOptimConfig, OptimKind, WeightDecay
from torchrec_kvemb.options import Initializer, with_config_init

ROOT = Path(__file__).resolve().parents[1]
TBE_DEFAULTS = {
    k: p.default
    for k, p in inspect.signature(SplitTableBatchedEmbeddingBagsCodegen.__init__).parameters.items()
}


def test_optimizer_defaults_are_fbgemms():
    config = FusedOptimConfig.from_fused_params(None)
    assert TBE_DEFAULTS["optimizer"] == EmbOptimType.EXACT_SGD
    assert config.kind == OptimKind.SGD
    for name in ("learning_rate", "eps", "beta1", "beta2", "weight_decay", "max_gradient"):
        assert getattr(config, name) == TBE_DEFAULTS[name], name
    assert config.gradient_clipping == TBE_DEFAULTS["gradient_clipping"]
    assert int(config.weight_decay_mode) == int(TBE_DEFAULTS["weight_decay_mode"].value)
    assert config.weight_decay_mode == WeightDecay.NONE


def twins(fused: dict, rows: int = 29, dim: int = 12):
    """A KV collection and fbgemm's CPU TBE with the same fused_params, same rows."""
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(rows, dim, EmbeddingLocation.HOST, ComputeDevice.CPU)], **fused
    )
    torch.manual_seed(0)
    weight = tbe.split_embedding_weights()[0]
    weight.copy_(torch.randn_like(weight))
    config = EmbeddingBagConfig(
        name="t", embedding_dim=dim, num_embeddings=rows, feature_names=["f"]
    )
    kv = KVEmbeddingBagCollection([config], KVTableOptions(capacity=64), fused_params=fused or None)
    kv.table("t").insert(torch.arange(rows), weight.detach().clone())
    return tbe, kv


@pytest.mark.parametrize(
    "fused",
    [
        pytest.param({}, id="no-fused-params"),
        pytest.param(
            {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "weight_decay": 0.1},
            id="adagrad-weight-decay-without-mode",
        ),
        pytest.param(
            {"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.2},
            id="adagrad-default-eps",
        ),
    ],
)
def test_left_out_fused_params_train_as_fbgemm(fused):
    tbe, kv = twins(fused)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        lengths = torch.randint(0, 4, (5,), generator=gen)
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=["f"], values=torch.randint(0, 29, (int(lengths.sum()),), generator=gen),
            lengths=lengths,
        )  # fmt: skip
        want = tbe(kjt.values(), kjt.offsets())
        got = kv(kjt).values()
        torch.testing.assert_close(got, want, msg=f"step {step}")
        grad = torch.randn(want.shape, generator=gen)
        want.backward(grad)
        got.backward(grad)
    rows, _ = kv.table("t").find(torch.arange(29))
    torch.testing.assert_close(rows, tbe.split_embedding_weights()[0], atol=1e-6, rtol=1e-5)


def initial_rows(config: EmbeddingBagConfig, options: KVTableOptions) -> torch.Tensor:
    """Rows of 2000 ids as a training forward stores them (initial values)."""
    kv = KVEmbeddingBagCollection([config], options)
    ids = torch.arange(2000) * 7919
    kv(
        KeyedJaggedTensor.from_lengths_sync(
            keys=["f"], values=ids, lengths=torch.ones(2000, dtype=torch.int64)
        )
    )
    return kv.table("t").find(ids)[0]


def config(**kw) -> EmbeddingBagConfig:
    return EmbeddingBagConfig(name="t", embedding_dim=5, feature_names=["f"], **kw)


@pytest.mark.parametrize(
    "kw, low, high",
    [
        pytest.param({"num_embeddings": 400}, -0.05, 0.05, id="sqrt-of-num-embeddings"),
        pytest.param(
            {"num_embeddings": 2**40, "weight_init_min": -0.3, "weight_init_max": 0.1},
            -0.3, 0.1, id="weight-init-min-max",
        ),
    ],
)  # fmt: skip
def test_initial_rows_take_torchrecs_range(kw, low, high):
    rows = initial_rows(config(**kw), KVTableOptions(capacity=4096))
    assert float(rows.min()) >= low and float(rows.max()) < high
    span = high - low
    assert float(rows.min()) < low + 0.01 * span and float(rows.max()) > high - 0.01 * span


def test_explicit_options_win_over_the_sqrt_default():
    rows = initial_rows(
        config(num_embeddings=2**40), KVTableOptions(capacity=4096, init_low=-1.0, init_high=1.0)
    )
    assert float(rows.max()) > 0.9 and float(rows.min()) < -0.9
    assert math.sqrt(1 / 2**40) < 1e-6


def test_a_nearly_zero_default_range_is_said_out_loud():
    """Over a whole id space TorchRec's default range is ~1e-10: the table follows it
    (as a stock table would) and warns, naming the table and what to set."""
    with pytest.warns(UserWarning, match=r"table 't': no initial range given.*weight_init_min"):
        options = with_config_init(KVTableOptions(capacity=64), config(num_embeddings=2**63 - 1))
    assert options.init_high == pytest.approx(math.sqrt(1 / (2**63 - 1)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a usable default range, or a given one: silent
        with_config_init(KVTableOptions(capacity=64), config(num_embeddings=400))
        with_config_init(
            KVTableOptions(capacity=64, init_low=-0.01, init_high=0.01),
            config(num_embeddings=2**63 - 1),
        )


@pytest.mark.parametrize(
    "options, kw, words",
    [
        pytest.param(
            KVTableOptions(capacity=8, init_low=-1.0, init_high=1.0),
            {"weight_init_min": -0.5, "weight_init_max": 0.5},
            "table 't': KVTableOptions' init range",
            id="two-ranges",
        ),
        pytest.param(
            KVTableOptions(capacity=8, initializer=Initializer.NORMAL),
            {"weight_init_min": -0.5, "weight_init_max": 0.5},
            "table 't': KVTableOptions asks for a NORMAL",
            id="normal-against-a-range",
        ),
        pytest.param(
            KVTableOptions(capacity=8),
            {"init_fn": partial(torch.nn.init.xavier_uniform_, gain=2.0)},
            "table 't': its config has an init_fn of its own",
            id="custom-init-fn",
        ),
    ],
)
def test_disagreeing_init_is_refused(options, kw, words):
    with pytest.raises(ValueError, match=re.escape(words)):
        KVEmbeddingBagCollection([config(num_embeddings=100, **kw)], options)


def test_pooling_none_is_refused():
    with pytest.raises(ValueError, match="table 't': pooling"):
        KVEmbeddingBagCollection(
            [config(num_embeddings=10, pooling=PoolingType.NONE)], KVTableOptions(capacity=8)
        )


def test_usage_doc_defaults_are_the_codes():
    """Every literal default in docs/usage.md's KVTableOptions table."""
    text = (ROOT / "docs" / "usage.md").read_text()
    defaults = KVTableOptions(capacity=1)
    rows = re.findall(r"^\| `(\w+)` \| (-?[\d.]+) \|", text, flags=re.M)
    assert len(rows) >= 3, rows
    for name, value in rows:
        assert float(getattr(defaults, name)) == float(value), name
    assert re.search(r"^\| `total_num_buckets` \| 40320 \|", text, flags=re.M)
