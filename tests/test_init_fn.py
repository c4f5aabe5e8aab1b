"""A config's ``init_fn`` as a KV table's initial distribution (docs/initial-rows.md).

``torch.nn.init.uniform_``, ``normal_``, ``trunc_normal_``, ``constant_``,
``zeros_`` and ``ones_`` (plain or as ``functools.partial``) become the draws
of ``KVTableOptions``; the rows a collection gives ids it has never seen are
checked by their moments against the distributions' formulas, constants
exactly and against the stock collection's rows, and by determinism (batch
order, another module). Other callables are refused as before. Sharded tables
honour ``init_fn`` too: ``tests/sharding/dist_worker.py`` gives its "user"
table one and compares sharded rows (2 and 3 ranks) with unsharded ones.
"""

from __future__ import annotations

import math
import re
from functools import partial

import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, EmbeddingCollection
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb import (
    Initializer,
    KVEmbeddingBagCollection,
    KVEmbeddingCollection,
    KVTableOptions,
)
from torchrec_kvemb.options import init_fn_distribution, with_config_init

INIT = torch.nn.init
DIM = 7
#: Fresh ids, spread over the id space: 3001 rows of DIM values per distribution.
IDS = torch.arange(3001, dtype=torch.int64) * 1_000_003 + 2**40
OPTIONS = KVTableOptions(capacity=8192, seed=5)


def bag_config(init_fn=None, **kw) -> EmbeddingBagConfig:
    return EmbeddingBagConfig(
        name="t", embedding_dim=DIM, num_embeddings=1000, feature_names=["f"], init_fn=init_fn, **kw
    )


def first_rows(module: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The rows a training forward gives ``ids`` seen for the first time (one id per bag)."""
    kjt = KeyedJaggedTensor.from_lengths_sync(["f"], ids, torch.ones_like(ids))
    out = module(kjt)
    values = out["f"].values() if isinstance(out, dict) else out.values()
    return values.detach().reshape(ids.numel(), DIM)


def truncated_normal_moments(mean: float, std: float, low: float, high: float):
    """Mean and standard deviation of N(mean, std) truncated to [low, high]."""
    alpha, beta = (low - mean) / std, (high - mean) / std
    pdf = lambda x: math.exp(-x * x / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    cdf = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))  # noqa: E731
    z = cdf(beta) - cdf(alpha)
    shift = (pdf(alpha) - pdf(beta)) / z
    var = 1 + (alpha * pdf(alpha) - beta * pdf(beta)) / z - shift**2
    return mean + std * shift, std * math.sqrt(var)


#: init_fn -> (expected KVTableOptions fields, mean, std, bounds or None).
CASES = {
    "uniform-partial": (
        partial(INIT.uniform_, a=-0.5, b=1.5),
        {"initializer": Initializer.UNIFORM, "init_low": -0.5, "init_high": 1.5},
        0.5, 2.0 / math.sqrt(12), (-0.5, 1.5),
    ),
    "uniform-plain": (
        INIT.uniform_,
        {"initializer": Initializer.UNIFORM, "init_low": 0.0, "init_high": 1.0},
        0.5, 1.0 / math.sqrt(12), (0.0, 1.0),
    ),
    "normal-partial": (
        partial(INIT.normal_, mean=0.0, std=1.5),
        {"initializer": Initializer.NORMAL, "init_mean": 0.0, "init_std": 1.5},
        0.0, 1.5, None,
    ),
    "normal-plain": (
        INIT.normal_,
        {"initializer": Initializer.NORMAL, "init_mean": 0.0, "init_std": 1.0},
        0.0, 1.0, None,
    ),
    "trunc-normal-plain": (
        INIT.trunc_normal_,
        {"initializer": Initializer.TRUNC_NORMAL, "init_mean": 0.0, "init_std": 1.0,
         "init_low": -2.0, "init_high": 2.0},
        *truncated_normal_moments(0.0, 1.0, -2.0, 2.0), (-2.0, 2.0),
    ),
    "trunc-normal-one-sided": (
        partial(INIT.trunc_normal_, mean=0.25, std=0.5, a=0.0, b=3.0),
        {"initializer": Initializer.TRUNC_NORMAL, "init_mean": 0.25, "init_std": 0.5,
         "init_low": 0.0, "init_high": 3.0},
        *truncated_normal_moments(0.25, 0.5, 0.0, 3.0), (0.0, 3.0),
    ),
    "trunc-normal-narrow": (
        partial(INIT.trunc_normal_, std=0.02, a=-0.01, b=0.03),
        {"initializer": Initializer.TRUNC_NORMAL, "init_mean": 0.0, "init_std": 0.02,
         "init_low": -0.01, "init_high": 0.03},
        *truncated_normal_moments(0.0, 0.02, -0.01, 0.03), (-0.01, 0.03),
    ),
}  # fmt: skip

CONSTANTS = {
    "constant": (partial(INIT.constant_, val=0.37), 0.37),
    "constant-negative": (partial(INIT.constant_, val=-2.5), -2.5),
    "zeros": (INIT.zeros_, 0.0),
    "ones": (INIT.ones_, 1.0),
}


@pytest.mark.parametrize("name", list(CASES))
def test_init_fn_maps_to_its_distribution(name: str) -> None:
    fn, fields, mean, std, bounds = CASES[name]
    assert init_fn_distribution(fn, "t") == fields
    options = with_config_init(OPTIONS, bag_config(fn))
    assert {k: getattr(options, k) for k in fields} == fields
    rows = first_rows(KVEmbeddingBagCollection([bag_config(fn)], OPTIONS), IDS)
    n = rows.numel()
    got_mean, got_std = float(rows.double().mean()), float(rows.double().std())
    assert abs(got_mean - mean) < 5 * std / math.sqrt(n), (got_mean, mean)
    assert abs(got_std - std) < 0.03 * std, (got_std, std)
    if bounds is None:  # a normal law: about 4.6% of values beyond 2 std
        beyond = float(((rows - mean).abs() > 2 * std).double().mean())
        assert 0.035 < beyond < 0.057, beyond
        return
    low, high = bounds
    assert float(rows.min()) >= low and float(rows.max()) <= high
    span = high - low
    assert float(rows.min()) < low + 0.01 * span
    if name != "trunc-normal-one-sided":  # its upper bound is 5.5 std away
        assert float(rows.max()) > high - 0.01 * span


@pytest.mark.parametrize("name", list(CONSTANTS))
@pytest.mark.parametrize("kind", ["bags", "sequence"])
def test_constant_init_fns_give_the_stock_rows_exactly(name: str, kind: str) -> None:
    fn, value = CONSTANTS[name]
    assert init_fn_distribution(fn, "t") == {
        "initializer": Initializer.UNIFORM, "init_low": value, "init_high": value,
    }  # fmt: skip
    if kind == "bags":
        config = bag_config(fn)
        kv, stock = KVEmbeddingBagCollection([config], OPTIONS), EmbeddingBagCollection([config])
        stock_weight = stock.embedding_bags["t"].weight
    else:
        config = EmbeddingConfig(
            name="t", embedding_dim=DIM, num_embeddings=1000, feature_names=["f"], init_fn=fn
        )
        kv, stock = KVEmbeddingCollection([config], OPTIONS), EmbeddingCollection([config])
        stock_weight = stock.embeddings["t"].weight
    rows = first_rows(kv, IDS[:97])
    want = torch.full((97, DIM), value, dtype=torch.float32)
    assert torch.equal(rows, want), rows
    assert torch.equal(stock_weight.detach()[:97], want)
    assert torch.equal(first_rows(stock, torch.arange(97)), rows)


def test_rows_are_a_function_of_id_seed_and_column() -> None:
    """Another module, another batch order and batch split: the same rows; another seed:
    other rows."""
    fn = partial(INIT.trunc_normal_, mean=0.1, std=0.3, a=-0.2, b=0.5)
    rows = first_rows(KVEmbeddingBagCollection([bag_config(fn)], OPTIONS), IDS[:101])
    other = KVEmbeddingBagCollection([bag_config(fn)], OPTIONS)
    order = torch.randperm(101, generator=torch.Generator().manual_seed(3))
    late = first_rows(other, IDS[:101][order][:50])
    early = first_rows(other, IDS[:101][order][50:])
    assert torch.equal(torch.cat([late, early]), rows[order])
    seeded = KVEmbeddingBagCollection([bag_config(fn)], KVTableOptions(capacity=8192, seed=6))
    assert not torch.equal(first_rows(seeded, IDS[:101]), rows)


@pytest.mark.parametrize(
    "fn",
    [
        pytest.param(partial(INIT.normal_, 0.0, 1.0), id="normal-positional"),
        pytest.param(partial(INIT.constant_, 0.5), id="constant-positional"),
    ],
)
def test_positional_arguments_before_the_weight_are_refused(fn) -> None:
    """A partial's positional arguments come before the weight, as torch would call it."""
    with pytest.raises(ValueError, match=r"table 't'.*positional arguments take"):
        KVEmbeddingBagCollection([bag_config(fn)], OPTIONS)


@pytest.mark.parametrize(
    "fn, words",
    [
        pytest.param(lambda w: w.fill_(1.0), "table 't': its config has an init_fn of its own",
                     id="lambda"),
        pytest.param(partial(INIT.kaiming_uniform_, a=1.0), "its config has an init_fn of its own",
                     id="kaiming"),
        pytest.param(partial(INIT.constant_), "constant_ refuses its arguments", id="no-value"),
        pytest.param(partial(INIT.uniform_, c=1.0), "uniform_ refuses its arguments",
                     id="unknown-keyword"),
        pytest.param(partial(INIT.normal_, generator=torch.Generator()), "with a generator",
                     id="generator"),
        pytest.param(partial(INIT.trunc_normal_, std=0.0), "TRUNC_NORMAL initializer needs "
                     "init_std > 0", id="trunc-zero-std"),
    ],
)  # fmt: skip
def test_other_init_fns_are_refused(fn, words: str) -> None:
    with pytest.raises(ValueError, match=re.escape(words)):
        KVEmbeddingBagCollection([bag_config(fn)], OPTIONS)


def test_options_and_init_fn_both_given() -> None:
    """Options that draw what the init_fn draws are accepted; others are refused."""
    fn = partial(INIT.normal_, mean=0.5, std=0.25)
    same = KVTableOptions(capacity=64, initializer=Initializer.NORMAL, init_mean=0.5, init_std=0.25)
    assert with_config_init(same, bag_config(fn)) == same
    other = KVTableOptions(capacity=64, init_low=-1.0, init_high=1.0)
    with pytest.raises(ValueError, match=r"table 't': KVTableOptions' initial rows .* init_fn"):
        KVEmbeddingBagCollection([bag_config(fn)], other)


def test_init_fn_wins_over_the_config_range_as_in_stock() -> None:
    """A config's own init_fn is what stock tables draw from, not weight_init_min / max."""
    fn = partial(INIT.uniform_, a=2.0, b=3.0)
    config = bag_config(fn, weight_init_min=-0.1, weight_init_max=0.1)
    rows = first_rows(KVEmbeddingBagCollection([config], OPTIONS), IDS[:301])
    stock = EmbeddingBagCollection([config]).embedding_bags["t"].weight
    for values in (rows, stock.detach()):
        assert float(values.min()) >= 2.0 and float(values.max()) < 3.0


def test_trunc_normal_options_are_checked() -> None:
    with pytest.raises(ValueError, match="TRUNC_NORMAL initializer needs its bounds"):
        KVTableOptions(capacity=8, initializer=Initializer.TRUNC_NORMAL)
    with pytest.raises(ValueError, match="finite float32"):
        KVTableOptions(
            capacity=8, initializer=Initializer.TRUNC_NORMAL, init_low=-1e39, init_high=1.0
        )
