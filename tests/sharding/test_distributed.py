"""Sharded KV training equals unsharded training: real torchrun jobs (gloo, CPU).

One job per world size runs every scenario of ``dist_worker`` in sequence
(one process group, so the job stays short); rank 0 writes per-scenario
figures to a JSON file that this test reads, prints and checks.
"""

import json

import pytest

from tests.torchrun_jobs import read_result, run_job, torchrun_command

WORKER = "tests.sharding.dist_worker"
SCENARIOS = {
    "kv_row_wise",
    "kv_table_wise",
    "weighted_row_wise",
    "weighted_table_wise",
    "mixed_stock_planner",
    "lr_change",
    "train_pipeline",
}


@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_training_matches_unsharded(world_size, tmp_path):
    result_path = tmp_path / "result.json"
    job = run_job(torchrun_command(world_size, "-m", WORKER, str(result_path)))
    result = read_result(result_path, job)
    assert result["world_size"] == world_size
    failed = {
        name: {k: v for k, v in r.items() if k != "plan"}
        for name, r in result["scenarios"].items()
        if not r["passed"]
    }
    assert not failed, json.dumps(failed, indent=1)
    assert set(result["scenarios"]) == SCENARIOS
    assert job.returncode == 0, job.stderr[-6000:]
