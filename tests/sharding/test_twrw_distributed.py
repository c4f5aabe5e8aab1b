"""Table-row-wise KV tables: real torchrun jobs (gloo, CPU).

One train job of 4 processes standing for 2 nodes x 2 local ranks (one
``torchrun --nproc_per_node 4`` whose workers set ``LOCAL_WORLD_SIZE=2`` before
the process group starts) checks training against the unsharded collection,
the stock planner proposing table-row-wise, and saves a checkpoint that it
loads row-wise; a 3-process job and this process load that checkpoint too.
The train job also trains a sequence collection of table-row-wise KV tables.
The jobs write their figures to JSON (see ``twrw_worker.py``); the assertions
are here.
"""

import json
from pathlib import Path

import pytest

from tests.sharding import twrw_worker
from tests.torchrun_jobs import assert_scenarios_passed, read_result, run_job, torchrun_command
from torchrec_kvemb import checkpoint

WORKER = "tests.sharding.twrw_worker"


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, dict]:
    """The train job's directory (``ckpt``, ``expected.pt``) and its result."""
    directory = tmp_path_factory.mktemp("twrw")
    job = run_job(torchrun_command(4, "-m", WORKER, "train", str(directory)))
    result = read_result(directory / "train.json", job)
    assert result["world_size"] == 4
    assert_scenarios_passed(
        result,
        job,
        {
            "twrw_training",
            "planner",
            "load_row_wise",
            "load_swapped_nodes",
            "sequence_twrw",
            "sequence_dedup",
        },
    )
    return directory, result


def test_training_matches_unsharded_on_two_nodes(trained):
    scenario = trained[1]["scenarios"]["twrw_training"]
    assert scenario["plan"]["ebc.user"] == "table_row_wise/customized_kernel ranks=[2, 3]"
    assert scenario["plan"]["ebc.item"] == "table_row_wise/customized_kernel ranks=[0, 1]"
    for name in (
        "train outputs",
        "eval outputs",
        "rows",
        "optimizer state",
        "stock outputs (step 0)",
    ):
        assert name in scenario["max_abs_diff"]
    for check in ("user ids on their local rank", "item optimizer state ids", "user same scores"):
        assert scenario["checks"][check]


def test_sequence_tables_match_unsharded_on_two_nodes(trained):
    scenario = trained[1]["scenarios"]["sequence_twrw"]
    assert scenario["plan"]["ec.item"] == "table_row_wise/customized_kernel ranks=[2, 3]"
    assert scenario["plan"]["ec.user"] == "table_row_wise/customized_kernel ranks=[0, 1]"
    assert scenario["plan"]["ec.stock"] == "table_wise/fused ranks=[3]"
    figures = {
        "outputs",
        "sequence rows",
        "sequence optimizer state",
        "sequence stock outputs (step 0)",
    }
    assert figures <= set(scenario["max_abs_diff"])
    for check in (
        "item ids on their local rank",
        "output lengths",
        "sequence user weights loaded table-wise",
    ):
        assert scenario["checks"][check]


def test_sequence_tables_under_index_dedup(trained):
    scenario = trained[1]["scenarios"]["sequence_dedup"]
    assert scenario["checks"]["dedup user ids"] and scenario["checks"]["dedup item scores"]
    assert {"outputs", "dedup rows"} <= set(scenario["max_abs_diff"])


def test_planner_proposes_table_row_wise(trained):
    plan = trained[1]["scenarios"]["planner"]["plan"]
    assert {plan["ebc.user"].split(" ")[0], plan["ebc.item"].split(" ")[0]} == {
        "table_row_wise/customized_kernel"
    }


def test_checkpoint_loads_row_wise_at_four(trained):
    scenario = trained[1]["scenarios"]["load_row_wise"]
    assert scenario["checks"]["row_wise: user weights"]
    assert "after load outputs" in scenario["max_abs_diff"]
    marker = checkpoint.read_marker(trained[0] / "ckpt")
    assert {t["sharding"] for t in marker["tables"].values()} == {"table_row_wise"}


def test_checkpoint_loads_table_row_wise_on_the_other_nodes(trained):
    scenario = trained[1]["scenarios"]["load_swapped_nodes"]
    assert scenario["plan"]["ebc.user"] == "table_row_wise/customized_kernel ranks=[0, 1]"
    assert scenario["checks"]["swapped nodes: item weights"]


def test_checkpoint_loads_at_three(trained):
    directory = trained[0]
    job = run_job(torchrun_command(3, "-m", WORKER, "load", str(directory)))
    result = read_result(directory / "load.json", job)
    assert_scenarios_passed(result, job, {"load"})
    checks = result["scenarios"]["load"]["checks"]
    assert checks["3 ranks: user weights"] and checks["3 ranks: item momentum1"]
    assert checks["sequence 3 ranks: user weights"] and checks["sequence 3 ranks: item scores"]
    plan = result["scenarios"]["load"]["plan"]
    assert plan["ec.user"] == "table_row_wise/customized_kernel ranks=[0, 1, 2]"


def test_checkpoint_loads_unsharded(trained):
    result = twrw_worker.load_unsharded(str(trained[0]))
    print(json.dumps(result, indent=1, sort_keys=True))
    assert result["passed"]
    assert result["checks"]["unsharded: user admission_counts"]
    assert result["checks"]["sequence unsharded: item weights"]
