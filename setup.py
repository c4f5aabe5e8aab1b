"""Build of the native CPU kernels in csrc/ (everything else is in pyproject.toml).

The kernels are a plain C++17 shared library without torch headers, loaded
with ctypes by torchrec_kvemb/ops/native.py. The extension is optional: where
no C++ compiler works the package still installs, ``native.available()`` is
False and the torch path runs (docs/native.md).

No -march=native: a wheel may be built on one machine and run on another.
On x86-64 the same sources are built twice, portable (SSE2) and with AVX2,
as two self-contained libraries (why not one library with both: inline and
template code compiled with -mavx2 could be merged into the portable code at
link time); native.py loads the AVX2 one where the CPU has AVX2.
``TORCHREC_KVEMB_NATIVE_FLAGS`` adds flags to both (e.g. -march=native for a
build that stays on its machine).
"""

import os
import platform
from glob import glob

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CXX_FLAGS = [
    "-std=c++17",
    "-O3",
    "-g0",
    # why: init_rows must round as torch does, so u * scale + shift stays two
    # roundings (no FMA contraction) and no fast-math reassociation.
    "-ffp-contract=off",
    "-pthread",
]

EXTRA_FLAGS = os.environ.get("TORCHREC_KVEMB_NATIVE_FLAGS", "").split()


def native_library(name: str, flags: list[str]) -> Extension:
    return Extension(
        f"torchrec_kvemb.{name}",
        sources=sorted(glob("csrc/*.cpp")),
        depends=sorted(glob("csrc/*.h")),
        include_dirs=["csrc"],
        language="c++",
        extra_compile_args=CXX_FLAGS + flags + EXTRA_FLAGS,
        extra_link_args=["-pthread"],
        optional=True,
    )


libraries = [native_library("_kvemb_native", [])]
if platform.machine().lower() in ("x86_64", "amd64"):
    # why: the AVX2 build runs find-or-insert ~25% faster (probe, initial rows).
    libraries.append(native_library("_kvemb_native_avx2", ["-mavx2"]))


class BuildNative(build_ext):
    """Each build compiles into a directory of its own: the builds share their
    sources, so with one directory the second would reuse the first's objects."""

    def build_extension(self, ext: Extension) -> None:
        shared = self.build_temp
        self.build_temp = os.path.join(shared, ext.name)
        try:
            super().build_extension(ext)
        finally:
            self.build_temp = shared


setup(ext_modules=libraries, cmdclass={"build_ext": BuildNative})
