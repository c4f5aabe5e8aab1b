"""Smoke test of benchmarks.native_builds: two builds and TBE take turns (no timing asserts)."""

from __future__ import annotations

from benchmarks import native_builds
from torchrec_kvemb import native_lib


def test_two_builds_and_small_pages_run_and_the_package_library_is_restored() -> None:
    path = str(native_lib.library_path(native_lib.variant()))
    package_load = native_lib.load
    rows = native_builds.main(
        [f"a={path}", f"b={path}", "--quick", "--repeats", "1", "--small-pages"]
    )
    systems = {(mode, system) for mode, system, *_ in rows}
    for mode in ("train", "eval"):
        for system in ("a", "b", native_builds.SMALL, "TBE"):
            assert (mode, system) in systems
    assert all(float(ms) > 0 for _, _, ms, _, _ in rows)
    assert native_lib.load is package_load
    assert native_lib.library() is package_load()[0]
