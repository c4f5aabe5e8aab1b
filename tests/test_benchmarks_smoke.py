"""Smoke test of the benchmarks: they run end to end at tiny sizes (no timing asserts)."""

from pathlib import Path

import pytest
import torch

from benchmarks import ebc_train, ec_train, precision
from benchmarks.common import ZipfIds, format_table, markdown_table, spread_ids

TINY = [
    "--quick",
    "--tables", "2",
    "--batch", "16",
    "--bag", "3",
    "--rows", "2000",
    "--dim", "8",
    "--steps", "1",
    "--repeats", "1",
    "--warmup", "1",
    "--prime", "1",
]  # fmt: skip


def test_ebc_train_runs_all_systems(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    out = tmp_path / "bench.md"
    result = ebc_train.main([*TINY, "--out", str(out)])
    assert torch.get_num_threads() == threads  # the benchmark restores the setting
    assert result is not None
    for system in (ebc_train.KV, ebc_train.KV_SPREAD, ebc_train.TBE, ebc_train.MCH):
        for mode in ("train", "eval"):
            r = result.get(system, mode)
            assert r.ids_per_s > 0 and r.gb_per_s > 0, (system, mode)
    for target in ebc_train.TARGETS:
        assert result.ratio(ebc_train.KV, target.baseline, target.mode) > 0
    assert result.kv_steady["load_factor"] > 0
    text = out.read_text()
    assert "| KV/TBE train |" in text and "| MCH | eval |" in text


def test_ec_train_runs_all_systems(tmp_path: Path) -> None:
    out = tmp_path / "ec.md"
    result = ec_train.main([*TINY, "--out", str(out)])
    for system in ec_train.SYSTEMS:
        for mode in ("train", "eval"):
            assert result.ids_per_s(system, mode) > 0, (system, mode)
    text = out.read_text()
    assert "| KV/EC train |" in text and "| seq TBE |" in text


def test_precision_kernels_time_every_row_dtype(capsys: pytest.CaptureFixture) -> None:
    assert precision.main([*TINY, "--kernels"]) is None
    lines = capsys.readouterr().out.splitlines()
    for op in ("pooled forward", "backward"):
        for name in precision.KERNEL_ROWS:
            rows = [line for line in lines if line.startswith(op) and f" {name} " in line]
            assert len(rows) == 1, (op, name, lines)
            assert float(rows[0].split()[-2]) > 0  # ms per call


def test_zipf_ids_in_range_and_skewed() -> None:
    ids = ZipfIds(rows=1000, alpha=1.05, seed=3).sample(20_000)
    assert ids.dtype == torch.int64
    assert int(ids.min()) >= 0 and int(ids.max()) < 1000
    counts = torch.bincount(ids, minlength=1000).sort(descending=True).values
    assert counts[0] > 20 * counts[100]  # rank 1 is far hotter than rank 101
    again = ZipfIds(rows=1000, alpha=1.05, seed=3).sample(20_000)
    assert torch.equal(ids, again)


def test_spread_ids_is_one_to_one() -> None:
    ids = torch.arange(100_000)
    spread = spread_ids(ids, bits=40)
    assert int(spread.min()) >= 0 and int(spread.max()) < 2**40
    assert torch.unique(spread).numel() == ids.numel()
    assert int(spread.max()) > 2**39  # small ids land all over the range
    with pytest.raises(ValueError):
        spread_ids(ids, bits=63)


def test_tables_format() -> None:
    text = format_table(("a", "b"), [("x", 1), ("yy", 22)])
    assert text.splitlines()[2] == "x    1"
    assert markdown_table(("a", "b"), [("x", 1)]).splitlines()[1] == "|:---|---:|"


@pytest.mark.parametrize("tables", [1, 3], ids=lambda t: f"{t}-tables")
def test_ssd_tier_benchmark_runs(tmp_path: Path, tables: int) -> None:
    from benchmarks import ssd_tier

    result = ssd_tier.main(["--quick", "--dir", str(tmp_path), "--tables", str(tables)])
    assert all(r.ids_per_s > 0 for r in result.train)
    assert all(r.rate > 0 for r in result.promotion + result.disk)
    assert result.cache["ssd_rows"] > 0
    assert result.config.tables == tables
    assert ssd_tier.describe(result).startswith(f"{tables} table(s)")


def test_ssd_tier_sequential_and_profile_run(tmp_path: Path, capsys) -> None:
    from benchmarks import ssd_tier

    args = ["--quick", "--dir", str(tmp_path), "--tables", "3"]
    ssd_tier.main([*args, "--sequential"])
    assert "3 table(s), each system on its own: all in memory" in capsys.readouterr().out
    ssd_tier.main([*args, "--profile"])
    assert "lookup_train_tiers" in capsys.readouterr().out


def test_native_ops_runs_both_sides(tmp_path: Path) -> None:
    from benchmarks import native_ops

    out = tmp_path / "native.md"
    result = native_ops.main(["--quick", "--repeats", "1", "--out", str(out)])
    for op in native_ops.OPS:
        for system in (native_ops.TORCH, native_ops.NATIVE, native_ops.NATIVE_1):
            assert result.get(op, system).ids_per_s > 0, (op, system)
    assert "| find-or-insert | native |" in out.read_text()
