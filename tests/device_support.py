"""What the device tests share (the tests that take the ``device`` fixture, see
``tests/conftest.py``): batches made on the CPU and moved to the device, the
CPU reference run, comparisons of tables by id, and the fbgemm fallbacks a CUDA
machine without fbgemm's CUDA build needs for TorchRec's own sparse ops.

A device test runs the same model twice on the same ids: on the device with the
backend that device gets by default (``TORCHREC_KVEMB_BACKEND=auto``: the Triton
kernels on CUDA, compiled; the native kernels on CPU), and on the CPU with the
torch path (``torch``, the reference). Ids, slots, scores and counters must be
equal; floats equal to a tolerance (sums in another order).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils._pytree import tree_leaves, tree_map
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from torchrec_kvemb.backend import ENV_VAR

CPU = torch.device("cpu")
#: Float tolerance of a device run against the CPU reference (float32 sums in
#: another order, a few fused optimizer steps).
ATOL = 1e-5
RTOL = 1e-4


@contextmanager
def backend(name: str) -> Iterator[None]:
    """``TORCHREC_KVEMB_BACKEND=name`` inside the block (read by every op call, so
    forward and backward must both run inside it)."""
    before = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = name
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = before


def kjt_to(kjt: KeyedJaggedTensor, device: torch.device) -> KeyedJaggedTensor:
    """``kjt`` on ``device``, its offsets computed on the CPU first: TorchRec computes
    a KJT's offsets with fbgemm's cumsum, which fbgemm's CPU build has no CUDA
    kernel of (a KJT that carries its offsets never asks)."""
    kjt.offsets()
    return kjt.to(device)


def cpu_tree(value):
    """Every tensor in ``value`` (a dict, list, tuple of tensors...) on the CPU, detached."""
    return tree_map(lambda t: t.detach().cpu() if isinstance(t, torch.Tensor) else t, value)


def assert_tables_equal(
    what: str,
    got: dict[str, torch.Tensor],
    want: dict[str, torch.Tensor],
    atol: float = ATOL,
    rtol: float = RTOL,
) -> None:
    """Two ``KVTable.export()`` s (on any devices): the same names, integer
    arrays (ids, scores) bit for bit, float arrays (rows, optimizer state) to
    ``atol`` / ``rtol``."""
    assert sorted(got) == sorted(want), f"{what}: export keys {sorted(got)} != {sorted(want)}"
    for key, ref in want.items():
        value = got[key].cpu()
        ref = ref.cpu()
        label = f"{what} {key}"
        assert value.dtype == ref.dtype, f"{label}: dtype {value.dtype} != {ref.dtype}"
        assert value.shape == ref.shape, (
            f"{label}: shape {tuple(value.shape)} != {tuple(ref.shape)}"
        )
        if ref.is_floating_point():
            torch.testing.assert_close(
                value, ref, atol=atol, rtol=rtol, msg=lambda m, label=label: f"{label}: {m}"
            )
        elif not torch.equal(value, ref):
            bad = (value != ref).nonzero().flatten()[:8].tolist()
            raise AssertionError(
                f"{label}: {int((value != ref).sum())} of {ref.numel()} differ; first at {bad}: "
                f"device {value.flatten()[bad].tolist()} vs cpu {ref.flatten()[bad].tolist()}"
            )


def assert_on(device: torch.device, *tensors: torch.Tensor) -> None:
    """Every tensor lives on ``device`` (no silent round trip through the CPU)."""
    for t in tensors:
        assert t.device.type == device.type, f"a result on {t.device}, expected {device}"


# ------------------------------------------------- fbgemm ops TorchRec calls
#: fbgemm's sparse ops that TorchRec's KJTs and its input / output dists call on the
#: device's tensors. fbgemm's CPU build (the one that travels to a GPU machine:
#: docs/gpu.md) registers them for CPU and Meta only. None mutates its inputs.
TORCHREC_SPARSE_OPS = (
    "asynchronous_complete_cumsum",
    "asynchronous_exclusive_cumsum",
    "asynchronous_inclusive_cumsum",
    "permute_2D_sparse_data",
    "permute_1D_sparse_data",
    "permute_sparse_features",
    "expand_into_jagged_permute",
    "invert_permute",
    "segment_sum_csr",
    "permute_pooled_embs",
    "permute_pooled_embs_auto_grad",
    "permute_multi_embedding",
    "regroup_keyed_tensor",
    "kt_regroup_arguments",
)
_FALLBACKS: torch.library.Library | None = None
_INSTALLED: list[str] = []


def has_kernel(op: str, key: str) -> bool:
    """Whether ``fbgemm::op`` has a kernel for dispatch key ``key`` (``CPU``, ``CUDA``)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"fbgemm::{op}", key)


def install_fbgemm_cuda_fallbacks() -> list[str]:
    """For each op of ``TORCHREC_SPARSE_OPS`` with a CPU kernel and no CUDA one, a
    CUDA kernel that runs the CPU kernel on copies of the inputs and moves the
    results back: what lets TorchRec's own dist code run on CUDA tensors on a
    machine whose fbgemm is the CPU build. Slow, exact (fbgemm's own CPU results);
    for tests only, never for timing. Returns every op so served (idempotent)."""
    global _FALLBACKS
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

    for name in TORCHREC_SPARSE_OPS:
        if name in _INSTALLED or not hasattr(torch.ops.fbgemm, name):
            continue
        if has_kernel(name, "CUDA") or not has_kernel(name, "CPU"):
            continue
        if _FALLBACKS is None:
            _FALLBACKS = torch.library.Library("fbgemm", "IMPL")
        _FALLBACKS.impl(name, _through_cpu(getattr(torch.ops.fbgemm, name).default), "CUDA")
        _INSTALLED.append(name)
    return list(_INSTALLED)


def _through_cpu(op):
    def kernel(*args, **kwargs):
        device = next(
            t.device
            for t in tree_leaves((args, kwargs))
            if isinstance(t, torch.Tensor) and t.is_cuda
        )
        cpu_args, cpu_kwargs = tree_map(
            lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, (args, kwargs)
        )
        out = op(*cpu_args, **cpu_kwargs)
        return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, out)

    return kernel
