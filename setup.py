"""Build of the native CPU kernels in csrc/ (everything else is in pyproject.toml).

The kernels are a plain C++17 shared library without torch headers, loaded
with ctypes by torchrec_kvemb/ops/native.py. The extension is optional: where
no C++ compiler works the package still installs, ``native.available()`` is
False and the torch path runs (docs/native.md).

Portable flags only (no -march=native): the library may be built on one
machine and run on another. ``TORCHREC_KVEMB_NATIVE_FLAGS`` adds flags, e.g.
``-march=native`` for a build that stays on its machine.
"""

import os
from glob import glob

from setuptools import Extension, setup

CXX_FLAGS = [
    "-std=c++17",
    "-O3",
    "-g0",
    # why: init_rows must round as torch does, so u * scale + shift stays two
    # roundings (no FMA contraction) and no fast-math reassociation.
    "-ffp-contract=off",
    "-pthread",
]

native = Extension(
    "torchrec_kvemb._kvemb_native",
    sources=sorted(glob("csrc/*.cpp")),
    depends=sorted(glob("csrc/*.h")),
    include_dirs=["csrc"],
    language="c++",
    extra_compile_args=CXX_FLAGS + os.environ.get("TORCHREC_KVEMB_NATIVE_FLAGS", "").split(),
    extra_link_args=["-pthread"],
    optional=True,
)

setup(ext_modules=[native])
