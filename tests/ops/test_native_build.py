"""The package's own build of the native library, from a copy of the sources.

A wheel built with the C++ compiler carries the library and loads it; a
wheel built where the compiler fails (``CC``/``CXX`` = ``/bin/false``, as on
a machine without one) still installs, ``native.available()`` is False and
KV tables run on the torch path. Each case builds a wheel with this
environment's setuptools (``--no-build-isolation``: no network) and installs
it into a temporary directory put first on ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "setup.py", "README.md", "csrc", "torchrec_kvemb", "kernels")

CHECK = """
import torch, torchrec_kvemb
from torchrec_kvemb import native_lib
from torchrec_kvemb.table import KVTable
from torchrec_kvemb.options import KVTableOptions
assert torchrec_kvemb.__file__.startswith({site!r}), torchrec_kvemb.__file__
slots = KVTable("t", 4, KVTableOptions(capacity=32)).lookup_train(torch.tensor([5, 6, 5]))
assert slots[0] == slots[2] >= 0
print("available", native_lib.available(), native_lib.unavailable_reason())
built = [v for v in native_lib.VARIANTS if native_lib.library_path(v)]
print("avx2 code per build", [native_lib.load_variant(v)[0].kv_build_has_avx2() for v in built])
"""


def copy_sources(dest: Path) -> None:
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.egg-info")
    for name in SOURCES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        else:
            shutil.copy2(src, dest / name)


def run(args: list[str], env: dict[str, str], cwd: Path) -> str:
    proc = subprocess.run(args, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout + proc.stderr


@pytest.mark.parametrize("compiler", ["with-compiler", "without-compiler"])
def test_wheel_build_and_fallback(tmp_path: Path, compiler: str) -> None:
    src, wheels, site = tmp_path / "src", tmp_path / "wheels", tmp_path / "site"
    src.mkdir()
    copy_sources(src)
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "CXX")}
    env["PIP_NO_INDEX"] = "1"
    if compiler == "without-compiler":
        env.update(CC="/bin/false", CXX="/bin/false")
    pip = [sys.executable, "-m", "pip"]
    log = run(
        [*pip, "wheel", "-v", "--no-deps", "--no-build-isolation", "-w", str(wheels), str(src)],
        env,
        tmp_path,
    )
    (wheel,) = wheels.glob("*.whl")
    libraries = [n for n in zipfile.ZipFile(wheel).namelist() if "_kvemb_native" in n]
    if compiler == "without-compiler":
        assert libraries == [], libraries
        assert "building extension" in log and "failed" in log, log[-2000:]
    else:  # the portable build, and the AVX2 one on x86-64
        x86 = platform.machine().lower() in ("x86_64", "amd64")
        assert len(libraries) == (2 if x86 else 1), libraries
    run([*pip, "install", "--no-deps", "--target", str(site), str(wheel)], env, tmp_path)
    check_env = dict(env, PYTHONPATH=str(site))
    out = run([sys.executable, "-c", CHECK.format(site=str(site))], check_env, tmp_path)
    if compiler == "without-compiler":
        assert "available False" in out and "was not built" in out, out
    else:  # each build compiled from its own objects: only the AVX2 one has AVX2 code
        assert "available True None" in out, out
        x86 = platform.machine().lower() in ("x86_64", "amd64")
        assert f"avx2 code per build {[0, 1] if x86 else [0]}" in out, out
