"""The suite runner: quick sizes end to end, its markdown and plots; ``--gpu`` without CUDA."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from benchmarks import ebc_train, matrix, run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _table_rows(text: str) -> list[list[str]]:
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[1:]]


def test_quick_suite_writes_table_and_plots(tmp_path: Path) -> None:
    only = "ebc,ec,precision,ssd,checkpoint"
    rows = run.main(["--quick", "--only", only, "--out-dir", str(tmp_path)])
    assert {r.benchmark for r in rows} == {"ebc", "ec", "precision", "ssd", "checkpoint"}
    assert all(r.kv > 0 and r.baseline > 0 and r.ratio > 0 for r in rows)

    text = (tmp_path / run.RESULTS_FILE).read_text()
    table = _table_rows(text)
    assert len(table) == len(rows)
    assert [cells[0] for cells in table] == [r.benchmark for r in rows]
    for name in ("ebc", "ec", "precision", "ssd", "checkpoint"):
        assert any(cells[0] == name for cells in table), name
    assert not any(cells[0] == "dist" for cells in table)
    assert any(f"{run.SSD_TABLES} tables:" in cells[1] for cells in table)  # grouped tiers
    assert "Machine: " in text and "python -m benchmarks.run --quick" in text

    for name in ("ratios.png", "ebc_throughput.png"):
        data = (tmp_path / "plots" / name).read_bytes()
        assert data[:8] == PNG_MAGIC, name
        assert len(data) > 5_000, name
        assert f"plots/{name}" in text


def test_quick_matrix_writes_report_rows_and_plots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny = replace(ebc_train.QUICK, batch=16, bag=3, rows=1000, dim=8, steps=1, repeats=1)
    monkeypatch.setattr(matrix, "QUICK", tiny)
    monkeypatch.setattr(matrix, "PROFILE_CALLS", 1)
    rows = run.main(["--quick", "--only", "matrix", "--out-dir", str(tmp_path)])
    assert [r.what for r in rows] == [
        f"{name}: KV / TBE {mode}" for name in matrix.STREAMS for mode in ("train", "eval")
    ]
    targets = {r.what: r.target for r in rows}
    assert targets["zipf1.05: KV / TBE train"] == 0.8
    assert targets["zipf1.05: KV / TBE eval"] == 1.0
    assert targets["capacity: KV / TBE train"] == 0.7
    assert targets["capacity: KV / TBE eval"] is None
    assert all(r.kv > 0 and r.baseline > 0 for r in rows)

    text = (tmp_path / run.RESULTS_FILE).read_text()
    assert len(_table_rows(text)) == len(rows)
    assert f"[{run.MATRIX_FILE}]({run.MATRIX_FILE})" in text
    report = (tmp_path / run.MATRIX_FILE).read_text()
    assert "## Where the KV step's time goes: zipf1.05" in report
    for name in ("matrix.png", "step_breakdown.png"):
        data = (tmp_path / "plots" / name).read_bytes()
        assert data[:8] == PNG_MAGIC, name
        assert len(data) > 5_000, name
        assert f"plots/{name}" in text


def test_targets_of_the_issue() -> None:
    eval_target = [t for t in ebc_train.TARGETS if t.mode == "eval" and t.baseline == "TBE"]
    assert [t.minimum for t in eval_target] == [1.0]
    assert run.PRECISION_TARGET == 1.0


def test_only_rejects_unknown_benchmark(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        run.main(["--only", "nope", "--out-dir", str(tmp_path)])
    assert exc.value.code == 2


def test_gpu_without_cuda_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exc:
        run.main(["--gpu", "--quick", "--out-dir", str(tmp_path)])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "CUDA device is required" in err
    assert not (tmp_path / run.GPU_RESULTS_FILE).exists()
    assert not (tmp_path / run.RESULTS_FILE).exists()
