"""``apply_optimizer_in_backward`` on an unsharded KV collection works as on a stock one.

torch's ``_apply_optimizer_in_backward`` (``torchrec.optim.apply_optimizer_in_backward``)
marks a KV table's placeholder weight as it marks a stock table's; the table then runs
that optimizer, translated as TorchRec's sharders translate it
(``fused_params_of_torch_optimizer``). Checked here:

* bags and sequences marked with ``torchrec.optim.RowWiseAdagrad``, ``torch.optim.SGD``
  and ``torch.optim.Adam`` (with kwargs) train bit for bit as the same collection given
  ``fused_params_of_torch_optimizer(...)`` (outputs, rows, optimizer state, state_dict),
  and as a stock collection under the same marked optimizer (torch's dense update,
  which touches only the rows a batch reads for SGD and row-wise Adagrad) or, for
  Adam, FBGEMM's Adam update written out (``tests/test_optimizer_args.py``);
* a refused class names the table, at the mark, and leaves the weight unmarked;
* the collection's ``fused_params`` merge under the mark (TorchRec's rule);
* a mark that would change a trained table's optimizer is refused, and so is one
  an SSD tier's files cannot hold;
* the tables take every mark in one build, on meta too, before a load (which then
  trains on as its twin) and before ``torch.compile(fullgraph=True)``;
* the placeholder stays out of dense optimizers and adds nothing to ``state_dict``;
* under ``DistributedModelParallel`` on two ranks, a KV collection marked before
  sharding trains as the stock sharded twin (``tests/sharding/marked_optimizer_worker.py``).
"""

from __future__ import annotations

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType
from torch.distributed.optim import _apply_optimizer_in_backward
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingBagCollection, EmbeddingCollection
from torchrec.optim import RowWiseAdagrad
from torchrec.optim.apply_optimizer_in_backward import apply_optimizer_in_backward
from torchrec.optim.optimizers import in_backward_optimizer_filter

from tests.sharding import marked_optimizer_worker as worker
from tests.test_optimizer_args import (
    DIM,
    FEATURES,
    ROWS,
    _sequence_grad,
    batches,
    fbgemm_adam,
    kjt,
    start_rows,
)
from tests.torchrun_jobs import assert_scenarios_passed, read_result, run_job, torchrun_command
from torchrec_kvemb import (
    KVEmbeddingBagCollection,
    KVEmbeddingCollection,
    KVTableOptions,
    SSDOptions,
)
from torchrec_kvemb.optimizer import (
    FusedOptimConfig,
    FusedParamsError,
    OptimKind,
    fused_params_of_torch_optimizer,
)

#: optimizer class and kwargs, by case; eps given where torch's default (RowWiseAdagrad:
#: 1e-10) differs from FBGEMM's (1e-8), so that the stock dense update is an oracle
MARKS = {
    "rowwise-adagrad": (RowWiseAdagrad, {"lr": 0.2, "eps": 1e-3}),
    "torch-sgd": (torch.optim.SGD, {"lr": 0.3}),
    "torch-adam": (torch.optim.Adam, {"lr": 0.05, "betas": (0.8, 0.95), "eps": 1e-3}),
}
KINDS = ["bags", "sequences"]


def build(kind: str, fused_params: dict | None = None, tables: int = 1):
    """A KV collection of ``tables`` tables ("t", "t1", ...) reading ``FEATURES``."""
    names = ["t"] + [f"t{i}" for i in range(1, tables)]
    if kind == "bags":
        configs = [EmbeddingBagConfig(name=n, embedding_dim=DIM, num_embeddings=ROWS,
                                      feature_names=FEATURES) for n in names]  # fmt: skip
        return KVEmbeddingBagCollection(
            configs, KVTableOptions(capacity=64), fused_params=fused_params
        )
    configs = [EmbeddingConfig(name=n, embedding_dim=DIM, num_embeddings=ROWS,
                               feature_names=FEATURES) for n in names]  # fmt: skip
    return KVEmbeddingCollection(configs, KVTableOptions(capacity=64), fused_params=fused_params)


def stock(kind: str):
    """The stock collection of ``build(kind)``, starting from ``start_rows()``."""
    if kind == "bags":
        config = EmbeddingBagConfig(
            name="t", embedding_dim=DIM, num_embeddings=ROWS, feature_names=FEATURES
        )
        module = EmbeddingBagCollection([config])
        weight = module.embedding_bags["t"].weight
    else:
        config = EmbeddingConfig(
            name="t", embedding_dim=DIM, num_embeddings=ROWS, feature_names=FEATURES
        )
        module = EmbeddingCollection([config])
        weight = module.embeddings["t"].weight
    with torch.no_grad():
        weight.copy_(start_rows())
    return module, weight


def train(module, kind: str) -> list[torch.Tensor]:
    """``batches()`` through ``module``; the outputs of every step."""
    outputs = []
    for ids, lengths, grad in batches():
        if kind == "bags":
            out = module(kjt(ids, lengths)).values()
            out.backward(grad)
        else:
            result = module(kjt(ids, lengths))
            out = torch.cat([result[f].values() for f in FEATURES])
            out.backward(_sequence_grad(ids, lengths))
        outputs.append(out.detach())
    return outputs


def trained_kv(kind: str, module) -> tuple[list[torch.Tensor], torch.Tensor]:
    module.table("t").insert(torch.arange(ROWS), start_rows())
    outputs = train(module, kind)
    return outputs, module.table("t").find(torch.arange(ROWS))[0]


# ------------------------------------------------------------ unsharded
@pytest.mark.parametrize("case", list(MARKS))
@pytest.mark.parametrize("kind", KINDS)
def test_marked_trains_as_fused_params_bit_for_bit(kind: str, case: str) -> None:
    optimizer_class, kwargs = MARKS[case]
    marked = build(kind)
    _apply_optimizer_in_backward(optimizer_class, marked.parameters(), dict(kwargs))
    given = build(kind, fused_params_of_torch_optimizer(optimizer_class, kwargs))
    assert marked.table("t").optim == given.table("t").optim
    got_outputs, _ = trained_kv(kind, marked)
    want_outputs, _ = trained_kv(kind, given)
    for step, (got, want) in enumerate(zip(got_outputs, want_outputs, strict=True)):
        assert torch.equal(got, want), f"{kind} {case}: output {step}"
    got, want = marked.state_dict(), given.state_dict()
    assert list(got) == list(want)
    for key in want:
        assert torch.equal(got[key], want[key]), f"{kind} {case}: {key}"
    got_export, want_export = marked.table("t").export(), given.table("t").export()
    assert set(got_export) == set(want_export)
    for key in want_export:
        assert torch.equal(got_export[key], want_export[key]), f"{kind} {case}: export {key}"


@pytest.mark.parametrize("case", ["rowwise-adagrad", "torch-sgd"])
@pytest.mark.parametrize("kind", KINDS)
def test_marked_trains_as_the_marked_stock_collection(kind: str, case: str) -> None:
    """The stock collection runs torch's dense optimizer on the same marks: a row no
    batch reads gets a zero gradient, which changes nothing under SGD and row-wise
    Adagrad, so rows and outputs agree to float rounding."""
    optimizer_class, kwargs = MARKS[case]
    kv = build(kind)
    apply_optimizer_in_backward(optimizer_class, kv.parameters(), dict(kwargs))
    got_outputs, got_rows = trained_kv(kind, kv)
    module, weight = stock(kind)
    apply_optimizer_in_backward(optimizer_class, module.parameters(), dict(kwargs))
    want_outputs = train(module, kind)
    for step, (got, want) in enumerate(zip(got_outputs, want_outputs, strict=True)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=f"{case}: output {step}")
    torch.testing.assert_close(got_rows, weight.detach(), rtol=0, atol=1e-6, msg=case)
    assert not torch.equal(got_rows, start_rows()), "the case trained nothing"


@pytest.mark.parametrize("kind", KINDS)
def test_marked_adam_trains_as_fbgemm_adam(kind: str) -> None:
    """Dense torch Adam keeps moving rows after their last gradient; FBGEMM's (and a KV
    table's) updates only the rows a batch reads: the oracle is FBGEMM's update."""
    optimizer_class, kwargs = MARKS["torch-adam"]
    kv = build(kind)
    _apply_optimizer_in_backward(optimizer_class, kv.parameters(), dict(kwargs))
    _, rows = trained_kv(kind, kv)
    want = fbgemm_adam(0.05, (0.8, 0.95), 1e-3, pooled=kind == "bags")
    torch.testing.assert_close(rows, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_a_refused_class_names_the_table_at_the_mark(kind: str) -> None:
    kv = build(kind)
    weight = kv.table_weight("t")
    with pytest.raises(FusedParamsError, match=r"table 't'.*AdamW"):
        _apply_optimizer_in_backward(torch.optim.AdamW, kv.parameters(), {"lr": 0.1})
    # the mark is taken back whole: a later one is the weight's only optimizer
    assert weight._optimizer_classes == [] and list(weight._optimizer_kwargs) == []
    assert len(weight._in_backward_optimizers) == 1
    _apply_optimizer_in_backward(torch.optim.SGD, kv.parameters(), {"lr": 0.3})
    assert kv.table("t").optim == FusedOptimConfig(OptimKind.SGD, 0.3)


def test_a_second_optimizer_on_one_table_is_refused() -> None:
    kv = build("bags")
    _apply_optimizer_in_backward(torch.optim.SGD, kv.parameters(), {"lr": 0.3})
    with pytest.raises(FusedParamsError, match=r"table 't'.*2 optimizers"):
        _apply_optimizer_in_backward(RowWiseAdagrad, kv.parameters(), {"lr": 0.1})
    assert kv.table("t").optim == FusedOptimConfig(OptimKind.SGD, 0.3)


def test_the_collection_fused_params_merge_under_the_mark() -> None:
    """TorchRec's rule for a stock fused table: the marked class and kwargs win, the
    keys they leave out keep the collection's ``fused_params``."""
    fused = {"optimizer": EmbOptimType.ADAM, "learning_rate": 0.5, "eps": 1e-4,
             "gradient_clipping": True, "max_gradient": 0.3}  # fmt: skip
    kv = build("bags", fused)
    _apply_optimizer_in_backward(RowWiseAdagrad, kv.parameters(), {"lr": 0.2})
    want = FusedOptimConfig(
        OptimKind.ROWWISE_ADAGRAD, 0.2, eps=1e-4, gradient_clipping=True, max_gradient=0.3
    )
    assert kv.table("t").optim == want


def test_marks_of_every_table_build_the_tables_once(monkeypatch) -> None:
    kv = build("bags", tables=3)
    builds = []
    build_lookup = kv._build_lookup
    monkeypatch.setattr(kv, "_build_lookup", lambda optims: builds.append(build_lookup(optims)))
    _apply_optimizer_in_backward(RowWiseAdagrad, kv.parameters(), {"lr": 0.2})
    assert builds == []  # not yet: the tables are built again at their next use
    assert {t.optim.kind for t in kv.kv_tables().values()} == {OptimKind.ROWWISE_ADAGRAD}
    kv.kv_tables()
    assert len(builds) == 1


def test_a_mark_after_training_is_refused_unless_it_changes_nothing() -> None:
    kv = build("bags", fused_params_of_torch_optimizer(torch.optim.SGD, {"lr": 0.3}))
    train(kv, "bags")
    with pytest.raises(FusedParamsError, match=r"table 't'.*trained"):
        _apply_optimizer_in_backward(RowWiseAdagrad, kv.parameters(), {"lr": 0.2})
    assert kv.table("t").optim.kind == OptimKind.SGD
    _apply_optimizer_in_backward(torch.optim.SGD, kv.parameters(), {"lr": 0.3})
    assert kv.table("t").size > 0  # the same optimizer: the rows stay


@pytest.mark.parametrize("kind", KINDS)
def test_a_marked_collection_loads_a_checkpoint_of_its_twin(kind: str) -> None:
    """Marked before the load (the tables take the mark first, then the rows and
    Adam's moments): it goes on training as the ``fused_params`` twin it loaded."""
    optimizer_class, kwargs = MARKS["torch-adam"]
    given = build(kind, fused_params_of_torch_optimizer(optimizer_class, kwargs))
    trained_kv(kind, given)
    marked = build(kind)
    _apply_optimizer_in_backward(optimizer_class, marked.parameters(), dict(kwargs))
    marked.load_state_dict(given.state_dict())
    train(marked, kind)
    train(given, kind)
    got, want = marked.table("t").export(), given.table("t").export()
    assert set(got) == set(want) and "exp_avg" in got
    assert all(torch.equal(got[key], want[key]) for key in want)


def test_a_collection_on_meta_takes_the_mark() -> None:
    """``DistributedModelParallel`` flows build the model on meta and mark it there."""
    with torch.device("meta"):
        kv = build("bags", tables=2)
    _apply_optimizer_in_backward(torch.optim.Adam, kv.parameters(), {"lr": 0.05})
    tables = kv.kv_tables()
    assert {t.optim.kind for t in tables.values()} == {OptimKind.ADAM}
    assert {t.device.type for t in tables.values()} == {"meta"}


def test_an_ssd_table_takes_a_mark_its_files_can_hold(tmp_path) -> None:
    """An SSD tier's files are laid out for the optimizer state the table was built
    with: a mark that keeps the layout (SGD at another rate) is taken, one that
    changes it is refused naming the table and what to do."""
    configs = [EmbeddingBagConfig(name="t", embedding_dim=DIM, num_embeddings=ROWS,
                                  feature_names=FEATURES)]  # fmt: skip
    options = KVTableOptions(capacity=16, ssd=SSDOptions(path=str(tmp_path)))
    kv = KVEmbeddingBagCollection(configs, options)
    with pytest.raises(FusedParamsError, match=r"table 't'.*SSD tier.*fused_params_of_torch"):
        _apply_optimizer_in_backward(RowWiseAdagrad, kv.parameters(), {"lr": 0.2})
    _apply_optimizer_in_backward(torch.optim.SGD, kv.parameters(), {"lr": 0.3})
    train(kv, "bags")
    assert kv.table("t").optim == FusedOptimConfig(OptimKind.SGD, 0.3)
    assert kv.table("t").total_size > 0
    kv.table("t").close()


def test_a_marked_collection_compiles_as_one_graph() -> None:
    """``torch.compile(fullgraph=True)`` after the marks: the tables take them first
    (``apply_marked_optimizers``, or any eager use), then training compiles as before
    and equals eager training bit for bit."""
    optimizer_class, kwargs = MARKS["rowwise-adagrad"]
    eager, compiled = build("bags"), build("bags")
    for module in (eager, compiled):
        _apply_optimizer_in_backward(optimizer_class, module.parameters(), dict(kwargs))
    compiled.apply_marked_optimizers()
    assert compiled.table("t").optim.kind == OptimKind.ROWWISE_ADAGRAD
    torch._dynamo.reset()
    step = torch.compile(compiled, fullgraph=True, backend="eager")
    got_outputs, got_rows = trained_kv("bags", step)
    want_outputs, want_rows = trained_kv("bags", eager)
    assert all(torch.equal(g, w) for g, w in zip(got_outputs, want_outputs, strict=True))
    assert torch.equal(got_rows, want_rows)


@pytest.mark.parametrize("kind", KINDS)
def test_the_placeholder_stays_out_of_dense_optimizers_and_the_state_dict(kind: str) -> None:
    kv = build(kind)
    before = kv.state_dict()
    assert [name for name, _ in in_backward_optimizer_filter(kv.named_parameters())] == []
    _apply_optimizer_in_backward(torch.optim.SGD, kv.parameters(), {"lr": 0.01})
    assert [name for name, _ in in_backward_optimizer_filter(kv.named_parameters())] == []
    after = kv.state_dict()
    assert list(after) == list(before)  # SGD: the same entries, none for the weight
    train(kv, kind)
    assert kv.table_weight("t").grad is None
    assert kv.table_weight("t").shape == (0, DIM)


# ---------------------------------------------------------------- sharded
def test_marked_before_sharding_trains_as_the_stock_sharded_twin(tmp_path) -> None:
    # one 2-rank job: RowWiseAdagrad under sharder fused_params, torch.optim.SGD
    out = tmp_path / "result.json"
    job = run_job(torchrun_command(2, "-m", "tests.sharding.marked_optimizer_worker", str(out)))
    result = read_result(out, job)
    assert_scenarios_passed(result, job, set(worker.SCENARIOS))
    assert result["world_size"] == 2
    # the sharded KV tables run the marked optimizers (the sharders' lr 0.5 gave way)
    scenarios = result["scenarios"]
    assert scenarios["rowwise_adagrad"]["kv optimizers"] == {
        "t": ["rowwise_adagrad", 0.2],
        "s": ["rowwise_adagrad", 0.2],
    }
    assert scenarios["torch_sgd"]["kv optimizers"] == {"t": ["sgd", 0.3], "s": ["sgd", 0.3]}
