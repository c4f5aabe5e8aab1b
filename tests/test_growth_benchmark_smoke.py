"""Smoke test of ``benchmarks.growth`` and its row in the suite, at tiny sizes (no
timing asserts)."""

from dataclasses import replace

from benchmarks import growth, run

TINY = ["--quick", "--capacity", "1024", "--id-range", "3000", "--steps", "4"]


def test_growth_benchmark_runs_both_models() -> None:
    result = growth.main(TINY)
    for system in (growth.FIXED, growth.GROWN):
        assert result.ids_per_s(system) > 0, system
    assert result.growths > 0
    assert result.memory_start[growth.GROWN] < result.memory_start[growth.FIXED]
    assert result.memory_end[growth.GROWN] <= result.memory_end[growth.FIXED]
    assert result.capacity_end[growth.FIXED] == 2 * 1024


def test_suite_runs_growth(monkeypatch) -> None:
    tiny = replace(growth.QUICK, capacity=1024, id_range=3000, steps=4)
    monkeypatch.setattr(growth, "QUICK", tiny)
    assert "growth" in run.BENCHMARKS
    rows, result = run.RUNNERS["growth"](True)
    assert [r.benchmark for r in rows] == ["growth", "growth"]
    assert rows[0].target == growth.TARGET and rows[0].ratio > 0
