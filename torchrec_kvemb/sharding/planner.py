"""What TorchRec's planner sees of a KV table: a storage stand-in and a bandwidth.

The stock planner sizes a table from the tensor ``shardable_parameters()`` gives
it (bytes = ``numel * element_size``) and prices it from a bandwidth per
(device, compute kernel). A KV table's memory follows its options, not
``num_embeddings`` (up to ``2**63 - 1``), and TorchRec has no bandwidth for
``customized_kernel``. So:

* :func:`storage_proxy` is a float32 ``meta`` tensor whose bytes are the
  table's memory (:func:`kv_table_bytes`); its rows are informational only
  (routing is by bucket, not by row range);
* :func:`register_perf_estimates` gives the default perf estimator a bandwidth
  for ``customized_kernel`` on CPU and CUDA (done when ``torchrec_kvemb.sharding``
  is imported).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch
from torchrec.distributed.embedding_types import EmbeddingComputeKernel
from torchrec.distributed.planner.constants import DDR_MEM_BW, HBM_MEM_BW
from torchrec.distributed.planner.estimator import device_bw
from torchrec.distributed.planner.estimator.config import EmbeddingPerfEstimatorConfig

from torchrec_kvemb.memory import table_memory
from torchrec_kvemb.optimizer import FusedOptimConfig
from torchrec_kvemb.options import KVTableOptions

#: The compute kernel name KV tables carry in sharding plans.
KV_COMPUTE_KERNEL = EmbeddingComputeKernel.CUSTOMIZED_KERNEL.value

#: Bandwidths (bytes/ms) the planner prices KV lookups with. Why a quarter of DDR
#: on CPU: the KV train step moves rows at 1.0 GB/s against fbgemm TBE's 4.2 GB/s
#: on the same batches (docs/bench_ebc_train.md). CUDA: not measured yet, half of HBM.
KV_CPU_BW = 0.25 * DDR_MEM_BW
KV_CUDA_BW = 0.5 * HBM_MEM_BW


def kv_table_bytes(options: KVTableOptions, dim: int, optim: FusedOptimConfig) -> int:
    """Memory of one KV table (or shard) built from ``options`` at its maximum
    capacity: rows, index, admission counter, and an SSD tier's scratch reserve
    (``memory.table_memory``). A table that grows (``initial_capacity``) is planned
    by its maximum.

    Equal to the bytes of the tensors ``KVTable(name, dim, options, optim)`` holds at
    its maximum capacity (``memory_bytes()``; with an SSD tier, once its scratch pad
    holds its first rows), without building it; at most ``memory_budget_bytes``.
    """
    return table_memory(options, dim, optim).bytes


def storage_proxy(options: KVTableOptions, dim: int, optim: FusedOptimConfig) -> torch.Tensor:
    """A float32 ``meta`` tensor ``[rows, dim]`` holding (at least) the table's bytes.

    Example::

        proxy = storage_proxy(KVTableOptions(capacity=100_000), 16, FusedOptimConfig())
        proxy.shape    # torch.Size([131250, 16]): 8.4 MB, as the table itself
    """
    rows = max(1, math.ceil(kv_table_bytes(options, dim, optim) / (4 * dim)))
    return torch.empty(rows, dim, dtype=torch.float32, device="meta")


def register_perf_estimates() -> None:
    """Give TorchRec's default perf estimator a bandwidth for ``customized_kernel``.

    Without it the planner raises ``Unrecognized or unsupported compute kernel:
    customized_kernel``. Idempotent; keeps a bandwidth the user registered first.
    """
    known = getattr(EmbeddingPerfEstimatorConfig, "kernel_device_bandwidths", None) or {}
    for device, bandwidth in (("cpu", KV_CPU_BW), ("cuda", KV_CUDA_BW)):
        if (device, KV_COMPUTE_KERNEL) not in known:
            device_bw(bandwidth=bandwidth, device=device, compute_kernel=KV_COMPUTE_KERNEL)(
                EmbeddingPerfEstimatorConfig
            )


def check_plan(
    kv_tables: Collection[str],
    configs: Sequence[Any],
    plan: Mapping[str, Any],
    sharding_types: Collection[str],
) -> None:
    """Every table of ``configs`` in ``plan``; the KV ones (named in ``kv_tables``)
    planned ``customized_kernel`` with one of ``sharding_types``, and no other.

    Example::

        check_plan({"user"}, ebc.embedding_bag_configs(), plan["ebc"], ["row_wise"])
    """
    for config in configs:
        name = config.name
        if name not in plan:
            raise ValueError(f"table {name!r}: the sharding plan has no entry for it")
        sharding = plan[name]
        is_kv = name in kv_tables
        if is_kv and sharding.compute_kernel != KV_COMPUTE_KERNEL:
            raise ValueError(
                f"table {name!r} has KVTableOptions but the plan gives it compute kernel "
                f"{sharding.compute_kernel!r}; KV tables need {KV_COMPUTE_KERNEL!r}"
            )
        if is_kv and sharding.sharding_type not in sharding_types:
            raise ValueError(
                f"table {name!r}: KV tables shard {' or '.join(sharding_types)}, "
                f"the plan says {sharding.sharding_type}"
            )
        if not is_kv and sharding.compute_kernel == KV_COMPUTE_KERNEL:
            raise ValueError(
                f"table {name!r}: the plan gives it {KV_COMPUTE_KERNEL!r} but the sharder "
                "has no KVTableOptions for it"
            )
