"""The fused optimizers against references from outside the project.

Every optimizer configuration ``fused_params`` accepts (``EXACT_SGD``,
``EXACT_ROWWISE_ADAGRAD``, ``ADAM``; no weight decay, L2 and decoupled weight
decay where FBGEMM's kernel applies them: row-wise Adagrad's both, Adam's
decoupled; gradient clipping) with SUM, MEAN and weighted (per-sample weights,
SUM) bags, float32 rows. (``tests/test_optimizer_args.py`` holds each key's
translation and refusals.) A ``KVEmbeddingBagCollection`` of two tables, each read by
two features, trains three steps on small odd-sized batches of ids with
repeats and empty bags. Half of its ids are inserted with known rows before
the first step, the others get their row (and zero state) when first seen;
capacity is ample, so nothing is evicted. Its outputs, its rows (``find``) and
its optimizer state (``export``) must match the reference on every CPU
backend: ``torch``, ``native`` (``auto``: the native kernels) and ``triton``
(Triton's interpreter).

The references:

* FBGEMM's CPU TBE (``SplitTableBatchedEmbeddingBagsCodegen``, host weights,
  CPU compute) for SGD and row-wise Adagrad, clipping included. Its CPU
  row-wise Adagrad takes a fast kernel for a table read by one feature, and
  that kernel drops weight decay (it is called with ``weight_decay=0``:
  ``L2``, ``DECOUPLE`` and none give the same rows); a table read by several
  features takes the generic kernel, which applies both modes. That is why
  each table here is read by two features. FBGEMM's SGD has no weight decay
  at all (a decay mode with it is refused), and its CPU TBE has no Adam.
* torch for Adam: ``torch.optim.Adam`` and, with weight decay,
  ``torch.optim.AdamW`` (decoupled, as FBGEMM's Adam kernel decays), each given
  the batch's rows as one dense tensor with their state and the table's step
  count (bias correction counts the table's steps, as FBGEMM's ``iter`` does, not the row's), and
  ``rowwise_adagrad_step`` below for row-wise Adagrad. Only the rows a batch
  reads are updated, as in FBGEMM's TBE. The rows' gradients come from autograd
  through ``torch.nn.functional.embedding_bag``.

Gradient clipping: FBGEMM's TBE clamps each element of the gradient of the
pooled output to ``[-max_gradient, max_gradient]``, bag by bag, before
reducing it into rows; the KV tables do the same, and so do the torch
references (``test_torch_references_match_fbgemm`` holds them to FBGEMM's
clipping).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from fbgemm_gpu.tbe.config.optimizer_config import WeightDecayMode
from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb import KVEmbeddingBagCollection, KVTableOptions
from torchrec_kvemb.backend import ENV_VAR
from torchrec_kvemb.ops import native

LR = 0.1
EPS = 1e-3
BETAS = (0.8, 0.95)
WEIGHT_DECAY = 0.05
MAX_GRADIENT = 0.6
STEPS = 3
BAGS = 5  # per feature
#: table -> (its features, its number of ids)
TABLES = {"a": (("x", "y"), 19), "b": (("z", "w"), 13)}
FEATURES = [f for features, _ in TABLES.values() for f in features]
#: One dim for both tables: they form one group (one lookup, one backward per
#: step). FBGEMM's CPU TBE takes dims that are a multiple of 4; torch any.
DIMS = {"fbgemm": {"a": 4, "b": 4}, "torch": {"a": 5, "b": 5}}
STATE_NAMES = ("momentum1", "exp_avg", "exp_avg_sq")


@dataclass(frozen=True)
class Case:
    optimizer: EmbOptimType
    decay: WeightDecayMode = WeightDecayMode.NONE
    clip: bool = False

    def fused_params(self) -> dict:
        params = {"optimizer": self.optimizer, "learning_rate": LR, "eps": EPS}
        if self.optimizer == EmbOptimType.ADAM:
            params.update(beta1=BETAS[0], beta2=BETAS[1])
        if self.decay != WeightDecayMode.NONE:
            params.update(weight_decay=WEIGHT_DECAY, weight_decay_mode=self.decay)
        if self.clip:
            params.update(gradient_clipping=True, max_gradient=MAX_GRADIENT)
        return params

    @property
    def reference(self) -> str:
        """The outside reference of this update (the module docstring says why)."""
        return "torch" if self.optimizer == EmbOptimType.ADAM else "fbgemm"

    @property
    def refused(self) -> bool:
        """A decay FBGEMM's kernel would not apply (SGD's any, Adam's L2): refused."""
        if self.decay == WeightDecayMode.NONE:
            return False
        return (
            self.optimizer == EmbOptimType.EXACT_SGD
            or self.decay == WeightDecayMode.L2
            and (self.optimizer == EmbOptimType.ADAM)
        )


_OPTIMIZERS = {
    "sgd": EmbOptimType.EXACT_SGD,
    "adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD,
    "adam": EmbOptimType.ADAM,
}
_VARIANTS = {
    "": {},
    "-l2": {"decay": WeightDecayMode.L2},
    "-decouple": {"decay": WeightDecayMode.DECOUPLE},
    "-clip": {"clip": True},
}
#: Clipping with weight decay (the decay applies to the clipped gradient): one
#: pooling each, as pooling only changes the gradient both of them take.
_COMBINED = {
    "-l2-clip": {"decay": WeightDecayMode.L2, "clip": True},
    "-decouple-clip": {"decay": WeightDecayMode.DECOUPLE, "clip": True},
}
CASES = {
    name + suffix: Case(optim, **variant)
    for name, optim in _OPTIMIZERS.items()
    for suffix, variant in (_VARIANTS | _COMBINED).items()
    if not Case(optim, **variant).refused
}
POOLINGS = ["sum", "mean", "weighted"]
CASE_POOLINGS = [
    (name, pooling)
    for name in CASES
    for pooling in (POOLINGS if not name.endswith(tuple(_COMBINED)) else ["weighted"])
]
#: The backend a test id names -> TORCHREC_KVEMB_BACKEND.
BACKENDS = {"torch": "torch", "native": "auto", "triton": "triton"}


# ----------------------------------------------------------------- the data
def raw_ids(table: str) -> torch.Tensor:
    """The table's ids as the KV tables see them; row i of a reference is id i."""
    offset = 2**40 if table == "a" else 2**50
    return torch.arange(TABLES[table][1]) * 1_000_003 + offset


def inserted(table: str) -> torch.Tensor:
    """Which of the table's ids are inserted before training (the others are new)."""
    return torch.arange(TABLES[table][1]) % 2 == 0


def table_of(feature: str) -> str:
    return next(t for t, (features, _) in TABLES.items() if feature in features)


@dataclass
class Batch:
    """One step: per feature (``FEATURES`` order) its rows (indices into the table's
    ids), bag lengths and sample weights; and the gradient of the pooled output."""

    rows: list[torch.Tensor]
    lengths: list[torch.Tensor]
    weights: list[torch.Tensor]
    grad: torch.Tensor

    def offsets(self, i: int) -> torch.Tensor:
        return torch.cat([torch.zeros(1, dtype=torch.int64), self.lengths[i].cumsum(0)])

    def read(self, table: str) -> torch.Tensor:
        """The rows of ``table`` the batch reads, sorted, once each."""
        return torch.cat([r for f, r in zip(FEATURES, self.rows) if table_of(f) == table]).unique()


def make_batches(dims: dict[str, int]) -> list[Batch]:
    gen = torch.Generator().manual_seed(17)
    out_dim = sum(dims[table_of(f)] for f in FEATURES)
    batches = []
    for _ in range(STEPS):
        rows, lengths, weights = [], [], []
        for feature in FEATURES:
            length = torch.randint(0, 4, (BAGS,), generator=gen)
            length[1], length[2] = 0, 3  # an empty bag; no feature without ids
            # the last 3 ids are never read; the others repeat within and across bags
            n = TABLES[table_of(feature)][1] - 3
            rows.append(torch.randint(0, n, (int(length.sum()),), generator=gen))
            lengths.append(length)
            weights.append(torch.rand(int(length.sum()), generator=gen) + 0.5)
        batches.append(Batch(rows, lengths, weights, torch.randn(BAGS, out_dim, generator=gen)))
    return batches


def make_ebc(dims: dict[str, int], case: Case, pooling: str) -> KVEmbeddingBagCollection:
    configs = [
        EmbeddingBagConfig(
            name=t,
            embedding_dim=dims[t],
            num_embeddings=2**62,
            feature_names=list(features),
            pooling=PoolingType.MEAN if pooling == "mean" else PoolingType.SUM,
        )
        for t, (features, _) in TABLES.items()
    ]
    return KVEmbeddingBagCollection(
        configs,
        KVTableOptions(capacity=64 * 16, seed=3, init_low=-0.5, init_high=0.5),
        is_weighted=pooling == "weighted",
        fused_params=case.fused_params(),
    )


def initial_rows(dims: dict[str, int]) -> dict[str, torch.Tensor]:
    """Every id's row before training: random rows for the ids ``inserted`` before
    it, and for the others the row the table gives an id it has not seen (read
    from a fresh collection after one forward over every id: initial values
    depend only on id, seed and column)."""
    fresh = make_ebc(dims, Case(EmbOptimType.EXACT_SGD), "sum")
    ids = [raw_ids(table_of(f)) for f in FEATURES]
    fresh(
        KeyedJaggedTensor.from_lengths_sync(
            keys=FEATURES, values=torch.cat(ids), lengths=torch.tensor([i.numel() for i in ids])
        )
    )
    gen = torch.Generator().manual_seed(5)
    rows = {}
    for t, (_, n) in TABLES.items():
        new, found = fresh.table(t).find(raw_ids(t))
        assert bool(found.all())
        rows[t] = torch.where(
            inserted(t).unsqueeze(1), torch.rand(n, dims[t], generator=gen) * 2 - 1, new
        )
    return rows


# ----------------------------------------------------------------- references
def rowwise_adagrad_step(
    w: torch.Tensor, g: torch.Tensor, state: torch.Tensor, decay: WeightDecayMode
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise Adagrad on dense rows ``w [n, dim]`` with their gradients ``g``:
    the new rows and state ``[n]``.

    FBGEMM's row-wise Adagrad: L2 adds ``weight_decay * w`` to the gradient;
    ``state += mean(g * g)`` over the row; ``w -= lr * g / (sqrt(state) + eps)``;
    decoupled decay then subtracts ``lr * weight_decay * w`` (``w`` before the step).
    """
    if decay == WeightDecayMode.L2:
        g = g + WEIGHT_DECAY * w
    state = state + (g * g).mean(dim=1)
    new_w = w - LR * g / (state.sqrt() + EPS).unsqueeze(1)
    if decay == WeightDecayMode.DECOUPLE:
        new_w = new_w - LR * WEIGHT_DECAY * w
    return new_w, state


def _torch_optimizer(case: Case, param: torch.Tensor) -> torch.optim.Optimizer:
    if case.optimizer == EmbOptimType.EXACT_SGD:
        return torch.optim.SGD([param], lr=LR)
    if case.decay == WeightDecayMode.DECOUPLE:
        return torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    return torch.optim.Adam([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=0.0)


def torch_reference(case: Case, pooling: str, batches: list[Batch], rows: dict) -> dict:
    """Outputs per step, rows and optimizer state by the torch references (clipping
    clamps the output's gradient: FBGEMM's rule)."""
    rows = {t: w.clone() for t, w in rows.items()}
    state = {}
    for t, w in rows.items():
        if case.optimizer == EmbOptimType.EXACT_ROWWISE_ADAGRAD:
            state[t] = {"momentum1": torch.zeros(w.shape[0])}
        elif case.optimizer == EmbOptimType.ADAM:
            state[t] = {"exp_avg": torch.zeros_like(w), "exp_avg_sq": torch.zeros_like(w)}
        else:
            state[t] = {}
    outputs, bites = [], []
    for step, batch in enumerate(batches, start=1):
        read = {t: batch.read(t) for t in TABLES}
        params = {t: rows[t][read[t]].clone().requires_grad_() for t in TABLES}
        pooled = []
        for i, feature in enumerate(FEATURES):
            t = table_of(feature)
            pooled.append(
                F.embedding_bag(
                    torch.searchsorted(read[t], batch.rows[i]),
                    params[t],
                    batch.offsets(i)[:-1],
                    mode="mean" if pooling == "mean" else "sum",
                    per_sample_weights=batch.weights[i] if pooling == "weighted" else None,
                )
            )
        out = torch.cat(pooled, dim=1)
        grad = batch.grad
        if case.clip:
            bites.append(bool((grad.abs() > MAX_GRADIENT).any()))
            grad = grad.clamp(-MAX_GRADIENT, MAX_GRADIENT)
        out.backward(grad)
        outputs.append(out.detach())
        for t in TABLES:
            p, idx = params[t], read[t]
            g = p.grad
            if case.optimizer == EmbOptimType.EXACT_ROWWISE_ADAGRAD:
                rows[t][idx], state[t]["momentum1"][idx] = rowwise_adagrad_step(
                    p.detach(), g, state[t]["momentum1"][idx], case.decay
                )
                continue
            p.grad = g
            opt = _torch_optimizer(case, p)
            if case.optimizer == EmbOptimType.ADAM:
                opt.state[p] = {
                    "step": torch.tensor(float(step - 1)),
                    "exp_avg": state[t]["exp_avg"][idx],
                    "exp_avg_sq": state[t]["exp_avg_sq"][idx],
                }
            opt.step()
            rows[t][idx] = p.detach()
            if case.optimizer == EmbOptimType.ADAM:
                assert float(opt.state[p]["step"]) == step
                for name in ("exp_avg", "exp_avg_sq"):
                    state[t][name][idx] = opt.state[p][name]
    assert not case.clip or any(bites), "clipping never clamped a gradient: raise them"
    return {"outputs": outputs, "rows": rows, "state": state}


def fbgemm_reference(case: Case, pooling: str, batches: list[Batch], rows: dict) -> dict:
    """Outputs per step, rows and optimizer state by FBGEMM's CPU TBE (with the
    configuration's clipping: FBGEMM's rule)."""
    tables = list(TABLES)
    tbe = SplitTableBatchedEmbeddingBagsCodegen(
        [
            (n, rows[t].shape[1], EmbeddingLocation.HOST, ComputeDevice.CPU)
            for t, (_, n) in TABLES.items()
        ],
        feature_table_map=[tables.index(table_of(f)) for f in FEATURES],
        optimizer=case.optimizer,
        learning_rate=LR,
        eps=EPS,
        weight_decay=WEIGHT_DECAY if case.decay != WeightDecayMode.NONE else 0.0,
        weight_decay_mode=case.decay,
        gradient_clipping=case.clip,
        max_gradient=MAX_GRADIENT,
        pooling_mode=PoolingMode.MEAN if pooling == "mean" else PoolingMode.SUM,
    )
    for t, w in zip(tables, tbe.split_embedding_weights(), strict=True):
        w.copy_(rows[t])
    outputs = []
    for batch in batches:
        lengths = torch.cat(batch.lengths)
        out = tbe(
            torch.cat(batch.rows),
            torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)]),
            per_sample_weights=torch.cat(batch.weights) if pooling == "weighted" else None,
        )
        out.backward(batch.grad)
        outputs.append(out.detach())
    state = {t: {} for t in tables}
    if case.optimizer == EmbOptimType.EXACT_ROWWISE_ADAGRAD:
        for t, (momentum,) in zip(tables, tbe.split_optimizer_states(), strict=True):
            state[t]["momentum1"] = momentum.clone()
    weights = tbe.split_embedding_weights()
    return {"outputs": outputs, "rows": dict(zip(tables, weights, strict=True)), "state": state}


# ----------------------------------------------------------- the KV tables
def _spy_backward(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts the fused backward calls that reach the native library and the Triton
    kernels (the narrowest entry of each backend's backward)."""
    from torchrec_kvemb.kernels import group_pooled

    calls = {"native": 0, "triton": 0}

    def counted(backend, real):
        def spy(*args, **kwargs):
            calls[backend] += 1
            return real(*args, **kwargs)

        return spy

    monkeypatch.setattr(
        native, "fused_backward_group", counted("native", native.fused_backward_group)
    )
    monkeypatch.setattr(
        group_pooled,
        "group_fused_backward_triton",
        counted("triton", group_pooled.group_fused_backward_triton),
    )
    return calls


def kv_run(
    backend: str, case: Case, pooling: str, batches: list[Batch], rows: dict, monkeypatch
) -> dict:
    """Outputs per step, rows (``find``) and optimizer state (``export``) of the
    KV collection trained on ``batches`` on ``backend``; rows and state of the ids
    it stores (the ``inserted`` ones and those the batches read)."""
    calls = _spy_backward(monkeypatch)
    ebc = make_ebc({t: w.shape[1] for t, w in rows.items()}, case, pooling)
    for t in TABLES:
        ebc.table(t).insert(raw_ids(t)[inserted(t)], rows[t][inserted(t)])
    outputs = []
    for batch in batches:
        kjt = KeyedJaggedTensor.from_lengths_sync(
            keys=FEATURES,
            values=torch.cat([raw_ids(table_of(f))[r] for f, r in zip(FEATURES, batch.rows)]),
            lengths=torch.cat(batch.lengths),
            weights=torch.cat(batch.weights) if pooling == "weighted" else None,
        )
        out = ebc(kjt).values()
        out.backward(batch.grad)
        outputs.append(out.detach())
    want_calls = {"native": 0, "triton": 0}
    if backend != "torch":
        want_calls[backend] = STEPS  # one group
    assert calls == want_calls, f"the {backend} backend's backward did not run: {calls}"
    found_rows, state = {}, {}
    for t in TABLES:
        table = ebc.table(t)
        m = table.metrics()
        assert m["evictions"] == 0 and m["insert_failures"] == 0, m
        stored = stored_ids(t, batches)
        found_rows[t], found = table.find(raw_ids(t))
        assert torch.equal(found, stored), f"table {t} holds other ids"
        export = table.export()
        assert torch.equal(export["ids"], raw_ids(t)[stored]), f"table {t} exports other ids"
        state[t] = {k: v for k, v in export.items() if k in STATE_NAMES}
    return {"outputs": outputs, "rows": found_rows, "state": state}


def stored_ids(table: str, batches: list[Batch]) -> torch.Tensor:
    """Which of the table's ids the KV table holds after ``batches``."""
    stored = inserted(table).clone()
    for batch in batches:
        stored[batch.read(table)] = True
    return stored


# ----------------------------------------------------------------------- tests
def assert_matches(got: dict, want: dict, stored: dict[str, torch.Tensor], what: str) -> None:
    """KV results (rows of stored ids, state of stored ids in id order) against a
    reference's (every id)."""
    for step, (a, b) in enumerate(zip(got["outputs"], want["outputs"], strict=True)):
        _assert_close(a, b, f"{what}: output {step}")
    for t in TABLES:
        _assert_close(got["rows"][t][stored[t]], want["rows"][t][stored[t]], f"{what}: rows of {t}")
        assert got["state"][t].keys() == want["state"][t].keys(), (what, t)
        for name, value in want["state"][t].items():
            _assert_close(got["state"][t][name], value[stored[t]], f"{what}: {name} of {t}")


def _assert_close(got: torch.Tensor, want: torch.Tensor, label: str) -> None:
    # float32 after three steps; the backends sum a row's gradient in their own order
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m: f"{label}: {m}")


@pytest.mark.parametrize("backend", list(BACKENDS))
@pytest.mark.parametrize("case,pooling", CASE_POOLINGS, ids=[f"{c}-{p}" for c, p in CASE_POOLINGS])
def test_fused_optimizer_matches_outside_reference(case, pooling, backend, monkeypatch):
    if backend == "native":
        assert native.available(), native.unavailable_reason()  # make test builds it
    config = CASES[case]
    dims = DIMS[config.reference]
    batches = make_batches(dims)
    rows = initial_rows(dims)
    reference = fbgemm_reference if config.reference == "fbgemm" else torch_reference
    want = reference(config, pooling, batches, rows)
    monkeypatch.setenv(ENV_VAR, BACKENDS[backend])
    got = kv_run(backend, config, pooling, batches, rows, monkeypatch)
    stored = {t: stored_ids(t, batches) for t in TABLES}
    assert all(bool((~s).any()) and bool((s & ~inserted(t)).any()) for t, s in stored.items())
    assert_matches(got, want, stored, f"{case} {pooling} on {backend} against {config.reference}")


@pytest.mark.parametrize("pooling", POOLINGS)
@pytest.mark.parametrize("case", [c for c, v in CASES.items() if v.reference == "fbgemm"])
def test_torch_references_match_fbgemm(case, pooling):
    """Where FBGEMM's CPU TBE computes the update (row-wise Adagrad with weight decay
    and clipping included: FBGEMM clamps the gradient of the pooled output, bag by
    bag, before it reaches the rows), the torch references compute the same."""
    dims = DIMS["fbgemm"]
    batches = make_batches(dims)
    rows = initial_rows(dims)
    want = fbgemm_reference(CASES[case], pooling, batches, rows)
    got = torch_reference(CASES[case], pooling, batches, rows)
    every = {t: torch.ones(n, dtype=torch.bool) for t, (_, n) in TABLES.items()}
    assert_matches(got, want, every, f"torch reference of {case} {pooling}")
