"""Which implementation runs the ops: the one backend decision.

The kernels are registered torch ops (``torch.ops.kvemb.*``, ``library/``):
PyTorch's dispatcher picks their kernel by the tensors' device (native C++ on the
CPU, Triton on CUDA). ``implementation`` says, for a device, whether those ops
run or the torch path (the readable reference, ``torchrec_kvemb/ops/``), by
``TORCHREC_KVEMB_BACKEND``:

* ``auto`` (default): ``"triton"`` on CUDA, ``"native"`` on the CPU where the
  native library was built, ``"torch"`` otherwise (no compiler at install: the
  slower path still works);
* ``torch``: always the torch path;
* ``triton``: always the Triton kernels (on CPU tensors this needs
  ``TRITON_INTERPRET=1``, Triton's interpreter, slowly: how the tests check them).

Example::

    implementation("cpu")    # "native" where the library was built, else "torch"
"""

from __future__ import annotations

import os

import torch

from torchrec_kvemb import native_lib

ENV_VAR = "TORCHREC_KVEMB_BACKEND"
_CHOICES = ("auto", "torch", "triton")
#: What ``implementation`` can answer.
IMPLEMENTATIONS = ("native", "torch", "triton")


def backend_setting() -> str:
    """The configured backend name, validated."""
    value = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if value not in _CHOICES:
        raise ValueError(f"{ENV_VAR}={value!r}: expected one of {', '.join(_CHOICES)}")
    return value


@torch.compiler.assume_constant_result  # a compiled graph keeps the implementation it saw
def implementation(device: torch.device | str) -> str:
    """What runs the ops on tensors of ``device``: ``"native"`` or ``"triton"`` (the
    registered ops; Triton also when forced on CPU tensors) or ``"torch"`` (the
    reference path)."""
    setting = backend_setting()
    if setting != "auto":
        return setting
    kind = torch.device(device).type
    if kind == "cuda":
        return "triton"
    if kind == "cpu" and native_lib.available():
        return "native"
    return "torch"
