"""Large CPU arrays on 2 MB pages (Linux transparent huge pages).

A KV table's rows sit at hashed slots of one large array, so an eval step
reads rows spread over a gigabyte: on 4 KB pages nearly every row costs a TLB
miss and a page walk. Where the kernel gives transparent huge pages on request
(``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` or
``always``), a group's arrays are asked for them (``madvise(MADV_HUGEPAGE)``)
before they are first written, so their pages are faulted in as 2 MB pages.
Values never depend on it; elsewhere (another OS, THP ``never``, a CUDA
tensor, arrays under ``MIN_BYTES``) nothing is done.
``TORCHREC_KVEMB_HUGE_PAGES=0`` turns it off (docs/native.md, Huge pages).

Example::

    weights = huge_pages.zeros((1 << 22, 64), torch.float32)   # CPU, 1 GB
    huge_pages.advised(weights)                                # True on Linux with THP
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

import torch

#: The transparent huge page size on x86-64 and most arm64 kernels.
HUGE_PAGE = 2 << 20
#: Arrays smaller than this stay on ordinary pages (why: a few 2 MB pages more
#: or less do not change the TLB misses; small tables stay small in memory).
MIN_BYTES = 8 << 20
_MADV_HUGEPAGE = 14


@functools.cache
def _madvise():
    """libc's ``madvise`` where transparent huge pages can be asked for, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            if "[never]" in f.read():
                return None
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def supported() -> bool:
    """Whether this system gives transparent huge pages on request (Linux, THP not ``never``)."""
    return _madvise() is not None


def enabled() -> bool:
    """Whether new large arrays are asked for huge pages here and now."""
    return os.environ.get("TORCHREC_KVEMB_HUGE_PAGES", "1") != "0" and _madvise() is not None


def advise(tensor: torch.Tensor) -> int:
    """Ask for huge pages under the 2 MB-aligned part of ``tensor``'s memory; the
    bytes asked for (0: not done). Called before the memory is first written, its
    pages are faulted in as 2 MB pages; after, khugepaged merges them later."""
    if tensor.device.type != "cpu" or not enabled():
        return 0
    nbytes = tensor.untyped_storage().nbytes()
    if nbytes < MIN_BYTES:
        return 0
    start = tensor.untyped_storage().data_ptr()
    begin = -(-start // HUGE_PAGE) * HUGE_PAGE
    end = (start + nbytes) // HUGE_PAGE * HUGE_PAGE
    if end <= begin or _madvise()(begin, end - begin, _MADV_HUGEPAGE) != 0:
        return 0
    return end - begin


def full(shape: tuple[int, ...], value: float, dtype: torch.dtype, device=None) -> torch.Tensor:
    """``torch.full`` whose memory was asked for huge pages before it was filled."""
    out = torch.empty(shape, dtype=dtype, device=device)
    advise(out)
    return out.fill_(value)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device=None) -> torch.Tensor:
    """``torch.zeros`` whose memory was asked for huge pages before it was filled."""
    return full(shape, 0, dtype, device)


def advised(tensor: torch.Tensor) -> bool:
    """True when ``tensor``'s memory lies in a mapping marked for huge pages
    (``hg`` in ``/proc/self/smaps``): what ``advise`` did, for tests."""
    address = tensor.untyped_storage().data_ptr() + tensor.untyped_storage().nbytes() // 2
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(" ", 1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and line.startswith("VmFlags:"):
                return " hg" in line
    return False
