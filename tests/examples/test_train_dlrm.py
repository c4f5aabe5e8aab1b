"""examples/train_dlrm.py end to end (torchrun, 2 processes, gloo) and the Criteo TSV reader.

The end-to-end jobs run with tiny flags: a few steps of small batches, KV
capacities small enough that tables evict (and the SSD tier is used), then
the checkpoint round trip at world size 1.
"""

import gzip
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.examples.helpers import EXAMPLES, TINY, load_example, run_example, train_tiny

SCRIPT = EXAMPLES / "train_dlrm.py"


def check_round_trip(job: subprocess.CompletedProcess, workdir: Path) -> None:
    assert (workdir / "eval_sharded.pt").exists()
    assert "held-out eval, sharded (2 ranks):" in job.stdout
    assert "checkpoint saved:" in job.stdout
    assert "held-out eval, reloaded (world size 1):" in job.stdout
    assert "MATCH: the reloaded model's evaluation matches the sharded model's" in job.stdout
    assert (workdir / "ckpt" / "COMPLETE").exists()


def test_train_dlrm_synthetic_torchrun(tmp_path):
    workdir = tmp_path / "demo"
    job = train_tiny(workdir, steps=6)
    assert "trained 6 steps x 2 ranks x 64 samples" in job.stdout
    # The progress bar (rank 0, stderr) carries the loss and the KV metrics.
    for word in ("step/s", "loss=", "rows=", "load=", "hit=", "evict=", "rejects=", "overflow="):
        assert word in job.stderr, word
    assert "SSD tier:" in job.stdout and "ssd_r/w=" in job.stdout
    assert any((workdir / "ssd").iterdir())
    check_round_trip(job, workdir)


def synthetic_tsv(path: Path, lines: int) -> None:
    """Criteo-format lines drawn from the example's synthetic stream, with some empty
    and negative dense values and some empty categorical values."""
    synthetic = load_example("common.synthetic")
    stream = synthetic.SyntheticCriteo(id_space=2**32, zipf=1.05, drift=2.0, seed=3)
    raw = stream.batch(step=0, rank=0, size=lines)
    with open(path, "w") as f:
        for i in range(lines):
            dense = [str(int(v)) for v in raw.dense[i]]
            dense[1] = "" if i % 3 == 0 else dense[1]
            dense[2] = "-2" if i % 5 == 0 else dense[2]
            cats = [format(int(v), "08x") for v in raw.sparse[i]]
            cats[4] = "" if i % 4 == 0 else cats[4]
            f.write("\t".join([str(int(raw.labels[i])), *dense, *cats]) + "\n")


def test_train_dlrm_on_criteo_tsv(tmp_path):
    """--data: held-out set = the first 2 blocks, training on the 3 full blocks after
    them (the incomplete last block is dropped, --steps is an upper bound); started
    without torchrun through --world-size."""
    data = tmp_path / "day_0.tsv"
    synthetic_tsv(data, lines=(2 + 3) * 2 * 64 + 50)
    workdir = tmp_path / "tsv"
    command = [
        sys.executable, str(SCRIPT), "--world-size", "2", "--data", str(data),
        "--workdir", str(workdir), "--steps", "10", *TINY,
    ]  # fmt: skip
    job = run_example(command)
    assert "trained 3 steps x 2 ranks x 64 samples" in job.stdout
    check_round_trip(job, workdir)


# ------------------------------------------------------------------ reader
def tsv_line(label: str, dense: list[str], cats: list[str]) -> str:
    return "\t".join([label, *dense, *cats]) + "\n"


def reader_lines() -> list[str]:
    dense = [str(i) for i in range(13)]
    cats = [format(i, "x") for i in range(26)]
    first = tsv_line(
        "1",
        ["3", "", "-1", *dense[3:]],
        ["68fd1e64", "", "ffffffffffffffff", "10000000000", *cats[4:]],
    )
    rest = [tsv_line(str(n % 2), [str(n)] * 13, [format(1000 * n + c, "x") for c in range(26)])
            for n in range(1, 5)]  # fmt: skip
    return [first, *rest]


def test_criteo_tsv_values(tmp_path):
    criteo = load_example("common.criteo")
    path = tmp_path / "tiny.tsv"
    path.write_text("".join(reader_lines()))
    (raw,) = criteo.read_criteo_tsv([path], batch_size=5)
    assert raw.labels.tolist() == [1, 1, 0, 1, 0]
    assert raw.dense[0, :4].tolist() == [3, 0, -1, 3]
    assert raw.sparse[0, :4].tolist() == [0x68FD1E64, 0, 2**63 - 1, 2**40]
    assert raw.sparse[2].tolist() == [2000 + c for c in range(26)]

    sizes = [None] * 26
    sizes[0], sizes[3] = 1000, 7
    batch = criteo.to_batch(raw, sizes)
    dense = batch.dense_features
    assert dense.dtype == torch.float32 and dense.shape == (5, 13)
    assert dense[0, :3].tolist() == pytest.approx([math.log(4), 0.0, 0.0])
    assert dense[2, 0].item() == pytest.approx(math.log(3))
    kjt = batch.sparse_features
    assert kjt.keys() == [f"cat_{i}" for i in range(26)]
    assert kjt.lengths().tolist() == [1] * (26 * 5)
    features = kjt.to_dict()
    assert features["cat_0"].values().tolist() == [0x68FD1E64 % 1000] + [
        (1000 * n) % 1000 for n in range(1, 5)
    ]
    assert features["cat_2"].values().tolist() == [2**63 - 1] + [1000 * n + 2 for n in range(1, 5)]
    assert features["cat_3"].values().tolist() == [2**40 % 7] + [
        (1000 * n + 3) % 7 for n in range(1, 5)
    ]
    assert batch.labels.tolist() == [1.0, 1.0, 0.0, 1.0, 0.0]
    assert raw.sparse[0, 0] == 0x68FD1E64  # to_batch leaves the raw ids alone


def test_criteo_tsv_ranks_blocks_and_gzip(tmp_path):
    criteo = load_example("common.criteo")
    lines = reader_lines()
    plain, packed = tmp_path / "a.tsv", tmp_path / "a.tsv.gz"
    plain.write_text("".join(lines))
    with gzip.open(packed, "wt") as f:
        f.write("".join(lines))
    read = criteo.read_criteo_tsv
    # Blocks of batch_size * world_size = 4 lines: one full block, line 5 dropped.
    rank0 = list(read([plain], batch_size=2, rank=0, world_size=2))
    rank1 = list(read([packed], batch_size=2, rank=1, world_size=2))
    assert len(rank0) == len(rank1) == 1
    assert rank0[0].labels.tolist() == [1, 1]
    assert rank1[0].dense[:, 5].tolist() == [2, 3]
    # Blocks of 1 line across two files; skip 2, take 3.
    both = list(read([plain, packed], batch_size=1, skip_batches=2, max_batches=3))
    assert [int(b.dense[0, 5]) for b in both] == [2, 3, 4]
    assert list(read([plain], batch_size=6)) == []


def test_criteo_tsv_refuses_malformed_lines(tmp_path):
    criteo = load_example("common.criteo")
    lines = reader_lines()
    path = tmp_path / "bad.tsv"
    path.write_text(lines[0] + "1\t2\t3\n")
    with pytest.raises(ValueError, match=r"bad.tsv:1\+1: expected 40 tab-separated columns"):
        list(criteo.read_criteo_tsv([path], batch_size=2))
    path.write_text(lines[0].replace("68fd1e64", "zz"))
    with pytest.raises(ValueError, match="bad.tsv:1"):
        list(criteo.read_criteo_tsv([path], batch_size=1))
