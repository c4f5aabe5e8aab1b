"""The plain ``torch.distributed.checkpoint`` recipe for models with KV tables
(docs/checkpoint-format.md, "Recipes"): ``dcp.save`` of ``model.state_dict()`` and
``fused_optimizer.state_dict()``, ``dcp.load`` with ``checkpoint.KVLoadPlanner()``
into a freshly built model, then ``load_state_dict`` of both. Without the planner
DCP's default planner refuses it with its own size-mismatch error (a KV table's
entries are as long as the table is full). The two-rank job also runs the recipe
through torch's ``get_model_state_dict`` / ``set_model_state_dict`` (one process:
test_torch_state_dict_api.py). One process (world size 1, and
unsharded), and two ranks with torchrun (``plain_dcp_worker.py``)."""

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tests.checkpoint.test_optimizer_state import kv, sharded, stock_rows, train
from tests.checkpoint.test_state_dict import assert_same, build, snapshot
from tests.checkpoint.test_state_dict import train as train_unsharded
from tests.torchrun_jobs import read_result, run_job, torchrun_command
from torchrec_kvemb import checkpoint

WORKER = "tests.checkpoint.plain_dcp_worker"


def run_plain_dcp_job(directory: Path, sharding: str) -> dict:
    job = run_job(torchrun_command(2, "-m", WORKER, str(directory), sharding), timeout=300)
    result = read_result(directory / f"plain_dcp_{sharding}.json", job)
    assert job.returncode == 0, job.stderr[-6000:]
    return result


@pytest.mark.parametrize("sharding", ["row_wise", "table_wise"])
def test_two_ranks(sharding, tmp_path):
    result = run_plain_dcp_job(tmp_path, sharding)
    assert "error" not in result, result["error"]
    failed = [name for name, ok in result["checks"].items() if not ok]
    assert not failed, failed
    for check in (
        "fused load by id: ebc.embedding_bags.user momentum1",
        "fused load by id: kv.embedding_bags.item exp_avg",
        "other ids refused",
        "other sharding refused",
        "plain recipe without the planner: DCP's size mismatch",
        "plain DCP: continued dense",
        "plain DCP: continued: ebc.embedding_bags.user momentum1",
        "plain DCP: continued: kv.embedding_bags.item exp_avg_sq",
        "plain DCP: continued stock momentum",
        "torch helpers: no missing or unexpected keys",
        "torch helpers: loaded: kv.embedding_bags.item exp_avg",
        "torch helpers: continued dense",
        "torch helpers: continued: ebc.embedding_bags.user momentum1",
        "torch helpers: continued stock momentum",
    ):
        assert check in result["checks"], check
    assert result["passed"]


# ------------------------------------------------------------ one process
def save_plain(model, path) -> None:
    dcp.save(
        {"model": model.state_dict(), "optim": model.fused_optimizer.state_dict()},
        checkpoint_id=path,
    )


def test_without_the_planner_dcp_refuses_with_its_size_mismatch(one_rank, tmp_path):
    """DCP checks every entry's saved size against the given one before any other
    code runs; no extension point lets an entry learn the saved size sooner."""
    model = sharded("adagrad", "row_wise")
    train(model, range(3))
    save_plain(model, tmp_path / "plain")
    fresh = sharded("adagrad", "row_wise")
    target = {"model": fresh.state_dict(), "optim": fresh.fused_optimizer.state_dict()}
    with pytest.raises(CheckpointException, match="Size mismatch"):
        dcp.load(target, checkpoint_id=tmp_path / "plain")


@pytest.mark.parametrize("sharding", ["row_wise", "table_wise"])
def test_with_the_planner_training_resumes_bit_identically(sharding, one_rank, tmp_path):
    model = sharded("adam", sharding)
    train(model, range(4))
    save_plain(model, tmp_path / "plain")
    fresh = sharded("adam", sharding)
    target = {"model": fresh.state_dict(), "optim": fresh.fused_optimizer.state_dict()}
    dcp.load(target, checkpoint_id=tmp_path / "plain", planner=checkpoint.KVLoadPlanner())
    fresh.load_state_dict(target["model"])
    fresh.fused_optimizer.load_state_dict(target["optim"])
    assert_same(snapshot(kv(fresh)), snapshot(kv(model)))
    for a, b in zip(train(model, range(4, 7)), train(fresh, range(4, 7)), strict=True):
        assert torch.equal(a, b)
    assert_same(snapshot(kv(fresh)), snapshot(kv(model)))
    for name, value in stock_rows(model).items():
        assert torch.equal(stock_rows(fresh)[name], value), name


def test_unsharded_without_a_process_group(tmp_path):
    ebc = build()
    train_unsharded(ebc, range(3))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that there is no process group
        dcp.save({"model": ebc.state_dict()}, checkpoint_id=tmp_path / "plain", no_dist=True)
        fresh = build()
        target = {"model": fresh.state_dict()}
        dcp.load(
            target,
            checkpoint_id=tmp_path / "plain",
            planner=checkpoint.KVLoadPlanner(),
            no_dist=True,
        )
    fresh.load_state_dict(target["model"])
    assert_same(snapshot(fresh), snapshot(ebc))
