"""Resharding KV tables in place equals resharding through a checkpoint: one torchrun
job of 3 gloo ranks (``reshard_worker``), plus the refused plans and a failure on
the way that changes nothing; one of 4 ranks as 2 nodes of 2 (``reshard_twrw_worker``)
for table-row-wise tables, bags and sequences."""

from tests.torchrun_jobs import assert_scenarios_passed, read_result, run_job, torchrun_command

WORKER = "tests.sharding.reshard_worker"
TWRW_WORKER = "tests.sharding.reshard_twrw_worker"


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


def test_reshard_table_row_wise_in_place_matches_checkpoint_round_trip(tmp_path):
    out = tmp_path / "result.json"
    job = run_job(torchrun_command(4, "-m", TWRW_WORKER, str(out), str(tmp_path)))
    result = read_result(out, job)
    assert result["world_size"] == 4
    assert_scenarios_passed(result, job, {"bags", "sequences"})
    checks = result["scenarios"]["bags"]["checks"]
    # Every change of the bag scenario was made and checked.
    for table, ranks in {"a": "[2, 3]", "b": "[0, 1, 2, 3]", "c": "[0, 1]", "d": "[1]"}.items():
        assert checks[f"bags after: {table} shards on {ranks}"]
        assert checks[f"bags after: {table} ids on their owner"]
    assert checks["bags after: e shards on [2, 3]"]
    assert checks["bags before: e shards on [0, 1]"]
    assert checks["twrw not on one node refused"]
    assert checks["column-wise refused, saying why"]
    sequence_checks = result["scenarios"]["sequences"]["checks"]
    assert sequence_checks["sequences after: c shards on [0, 1]"]
    assert sequence_checks["sequences: outputs a"]
