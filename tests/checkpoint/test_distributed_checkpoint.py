"""Checkpoints across world sizes and sharding types: real torchrun jobs (gloo, CPU).

One save job (2 ranks, KV tables row-wise, their learning rates changed during
training; it ends by killing rank 0 in the middle of a second save), then loads
of its checkpoint at 3 ranks row-wise, 2 ranks table-wise (each also re-saves and
loads into the other sharding type) and 1 process unsharded (in this process).
The jobs write their figures to JSON (see ``ckpt_worker.py``); the assertions
are here.
"""

import json
import subprocess
import warnings
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp

from tests.checkpoint import ckpt_worker
from tests.torchrun_jobs import read_result, run_job, torchrun_command
from torchrec_kvemb import checkpoint

WORKER = "tests.checkpoint.ckpt_worker"


def torchrun(world_size: int, *args: str) -> subprocess.CompletedProcess:
    return run_job(torchrun_command(world_size, "-m", WORKER, *args))


def assert_passed(result: dict) -> None:
    assert "error" not in result, result["error"]
    failed = [name for name, ok in result["checks"].items() if not ok]
    assert not failed, failed
    too_far = {k: v for k, v in result["max_abs_diff"].items() if v > ckpt_worker.TOL}
    assert not too_far, too_far
    assert result["passed"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """The save job's directory: ``ckpt`` (complete), ``killed`` (rank 0 killed
    before the marker), ``expected.pt``, ``save.json``."""
    directory = tmp_path_factory.mktemp("ckpt")
    job = torchrun(2, "save", str(directory))
    result = read_result(directory / "save.json", job)
    assert_passed(result)
    # The job ends with rank 0 SIGKILLed in the middle of the second save.
    assert job.returncode != 0
    return directory


def test_save_at_two_ranks_row_wise(saved):
    marker = checkpoint.read_marker(saved / "ckpt")
    assert marker["world_size"] == 2
    tables = marker["tables"]
    assert set(tables) == set(ckpt_worker.KV_TABLES)
    assert tables["ebc.embedding_bags.user"]["optimizer"] == "rowwise_adagrad"
    assert tables["kv.embedding_bags.item"]["optimizer"] == "adam"
    assert {t["sharding"] for t in tables.values()} == {"row_wise"}
    assert marker["fingerprint"] == checkpoint.fingerprint(tables)
    # The KV tables' learning rates when saved: one entry per table, any DCP reader.
    lrs = {f"fused_optim.param_groups.{prefix}.weight.lr": None for prefix in tables}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP warns that there is no process group
        dcp.load(lrs, storage_reader=dcp.FileSystemReader(saved / "ckpt"), no_dist=True)
    assert lrs == {
        f"fused_optim.param_groups.{prefix}.weight.lr": lr
        for prefix, lr in ckpt_worker.CHANGED_LR.items()
    }


def test_rank_killed_mid_save_leaves_an_incomplete_checkpoint(saved):
    killed = saved / "killed"
    # Every rank's data files and DCP's metadata are there; the marker is not.
    assert (killed / ".metadata").exists()
    assert {p.name.split("_")[2] for p in killed.glob("*.distcp")} == {"0", "1"}  # __<rank>_<n>
    assert not (killed / checkpoint.MARKER).exists()
    with pytest.raises(checkpoint.CheckpointError, match="incomplete"):
        checkpoint.read_marker(killed)
    assert not list(saved.glob("ckpt.tmp-*"))


@pytest.mark.parametrize("world_size, sharding", [(3, "row_wise"), (2, "table_wise")])
def test_load_at_another_world_size_and_sharding(saved, world_size, sharding):
    job = torchrun(world_size, "load", str(saved), sharding)
    result = read_result(saved / f"load_{world_size}_{sharding}.json", job)
    assert_passed(result)
    assert result["world_size"] == world_size
    checks = result["checks"]
    for check in (
        "incomplete checkpoint refused",
        "other dim refused",
        "loaded: stock rows",
        "loaded: stock momentum",
        "loaded: optimizer exp_avg",
        "resharded: stock rows",
        "user planned " + sharding,
        "item planned " + sharding,
        "export_dense: stored rows",
        "export_dense: initial rows",
        "load_dense_into_kv: rows",
    ):
        assert check in checks
    if sharding == "table_wise":
        assert "other optimizer refused" in checks
    for prefix in ckpt_worker.KV_TABLES:
        assert f"loaded: {prefix} learning rate" in checks
        assert f"resharded: {prefix} learning rate" in checks
    assert any(c.startswith("loaded: ebc.embedding_bags.user momentum1") for c in checks)
    assert any(c.startswith("resharded: kv.embedding_bags.item exp_avg") for c in checks)
    assert job.returncode == 0, job.stderr[-6000:]


def test_load_unsharded(saved):
    result = ckpt_worker.load_job(str(saved), None)
    print(json.dumps(result, indent=1, sort_keys=True))
    assert_passed(result)
    assert "other optimizer refused" in result["checks"]
    for prefix in ckpt_worker.KV_TABLES:
        assert f"loaded: {prefix} learning rate" in result["checks"]
    assert "continued: outputs" in result["max_abs_diff"]
