"""The native CPU library: loading, its C ABI, and the checks every call makes.

``csrc/`` is built by the package's install (``setup.py``) into one shared
library, in two builds on x86-64 (``portable`` and ``avx2``, the same results);
this module finds and loads the one the CPU runs (``load``), checks its ABI
version against ``ABI_VERSION`` (a stale build is refused with the reason in
``unavailable_reason()``), mirrors the argument structs of
``csrc/kvemb_native.h`` field for field, and gives the wrappers in
``ops/native.py`` their argument checks (``tensor_ptr``), status translation
(``check_status``), thread counts and scratch memory (``Workspace``).

Why the mirrors live here, apart from the wrappers: they must change together
with the header (and its ``ABI_VERSION``); kept side by side, a field added to
one cannot be missed in the other.

Example::

    if native_lib.available():
        lib = native_lib.library()          # the loaded ctypes library
        print(native_lib.variant())         # "avx2" or "portable"
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
from collections.abc import Sequence
from pathlib import Path

import torch

from torchrec_kvemb.validation import KVInputError

#: The shared library's extension name (setup.py builds csrc/ into it).
LIBRARY = "torchrec_kvemb._kvemb_native"
#: Must equal KV_ABI_VERSION in csrc/kvemb_native.h.
ABI_VERSION = 17

_OK, _BAD_TABLE, _NEGATIVE_ID, _OUT_OF_MEMORY, _BAD_ARGUMENT, _NO_ROOM = range(6)


class NativeOpError(RuntimeError):
    """A native op refused its arguments or ran out of memory."""


class NoRoomError(NativeOpError):
    """``host_exchange``: an id to place found no empty way in its main or stash
    bucket (nothing was written: the caller grows the index and places it)."""


# ----------------------------------------------------------------- loading
_I64 = ctypes.c_int64
_F64 = ctypes.c_double
_PTR = ctypes.c_void_p


class TrainArgs(ctypes.Structure):
    """Mirror of ``KvTrainArgs`` (csrc/kvemb_native.h), field for field."""

    _fields_ = [
        ("keys", _PTR),
        ("scores", _PTR),
        ("num_buckets_total", _I64),
        ("weights", _PTR),
        ("weights_dtype", _I64),
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
        ("tier_index", _PTR),
        ("unique_tier_slots", _PTR),
    ]


class BackwardArgs(ctypes.Structure):
    """Mirror of ``KvBackwardArgs`` (csrc/kvemb_native.h), field for field."""

    _fields_ = [
        ("weights", _PTR),
        ("weights_dtype", _I64),
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


class PooledArgs(ctypes.Structure):
    """Mirror of ``KvPooledArgs`` (csrc/kvemb_native.h), field for field."""

    _fields_ = [
        ("weights", _PTR),
        ("weights_dtype", _I64),
        ("num_rows", _I64),
        ("dim", _I64),
        ("offsets", _PTR),
        ("num_bags", _I64),
        ("n", _I64),
        ("scale", _PTR),
        ("per_sample_weights", _PTR),
        ("mean_of_bag", _PTR),
        ("table_of_bag", _PTR),
        ("table_idx", _PTR),
        ("num_tables", _I64),
        ("slots", _PTR),
        ("keys", _PTR),
        ("num_buckets_total", _I64),
        ("bucket_offset", _PTR),
        ("num_buckets", _PTR),
        ("ids", _PTR),
        ("out", _PTR),
        ("out_numel", _I64),
        ("out_offset", _PTR),
        ("hits", _PTR),
        ("seen", _PTR),
        ("missing", _PTR),
        ("num_threads", _I64),
        ("unpooled", _I64),
    ]


class InsertArgs(ctypes.Structure):
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


class HostExchangeArgs(ctypes.Structure):
    """Mirror of ``KvHostExchangeArgs`` (csrc/kvemb_native.h), field for field."""

    _fields_ = [
        ("weights", _PTR),
        ("state", _PTR),
        ("table_rows", _I64),
        ("dim", _I64),
        ("state_dim", _I64),
        ("rows", _PTR),
        ("record_ids", _PTR),
        ("record_scores", _PTR),
        ("num_records", _I64),
        ("free_list", _PTR),
        ("free_count", _PTR),
        ("main_keys", _PTR),
        ("main_scores", _PTR),
        ("main_record", _PTR),
        ("main_slots", _I64),
        ("stash_keys", _PTR),
        ("stash_scores", _PTR),
        ("stash_record", _PTR),
        ("stash_slots", _I64),
        ("down_slots", _PTR),
        ("down_ids", _PTR),
        ("down_scores", _PTR),
        ("down_host_slots", _PTR),
        ("num_down", _I64),
        ("up_host_slots", _PTR),
        ("up_slots", _PTR),
        ("num_up", _I64),
        ("num_threads", _I64),
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
    package_dir = Path(__file__).resolve().parent
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
    lib.kv_lookup_train_group.argtypes = [ctypes.POINTER(TrainArgs)]
    lib.kv_fused_backward_group.argtypes = [ctypes.POINTER(BackwardArgs)]
    lib.kv_insert.argtypes = [ctypes.POINTER(InsertArgs)]
    lib.kv_host_exchange.argtypes = [ctypes.POINTER(HostExchangeArgs)]
    lib.kv_pooled_forward.argtypes = [ctypes.POINTER(PooledArgs)]
    lib.kv_read_records.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _PTR, _I64, _PTR, _PTR]
    lib.kv_bulk_load.argtypes = [_PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _PTR]
    lib.kv_scatter_rows.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64, _I64]
    lib.kv_gather_rows.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _I64, _I64]
    lib.kv_place.argtypes = [_PTR, _I64, _PTR, _I64, _I64, _PTR]
    lib.kv_record_checksum.argtypes = [_PTR, _I64, _I64, _I64, _PTR]
    lib.kv_write_records.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64]
    lib.kv_export_order.argtypes = [_PTR, _I64, ctypes.c_uint64, _I64, _I64, _PTR, _PTR, _PTR]
    lib.kv_crc32.argtypes = [_PTR, _I64, ctypes.c_uint32, _PTR]
    lib.kv_crc32_folds.argtypes = []
    lib.kv_crc32_copy.argtypes = [_PTR, _PTR, _I64, ctypes.c_uint32, _PTR]
    lib.kv_pool_stats.argtypes = [_PTR]
    lib.kv_pool_selftest.argtypes = [_I64, _I64, _I64, _I64, _PTR, _PTR]
    lib.kv_set_f16c.argtypes = [_I64]
    for fn in (
        lib.kv_index_bucket,
        lib.kv_init_uniform,
        lib.kv_lookup_eval_group,
        lib.kv_lookup_train_group,
        lib.kv_fused_backward_group,
        lib.kv_pooled_forward,
        lib.kv_insert,
        lib.kv_host_exchange,
        lib.kv_place,
        lib.kv_bulk_load,
        lib.kv_scatter_rows,
        lib.kv_gather_rows,
        lib.kv_read_records,
        lib.kv_record_checksum,
        lib.kv_write_records,
        lib.kv_export_order,
        lib.kv_crc32,
        lib.kv_crc32_folds,
        lib.kv_crc32_copy,
        lib.kv_pool_stats,
        lib.kv_pool_selftest,
        lib.kv_cpu_has_avx2,
        lib.kv_build_has_avx2,
        lib.kv_set_f16c,
    ):
        fn.restype = c_int
    return lib, None


@functools.cache
def load() -> tuple[ctypes.CDLL | None, str | None]:
    """The library the ops use: the AVX2 build where the CPU runs it, else the portable one."""
    variants = built_variants()
    if not variants:
        return None, load_variant("portable")[1]
    return load_variant(variants[-1])


def variant() -> str | None:
    """Which build the ops use (``portable`` / ``avx2``), None when unavailable."""
    lib = load()[0]
    if lib is None:
        return None
    return "avx2" if lib.kv_build_has_avx2() else "portable"


def available() -> bool:
    """True when the compiled library is loaded (built at install, current ABI)."""
    return load()[0] is not None


def unavailable_reason() -> str | None:
    """Why ``available()`` is False (None when it is True)."""
    return load()[1]


def library() -> ctypes.CDLL:
    lib, reason = load()
    if lib is None:
        raise NativeOpError(f"torchrec_kvemb native kernels unavailable: {reason}")
    return lib


def set_f16c(enabled: bool, lib: ctypes.CDLL | None = None) -> bool:
    """Whether float16 rows may be converted by the CPU's F16C instructions (the
    default where it has them) or must take the library's integer conversions
    (the same bits; tests run both), for ``lib`` (default: the one the ops use)
    in this process. Returns True if F16C is used after the call."""
    return bool((lib or library()).kv_set_f16c(int(bool(enabled))))


def pool_stats() -> dict[str, int]:
    """What the library's worker pool did in this process (docs/native.md, Threads).

    ``threads``: pool threads started; ``pooled_calls``: parallel calls the pool
    ran; ``spawned_calls``: calls that found it busy (another thread's call)
    and started threads of their own; ``spin_us``: how long an idle pool
    thread spins before it sleeps (``TORCHREC_KVEMB_POOL_SPIN_US``)."""
    out = torch.zeros(4, dtype=torch.int64)
    check_status(library().kv_pool_stats(out.data_ptr()), "pool_stats")
    names = ("threads", "pooled_calls", "spawned_calls", "spin_us")
    return dict(zip(names, out.tolist()))


# ------------------------------------------------------------- argument checks
def tensor_ptr(
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


def check_status(status: int, op: str) -> None:
    if status == _OK:
        return
    if status == _NEGATIVE_ID:
        raise KVInputError(f"{op}: ids must be >= 0")
    if status == _BAD_TABLE:
        raise ValueError(f"{op}: table_idx entries must be in [-1, num_tables)")
    if status == _OUT_OF_MEMORY:
        raise NativeOpError(f"{op}: out of memory")
    if status == _NO_ROOM:
        raise NoRoomError(f"{op}: an id found no empty way in its buckets")
    raise NativeOpError(f"{op}: inconsistent arguments (sizes, offsets or indices; code {status})")


#: Items below which an op given no thread count runs on one thread (why: a
#: thread start cost 30-50 us, and on a busy machine a thread waiting for a
#: core stalled the call for a scheduler slice, milliseconds; measured with
#: threads started per call, before the pool, and kept).
SMALL_WORK = 65_536


def threads(num_threads: int | None, work: int | None = None) -> int:
    if num_threads is None and work is not None and work < SMALL_WORK:
        return 1
    return max(1, int(num_threads if num_threads is not None else torch.get_num_threads()))


def per_table(value: torch.Tensor | Sequence, dtype: torch.dtype, name: str, T: int):
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
        self._lib = library()
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


def workspace_handle(workspace: Workspace | None) -> int | None:
    if workspace is None:
        return None
    if not isinstance(workspace, Workspace):
        raise TypeError(f"native op: workspace must be a Workspace, got {type(workspace).__name__}")
    return workspace._handle


if __name__ == "__main__":  # one line for install logs: ``python -m torchrec_kvemb.native_lib``
    if available():
        print(f"native kernels: {variant()} build in use; built: {', '.join(built_variants())}")
    else:
        print(f"native kernels: no ({unavailable_reason()})")
