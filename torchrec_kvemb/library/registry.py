"""How an op of ``torch.ops.kvemb`` is registered: one schema, a kernel per device.

``define`` registers a ``torch.library.custom_op`` with a CPU kernel, a CUDA
kernel and a fake kernel (shapes only) of one schema, and remembers the CUDA
kernel so that the Triton kernels can run on CPU tensors in Triton's interpreter
(``TORCHREC_KVEMB_BACKEND=triton``, the tests): ``cuda_kernel(name)`` is exactly
what the dispatcher runs on a GPU. The schema comes from the CPU kernel's type
hints, or, for an op of many arguments, from a ``NamedTuple`` of them
(``schema``): its kernels then take ``*args`` and read them by name.

Example::

    def probe_cpu(keys: torch.Tensor, ids: torch.Tensor) -> torch.Tensor: ...
    probe = define("probe", probe_cpu, probe_cuda, probe_fake)
    torch.ops.kvemb.probe(keys, ids)          # the dispatcher picks by device
"""

import typing
from collections.abc import Callable, Sequence
from typing import Any

import torch

#: The ops' namespace: ``torch.ops.kvemb.<name>``.
NAMESPACE = "kvemb"

_CUDA_KERNELS: dict[str, Callable[..., Any]] = {}
_CPU_KERNELS: dict[str, Callable[..., Any]] = {}
_KERNEL_NAMES: dict[str, dict[str, str]] = {}


def _schema_type(hint: Any) -> str:
    """The schema type of an argument's type hint."""
    if hint is torch.Tensor:
        return "Tensor"
    if set(typing.get_args(hint)) == {torch.Tensor, type(None)}:
        return "Tensor?"
    if hint in (bool, int, float):
        return hint.__name__
    raise TypeError(f"schema: no schema type for {hint!r}")


def schema(arguments: type, returns: str, mutates: Sequence[str] = ()) -> str:
    """The schema of an op whose arguments are the fields of the ``NamedTuple``
    ``arguments`` (tensors, optional tensors, bools, ints, floats), ``mutates`` of
    them written in place, returning ``returns`` (e.g. ``"(Tensor, Tensor)"``)."""
    hints = typing.get_type_hints(arguments)
    fields = []
    for name in arguments._fields:
        kind = _schema_type(hints[name])
        if name in mutates:
            kind = f"Tensor(a{len(fields)}!)"
        fields.append(f"{kind} {name}")
    unknown = set(mutates) - set(arguments._fields)
    if unknown:
        raise ValueError(f"schema: {sorted(unknown)} are not arguments")
    return f"({', '.join(fields)}) -> {returns}"


def define(
    name: str,
    cpu: Callable[..., Any],
    cuda: Callable[..., Any],
    fake: Callable[..., Any],
    mutates: Sequence[str] = (),
    cpu_name: str = "native",
    cuda_name: str = "triton",
    op_schema: str | None = None,
) -> torch.library.CustomOpDef:
    """Register ``kvemb::name`` with ``cpu``, ``cuda`` and ``fake``; ``mutates``: the
    arguments it writes in place; ``op_schema``: the schema (``schema(...)``), else
    ``cpu``'s type hints; ``cpu_name`` / ``cuda_name``: what each kernel runs, for
    ``kernel_names``."""
    op = torch.library.custom_op(
        f"{NAMESPACE}::{name}",
        cpu,
        mutates_args=tuple(mutates),
        device_types="cpu",
        schema=op_schema,
    )
    op.register_kernel("cuda", cuda)
    op.register_fake(fake)
    _CUDA_KERNELS[name] = cuda
    _CPU_KERNELS[name] = cpu
    _KERNEL_NAMES[name] = {"cpu": cpu_name, "cuda": cuda_name}
    return op


def cuda_kernel(name: str) -> Callable[..., Any]:
    """The CUDA kernel of ``kvemb::name`` (Triton), callable on any device's tensors."""
    return _CUDA_KERNELS[name]


def cpu_kernel(name: str) -> Callable[..., Any]:
    """The CPU kernel of ``kvemb::name``: what the dispatcher runs on CPU tensors."""
    return _CPU_KERNELS[name]


def kernel_names() -> dict[str, dict[str, str]]:
    """Each op's kernels by device: ``{"probe": {"cpu": "native", "cuda": "triton"}, ...}``."""
    return {name: dict(kernels) for name, kernels in sorted(_KERNEL_NAMES.items())}
