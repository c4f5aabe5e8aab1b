"""examples/train_sequence.py end to end (torchrun, 2 processes, gloo): KV sequence
embeddings trained row-wise, evaluated, saved, and reloaded at world size 1."""

import pytest

from tests.examples.helpers import EXAMPLES, run_example
from tests.torchrun_jobs import torchrun_command

SCRIPT = str(EXAMPLES / "train_sequence.py")
TINY = ["--steps", "12", "--batch-size", "32", "--eval-batches", "2", "--log-every", "4"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_train_sequence_round_trip(tmp_path, dtype):
    workdir = tmp_path / "seq"
    job = run_example(
        torchrun_command(
            2, SCRIPT, "--workdir", str(workdir), "--weights-dtype", dtype,
            "--kv-capacity", "256", *TINY,
        )
    )  # fmt: skip
    assert f"row_wise / customized_kernel on ranks [0, 1], {dtype} rows" in job.stdout
    assert "trained 12 steps x 2 ranks x 32 sessions" in job.stdout
    for word in ("loss=", "rows=", "load=", "hit=", "evict="):
        assert word in job.stderr, word  # rank 0's progress bar
    assert "held-out eval, reloaded (world size 1):" in job.stdout
    assert "MATCH: the reloaded model's evaluation matches the sharded model's" in job.stdout
    assert (workdir / "ckpt" / "COMPLETE").exists()
