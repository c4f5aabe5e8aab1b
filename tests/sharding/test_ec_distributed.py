"""Sharded KV sequence embeddings equal unsharded ones: real torchrun jobs (gloo, CPU).

One job per world size runs every scenario of ``ec_dist_worker``; then a
checkpoint saved by 2 row-wise ranks is loaded at 3 ranks (row-wise and
table-wise) and into the unsharded ``KVEmbeddingCollection`` in this process.
"""

import json
from pathlib import Path

import pytest
import torch

from tests.sharding import ec_dist_worker as worker
from tests.torchrun_jobs import read_result, run_job, torchrun_command
from torchrec_kvemb import KVEmbeddingCollection, checkpoint

WORKER = "tests.sharding.ec_dist_worker"


def failures(result: dict) -> dict:
    return {name: r for name, r in result["scenarios"].items() if not r["passed"]}


@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_sequence_training_matches_unsharded(world_size, tmp_path):
    result_path = tmp_path / "result.json"
    job = run_job(torchrun_command(world_size, "-m", WORKER, str(result_path)))
    result = read_result(result_path, job)
    assert result["world_size"] == world_size
    assert not failures(result), json.dumps(failures(result), indent=1)
    assert set(result["scenarios"]) == set(worker.SCENARIOS)
    assert job.returncode == 0, job.stderr[-6000:]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("ec_ckpt")
    result_path = directory / "save.json"
    job = run_job(torchrun_command(2, "-m", WORKER, str(result_path), str(directory), "save"))
    result = read_result(result_path, job)
    assert not failures(result), json.dumps(failures(result), indent=1)
    assert job.returncode == 0, job.stderr[-6000:]
    return directory


def test_checkpoint_from_two_ranks_loads_at_three(saved):
    result_path = saved / "load3.json"
    job = run_job(torchrun_command(3, "-m", WORKER, str(result_path), str(saved), "load"))
    result = read_result(result_path, job)
    assert set(result["scenarios"]) == {"load_row_wise", "load_table_wise"}
    assert not failures(result), json.dumps(failures(result), indent=1)
    assert job.returncode == 0, job.stderr[-6000:]


def test_checkpoint_from_two_ranks_loads_unsharded(saved):
    model = worker.ECModel(
        KVEmbeddingCollection(worker.kv_configs(), worker.OPTIONS, fused_params=worker.ADAGRAD)
    )
    checkpoint.load(model, saved / "ckpt")
    want = torch.load(saved / "expected.pt")
    for name, table in model.ec.kv_tables().items():
        got = table.export()
        order = torch.argsort(got["ids"])
        assert torch.equal(got["ids"][order], want[name]["ids"]), name
        assert torch.equal(got["scores"][order], want[name]["scores"]), name
        for key in want[name]:
            if key not in ("ids", "scores"):
                torch.testing.assert_close(got[key][order], want[name][key], atol=1e-5, rtol=0)
