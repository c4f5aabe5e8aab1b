"""Ops of one bucketed index and its rows: ``torch.ops.kvemb.{index_bucket, probe,
insert, place, bulk_load, export_order, scatter_rows, gather_rows, init_rows}``.

Each takes contiguous int64 ids (callers make them so) and gives exactly what its
torch path in ``torchrec_kvemb/ops/`` gives, which tests hold it to. Kernels:

=============  ================================  =====================================
op             CPU                               CUDA
=============  ================================  =====================================
index_bucket   native                            torch path (``ops/hashing.py``)
probe          native                            Triton (``kernels/probe.py``)
insert         native                            Triton (``kernels/insert.py``)
place          native                            torch path (``ops/place.py``)
bulk_load      native                            torch path (``ops/place.py``)
export_order   native                            torch path (``ops/export_order.py``)
scatter_rows   native (float32 rows), else       ``index_copy_``
               ``index_copy_``
gather_rows    native (float32 rows), else       ``index_select``
               ``index_select``
init_rows      native (uniform), torch path      torch path (``ops/hashing.py``)
               (normal: torch's log and cos)
=============  ================================  =====================================

Example::

    slots = torch.ops.kvemb.probe(index.keys, ids)      # -1 where absent
"""

import torch

from torchrec_kvemb.contracts import ROUTE_SALT
from torchrec_kvemb.library.registry import define
from torchrec_kvemb.ops import native
from torchrec_kvemb.ops.export_order import export_order_torch
from torchrec_kvemb.ops.hashing import index_bucket as index_bucket_torch
from torchrec_kvemb.ops.hashing import init_rows as init_rows_torch
from torchrec_kvemb.ops.place import bulk_load_torch, place_torch

Tensor = torch.Tensor


# ----------------------------------------------------------------- index_bucket
def _index_bucket_cpu(ids: Tensor, num_buckets: int) -> Tensor:
    return native.index_bucket(ids, num_buckets)


def _index_bucket_cuda(ids: Tensor, num_buckets: int) -> Tensor:
    return index_bucket_torch(ids, num_buckets)


def _index_bucket_fake(ids: Tensor, num_buckets: int) -> Tensor:
    return torch.empty_like(ids)


index_bucket = define(
    "index_bucket", _index_bucket_cpu, _index_bucket_cuda, _index_bucket_fake, cuda_name="torch"
)


# ------------------------------------------------------------------------ probe
def _probe_cpu(keys: Tensor, ids: Tensor) -> Tensor:
    # The group probe of one table: one bucket range starting at 0.
    one = torch.tensor([keys.shape[0]], dtype=torch.int64)
    table = torch.zeros(ids.numel(), dtype=torch.int64)
    return native.lookup_eval_group(keys, one.new_zeros(1), one, ids, table)[0]


def _probe_cuda(keys: Tensor, ids: Tensor) -> Tensor:
    from torchrec_kvemb.kernels.probe import probe_triton

    return probe_triton(keys, ids)


def _probe_fake(keys: Tensor, ids: Tensor) -> Tensor:
    return torch.empty_like(ids)


probe = define("probe", _probe_cpu, _probe_cuda, _probe_fake)


# ----------------------------------------------------------------------- insert
def _insert_cpu(
    keys: Tensor, scores: Tensor, ids: Tensor, values: Tensor, accumulate: bool, keep_existing: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return tuple(native.insert(keys, scores, ids, values, accumulate, keep_existing))


def _insert_cuda(
    keys: Tensor, scores: Tensor, ids: Tensor, values: Tensor, accumulate: bool, keep_existing: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    from torchrec_kvemb.kernels.insert import insert_triton

    return tuple(insert_triton(keys, scores, ids, values, accumulate, keep_existing))


def _insert_fake(
    keys: Tensor, scores: Tensor, ids: Tensor, values: Tensor, accumulate: bool, keep_existing: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    evicted = torch.library.get_ctx().new_dynamic_size()
    flags = torch.empty(ids.shape, dtype=torch.bool, device=ids.device)
    return (
        torch.empty_like(ids),
        flags,
        torch.empty_like(flags),
        ids.new_empty(evicted),
        ids.new_empty(evicted),
    )


insert = define("insert", _insert_cpu, _insert_cuda, _insert_fake, mutates=("keys", "scores"))


# ------------------------------------------------------------------------ place
def _place_cpu(keys: Tensor, ids: Tensor) -> Tensor:
    return native.place(keys, ids)


def _place_cuda(keys: Tensor, ids: Tensor) -> Tensor:
    return place_torch(keys, ids)


def _place_fake(keys: Tensor, ids: Tensor) -> Tensor:
    return torch.empty_like(ids)


place = define("place", _place_cpu, _place_cuda, _place_fake, mutates=("keys",), cuda_name="torch")


# -------------------------------------------------------------------- bulk_load
def _bulk_load_cpu(keys: Tensor, scores: Tensor, ids: Tensor, values: Tensor) -> Tensor:
    return native.bulk_load(keys, scores, ids, values)


def _bulk_load_cuda(keys: Tensor, scores: Tensor, ids: Tensor, values: Tensor) -> Tensor:
    src, slots = bulk_load_torch(keys, scores, ids, values)
    if src is None:
        return slots
    return torch.full_like(ids, -1).index_copy_(0, src, slots)


def _bulk_load_fake(keys: Tensor, scores: Tensor, ids: Tensor, values: Tensor) -> Tensor:
    return torch.empty_like(ids)


bulk_load = define(
    "bulk_load",
    _bulk_load_cpu,
    _bulk_load_cuda,
    _bulk_load_fake,
    mutates=("keys", "scores"),
    cuda_name="torch",
)


# ----------------------------------------------------------------- export_order
def _export_order_cpu(keys: Tensor, route_buckets: int) -> tuple[Tensor, Tensor, Tensor]:
    return native.export_order(keys.view(-1), route_buckets, ROUTE_SALT)


def _export_order_cuda(keys: Tensor, route_buckets: int) -> tuple[Tensor, Tensor, Tensor]:
    return export_order_torch(keys, route_buckets)


def _export_order_fake(keys: Tensor, route_buckets: int) -> tuple[Tensor, Tensor, Tensor]:
    stored = torch.library.get_ctx().new_dynamic_size()
    return keys.new_empty(stored), keys.new_empty(stored), keys.new_empty(route_buckets)


export_order = define(
    "export_order", _export_order_cpu, _export_order_cuda, _export_order_fake, cuda_name="torch"
)


# ----------------------------------------------------------------- scatter_rows
def _scatter_rows_cpu(dest: Tensor, slots: Tensor, rows: Tensor) -> None:
    if dest.dtype == rows.dtype == torch.float32 and dest.dim() == rows.dim() == 2:
        # why native: destination rows prefetched ahead; index_copy_ waits on each
        # random row's cache misses (a checkpoint load scatters 1.1 GB of rows).
        native.scatter_rows(dest, slots, rows)
    else:
        dest.index_copy_(0, slots, rows)


def _scatter_rows_cuda(dest: Tensor, slots: Tensor, rows: Tensor) -> None:
    dest.index_copy_(0, slots, rows)


def _scatter_rows_fake(dest: Tensor, slots: Tensor, rows: Tensor) -> None:
    return None


scatter_rows = define(
    "scatter_rows",
    _scatter_rows_cpu,
    _scatter_rows_cuda,
    _scatter_rows_fake,
    mutates=("dest",),
    cpu_name="native (float32 rows) / index_copy_",
    cuda_name="index_copy_",
)


# ------------------------------------------------------------------ gather_rows
def _gather_rows_cpu(src: Tensor, slots: Tensor, out: Tensor) -> None:
    if src.dtype == out.dtype == torch.float32 and src.dim() == out.dim() == 2:
        # why native: on the package's own threads (a torch parallel op leaves its
        # OpenMP thread spinning on the core the next native call needs), with the
        # source rows prefetched ahead.
        native.gather_rows(src, slots, out)
    else:
        torch.index_select(src, 0, slots, out=out)


def _gather_rows_cuda(src: Tensor, slots: Tensor, out: Tensor) -> None:
    torch.index_select(src, 0, slots, out=out)


def _gather_rows_fake(src: Tensor, slots: Tensor, out: Tensor) -> None:
    return None


gather_rows = define(
    "gather_rows",
    _gather_rows_cpu,
    _gather_rows_cuda,
    _gather_rows_fake,
    mutates=("out",),
    cpu_name="native (float32 rows) / index_select",
    cuda_name="index_select",
)


# -------------------------------------------------------------------- init_rows
def _init_rows_cpu(ids: Tensor, dim: int, seed: int, normal: int, a: float, b: float) -> Tensor:
    if normal:  # normal, truncated normal: torch's vectorized log, cos, erf and erfinv
        return init_rows_torch(ids, dim, seed, normal, a, b)
    # why native: the same bits without the [n, dim] int64 temporaries (~4x faster).
    return native.init_uniform(ids, dim, seed, a, b)


def _init_rows_cuda(ids: Tensor, dim: int, seed: int, normal: int, a: float, b: float) -> Tensor:
    return init_rows_torch(ids, dim, seed, normal, a, b)


def _init_rows_fake(ids: Tensor, dim: int, seed: int, normal: int, a: float, b: float) -> Tensor:
    return ids.new_empty((ids.numel(), dim), dtype=torch.float32)


init_rows = define(
    "init_rows",
    _init_rows_cpu,
    _init_rows_cuda,
    _init_rows_fake,
    cpu_name="native (uniform) / torch (normal)",
    cuda_name="torch",
)
