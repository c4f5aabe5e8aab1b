"""``benchmarks/checkpoint.py`` runs end to end (tiny sizes)."""

from benchmarks import checkpoint as bench


def test_checkpoint_benchmark_quick(tmp_path, capsys):
    result = bench.main(["--quick", "--dir", str(tmp_path)])
    assert 0.99 * 2 * 20_000 * (4 * 16 + 4 + 8 + 8) <= result.bytes
    for what in ("save", "load", "disk write", "disk read"):
        assert result.rate(what) > 0
    assert result.steps["in flight"] >= 1 and result.steps["plain write"] >= 1
    assert result.async_ratio() > 0 and result.plain_write_ratio() > 0
    out = capsys.readouterr().out
    assert "vs disk" in out and "load" in out and "async save in flight" in out
    assert list(tmp_path.iterdir()) == []  # the run cleans up
