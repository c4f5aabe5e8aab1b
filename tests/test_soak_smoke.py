"""The soak benchmark at a tiny setting: it runs, samples, plots, and its checks hold
(no stale row, no row lost, the slab within its bound, load factors in range)."""

from pathlib import Path

import torch

from benchmarks import soak

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY = ["--steps", "150", "--memory-rows", "256", "--ssd-capacity", "2048", "--new", "40",
        "--recent", "40", "--old", "9", "--window", "7", "--flush-every", "45",
        "--sample-every", "10", "--recent-check", "3"]  # fmt: skip


def test_soak_runs_and_its_checks_hold(tmp_path: Path) -> None:
    threads = torch.get_num_threads()
    out, png = tmp_path / "soak.md", tmp_path / "soak.png"
    result = soak.main([*TINY, "--dir", str(tmp_path), "--out", str(out), "--plot", str(png)])
    assert torch.get_num_threads() == threads
    assert len(result.samples) == 16
    m = result.metrics
    assert m["promotions"] > 0 and m["demotions"] > 0 and m["ssd_evictions"] > 0, m
    assert m["ssd_flushes"] >= 3
    for name in ("no stale row", "no row lost", "slab bounded", "load factor"):
        passed, text = result.checks[name]
        assert passed, f"{name}: {text}"
    assert "rss flat" in result.checks
    assert png.read_bytes()[:8] == PNG_MAGIC
    assert "no row lost: met" in out.read_text()
    assert not list(tmp_path.glob("kv_soak_*")), "the soak's files are removed"


def test_the_check_catches_a_stale_row(tmp_path: Path, monkeypatch) -> None:
    """One held row that is not its id's last trained row is reported (the check is
    live): the check's expected rows are shifted for one id."""
    real = soak.trained_rows
    config = soak.parse_args(TINY)[0]
    calls = {"n": 0}

    def shifted_at_check(ids, steps, width):
        rows = real(ids, steps, width)
        calls["n"] += 1
        if calls["n"] == config.steps + 1:  # the check's call, after every step's
            rows[ids.numel() // 2, 3] += 0.25
        return rows

    monkeypatch.setattr(soak, "trained_rows", shifted_at_check)
    result = soak.run(config, directory=str(tmp_path))
    passed, text = result.checks["no stale row"]
    assert not passed and ", 1 without" in text, text
