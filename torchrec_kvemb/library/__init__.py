"""The kernels as PyTorch ops: ``torch.ops.kvemb.*``, registered on import.

Each op has one schema and a kernel per device, picked by PyTorch's dispatcher:
the native C++ kernels (or the torch path where an op has none) on the CPU, the
Triton kernels on CUDA, and a fake kernel (shapes only) for ``torch.compile``,
``torch.export`` and FX. ``kernel_names()`` says which kernel each op runs on
each device. The torch path (``torchrec_kvemb/ops/``) stays the reference the
kernels are tested against; ``backend.implementation`` says when it runs instead
(``TORCHREC_KVEMB_BACKEND=torch``, or a CPU without the native library).

Modules: ``registry`` (how an op is defined), ``index_ops`` (one index: probe,
insert, place, bulk load, checkpoint order, rows), ``group_ops`` (a group's
lookups, pooled forward, fused backward), ``bucketize_op`` (routing),
``tier_ops`` (a host tier's row exchange).

Example::

    import torchrec_kvemb   # registers the ops
    slots = torch.ops.kvemb.probe(keys, ids)
"""

from torchrec_kvemb.library import bucketize_op, group_ops, index_ops, tier_ops
from torchrec_kvemb.library.registry import NAMESPACE, cpu_kernel, cuda_kernel, kernel_names

__all__ = [
    "NAMESPACE",
    "bucketize_op",
    "cpu_kernel",
    "cuda_kernel",
    "group_ops",
    "index_ops",
    "kernel_names",
    "tier_ops",
]
