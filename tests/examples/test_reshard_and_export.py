"""examples/reshard_checkpoint.py and examples/export_for_inference.py end to end.

One tiny training run of examples/train_dlrm.py (2 ranks, gloo) writes a
checkpoint that both tests read: it is resharded to world size 1 with table-wise
KV tables and the resharded checkpoint is exported for inference with dense KV
exports; and it goes through a chain of reshards (2 -> 3 -> 2, 2 -> 1 -> 2).
"""

import sys
from pathlib import Path

import pytest
import torch

from tests.examples.helpers import EXAMPLES, run_example, train_tiny
from tests.torchrun_jobs import torchrun_command

KV_TABLES = ("t_cat_0", "t_cat_9", "t_cat_19", "t_cat_21")  # the 4 largest features


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A tiny training run's directory (2 ranks, 4 steps): ``ckpt``, ``eval_sharded.pt``."""
    workdir = tmp_path_factory.mktemp("demo")
    train_tiny(workdir, steps=4)
    assert (workdir / "ckpt" / "COMPLETE").exists()
    return workdir


def reshard(workdir: Path, ckpt: Path | None, out: Path, world: int, sharding: str) -> str:
    """``reshard_checkpoint.py`` on ``world`` ranks; its stdout. Row counts must match."""
    args = ["--workdir", str(workdir), "--sharding", sharding, "--out", str(out)]
    if ckpt is not None:
        args += ["--ckpt", str(ckpt)]
    script = str(EXAMPLES / "reshard_checkpoint.py")
    out_text = run_example(torchrun_command(world, script, *args)).stdout
    assert "ROW COUNTS MATCH" in out_text, out_text
    assert (out / "COMPLETE").exists()
    return out_text


def test_reshard_then_export(trained, tmp_path):
    workdir = trained
    resharded = tmp_path / "ckpt_ws1"
    out = reshard(workdir, None, resharded, 1, "table_wise")
    assert "(saved by 2 ranks) -> 1 ranks" in out
    for name in KV_TABLES:
        line = next(x for x in out.splitlines() if x.startswith(f"table {name}:"))
        saved, loaded = line.split(": ")[1].split(" rows saved, ")
        assert int(saved) == int(loaded.split(" rows loaded")[0]) > 0, line
        assert "(table_wise over 1 ranks) OK" in line
    assert "ROW COUNTS MATCH" in out
    assert "held-out predictions MATCH the training run's" in out
    assert "resharded checkpoint saved:" in out
    assert (resharded / "COMPLETE").exists()

    bundle_path = tmp_path / "inference.pt"
    job = run_example([
        sys.executable, str(EXAMPLES / "export_for_inference.py"), "--workdir", str(workdir),
        "--ckpt", str(resharded), "--out", str(bundle_path), "--dense-rows", "64",
        "--batches", "2", "--batch-size", "4",
    ])  # fmt: skip
    out = job.stdout
    assert "(saved by 1 ranks) into a read-only unsharded DLRM" in out
    assert "held-out predictions MATCH the training run's" in out
    assert "traced DLRM (torchrec.fx.symbolic_trace): held-out predictions EQUAL" in out
    assert "inference bundle saved:" in out
    predictions = [x for x in out.splitlines() if x.startswith("batch ")]
    assert len(predictions) == 2
    for line in predictions:
        probs = [float(p) for p in line.split("predictions ")[1].split()]
        assert len(probs) == 4 and all(0.0 < p < 1.0 for p in probs)

    bundle = torch.load(bundle_path, weights_only=False)
    assert sorted(bundle["kv_tables"]) == sorted(KV_TABLES)
    assert len(bundle["table_configs"]) == 26
    for name in KV_TABLES:
        assert bundle["dense_kv_weights"][name].shape == (64, 16)
        assert any(k.endswith(f"embedding_bags.{name}.weight_id") for k in bundle["state_dict"])


def test_reshard_chain_2_to_3_to_2_and_1_to_2(trained, tmp_path):
    """2 ranks -> 3 table-wise -> 2 row-wise, and 2 -> 1 -> 2: rows and predictions hold."""
    workdir = trained
    three = reshard(workdir, None, tmp_path / "ws3", 3, "table_wise")
    assert "(saved by 2 ranks) -> 3 ranks" in three
    back = reshard(workdir, tmp_path / "ws3", tmp_path / "ws3to2", 2, "row_wise")
    assert "(saved by 3 ranks) -> 2 ranks" in back
    assert "held-out predictions MATCH the training run's" in back
    one = reshard(workdir, None, tmp_path / "ws1", 1, "row_wise")
    assert "held-out predictions MATCH the training run's" in one
    up = reshard(workdir, tmp_path / "ws1", tmp_path / "ws1to2", 2, "row_wise")
    assert "(saved by 1 ranks) -> 2 ranks" in up
    assert "held-out predictions MATCH the training run's" in up
