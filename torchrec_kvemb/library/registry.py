"""How an op of ``torch.ops.kvemb`` is registered: one schema, a kernel per device.

``define`` turns a CPU function into a ``torch.library.custom_op`` (its type hints
give the schema), registers the CUDA function and the fake (shapes only) for the
same schema, and remembers the CUDA function so that the Triton kernels can run
on CPU tensors in Triton's interpreter (``TORCHREC_KVEMB_BACKEND=triton``, the
tests): ``cuda_kernel(name)`` is exactly what the dispatcher runs on a GPU.

Example::

    def probe_cpu(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor: ...
    probe = define("probe", probe_cpu, probe_cuda, probe_fake)
    torch.ops.kvemb.probe(keys, ids)          # the dispatcher picks by device
"""

from collections.abc import Callable, Sequence
from typing import Any

import torch

#: The ops' namespace: ``torch.ops.kvemb.<name>``.
NAMESPACE = "kvemb"

_CUDA_KERNELS: dict[str, Callable[..., Any]] = {}
_KERNEL_NAMES: dict[str, dict[str, str]] = {}


def define(
    name: str,
    cpu: Callable[..., Any],
    cuda: Callable[..., Any],
    fake: Callable[..., Any],
    mutates: Sequence[str] = (),
    cpu_name: str = "native",
    cuda_name: str = "triton",
) -> torch.library.CustomOpDef:
    """Register ``kvemb::name`` with ``cpu`` (whose signature is the schema),
    ``cuda`` and ``fake``; ``mutates``: the arguments it writes in place;
    ``cpu_name`` / ``cuda_name``: what each kernel runs, for ``kernel_names``."""
    op = torch.library.custom_op(
        f"{NAMESPACE}::{name}", cpu, mutates_args=tuple(mutates), device_types="cpu"
    )
    op.register_kernel("cuda", cuda)
    op.register_fake(fake)
    _CUDA_KERNELS[name] = cuda
    _KERNEL_NAMES[name] = {"cpu": cpu_name, "cuda": cuda_name}
    return op


def cuda_kernel(name: str) -> Callable[..., Any]:
    """The CUDA kernel of ``kvemb::name`` (Triton), callable on any device's tensors."""
    return _CUDA_KERNELS[name]


def kernel_names() -> dict[str, dict[str, str]]:
    """Each op's kernels by device: ``{"probe": {"cpu": "native", "cuda": "triton"}, ...}``."""
    return {name: dict(kernels) for name, kernels in sorted(_KERNEL_NAMES.items())}
