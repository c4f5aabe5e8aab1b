"""The slab file stays under ``storage_estimate``'s bound under churn with periodic
flushes (a flush must find room for its snapshot of the memory rows without
growing the slab), and what the table holds stays exact."""

from dataclasses import replace

from benchmarks import soak


def test_periodic_flushes_keep_the_slab_under_its_bound(tmp_path):
    config = replace(soak.QUICK, steps=600, sample_every=10, recent_check=4)
    result = soak.run(config, directory=str(tmp_path))
    for name in ("slab bounded", "no stale row", "no row lost"):
        passed, text = result.checks[name]
        assert passed, f"{name}: {text}"
    assert result.metrics["ssd_flushes"] >= config.steps // config.flush_every
