"""Fixtures of the op tests: the builds of the native library."""

from __future__ import annotations

import platform
from collections.abc import Iterator

import pytest

from torchrec_kvemb import native_lib

#: Builds a native test runs on: the portable one, and the AVX2 one on x86-64.
BUILDS = ["portable", "avx2"] if platform.machine().lower() in ("x86_64", "amd64") else ["portable"]


@pytest.fixture(params=BUILDS)
def native_build(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run the test on one build of the library (it must be built: no skip)."""
    assert native_lib.available(), f"native library not built: {native_lib.unavailable_reason()}"
    lib, reason = native_lib.load_variant(request.param)
    if request.param == "avx2" and not native_lib.load_variant("portable")[0].kv_cpu_has_avx2():
        pytest.skip("this CPU has no AVX2")
    assert lib is not None, f"{request.param} build missing: {reason}"
    monkeypatch.setattr(native_lib, "load", lambda: (lib, None))
    assert native_lib.variant() == request.param
    return request.param


@pytest.fixture(params=["f16c", "integer"])
def half_conversion(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test with float16 rows converted by F16C instructions, then by the
    library's integer code (the same bits by contract), in the library the ops
    use (request ``native_build`` first to pick a build)."""
    lib = native_lib.library()
    use = native_lib.set_f16c(request.param == "f16c", lib)
    try:
        if request.param == "f16c" and not use:
            pytest.skip("this CPU has no F16C")
        assert use == (request.param == "f16c")
        yield request.param
    finally:
        native_lib.set_f16c(True, lib)
