"""Every optimizer argument, as FBGEMM reads it, or refused by name.

``FusedOptimConfig.from_fused_params`` is the one translation from TorchRec's
``fused_params`` (a sharder's, a plan's, and the kwargs of an
``apply_optimizer_in_backward`` optimizer, which TorchRec merges into them) to
a KV table's update. Each case trains a KV table on the same rows and batches
as its reference and compares rows (and outputs) after a few steps:

* FBGEMM's CPU TBE built from the very same ``fused_params`` (``**fused_params``)
  where it has the optimizer (SGD, row-wise Adagrad: learning rate, eps, each
  weight decay mode, a decay without a mode, clipping, keys that change no
  number);
* for Adam, which FBGEMM's CPU TBE lacks, FBGEMM's Adam kernel written out
  (``fbgemm_adam``): moments, bias correction by the table's step, and weight
  decay always decoupled, ``w -= lr * (m_hat / (sqrt(v_hat) + eps) + wd * w)``,
  with the output gradient clamped first when clipping (FBGEMM's rule);
* under ``DistributedModelParallel`` (one gloo rank), a stock
  ``EmbeddingBagCollection`` (or ``EmbeddingCollection``) whose weights
  ``apply_optimizer_in_backward`` marked, sharded by the KV sharder, against
  the same collection sharded by TorchRec's own sharder (FBGEMM's fused
  tables) or, for ``torch.optim.Adam`` (whose ``betas`` FBGEMM's TBE does not
  take), against ``fbgemm_adam``.

And each argument a KV table cannot run as FBGEMM would is refused with a
``FusedParamsError`` naming it (and the table, where one is known).
"""

from __future__ import annotations

import tempfile

import pytest
import torch
import torch.distributed as dist
from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode, EmbeddingLocation
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from fbgemm_gpu.tbe.config.optimizer_config import (
    CounterBasedRegularizationDefinition,
    WeightDecayMode,
)
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.optim import LAMB, RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb import (
    KVEmbeddingBagCollection,
    KVEmbeddingBagCollectionSharder,
    KVEmbeddingCollection,
    KVEmbeddingCollectionSharder,
    KVTableOptions,
)
from torchrec_kvemb.optimizer import (
    NO_EFFECT_KEYS,
    FusedOptimConfig,
    FusedParamsError,
    OptimKind,
    WeightDecay,
    fused_params_of_torch_optimizer,
)
from torchrec_kvemb.sharding.kv_embedding import optim_config

from .checkpoint.one_rank_dmp import shard_on_one_rank

ROWS, DIM, BAGS, STEPS = 11, 4, 5, 3  # FBGEMM's CPU TBE takes dims that are a multiple of 4
FEATURES = ["f", "g"]  # two features: FBGEMM's generic CPU kernel (the module docstring
# of tests/test_optimizer_reference.py says why one feature would drop row-wise decay)
ADAGRAD, SGD, ADAM = EmbOptimType.EXACT_ROWWISE_ADAGRAD, EmbOptimType.EXACT_SGD, EmbOptimType.ADAM


# ----------------------------------------------------------------- the data
def start_rows() -> torch.Tensor:
    return torch.rand(ROWS, DIM, generator=torch.Generator().manual_seed(3)) * 2 - 1


def batches() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per step: ids, lengths (per feature, per bag) and the output's gradient,
    large enough that clipping at 0.3 bites."""
    gen = torch.Generator().manual_seed(11)
    out = []
    for _ in range(STEPS):
        lengths = torch.randint(0, 4, (len(FEATURES) * BAGS,), generator=gen)
        lengths[1] = 0
        ids = torch.randint(0, ROWS - 2, (int(lengths.sum()),), generator=gen)
        grad = torch.randn(BAGS, len(FEATURES) * DIM, generator=gen)
        out.append((ids, lengths, grad))
    return out


def kjt(ids: torch.Tensor, lengths: torch.Tensor) -> KeyedJaggedTensor:
    return KeyedJaggedTensor.from_lengths_sync(keys=FEATURES, values=ids, lengths=lengths)


def bag_config(**kwargs) -> EmbeddingBagConfig:
    return EmbeddingBagConfig(
        name="t", embedding_dim=DIM, num_embeddings=ROWS, feature_names=FEATURES, **kwargs
    )


# ------------------------------------------------------------- the trainers
def kv_train(fused_params: dict) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Outputs per step and rows after the batches of a ``KVEmbeddingBagCollection``."""
    ebc = KVEmbeddingBagCollection(
        [bag_config()], KVTableOptions(capacity=64), fused_params=fused_params
    )
    ebc.table("t").insert(torch.arange(ROWS), start_rows())
    outputs = []
    for ids, lengths, grad in batches():
        out = ebc(kjt(ids, lengths)).values()
        out.backward(grad)
        outputs.append(out.detach())
    return outputs, ebc.table("t").find(torch.arange(ROWS))[0]


def fbgemm_train(fused_params: dict) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The same on FBGEMM's CPU TBE built from the same ``fused_params``."""
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [(ROWS, DIM, EmbeddingLocation.HOST, ComputeDevice.CPU)],
        feature_table_map=[0] * len(FEATURES),
        **fused_params,
    )
    tbe.split_embedding_weights()[0].copy_(start_rows())
    outputs = []
    for ids, lengths, grad in batches():
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        out = tbe(ids, offsets)
        out.backward(grad)
        outputs.append(out.detach())
    return outputs, tbe.split_embedding_weights()[0].detach().clone()


def fbgemm_adam(
    lr: float,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    max_gradient: float | None = None,
    pooled: bool = True,
) -> torch.Tensor:
    """Rows after the batches under FBGEMM's Adam kernel, written out: per step the
    output gradient (clamped to ``max_gradient``), each read row's summed gradient
    ``g``, ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``, and
    ``w -= lr * (m / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps) + weight_decay * w)``
    (``t``: the table's step). ``pooled=False``: every id a bag of its own."""
    w = start_rows().double()
    m, v = torch.zeros_like(w), torch.zeros_like(w)
    b1, b2 = betas
    for t, (ids, lengths, grad) in enumerate(batches(), start=1):
        grad = grad.double() if pooled else _sequence_grad(ids, lengths).double()
        if max_gradient is not None:
            grad = grad.clamp(-max_gradient, max_gradient)
        g = torch.zeros_like(w)
        for i, (row, (feature, bag)) in enumerate(zip(ids.tolist(), _bag_of(lengths))):
            g[row] += grad[bag, feature * DIM : (feature + 1) * DIM] if pooled else grad[i]
        read = torch.zeros(ROWS, dtype=torch.bool)
        read[ids] = True
        m[read] = b1 * m[read] + (1 - b1) * g[read]
        v[read] = b2 * v[read] + (1 - b2) * g[read] ** 2
        step = m[read] / (1 - b1**t) / ((v[read] / (1 - b2**t)).sqrt() + eps)
        w[read] = w[read] - lr * (step + weight_decay * w[read])
    return w.float()


def _bag_of(lengths: torch.Tensor) -> list[tuple[int, int]]:
    """(feature, bag) of each id of a batch."""
    return [(k // BAGS, k % BAGS) for k, n in enumerate(lengths.tolist()) for _ in range(int(n))]


def _sequence_grad(ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The gradient of each id's row in a sequence lookup: ``[n, DIM]``, fixed by the
    batch's seed."""
    return torch.randn(ids.numel(), DIM, generator=torch.Generator().manual_seed(ids.numel()))


# -------------------------------------------------- fused_params vs FBGEMM
FBGEMM_CASES = {
    "sgd-learning-rate": {"optimizer": SGD, "learning_rate": 0.3},
    "sgd-decay-without-mode": {"optimizer": SGD, "learning_rate": 0.3, "weight_decay": 0.1},
    "sgd-clipping": {"optimizer": SGD, "gradient_clipping": True, "max_gradient": 0.3},
    "adagrad-eps": {"optimizer": ADAGRAD, "learning_rate": 0.2, "eps": 1e-2},
    "adagrad-l2": {
        "optimizer": ADAGRAD,
        "learning_rate": 0.2,
        "weight_decay": 0.1,
        "weight_decay_mode": WeightDecayMode.L2,
    },
    "adagrad-decouple": {
        "optimizer": ADAGRAD,
        "learning_rate": 0.2,
        "eps": 1e-3,
        "weight_decay": 0.1,
        "weight_decay_mode": WeightDecayMode.DECOUPLE,
    },
    "adagrad-decay-without-mode": {"optimizer": ADAGRAD, "weight_decay": 0.1},
    "adagrad-decouple-clipping": {
        "optimizer": ADAGRAD,
        "learning_rate": 0.2,
        "weight_decay": 0.1,
        "weight_decay_mode": WeightDecayMode.DECOUPLE,
        "gradient_clipping": True,
        "max_gradient": 0.3,
    },
    "keys-that-change-no-number": {
        "optimizer": ADAGRAD,
        "learning_rate": 0.2,
        "stochastic_rounding": True,
        "cache_load_factor": 0.5,
        "prefetch_pipeline": False,
        "bounds_check_mode": BoundsCheckMode.WARNING,
        "output_dtype": SparseType.FP32,
        "max_norm": 0.0,
    },
}


@pytest.mark.parametrize("case", list(FBGEMM_CASES))
def test_fused_params_train_as_fbgemm(case: str) -> None:
    params = FBGEMM_CASES[case]
    kv_outputs, kv_rows = kv_train(params)
    outputs, rows = fbgemm_train(params)
    for step, (got, want) in enumerate(zip(kv_outputs, outputs, strict=True)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=f"{case}: output {step}")
    torch.testing.assert_close(kv_rows, rows, rtol=0, atol=1e-6, msg=f"{case}: rows")
    assert not torch.equal(rows, start_rows()), "the case trained nothing"


def test_clipping_and_decay_change_the_rows() -> None:
    """The clipping and decay cases are not vacuous: without them FBGEMM's rows differ."""
    plain = {
        k: v for k, v in FBGEMM_CASES["adagrad-decouple-clipping"].items() if "weight" not in k
    }
    unclipped = dict(plain, gradient_clipping=False)
    rows = {name: fbgemm_train(p)[1] for name, p in [("plain", plain), ("free", unclipped)]}
    decayed = fbgemm_train(FBGEMM_CASES["adagrad-decouple-clipping"])[1]
    assert (rows["plain"] - rows["free"]).abs().max() > 1e-3
    assert (decayed - rows["plain"]).abs().max() > 1e-3


# ----------------------------------------------------------------- Adam
ADAM_CASES = {
    "default": ({}, {}),
    "betas-eps": ({"beta1": 0.8, "beta2": 0.95, "eps": 1e-3}, {"betas": (0.8, 0.95), "eps": 1e-3}),
    "decay-without-mode": ({"weight_decay": 0.1}, {"weight_decay": 0.1}),
    "decay-decouple": (
        {"weight_decay": 0.1, "weight_decay_mode": WeightDecayMode.DECOUPLE},
        {"weight_decay": 0.1},
    ),
    "decay-mode-none": (
        {"weight_decay": 0.1, "weight_decay_mode": WeightDecayMode.NONE},
        {"weight_decay": 0.1},
    ),
    "clipping": ({"gradient_clipping": True, "max_gradient": 0.3}, {"max_gradient": 0.3}),
}


@pytest.mark.parametrize("case", list(ADAM_CASES))
def test_adam_trains_as_fbgemm_adam(case: str) -> None:
    """FBGEMM's Adam decays decoupled whatever ``weight_decay_mode`` says (none
    included): after three steps the rows equal its update to 1e-6."""
    params, formula = ADAM_CASES[case]
    _, rows = kv_train({"optimizer": ADAM, "learning_rate": 0.05, **params})
    want = fbgemm_adam(0.05, **formula)
    torch.testing.assert_close(rows, want, rtol=0, atol=1e-6, msg=case)
    if case == "decay-without-mode":
        plain = fbgemm_adam(0.05)
        assert (plain - want).abs().max() > 1e-4, "the decay changed nothing: raise it"


def test_torch_adam_kwargs_on_an_unsharded_collection() -> None:
    """A KV collection takes a torch optimizer's kwargs through
    ``fused_params_of_torch_optimizer``: ``lr``, ``betas``, ``eps``, ``weight_decay``
    as TorchRec's sharded tables read them."""
    kwargs = {"lr": 0.05, "betas": (0.8, 0.95), "eps": 1e-3, "weight_decay": 0.1}
    fused = fused_params_of_torch_optimizer(torch.optim.Adam, kwargs)
    _, rows = kv_train(fused)
    want = fbgemm_adam(0.05, (0.8, 0.95), 1e-3, 0.1)
    torch.testing.assert_close(rows, want, rtol=0, atol=1e-6)


def test_adam_on_a_sequence_collection() -> None:
    """``KVEmbeddingCollection`` reads the same translation: Adam with custom betas and
    a decay without a mode, each id its own row, clipping its output gradient."""
    ec = KVEmbeddingCollection(
        [EmbeddingConfig(name="t", embedding_dim=DIM, num_embeddings=ROWS, feature_names=FEATURES)],
        KVTableOptions(capacity=64),
        fused_params={
            "optimizer": ADAM,
            "learning_rate": 0.05,
            "betas": (0.8, 0.95),
            "weight_decay": 0.1,
            "gradient_clipping": True,
            "max_gradient": 0.5,
        },
    )
    ec.table("t").insert(torch.arange(ROWS), start_rows())
    for ids, lengths, _ in batches():
        out = ec(kjt(ids, lengths))
        values = torch.cat([out[f].values() for f in FEATURES])
        values.backward(_sequence_grad(ids, lengths))
    rows = ec.table("t").find(torch.arange(ROWS))[0]
    want = fbgemm_adam(0.05, (0.8, 0.95), weight_decay=0.1, max_gradient=0.5, pooled=False)
    torch.testing.assert_close(rows, want, rtol=0, atol=1e-6)


# ------------------------------------------- apply_optimizer_in_backward
@pytest.fixture
def one_rank():
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def _sharded(optimizer_class: type, kwargs: dict, kv: bool, sharding: str = "row_wise"):
    ebc = EmbeddingBagCollection([bag_config()], device=torch.device("meta"))
    # a copy: TorchRec's sharders add "optimizer" to the dict the weight carries
    apply_optimizer_in_backward(optimizer_class, ebc.embedding_bags.parameters(), dict(kwargs))
    sharder = (
        KVEmbeddingBagCollectionSharder({"t": KVTableOptions(capacity=64)})
        if kv
        else EmbeddingBagCollectionSharder()
    )
    return shard_on_one_rank(ebc, [sharder], ["t"], sharding)


def _train_sharded(model, kv: bool) -> tuple[list[torch.Tensor], torch.Tensor]:
    if kv:
        model.module.kv_tables()["t"].insert(torch.arange(ROWS), start_rows())
    else:
        _stock_rows(model).copy_(start_rows())
    outputs = []
    for ids, lengths, grad in batches():
        out = model(kjt(ids, lengths)).values()
        out.backward(grad)
        outputs.append(out.detach())
    if kv:
        return outputs, model.module.kv_tables()["t"].find(torch.arange(ROWS))[0]
    return outputs, _stock_rows(model).detach().clone()


def _stock_rows(model) -> torch.Tensor:
    (shard,) = model.state_dict()["embedding_bags.t.weight"].local_shards()
    return shard.tensor


@pytest.mark.parametrize("sharding", ["row_wise", "table_wise"])
def test_torch_adam_in_backward_sharded(one_rank, sharding: str) -> None:
    """``apply_optimizer_in_backward(torch.optim.Adam, ..., {lr, betas, eps,
    weight_decay})`` on a stock collection sharded by the KV sharder: every kwarg
    reaches the KV table (betas were dropped before), decay as FBGEMM's Adam."""
    kwargs = {"lr": 0.05, "betas": (0.8, 0.95), "eps": 1e-3, "weight_decay": 0.1}
    model = _sharded(torch.optim.Adam, kwargs, kv=True, sharding=sharding)
    optim = model.module.kv_tables()["t"].optim
    assert (optim.kind, optim.beta1, optim.beta2) == (OptimKind.ADAM, 0.8, 0.95)
    _, rows = _train_sharded(model, kv=True)
    want = fbgemm_adam(0.05, (0.8, 0.95), 1e-3, 0.1)
    torch.testing.assert_close(rows, want, rtol=0, atol=1e-6)


ROWWISE_IN_BACKWARD = {
    "rowwise-adagrad-decouple": (
        RowWiseAdagrad,
        {
            "lr": 0.2,
            "eps": 1e-3,
            "weight_decay": 0.1,
            "weight_decay_mode": WeightDecayMode.DECOUPLE,
            "gradient_clipping": True,
            "max_gradient": 0.3,
        },
    ),
    # torch's SGD decays by L2; FBGEMM's SGD, which TorchRec runs it on, ignores the decay
    "torch-sgd-weight-decay": (torch.optim.SGD, {"lr": 0.3, "weight_decay": 0.1}),
}


@pytest.mark.parametrize("case", list(ROWWISE_IN_BACKWARD))
def test_optimizer_in_backward_as_the_stock_sharded_twin(one_rank, case: str) -> None:
    """The same marked collection sharded by TorchRec's sharder (FBGEMM's fused CPU
    tables) and by the KV sharder: same outputs and rows."""
    optimizer_class, kwargs = ROWWISE_IN_BACKWARD[case]
    # table-wise: the stock sharder shards CPU tables no other way
    stock = _sharded(optimizer_class, kwargs, kv=False, sharding="table_wise")
    want_outputs, want_rows = _train_sharded(stock, False)
    kv = _sharded(optimizer_class, kwargs, kv=True, sharding="table_wise")
    got_outputs, got_rows = _train_sharded(kv, True)
    for step, (got, want) in enumerate(zip(got_outputs, want_outputs, strict=True)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=f"{case}: output {step}")
    torch.testing.assert_close(got_rows, want_rows, rtol=0, atol=1e-6, msg=f"{case}: rows")
    assert not torch.equal(want_rows, start_rows())


def test_refused_optimizer_in_backward_names_its_argument(one_rank) -> None:
    with pytest.raises(FusedParamsError, match=r"table 't'.*'momentum'"):
        _sharded(torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}, kv=True)


# ------------------------------------------------------------- refusals
REFUSED = {
    "sgd-l2": (
        {"optimizer": SGD, "weight_decay": 0.1, "weight_decay_mode": 1},
        "weight_decay_mode",
    ),
    "sgd-decouple": (
        {"optimizer": SGD, "weight_decay": 0.1, "weight_decay_mode": WeightDecayMode.DECOUPLE},
        "weight_decay_mode",
    ),
    "adam-l2": (
        {"optimizer": ADAM, "weight_decay": 0.1, "weight_decay_mode": WeightDecayMode.L2},
        "weight_decay_mode",
    ),
    "counter-mode": (
        {"optimizer": ADAGRAD, "weight_decay": 0.1, "weight_decay_mode": WeightDecayMode.COUNTER},
        "weight_decay_mode",
    ),
    "cowclip-mode": ({"optimizer": ADAGRAD, "weight_decay_mode": 4}, "weight_decay_mode"),
    "decouple-global": (
        {"optimizer": ADAGRAD, "weight_decay_mode": WeightDecayMode.DECOUPLE_GLOBAL},
        "weight_decay_mode",
    ),
    "counter-regularization": (
        {"counter_based_regularization": CounterBasedRegularizationDefinition()},
        "counter_based_regularization",
    ),
    "cowclip-regularization": ({"cowclip_regularization": object()}, "cowclip_regularization"),
    "global-weight-decay": ({"global_weight_decay": object()}, "global_weight_decay"),
    "ensemble": ({"ensemble_mode": {"step_ema": 1.0}}, "ensemble_mode"),
    "lamb": ({"optimizer": EmbOptimType.LAMB}, "optimizer"),
    "exact-adagrad": ({"optimizer": EmbOptimType.EXACT_ADAGRAD}, "optimizer"),
    "partial-rowwise-adam": ({"optimizer": "partial_row_wise_adam"}, "optimizer"),
    "lars-eta": ({"eta": 0.01}, "eta"),
    "momentum": ({"momentum": 0.9}, "momentum"),
    "nesterov": ({"nesterov": True}, "nesterov"),
    "dampening": ({"dampening": 0.1}, "dampening"),
    "amsgrad": ({"optimizer": ADAM, "amsgrad": True}, "amsgrad"),
    "maximize": ({"maximize": True}, "maximize"),
    "lr-decay": ({"optimizer": ADAGRAD, "lr_decay": 0.1}, "lr_decay"),
    "initial-accumulator": (
        {"optimizer": ADAGRAD, "initial_accumulator_value": 0.1},
        "initial_accumulator_value",
    ),
    "max-norm": ({"max_norm": 1.0}, "max_norm"),
    "output-fp16": ({"output_dtype": SparseType.FP16}, "output_dtype"),
    "weights-fp16": ({"weights_precision": SparseType.FP16}, "weights_precision"),
    "state-dtypes": (
        {"optimizer_state_dtypes": {"momentum1": SparseType.FP16}},
        "optimizer_state_dtypes",
    ),
    "lr-and-learning-rate": ({"learning_rate": 0.1, "lr": 0.2}, "lr"),
    "betas-and-beta1": ({"optimizer": ADAM, "betas": (0.8, 0.9), "beta1": 0.7}, "beta1"),
    "beta-out-of-range": ({"optimizer": ADAM, "beta2": 1.0}, "beta2"),
    "negative-decay": ({"optimizer": ADAGRAD, "weight_decay": -0.1}, "weight_decay"),
    "unknown": ({"learning_rate_mode": "cosine"}, "learning_rate_mode"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_refused_keys_are_named(case: str) -> None:
    params, key = REFUSED[case]
    with pytest.raises(FusedParamsError, match=f"'{key}'"):
        FusedOptimConfig.from_fused_params(params)
    with pytest.raises(FusedParamsError, match=f"table 'items'.*'{key}'"):
        optim_config(params, "items")


TORCH_REFUSED = {
    "torch-adagrad": torch.optim.Adagrad,  # FBGEMM's EXACT_ADAGRAD: state per element
    "torch-adamw": torch.optim.AdamW,  # TorchRec maps it to no EmbOptimType
    "torchrec-lamb": LAMB,
}


@pytest.mark.parametrize("case", list(TORCH_REFUSED))
def test_refused_torch_optimizers_are_named(case: str) -> None:
    cls = TORCH_REFUSED[case]
    with pytest.raises(FusedParamsError, match=f"table 't'.*{cls.__qualname__}"):
        FusedOptimConfig.from_torch_optimizer(cls, {"lr": 0.1}, table="t")


def test_torch_optimizer_kwargs_translate() -> None:
    got = FusedOptimConfig.from_torch_optimizer(
        torch.optim.Adam,
        {"lr": 0.02, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.01, "foreach": True},
    )
    want = FusedOptimConfig(OptimKind.ADAM, 0.02, 1e-6, 0.8, 0.95, 0.01, WeightDecay.DECOUPLE)
    assert got == want
    sgd = FusedOptimConfig.from_torch_optimizer(torch.optim.SGD, {"lr": 0.5, "momentum": 0.0})
    assert sgd == FusedOptimConfig(OptimKind.SGD, 0.5)
    rowwise = FusedOptimConfig.from_torch_optimizer(RowWiseAdagrad, {"lr": 0.1, "eps": 1e-10})
    assert rowwise == FusedOptimConfig(OptimKind.ROWWISE_ADAGRAD, 0.1, 1e-10)


@pytest.mark.parametrize("key", sorted(NO_EFFECT_KEYS))
def test_keys_that_change_no_number_are_accepted(key: str) -> None:
    params = {"optimizer": ADAGRAD, "learning_rate": 0.1}
    assert FusedOptimConfig.from_fused_params({**params, key: object()}, "t") == (
        FusedOptimConfig.from_fused_params(params)
    )


def test_torch_adam_in_backward_sharded_sequences(one_rank) -> None:
    """The same through ``KVEmbeddingCollectionSharder`` on a stock
    ``EmbeddingCollection``: betas, eps and decay reach the KV table; rows equal
    FBGEMM's Adam update with every id its own row."""
    ec = EmbeddingCollection(
        [EmbeddingConfig(name="t", embedding_dim=DIM, num_embeddings=ROWS, feature_names=FEATURES)],
        device=torch.device("meta"),
    )
    kwargs = {"lr": 0.05, "betas": (0.8, 0.95), "eps": 1e-3, "weight_decay": 0.1}
    apply_optimizer_in_backward(torch.optim.Adam, ec.embeddings.parameters(), kwargs)
    sharder = KVEmbeddingCollectionSharder({"t": KVTableOptions(capacity=64)})
    model = shard_on_one_rank(ec, [sharder], ["t"], "row_wise")
    table = model.module.kv_tables()["t"]
    table.insert(torch.arange(ROWS), start_rows())
    for ids, lengths, _ in batches():
        out = model(kjt(ids, lengths))
        values = torch.cat([out[f].values() for f in FEATURES])
        values.backward(_sequence_grad(ids, lengths))
    want = fbgemm_adam(0.05, (0.8, 0.95), 1e-3, 0.1, pooled=False)
    torch.testing.assert_close(table.find(torch.arange(ROWS))[0], want, rtol=0, atol=1e-6)
