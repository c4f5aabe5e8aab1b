"""TorchRec's own sharding harness (``sharding_single_rank_test`` with the sequence test
model ``TestMixedEmbeddingSparseArch``, from the installed
``torchrec.distributed.test_utils``) with the KV sequence sharder on 2 gloo ranks:
KV tables row-wise or table-wise, one of them reading the features of two others
(outputs ``feature@table``), a stock table beside them; one SGD step of the sharded
model, predictions compared by the harness with TorchRec's unsharded model. One
torchrun job per sharding (the harness makes a process group per call).
Adaptations: ``tests/sharding/ec_harness_worker.py``."""

import pytest

from tests.torchrun_jobs import read_result, run_job, torchrun_command


@pytest.mark.parametrize("sharding", ["row_wise", "table_wise"])
def test_torchrec_sequence_harness_passes_with_the_kv_sharder(sharding, tmp_path):
    out = tmp_path / "result.json"
    job = run_job(torchrun_command(2, "-m", "tests.sharding.ec_harness_worker", str(out), sharding))
    result = read_result(out, job)
    assert result == {sharding: "passed"}, result[sharding]
    assert job.returncode == 0, job.stderr[-6000:]
