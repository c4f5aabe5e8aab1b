"""The suite runner: quick sizes end to end, its markdown and plots; ``--gpu`` without CUDA."""

from pathlib import Path

import pytest
import torch

from benchmarks import run

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
