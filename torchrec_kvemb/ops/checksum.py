"""CRC-32 of byte buffers (zlib's, the zip format's): the native kernel where it
folds with carry-less multiplies (x86-64 with PCLMULQDQ: about 14 GB/s here
against zlib's 4), zlib elsewhere and for small or read-only buffers. The
checkpoint writer checksums every byte it writes (``checkpoint/tensor_record.py``),
with :func:`crc32_copy` as it copies them into its write buffer: one pass over the
bytes, not one for the copy and one for the checksum.

Example::

    crc = crc32(memoryview(data))             # == zlib.crc32(data)
    crc = crc32(memoryview(more), crc)         # continued over more bytes
    crc = crc32_copy(buffer[:n], memoryview(data), crc)   # buffer[:n] = data, too
"""

from __future__ import annotations

import ctypes
import zlib

from torchrec_kvemb.backend import implementation
from torchrec_kvemb.ops import native

#: Buffers shorter than this go to zlib (a native call costs more than it saves).
NATIVE_FROM = 4096


def crc32(data: memoryview | bytes | bytearray, value: int = 0) -> int:
    """``zlib.crc32(data, value)``, bit for bit (``data`` C-contiguous)."""
    view = memoryview(data).cast("B")
    if len(view) >= NATIVE_FROM and not view.readonly and _native():
        buffer = (ctypes.c_char * len(view)).from_buffer(view)
        return native.crc32(ctypes.addressof(buffer), len(view), value)
    return zlib.crc32(view, value)


def crc32_copy(dst: memoryview, src: memoryview | bytes | bytearray, value: int = 0) -> int:
    """Copy ``src`` into ``dst`` (writable, as many bytes, not overlapping ``src``)
    and return ``zlib.crc32(src, value)``, bit for bit (both C-contiguous)."""
    into = memoryview(dst).cast("B")
    view = memoryview(src).cast("B")
    if len(into) != len(view):
        raise ValueError(f"crc32_copy: {len(view)} bytes into a buffer of {len(into)}")
    if len(view) >= NATIVE_FROM and not view.readonly and _native():
        target = (ctypes.c_char * len(into)).from_buffer(into)
        source = (ctypes.c_char * len(view)).from_buffer(view)
        address = ctypes.addressof
        return native.crc32_copy(address(target), address(source), len(view), value)
    into[:] = view
    return zlib.crc32(view, value)


def _native() -> bool:
    return implementation("cpu") == "native" and native.crc32_folds()
