"""TorchRec's ``PrefetchTrainPipelineSparseDist`` reaches the SSD tiers of sharded KV
tables (bags row-wise with and without ``use_index_dedup``, sequences table-wise,
2 gloo ranks): prefetch hits on every tiered table under the pipeline, outputs and
rows equal the plain loop's (``prefetch_worker``)."""

from tests.ssd import prefetch_worker as worker
from tests.torchrun_jobs import assert_scenarios_passed, read_result, run_job, torchrun_command


def test_prefetch_pipeline_reaches_every_tiered_table(tmp_path):
    result_path = tmp_path / "result.json"
    job = run_job(
        torchrun_command(2, "-m", "tests.ssd.prefetch_worker", str(result_path), str(tmp_path))
    )
    result = read_result(result_path, job)
    assert_scenarios_passed(result, job, set(worker.SCENARIOS))
