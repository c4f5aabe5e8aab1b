"""KV tables under 2D parallelism: one torchrun job of 4 gloo processes (2 replica
groups x 2 sharding ranks) runs every scenario of ``replica_2d_worker``."""

from tests.torchrun_jobs import assert_scenarios_passed, read_result, run_job, torchrun_command

WORKER = "tests.sharding.replica_2d_worker"
SCENARIOS = {
    "sgd_global_batch_row_wise",
    "sgd_global_batch_table_wise",
    "sequence_row_wise",
    "eviction_pressure",
}


def test_replicas_synced_by_id(tmp_path):
    result_path = tmp_path / "result.json"
    job = run_job(torchrun_command(4, "-m", WORKER, str(result_path)))
    result = read_result(result_path, job)
    assert result["world_size"] == 4
    assert_scenarios_passed(result, job, SCENARIOS)
    # the pressure was real: the merged ranking evicted ids
    assert result["scenarios"]["eviction_pressure"]["sync_evictions"] > 0
