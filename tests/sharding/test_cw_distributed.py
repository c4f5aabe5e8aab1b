"""Column-wise KV tables (bags and sequences): torchrun twins on gloo (2 and 3 ranks)
against unsharded collections, and their checkpoint loaded at 1 and 3 processes and
into row-wise.

Two jobs (``tests/sharding/cw_worker.py``): 2 ranks train the twins and save a
checkpoint; 3 ranks train them too and load the 2-rank checkpoint column-wise,
row-wise, table-wise and unsharded. This process then loads it at world size 1.
"""

import pytest
import torch
from fbgemm_gpu.split_embedding_configs import EmbOptimType

from tests.sharding.cw_worker import CONFIGS, LOAD_OPTIONS, EBCModel
from tests.torchrun_jobs import assert_scenarios_passed, read_result, run_job, torchrun_command
from torchrec_kvemb import KVEmbeddingBagCollection, checkpoint

WORKER = "tests.sharding.cw_worker"


@pytest.fixture(scope="module")
def saved_by_two_ranks(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("cw2")
    out = work / "result.json"
    job = run_job(torchrun_command(2, "-m", WORKER, str(out), str(work)))
    return {"work": work, "job": job, "result": read_result(out, job)}


def test_two_ranks_match_the_unsharded_twins(saved_by_two_ranks) -> None:
    run = saved_by_two_ranks
    assert run["result"]["world_size"] == 2
    assert_scenarios_passed(run["result"], run["job"], {"adam", "rowwise_adagrad", "sequence"})
    # Bit for bit at 2 ranks (gradient division by 2 is exact).
    scenarios = run["result"]["scenarios"]
    assert scenarios["adam"]["max_abs_diff"] == {"adam state": 0.0, "outputs": 0.0, "rows": 0.0}
    assert set(scenarios["sequence"]["max_abs_diff"].values()) == {0.0}


def test_three_ranks_match_and_load_the_two_rank_checkpoint(saved_by_two_ranks, tmp_path) -> None:
    out = tmp_path / "result.json"
    job = run_job(
        torchrun_command(3, "-m", WORKER, str(out), str(tmp_path), str(saved_by_two_ranks["work"]))
    )
    result = read_result(out, job)
    assert result["world_size"] == 3
    assert_scenarios_passed(result, job, {"adam", "rowwise_adagrad", "sequence", "load"})


def test_checkpoint_loads_in_one_process(saved_by_two_ranks) -> None:
    """World size 1, no process group: the unsharded collection gets every saved row."""
    work = saved_by_two_ranks["work"]
    twin = torch.load(work / "twin.pt")
    fused = {"optimizer": EmbOptimType.ADAM, "learning_rate": 0.05}
    model = EBCModel(KVEmbeddingBagCollection(CONFIGS, LOAD_OPTIONS, fused_params=fused))
    checkpoint.load(model, str(work / "cw_ckpt"))
    for name, want in twin.items():
        got = model.ebc.table(name).export()
        assert torch.equal(got["ids"], want["ids"]), name
        assert torch.equal(got["scores"], want["scores"]), name
        for key in ("weights", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got[key], want[key]), (name, key)
