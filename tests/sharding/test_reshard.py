"""Resharding KV tables in place equals resharding through a checkpoint: one torchrun
job of 3 gloo ranks (``reshard_worker``), plus the refused plans and a failure on
the way that changes nothing."""

from tests.torchrun_jobs import assert_scenarios_passed, read_result, run_job, torchrun_command

WORKER = "tests.sharding.reshard_worker"


def test_reshard_in_place_matches_checkpoint_round_trip(tmp_path):
    out = tmp_path / "result.json"
    job = run_job(torchrun_command(3, "-m", WORKER, str(out), str(tmp_path)))
    result = read_result(out, job)
    assert result["world_size"] == 3
    assert_scenarios_passed(
        result,
        job,
        {
            "in_place_vs_checkpoint",
            "bad_plans",
            "failure_midway",
            "kv_collection_module",
            "sequence_collection",
        },
    )
