"""Sharded KV training equals unsharded training: real torchrun jobs (gloo, CPU).

One job per world size runs every scenario of ``dist_worker.py`` in sequence
(one process group, so the job stays short); rank 0 writes per-scenario
figures to a JSON file that this test reads, prints and checks.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("dist_worker.py")
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
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world_size}",
        str(WORKER),
        str(result_path),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    job = subprocess.run(command, capture_output=True, text=True, timeout=240, env=env)
    if not result_path.exists():
        pytest.fail(f"the job wrote no result (exit {job.returncode}):\n{job.stderr[-6000:]}")
    result = json.loads(result_path.read_text())
    print(json.dumps(result, indent=1, sort_keys=True))
    assert result["world_size"] == world_size
    failed = {
        name: {k: v for k, v in r.items() if k != "plan"}
        for name, r in result["scenarios"].items()
        if not r["passed"]
    }
    assert not failed, json.dumps(failed, indent=1)
    assert set(result["scenarios"]) == SCENARIOS
    assert job.returncode == 0, job.stderr[-6000:]
