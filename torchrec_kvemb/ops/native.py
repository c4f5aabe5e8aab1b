"""Native CPU kernels for groups of KV tables (C++ in ``csrc/``, called through ctypes).

A group is T KV tables sharing one set of arrays, as FBGEMM's TBE shares one
weight array with table offsets: table t owns the index buckets
``[bucket_offset[t], bucket_offset[t] + num_buckets[t])`` of the group's
``keys`` / ``scores`` (int64 ``[NB, WAYS]``), so its slots are
``[WAYS * bucket_offset[t], WAYS * (bucket_offset[t] + num_buckets[t]))`` of
the group's ``weights [NB * WAYS, dim]`` and ``state [NB * WAYS, state_dim]``.
Tables with admission own a range of a second index, the admission counter
(``CounterIndex``), the same way. An id of table t lives in bucket
``bucket_offset[t] + index_bucket(id, num_buckets[t])``.

Every op gives, table by table, exactly what T calls of the per-table torch
path give (``KVTable.lookup_eval`` / ``lookup_train``, ``apply_gradients``):
the same slots, keys, scores, rows, optimizer state, counters and metrics,
for any ``num_threads``. The library is built by the package's install
(``setup.py``); where no C++ compiler was found ``available()`` is False and
callers keep the torch path. Beside the group ops: one index's find-or-insert
(``insert``) and placement (``place``), and the SSD tier's slab records
(``write_records``, ``read_records``, ``record_checksum``), each bit-exact with
its torch path. See docs/native.md.

Why one file of some 950 lines: it is the binding of one C library; the ctypes
mirrors of ``csrc/kvemb_native.h``'s argument structs and the wrappers that
fill them must change together with that header (and its ``ABI_VERSION``);
kept side by side, a field added to one cannot be missed in the other.

Example::

    if native.use_native(ids.device):
        tables = GroupLayout.of([64, 7], [EvictionPolicy.LRU] * 2, [spec, spec])
        out = native.lookup_train_group(tables, keys, scores, weights, state,
                                        ids, table_idx, step=torch.tensor([3, 3]))
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from torchrec_kvemb.backend import backend_setting
from torchrec_kvemb.contracts import GroupLayout, InsertResult, seed_mix
from torchrec_kvemb.ops.hashing import init_rows
from torchrec_kvemb.optimizer import FusedOptimConfig, OptimKind
from torchrec_kvemb.options import WAYS
from torchrec_kvemb.validation import KVInputError

#: The shared library's extension name (setup.py builds csrc/ into it).
LIBRARY = "torchrec_kvemb._kvemb_native"
#: Must equal KV_ABI_VERSION in csrc/kvemb_native.h.
ABI_VERSION = 5

#: Columns of ``TrainLookup.metrics``: the ``KVTable.metrics()`` counters they add to.
METRIC_NAMES = (
    "hits",
    "misses",
    "inserts",
    "evictions",
    "admission_rejects",
    "insert_failures",
)

_OPTIM_CODES = {OptimKind.SGD: 0, OptimKind.ROWWISE_ADAGRAD: 1, OptimKind.ADAM: 2}

_OK, _BAD_TABLE, _NEGATIVE_ID, _OUT_OF_MEMORY, _BAD_ARGUMENT = range(5)


class NativeOpError(RuntimeError):
    """A native op refused its arguments or ran out of memory."""


# ----------------------------------------------------------------- loading
_I64 = ctypes.c_int64
_F64 = ctypes.c_double
_PTR = ctypes.c_void_p


class _TrainArgs(ctypes.Structure):
    """Mirror of ``KvTrainArgs`` (csrc/kvemb_native.h), field for field."""

    _fields_ = [
        ("keys", _PTR),
        ("scores", _PTR),
        ("num_buckets_total", _I64),
        ("weights", _PTR),
        ("dim", _I64),
        ("state", _PTR),
        ("state_dim", _I64),
        ("counter_keys", _PTR),
        ("counter_scores", _PTR),
        ("counter_counts", _PTR),
        ("counter_num_buckets_total", _I64),
        ("num_tables", _I64),
        ("bucket_offset", _PTR),
        ("num_buckets", _PTR),
        ("policy", _PTR),
        ("step", _PTR),
        ("use_custom", _PTR),
        ("admission_threshold", _PTR),
        ("counter_bucket_offset", _PTR),
        ("counter_num_buckets", _PTR),
        ("init_native", _PTR),
        ("seed_mix", _PTR),
        ("init_low", _PTR),
        ("init_high", _PTR),
        ("ids", _PTR),
        ("table_idx", _PTR),
        ("custom_scores", _PTR),
        ("n", _I64),
        ("num_threads", _I64),
        ("workspace", _PTR),
        ("slots", _PTR),
        ("unique_index", _PTR),
        ("unique_ids", _PTR),
        ("unique_slots", _PTR),
        ("unique_table", _PTR),
        ("unique_inserted", _PTR),
        ("evicted_ids", _PTR),
        ("evicted_slots", _PTR),
        ("metrics", _PTR),
        ("sizes", _PTR),
        ("promote_ids", _PTR),
        ("promote_scores", _PTR),
        ("promote_offsets", _PTR),
        ("num_promote", _I64),
        ("unique_flags", _PTR),
        ("unique_scores", _PTR),
        ("evicted_scores", _PTR),
    ]


class _BackwardArgs(ctypes.Structure):
    """Mirror of ``KvBackwardArgs`` (csrc/kvemb_native.h), field for field."""

    _fields_ = [
        ("weights", _PTR),
        ("state", _PTR),
        ("num_rows", _I64),
        ("dim", _I64),
        ("state_dim", _I64),
        ("grad", _PTR),
        ("bags_per_group", _I64),
        ("group_stride", _I64),
        ("bag_stride", _I64),
        ("offsets", _PTR),
        ("num_bags", _I64),
        ("per_sample_weights", _PTR),
        ("mean", _I64),
        ("unique_index", _PTR),
        ("n", _I64),
        ("unique_slots", _PTR),
        ("unique_table", _PTR),
        ("num_unique", _I64),
        ("num_tables", _I64),
        ("learning_rate", _PTR),
        ("optim_step", _PTR),
        ("kind", _I64),
        ("eps", _F64),
        ("beta1", _F64),
        ("beta2", _F64),
        ("weight_decay", _F64),
        ("weight_decay_mode", _I64),
        ("gradient_clipping", _I64),
        ("max_gradient", _F64),
        ("num_threads", _I64),
        ("workspace", _PTR),
    ]


class _InsertArgs(ctypes.Structure):
    """Mirror of ``KvInsertArgs`` (csrc/kvemb_native.h), field for field."""

    _fields_ = [
        ("keys", _PTR),
        ("scores", _PTR),
        ("num_buckets", _I64),
        ("ids", _PTR),
        ("values", _PTR),
        ("n", _I64),
        ("accumulate", _I64),
        ("keep_existing", _I64),
        ("num_threads", _I64),
        ("workspace", _PTR),
        ("slots", _PTR),
        ("hit", _PTR),
        ("inserted", _PTR),
        ("evicted_ids", _PTR),
        ("evicted_slots", _PTR),
        ("num_evicted", _PTR),
    ]


#: Builds of the library: ``portable`` (SSE2 on x86-64) everywhere, ``avx2``
#: beside it on x86-64 (the same sources with -mavx2, same results; setup.py).
VARIANTS = ("portable", "avx2")
_FILE_NAMES = {"portable": "_kvemb_native", "avx2": "_kvemb_native_avx2"}


def library_path(variant: str = "portable") -> Path | None:
    """Where a build of the library is, or None (not built: no compiler at install time).

    Only beside the imported package (why not ``importlib.util.find_spec``: an
    editable install's finder answers for its own source tree even when
    another copy of the package is the one imported)."""
    package_dir = Path(__file__).resolve().parent.parent
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = package_dir / f"{_FILE_NAMES[variant]}{suffix}"
        if path.is_file():
            return path
    return None


def built_variants() -> tuple[str, ...]:
    """The builds present that this CPU can run."""
    lib, _ = load_variant("portable")
    runs = {"portable": True, "avx2": lib is not None and bool(lib.kv_cpu_has_avx2())}
    return tuple(v for v in VARIANTS if runs[v] and library_path(v) is not None)


@functools.cache
def load_variant(variant: str) -> tuple[ctypes.CDLL | None, str | None]:
    """One build of the library, loaded: ``(library, None)`` or ``(None, why not)``."""
    path = library_path(variant)
    if path is None:
        return None, f"the native library ({variant}) was not built (no C++ compiler at install?)"
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return None, f"cannot load {path}: {e}"
    version = lib.kv_abi_version()
    if version != ABI_VERSION:
        return None, (
            f"{path} has ABI version {version}, this package needs {ABI_VERSION}: "
            "a stale build; reinstall the package (pip install -e .)"
        )
    c_int = ctypes.c_int
    lib.kv_index_bucket.argtypes = [_PTR, _I64, _I64, _PTR]
    lib.kv_init_uniform.argtypes = [_PTR, _I64, _I64, _I64, _F64, _F64, _I64, _PTR]
    lib.kv_lookup_eval_group.argtypes = [_PTR, _I64, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64]
    lib.kv_lookup_eval_group.argtypes += [_PTR, _PTR]
    lib.kv_workspace_create.argtypes = []
    lib.kv_workspace_create.restype = _PTR
    lib.kv_workspace_destroy.argtypes = [_PTR]
    lib.kv_workspace_destroy.restype = None
    lib.kv_workspace_bytes.argtypes = [_PTR]
    lib.kv_workspace_bytes.restype = _I64
    lib.kv_lookup_train_group.argtypes = [ctypes.POINTER(_TrainArgs)]
    lib.kv_fused_backward_group.argtypes = [ctypes.POINTER(_BackwardArgs)]
    lib.kv_insert.argtypes = [ctypes.POINTER(_InsertArgs)]
    lib.kv_read_records.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _PTR, _I64, _PTR, _PTR]
    lib.kv_bulk_load.argtypes = [_PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _PTR]
    lib.kv_scatter_rows.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64, _I64]
    lib.kv_place.argtypes = [_PTR, _I64, _PTR, _I64, _I64, _PTR]
    lib.kv_record_checksum.argtypes = [_PTR, _I64, _I64, _I64, _PTR]
    lib.kv_write_records.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64]
    lib.kv_export_order.argtypes = [_PTR, _I64, ctypes.c_uint64, _I64, _I64, _PTR, _PTR, _PTR]
    lib.kv_crc32.argtypes = [_PTR, _I64, ctypes.c_uint32, _PTR]
    lib.kv_crc32_folds.argtypes = []
    for fn in (
        lib.kv_index_bucket,
        lib.kv_init_uniform,
        lib.kv_lookup_eval_group,
        lib.kv_lookup_train_group,
        lib.kv_fused_backward_group,
        lib.kv_insert,
        lib.kv_place,
        lib.kv_bulk_load,
        lib.kv_scatter_rows,
        lib.kv_read_records,
        lib.kv_record_checksum,
        lib.kv_write_records,
        lib.kv_export_order,
        lib.kv_crc32,
        lib.kv_crc32_folds,
        lib.kv_cpu_has_avx2,
        lib.kv_build_has_avx2,
    ):
        fn.restype = c_int
    return lib, None


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    """The library the ops use: the AVX2 build where the CPU runs it, else the portable one."""
    variants = built_variants()
    if not variants:
        return None, load_variant("portable")[1]
    return load_variant(variants[-1])


def variant() -> str | None:
    """Which build the ops use (``portable`` / ``avx2``), None when unavailable."""
    lib = _load()[0]
    if lib is None:
        return None
    return "avx2" if lib.kv_build_has_avx2() else "portable"


def available() -> bool:
    """True when the compiled library is loaded (built at install, current ABI)."""
    return _load()[0] is not None


def unavailable_reason() -> str | None:
    """Why ``available()`` is False (None when it is True)."""
    return _load()[1]


def use_native(device: torch.device | str) -> bool:
    """True when ops on ``device`` should run the native kernels: CPU tensors, the
    library available, and ``TORCHREC_KVEMB_BACKEND`` not forcing ``torch`` or ``triton``."""
    return torch.device(device).type == "cpu" and backend_setting() == "auto" and available()


def _lib() -> ctypes.CDLL:
    lib, reason = _load()
    if lib is None:
        raise NativeOpError(f"torchrec_kvemb native kernels unavailable: {reason}")
    return lib


# ------------------------------------------------------------- argument checks
def _tensor(
    value: torch.Tensor | None,
    name: str,
    dtype: torch.dtype,
    shape: tuple[int, ...] | None = None,
    optional: bool = False,
) -> int | None:
    """``value``'s data pointer after checking it is a contiguous CPU tensor of
    ``dtype`` (and ``shape``; -1 matches any size)."""
    if value is None:
        if optional:
            return None
        raise ValueError(f"native op: {name} is required")
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"native op: {name} must be a tensor, got {type(value).__name__}")
    if value.device.type != "cpu":
        raise ValueError(f"native op: {name} must be on the CPU, got {value.device}")
    if value.dtype != dtype:
        raise ValueError(f"native op: {name} must be {dtype}, got {value.dtype}")
    if not value.is_contiguous():
        raise ValueError(f"native op: {name} must be contiguous")
    if shape is not None and (
        value.dim() != len(shape) or any(s not in (-1, v) for s, v in zip(shape, value.shape))
    ):
        want = tuple("*" if s == -1 else s for s in shape)
        raise ValueError(f"native op: {name} must have shape {want}, got {tuple(value.shape)}")
    return value.data_ptr()


def _check_status(status: int, op: str) -> None:
    if status == _OK:
        return
    if status == _NEGATIVE_ID:
        raise KVInputError(f"{op}: ids must be >= 0")
    if status == _BAD_TABLE:
        raise ValueError(f"{op}: table_idx entries must be in [-1, num_tables)")
    if status == _OUT_OF_MEMORY:
        raise NativeOpError(f"{op}: out of memory")
    raise NativeOpError(f"{op}: inconsistent arguments (sizes, offsets or indices; code {status})")


#: Items below which an op given no thread count runs on one thread (why: a
#: thread start costs 30-50 us, and on a busy machine a thread waiting for a
#: core stalls the call for a scheduler slice, milliseconds).
SMALL_WORK = 65_536


def _threads(num_threads: int | None, work: int | None = None) -> int:
    if num_threads is None and work is not None and work < SMALL_WORK:
        return 1
    return max(1, int(num_threads if num_threads is not None else torch.get_num_threads()))


def _per_table(value: torch.Tensor | Sequence, dtype: torch.dtype, name: str, T: int):
    out = torch.as_tensor(value, dtype=dtype).contiguous()
    if tuple(out.shape) != (T,):
        raise ValueError(f"native op: {name} must have {T} entries, got shape {tuple(out.shape)}")
    return out


class Workspace:
    """Scratch memory the native ops reuse from call to call (why: fresh scratch
    pages cost ~15% of a training lookup of 327k ids in page faults).

    Optional: an op without one allocates its own. Keep one per group (or per
    thread); a call that finds it in use by another call allocates its own.
    Freed with the object.

    Example::

        workspace = native.Workspace()
        out = native.lookup_train_group(..., workspace=workspace)
    """

    def __init__(self) -> None:
        self._lib = _lib()
        self._handle = self._lib.kv_workspace_create()
        if not self._handle:
            raise NativeOpError("Workspace: out of memory")

    @property
    def nbytes(self) -> int:
        """Bytes of scratch held now."""
        return int(self._lib.kv_workspace_bytes(self._handle))

    def __del__(self) -> None:
        handle, self._handle = getattr(self, "_handle", None), None
        if handle:
            self._lib.kv_workspace_destroy(handle)


def _workspace_handle(workspace: Workspace | None) -> int | None:
    if workspace is None:
        return None
    if not isinstance(workspace, Workspace):
        raise TypeError(f"native op: workspace must be a Workspace, got {type(workspace).__name__}")
    return workspace._handle


# ------------------------------------------------------------------ hashing
def index_bucket(ids: torch.Tensor, num_buckets: int) -> torch.Tensor:
    """``ops.hashing.index_bucket`` by the native multiply-high remainder."""
    out = torch.empty_like(ids)
    status = _lib().kv_index_bucket(
        _tensor(ids, "ids", torch.int64, (-1,)), ids.numel(), int(num_buckets), out.data_ptr()
    )
    _check_status(status, "index_bucket")
    return out


def export_order(
    keys: torch.Tensor, route_buckets: int, salt: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``ops.export_order.export_order_torch(keys, route_buckets)`` for flat ``keys``
    (routing hash salt ``salt``): a counting sort by routing bucket, then by id."""
    n = int((keys >= 0).sum())
    ids = torch.empty(n, dtype=torch.int64)
    slots = torch.empty(n, dtype=torch.int64)
    counts = torch.empty(int(route_buckets), dtype=torch.int64)
    status = _lib().kv_export_order(
        _tensor(keys, "keys", torch.int64, (-1,)),
        keys.numel(),
        salt & 0xFFFFFFFFFFFFFFFF,
        int(route_buckets),
        n,
        ids.data_ptr(),
        slots.data_ptr(),
        counts.data_ptr(),
    )
    _check_status(status, "export_order")
    return ids, slots, counts


def init_uniform(
    ids: torch.Tensor, dim: int, seed: int, low: float, high: float, num_threads: int = 1
) -> torch.Tensor:
    """``ops.hashing.init_rows(ids, dim, seed, False, low, high)``, natively (same bits)."""
    out = torch.empty(ids.numel(), dim, dtype=torch.float32)
    status = _lib().kv_init_uniform(
        _tensor(ids, "ids", torch.int64, (-1,)),
        ids.numel(),
        int(dim),
        seed_mix(seed),
        float(low),
        float(high),
        _threads(num_threads),
        out.data_ptr(),
    )
    _check_status(status, "init_uniform")
    return out


# ------------------------------------------------------------------ lookups
def lookup_eval_group(
    keys: torch.Tensor,
    bucket_offset: torch.Tensor,
    num_buckets: torch.Tensor,
    ids: torch.Tensor,
    table_idx: torch.Tensor,
    num_threads: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Read-only probe of a group: ``(slots [n], hits [T])``.

    ``slots`` are global (-1: absent, or ``table_idx`` -1: not this group's id);
    ``hits`` counts the found ids per table (``misses`` = ids of the table - hits).
    """
    T = bucket_offset.numel()
    n = ids.numel()
    slots = torch.empty(n, dtype=torch.int64)
    hits = torch.empty(T, dtype=torch.int64)
    status = _lib().kv_lookup_eval_group(
        _tensor(keys, "keys", torch.int64, (-1, WAYS)),
        keys.shape[0],
        _tensor(bucket_offset, "bucket_offset", torch.int64, (T,)),
        _tensor(num_buckets, "num_buckets", torch.int64, (T,)),
        T,
        _tensor(ids, "ids", torch.int64, (-1,)),
        _tensor(table_idx, "table_idx", torch.int64, (n,)),
        n,
        _threads(num_threads, n),
        slots.data_ptr(),
        hits.data_ptr(),
    )
    _check_status(status, "lookup_eval_group")
    return slots, hits


def insert(
    keys: torch.Tensor,
    scores: torch.Tensor,
    ids: torch.Tensor,
    values: torch.Tensor,
    accumulate: bool,
    keep_existing: bool,
    num_threads: int | None = None,
    workspace: Workspace | None = None,
) -> InsertResult:
    """``ops.insert.insert_torch`` natively: find-or-insert of unique ``ids`` (>= 0)
    with score ``values`` in the index ``keys`` / ``scores``, updated in place.
    The same slots, hits, insertions and evictions (evictions ascending by slot)."""
    n = ids.numel()
    slots = torch.empty(n, dtype=torch.int64)
    flags = torch.empty(2, n, dtype=torch.uint8)
    evicted = torch.empty(2, n, dtype=torch.int64)
    count = torch.zeros(1, dtype=torch.int64)
    args = _InsertArgs(
        keys=_tensor(keys, "keys", torch.int64, (-1, WAYS)),
        scores=_tensor(scores, "scores", torch.int64, tuple(keys.shape)),
        num_buckets=keys.shape[0],
        ids=_tensor(ids, "ids", torch.int64, (-1,)),
        values=_tensor(values, "values", torch.int64, (n,)),
        n=n,
        accumulate=int(bool(accumulate)),
        keep_existing=int(bool(keep_existing)),
        num_threads=_threads(num_threads, n),
        workspace=_workspace_handle(workspace),
        slots=slots.data_ptr(),
        hit=flags[0].data_ptr(),
        inserted=flags[1].data_ptr(),
        evicted_ids=evicted[0].data_ptr(),
        evicted_slots=evicted[1].data_ptr(),
        num_evicted=count.data_ptr(),
    )
    _check_status(_lib().kv_insert(ctypes.byref(args)), "insert")
    e = int(count)
    flags = flags.view(torch.bool)
    return InsertResult(slots, flags[0], flags[1], evicted[0, :e], evicted[1, :e])


def place(keys: torch.Tensor, ids: torch.Tensor, num_threads: int | None = None) -> torch.Tensor:
    """``BucketIndex.place`` natively: absent ``ids`` (>= 0) into the first empty ways
    of their buckets in the given order; their slots, -1 for every id of a bucket
    without room for all of them. ``keys`` is updated in place."""
    slots = torch.empty(ids.numel(), dtype=torch.int64)
    status = _lib().kv_place(
        _tensor(keys, "keys", torch.int64, (-1, WAYS)),
        keys.shape[0],
        _tensor(ids, "ids", torch.int64, (-1,)),
        ids.numel(),
        _threads(num_threads, ids.numel()),
        slots.data_ptr(),
    )
    _check_status(status, "place")
    return slots


def bulk_load(
    keys: torch.Tensor,
    scores: torch.Tensor,
    ids: torch.Tensor,
    values: torch.Tensor,
    num_threads: int | None = None,
) -> torch.Tensor:
    """``BucketIndex.bulk_load`` natively: unique ``ids`` (>= 0) with score ``values``
    into the EMPTY index ``keys`` / ``scores``; slots ``[n]``, -1 for the ids a full
    bucket left out (the same slots as the torch path)."""
    n = ids.numel()
    slots = torch.empty(n, dtype=torch.int64)
    status = _lib().kv_bulk_load(
        _tensor(keys, "keys", torch.int64, (-1, WAYS)),
        _tensor(scores, "scores", torch.int64, tuple(keys.shape)),
        keys.shape[0],
        _tensor(ids, "ids", torch.int64, (-1,)),
        _tensor(values, "values", torch.int64, (n,)),
        n,
        _threads(num_threads, n),
        slots.data_ptr(),
    )
    _check_status(status, "bulk_load")
    return slots


def scatter_rows(
    dest: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, num_threads: int | None = None
) -> None:
    """``dest.index_copy_(0, slots, rows)`` for float32 ``dest [N, w]`` and ``rows [k, w]``
    whose rows are contiguous (any row stride); ``slots`` in ``[0, N)``."""
    k = slots.numel()
    for name, t in (("dest", dest), ("rows", rows)):
        if t.dtype != torch.float32 or t.dim() != 2 or t.device.type != "cpu":
            raise ValueError(f"native op: {name} must be a 2-D float32 CPU tensor")
        if t.shape[1] > 1 and t.stride(1) != 1:
            raise ValueError(f"native op: {name}'s rows must be contiguous")
    if rows.shape != (k, dest.shape[1]):
        raise ValueError(f"native op: rows must have shape ({k}, {dest.shape[1]})")
    status = _lib().kv_scatter_rows(
        dest.data_ptr(),
        dest.shape[0],
        dest.stride(0),
        dest.shape[1],
        _tensor(slots, "slots", torch.int64, (k,)),
        k,
        rows.data_ptr(),
        rows.stride(0),
        _threads(num_threads, k * dest.shape[1]),
    )
    _check_status(status, "scatter_rows")


# ---------------------------------------------------------------- checksums
def crc32(address: int, n: int, value: int = 0) -> int:
    """``zlib.crc32`` of the ``n`` bytes at ``address``, continuing ``value``."""
    out = ctypes.c_uint32()
    status = _lib().kv_crc32(address, n, value & 0xFFFFFFFF, ctypes.byref(out))
    _check_status(status, "crc32")
    return out.value


def crc32_folds() -> bool:
    """Whether :func:`crc32` folds with carry-less multiplies here (x86-64 with
    PCLMULQDQ); where it does not, zlib's is faster."""
    return available() and bool(_lib().kv_crc32_folds())


# ------------------------------------------------------------ slab records
def record_checksum(block: torch.Tensor, num_threads: int | None = None) -> torch.Tensor:
    """Checksums ``[k]`` of slab records ``block [k, words]`` (``ssd.slab.checksum``)."""
    out = torch.empty(block.shape[0], dtype=torch.int64)
    status = _lib().kv_record_checksum(
        _tensor(block, "block", torch.int64, (-1, -1)),
        block.shape[0],
        block.shape[1],
        _threads(num_threads, block.shape[0]),
        out.data_ptr(),
    )
    _check_status(status, "record_checksum")
    return out


def _record_args(slab: torch.Tensor, records: torch.Tensor, ids: torch.Tensor) -> tuple:
    """The leading arguments of the record ops: the slab ``[records, words]``, then
    ``k`` record numbers and their ids."""
    k = records.numel()
    return (
        _tensor(slab, "slab", torch.int64, (-1, -1)),
        slab.shape[0],
        slab.shape[1],
        _tensor(records, "records", torch.int64, (k,)),
        k,
        _tensor(ids, "ids", torch.int64, (k,)),
    )


def read_records(
    slab: torch.Tensor, records: torch.Tensor, ids: torch.Tensor, num_threads: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Copies of ``records`` of ``slab [records, words]``: ``(block [k, words], ok [k])``,
    ``ok`` where a record holds its id of ``ids`` and its checksum matches (what
    ``index_select`` then ``Slab.verify`` give)."""
    k = records.numel()
    out = torch.empty(k, slab.shape[1], dtype=torch.int64)
    ok = torch.empty(k, dtype=torch.bool)
    status = _lib().kv_read_records(
        *_record_args(slab, records, ids),
        _threads(num_threads, k),
        out.data_ptr(),
        ok.data_ptr(),
    )
    _check_status(status, "read_records")
    return out, ok


def write_records(
    slab: torch.Tensor,
    records: torch.Tensor,
    ids: torch.Tensor,
    scores: torch.Tensor,
    rows: torch.Tensor,
    num_threads: int | None = None,
) -> None:
    """Encode records of ``ids``, ``scores`` and float32 ``rows [k, width]`` (with their
    checksums) into ``slab [records, words]`` at the distinct ``records``: what
    ``slab.index_copy_(0, records, Slab.encode(ids, scores, rows))`` writes."""
    k = records.numel()
    status = _lib().kv_write_records(
        *_record_args(slab, records, ids),
        _tensor(scores, "scores", torch.int64, (k,)),
        _tensor(rows, "rows", torch.float32, (k, -1)),
        rows.shape[1],
        _threads(num_threads, k),
    )
    _check_status(status, "write_records")


class CounterIndex(NamedTuple):
    """A group's admission counter: keys, scores ``[NCB, WAYS]`` and counts ``[NCB * WAYS]``."""

    keys: torch.Tensor
    scores: torch.Tensor
    counts: torch.Tensor


class TrainLookup(NamedTuple):
    """What ``lookup_train_group`` did. Uniques are (table, id) pairs ordered by
    global bucket, then stored ids by way, then new ids by id; evictions by slot."""

    slots: torch.Tensor  # [n] global slot per occurrence, -1: no row
    unique_index: torch.Tensor  # [n] unique of each occurrence, -1: table_idx -1
    unique_ids: torch.Tensor  # [U]
    unique_slots: torch.Tensor  # [U], -1: no row (not admitted / no room)
    unique_table: torch.Tensor  # [U]
    unique_inserted: torch.Tensor  # [U] bool: got a new row in this call
    evicted_ids: torch.Tensor  # [E]
    evicted_slots: torch.Tensor  # [E], reused by inserted ids
    metrics: torch.Tensor  # [T, 6] int64 deltas, columns METRIC_NAMES
    # With a ``TierPromotion`` only (else None):
    unique_flags: torch.Tensor | None = None  # [U] uint8, UNIQUE_* bits
    unique_scores: torch.Tensor | None = None  # [U] the score held (or, without a row, due)
    evicted_scores: torch.Tensor | None = None  # [E] the evicted entries' scores


#: Bits of ``TrainLookup.unique_flags`` (KvUniqueFlag in csrc/kvemb_native.h).
UNIQUE_INSERTED, UNIQUE_PROMOTED, UNIQUE_NO_ROOM = 1, 2, 4


class TierPromotion(NamedTuple):
    """The batch's ids a lower tier holds (none in memory) with their in-memory
    scores: ``lookup_train_group`` of a group of tables over SSD tiers. Table by
    table (``offsets [T + 1]``: table ``t``'s at ``[offsets[t], offsets[t + 1])``;
    None: a group of one table), ascending within a table."""

    ids: torch.Tensor
    scores: torch.Tensor
    offsets: torch.Tensor | None = None


def lookup_train_group(
    tables: GroupLayout,
    keys: torch.Tensor,
    scores: torch.Tensor,
    weights: torch.Tensor,
    state: torch.Tensor,
    ids: torch.Tensor,
    table_idx: torch.Tensor,
    step: torch.Tensor | Sequence[int],
    custom_scores: torch.Tensor | None = None,
    custom_tables: torch.Tensor | Sequence[bool] | None = None,
    counter: CounterIndex | None = None,
    num_threads: int | None = None,
    workspace: Workspace | None = None,
    tier: TierPromotion | None = None,
) -> TrainLookup:
    """Slots for a training batch of a group, inserting new ids; updates in place.

    Per table, ``KVTable.lookup_train``: ids are de-duplicated per (table, id);
    the score value of an id is ``step[t]`` (LRU, NONE: stored entries never
    lose), its count in the batch (LFU, added to the stored count), or the max
    of its ``custom_scores`` (CUSTOM_SCORE tables with ``custom_tables[t]``
    true; default: every CUSTOM_SCORE table when ``custom_scores`` is given).
    ``step`` is each table's clock for this batch, already advanced. Ids of
    admission tables not stored are counted in ``counter``; only stored and
    admitted ids compete for rows (ops/insert.py's rule). New rows get their
    initial values (normal ones through ``ops.hashing.init_rows``) and zero
    optimizer state. ``num_threads`` (default ``torch.get_num_threads()``)
    changes the speed only; ``workspace`` keeps scratch memory between calls.

    ``tier`` (tables over lower tiers): its ids compete as stored
    ones that outrank every unprotected entry (see ``KvTrainArgs``); no row is
    written (the caller moves evicted rows out first, then writes promoted and
    new rows), and the result has ``unique_flags``, ``unique_scores`` and
    ``evicted_scores``.
    """
    T = tables.num_tables
    n = ids.numel()
    nb = keys.shape[0] if keys.dim() == 2 else -1
    dim = weights.shape[1] if weights.dim() == 2 else -1
    state_dim = state.shape[1] if state.dim() == 2 else -1
    if nb < tables.total_buckets:
        raise ValueError(
            f"lookup_train_group: keys has {nb} buckets, the tables need {tables.total_buckets}"
        )
    args = _TrainArgs(
        keys=_tensor(keys, "keys", torch.int64, (nb, WAYS)),
        scores=_tensor(scores, "scores", torch.int64, (nb, WAYS)),
        num_buckets_total=nb,
        # Half-precision rows: the kernel writes no weights; new rows are written below.
        weights=_tensor(weights, "weights", torch.float32, (nb * WAYS, dim))
        if weights.dtype == torch.float32
        else _tensor(None, "weights", torch.float32, optional=True),
        dim=dim,
        state=_tensor(state, "state", torch.float32, (nb * WAYS, state_dim)),
        state_dim=state_dim,
        num_tables=T,
        ids=_tensor(ids, "ids", torch.int64, (n,)),
        table_idx=_tensor(table_idx, "table_idx", torch.int64, (n,)),
        n=n,
        num_threads=_threads(num_threads),
        workspace=_workspace_handle(workspace),
    )
    if tables.has_admission:
        if counter is None:
            raise ValueError("lookup_train_group: tables with admission need the counter index")
        ncb = counter.keys.shape[0] if counter.keys.dim() == 2 else -1
        if ncb < tables.total_counter_buckets:
            raise ValueError(
                f"lookup_train_group: the counter has {ncb} buckets, "
                f"the tables need {tables.total_counter_buckets}"
            )
        args.counter_keys = _tensor(counter.keys, "counter.keys", torch.int64, (ncb, WAYS))
        args.counter_scores = _tensor(counter.scores, "counter.scores", torch.int64, (ncb, WAYS))
        args.counter_counts = _tensor(counter.counts, "counter.counts", torch.int64, (ncb * WAYS,))
        args.counter_num_buckets_total = ncb
    use_custom = torch.zeros(T, dtype=torch.int64)
    if custom_scores is not None:
        custom_scores = custom_scores.to(torch.int64).contiguous()
        args.custom_scores = _tensor(custom_scores, "custom_scores", torch.int64, (n,))
        use_custom = (
            torch.ones(T, dtype=torch.int64)
            if custom_tables is None
            else _per_table(custom_tables, torch.int64, "custom_tables", T)
        )
    step = _per_table(step, torch.int64, "step", T)
    per_table = dict(
        bucket_offset=tables.bucket_offset,
        num_buckets=tables.num_buckets,
        policy=tables.policy,
        step=step,
        use_custom=use_custom,
        admission_threshold=tables.admission_threshold,
        counter_bucket_offset=tables.counter_bucket_offset,
        counter_num_buckets=tables.counter_num_buckets,
        init_native=(1 - tables.init_normal) * int(weights.dtype == torch.float32),
        seed_mix=tables.seed_mix,
    )
    for name, value in per_table.items():
        setattr(args, name, _tensor(value, name, torch.int64, (T,)))
    args.init_low = _tensor(tables.init_a, "init_low", torch.float64, (T,))
    args.init_high = _tensor(tables.init_b, "init_high", torch.float64, (T,))

    i64 = dict(dtype=torch.int64)
    tier_out = None
    if tier is not None:
        if T != 1 and tier.offsets is None:
            raise ValueError("lookup_train_group: a tier of several tables needs its offsets")
        p = tier.ids.numel()
        args.weights = args.state = None
        args.promote_ids = _tensor(tier.ids, "tier.ids", torch.int64, (p,))
        args.promote_scores = _tensor(tier.scores, "tier.scores", torch.int64, (p,))
        if tier.offsets is not None:
            args.promote_offsets = _tensor(tier.offsets, "tier.offsets", torch.int64, (T + 1,))
        args.num_promote = p
        tier_out = (
            torch.empty(n, dtype=torch.uint8),
            torch.empty(n, **i64),
            torch.empty(n, **i64),
        )
        args.unique_flags, args.unique_scores, args.evicted_scores = (
            t.data_ptr() for t in tier_out
        )
    slots, unique_index = torch.empty(n, **i64), torch.empty(n, **i64)
    unique_ids, unique_slots, unique_table = (torch.empty(n, **i64) for _ in range(3))
    unique_inserted = torch.empty(n, dtype=torch.bool)
    evicted_ids, evicted_slots = torch.empty(n, **i64), torch.empty(n, **i64)
    metrics, sizes = torch.empty(T, len(METRIC_NAMES), **i64), torch.empty(2, **i64)
    for name, out in (
        ("slots", slots),
        ("unique_index", unique_index),
        ("unique_ids", unique_ids),
        ("unique_slots", unique_slots),
        ("unique_table", unique_table),
        ("unique_inserted", unique_inserted),
        ("evicted_ids", evicted_ids),
        ("evicted_slots", evicted_slots),
        ("metrics", metrics),
        ("sizes", sizes),
    ):
        setattr(args, name, out.data_ptr())
    _check_status(_lib().kv_lookup_train_group(ctypes.byref(args)), "lookup_train_group")

    u, e = sizes.tolist()
    result = TrainLookup(
        slots,
        unique_index,
        unique_ids[:u],
        unique_slots[:u],
        unique_table[:u],
        unique_inserted[:u],
        evicted_ids[:e],
        evicted_slots[:e],
        metrics,
    )
    if tier_out is not None:
        flags, scores_u, scores_e = tier_out
        return result._replace(
            unique_flags=flags[:u], unique_scores=scores_u[:u], evicted_scores=scores_e[:e]
        )
    every_table = weights.dtype != torch.float32
    if tables.has_normal or every_table:
        _fill_new_rows(tables, weights, result, every_table)
    return result


def _fill_new_rows(
    tables: GroupLayout, weights: torch.Tensor, result: TrainLookup, every_table: bool
) -> None:
    """Initial rows of the new ids of NORMAL tables (of every table with
    ``every_table``: half-precision rows), by the torch path (why NORMAL: its log
    and cos are torch's vectorized ones, which C++ libm does not match bit for bit)."""
    new = result.unique_inserted
    if not bool(new.any()):
        return
    dim = weights.shape[1]
    for t, spec in enumerate(tables.init_specs):
        if not (spec.normal or every_table):
            continue
        mask = new & (result.unique_table == t)
        if bool(mask.any()):
            rows = init_rows(result.unique_ids[mask], dim, spec.seed, spec.normal, spec.a, spec.b)
            weights.index_copy_(0, result.unique_slots[mask], rows.to(weights.dtype))


# ----------------------------------------------------------------- backward
def fused_backward_group(
    weights: torch.Tensor,
    state: torch.Tensor,
    grad_out: torch.Tensor,
    offsets: torch.Tensor,
    unique_index: torch.Tensor,
    unique_slots: torch.Tensor,
    unique_table: torch.Tensor,
    config: FusedOptimConfig,
    learning_rate: torch.Tensor | Sequence[float],
    optim_step: torch.Tensor | Sequence[int],
    per_sample_weights: torch.Tensor | None = None,
    mean: bool = False,
    num_threads: int | None = None,
    workspace: Workspace | None = None,
) -> None:
    """Reduce the pooled gradient per unique row and apply one optimizer step, in place.

    ``offsets [num_bags + 1]`` cut the lookup's occurrences into bags; the
    gradient of a unique row is the sum over its occurrences of
    ``grad_out[bag] * scale`` (scale: the per-sample weight, divided by the bag
    length for ``mean``); rows with slot -1 get nothing. ``grad_out`` is
    ``[num_bags, dim]`` or ``[G, B, dim]`` (bag ``b`` at ``[b // B, b % B]``,
    any strides with a unit last one: e.g. a ``KeyedTensor`` gradient
    ``[B, G * dim]`` viewed as ``.view(B, G, dim).transpose(0, 1)``).
    ``config`` gives the optimizer of the group; ``learning_rate`` and
    ``optim_step`` (Adam's bias correction, already advanced) are per table.
    """
    T = len(learning_rate) if not isinstance(learning_rate, torch.Tensor) else learning_rate.numel()
    rows = weights.shape[0] if weights.dim() == 2 else -1
    dim = weights.shape[1] if weights.dim() == 2 else -1
    state_dim = config.state_dim(dim)
    n = unique_index.numel()
    U = unique_slots.numel()
    num_bags = offsets.numel() - 1
    if num_bags < 0:
        raise ValueError("fused_backward_group: offsets must have at least one entry")
    grad = grad_out.unsqueeze(0) if grad_out.dim() == 2 else grad_out
    if (
        grad.dim() != 3
        or grad.shape[2] != dim
        or grad.shape[0] * grad.shape[1] != num_bags
        or grad.stride(2) != 1
    ):
        raise ValueError(
            f"fused_backward_group: grad_out must be [{num_bags}, {dim}] or [G, B, {dim}] with "
            f"G * B = {num_bags} and a unit last stride, got shape {tuple(grad_out.shape)} "
            f"strides {grad_out.stride()}"
        )
    if grad.dtype != torch.float32 or grad.device.type != "cpu":
        raise ValueError(
            f"fused_backward_group: grad_out must be float32 on the CPU, got {grad.dtype} "
            f"on {grad.device}"
        )
    lr = _per_table(learning_rate, torch.float64, "learning_rate", T)
    steps = _per_table(optim_step, torch.int64, "optim_step", T)
    args = _BackwardArgs(
        weights=_tensor(weights, "weights", torch.float32, (rows, dim)),
        state=_tensor(state, "state", torch.float32, (rows, state_dim)),
        num_rows=rows,
        dim=dim,
        state_dim=state_dim,
        grad=grad.data_ptr(),
        bags_per_group=max(1, grad.shape[1]),
        group_stride=grad.stride(0),
        bag_stride=grad.stride(1),
        offsets=_tensor(offsets, "offsets", torch.int64, (num_bags + 1,)),
        num_bags=num_bags,
        per_sample_weights=_tensor(
            per_sample_weights, "per_sample_weights", torch.float32, (n,), optional=True
        ),
        mean=int(bool(mean)),
        unique_index=_tensor(unique_index, "unique_index", torch.int64, (n,)),
        n=n,
        unique_slots=_tensor(unique_slots, "unique_slots", torch.int64, (U,)),
        unique_table=_tensor(unique_table, "unique_table", torch.int64, (U,)),
        num_unique=U,
        num_tables=T,
        learning_rate=lr.data_ptr(),
        optim_step=steps.data_ptr(),
        kind=_OPTIM_CODES[config.kind],
        eps=config.eps,
        beta1=config.beta1,
        beta2=config.beta2,
        weight_decay=config.weight_decay,
        weight_decay_mode=int(config.weight_decay_mode),
        gradient_clipping=int(config.gradient_clipping),
        max_gradient=config.max_gradient,
        num_threads=_threads(num_threads),
        workspace=_workspace_handle(workspace),
    )
    _check_status(_lib().kv_fused_backward_group(ctypes.byref(args)), "fused_backward_group")


__all__ = [
    "ABI_VERSION",
    "METRIC_NAMES",
    "CounterIndex",
    "NativeOpError",
    "TierPromotion",
    "TrainLookup",
    "UNIQUE_INSERTED",
    "UNIQUE_NO_ROOM",
    "UNIQUE_PROMOTED",
    "Workspace",
    "VARIANTS",
    "available",
    "built_variants",
    "bulk_load",
    "fused_backward_group",
    "index_bucket",
    "init_uniform",
    "insert",
    "library_path",
    "load_variant",
    "place",
    "lookup_eval_group",
    "lookup_train_group",
    "read_records",
    "record_checksum",
    "scatter_rows",
    "unavailable_reason",
    "use_native",
    "variant",
    "write_records",
]


if __name__ == "__main__":  # one line for install logs: ``python -m torchrec_kvemb.ops.native``
    if available():
        print(f"native kernels: {variant()} build in use; built: {', '.join(built_variants())}")
    else:
        print(f"native kernels: no ({unavailable_reason()})")
