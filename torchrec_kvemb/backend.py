"""Which implementation runs an op: the Triton kernels or the torch path.

``TORCHREC_KVEMB_BACKEND`` overrides the choice:

* ``auto`` (default): Triton for CUDA tensors, torch otherwise.
* ``torch``: always the vectorized torch path.
* ``triton``: always the Triton kernels (on CPU tensors this needs
  ``TRITON_INTERPRET=1``, which runs them in Triton's interpreter, slowly).
"""

from __future__ import annotations

import os

import torch

ENV_VAR = "TORCHREC_KVEMB_BACKEND"
_CHOICES = ("auto", "torch", "triton")


def backend_setting() -> str:
    """The configured backend name, validated."""
    value = os.environ.get(ENV_VAR, "auto").strip().lower() or "auto"
    if value not in _CHOICES:
        raise ValueError(f"{ENV_VAR}={value!r}: expected one of {', '.join(_CHOICES)}")
    return value


def use_triton(device: torch.device | str) -> bool:
    """True when ops on ``device`` should run the Triton kernels."""
    setting = backend_setting()
    if setting == "auto":
        return torch.device(device).type == "cuda"
    return setting == "triton"
