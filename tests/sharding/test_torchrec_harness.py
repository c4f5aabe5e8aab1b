"""TorchRec's own sharding harness (``sharding_single_rank_test`` with ``TestSparseNN``,
from the installed ``torchrec.distributed.test_utils``) with the KV sharder on 2 gloo
ranks: one SGD step of the sharded model, predictions compared by the harness with
TorchRec's unsharded model. One torchrun job per scenario (the harness makes a
process group per call). Adaptations: ``tests/sharding/harness_worker.py``."""

import pytest

from tests.torchrun_jobs import read_result, run_job, torchrun_command

SCENARIOS = [
    # sharding + flags: weighted tables are in every scenario
    "row_wise",
    "table_wise",
    "row_wise+mean+shared+mixed",
    "table_wise+mean+shared+mixed",
    "row_wise+in_backward",
    "table_wise+in_backward",
    # Variable batch per feature (the harness's generator). Table-wise only: the
    # row-wise reduce-scatter's backward is an uneven all-gather, which gloo
    # refuses for stock tables too (row-wise VBE: tests/sharding/test_vbe.py).
    "table_wise+vbe",
    "table_wise+vbe+mean+shared+mixed",
]


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_torchrec_harness_passes_with_the_kv_sharder(scenario, tmp_path):
    out = tmp_path / "result.json"
    job = run_job(torchrun_command(2, "-m", "tests.sharding.harness_worker", str(out), scenario))
    result = read_result(out, job)
    assert result == {scenario: "passed"}, result[scenario]
    assert job.returncode == 0, job.stderr[-6000:]
