"""``ops.checksum.crc32`` and the native ``kv_crc32`` equal ``zlib.crc32`` bit for bit:
every length from 0 to 300 bytes and odd larger ones (the folded bulk, the bytes
before and after it), unaligned starts, continued values, on each build; where the
kernel does not fold (or the native path is off) zlib runs, with the same result."""

import ctypes
import os
import zlib

import pytest

from torchrec_kvemb import native_lib
from torchrec_kvemb.ops import checksum, native

LENGTHS = [*range(0, 300), 1023, 4095, 4096, 65537, 1 << 20]
VALUES = [0, 1, 0xFFFFFFFF, 0x9E3779B9]


@pytest.fixture(scope="module")
def data() -> bytearray:
    return bytearray(os.urandom((1 << 20) + 64))


def test_native_kernel_equals_zlib(native_build, data):
    assert native.crc32_folds() == (native_lib.load_variant("portable")[0].kv_crc32_folds() == 1)
    base = ctypes.addressof((ctypes.c_char * len(data)).from_buffer(data))
    view = memoryview(data)
    wrong = [
        (n, start, value)
        for n in LENGTHS
        for start in (0, 1, 13)
        for value in VALUES
        if native.crc32(base + start, n, value) != zlib.crc32(view[start : start + n], value)
    ]
    assert not wrong, wrong[:10]


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_crc32_equals_zlib(backend, data, monkeypatch):
    monkeypatch.setenv("TORCHREC_KVEMB_BACKEND", backend)
    view = memoryview(data)
    for n in (0, 5, 4095, 4096, 100_003):
        for value in VALUES:
            assert checksum.crc32(view[7 : 7 + n], value) == zlib.crc32(view[7 : 7 + n], value)
    assert checksum.crc32(bytes(view[:9000])) == zlib.crc32(view[:9000])  # read-only: zlib


def test_continued_crc_is_the_whole_crc(data):
    view = memoryview(data)
    crc = 0
    for start in range(0, 200_001, 40_000):
        crc = checksum.crc32(view[start : start + 40_000], crc)
    assert crc == zlib.crc32(view[:240_000])


def test_bad_arguments_are_refused():
    with pytest.raises(native.NativeOpError):
        native.crc32(0, 5, 0)  # no data at address 0


def test_native_copy_equals_zlib_and_copies_the_bytes(native_build, data):
    """``kv_crc32_copy``: the CRC of ``src`` equals zlib's and ``dst`` holds exactly
    ``src`` (the bytes around it untouched), for every length to 300 and odd larger
    ones, destinations at each offset from a 16-byte boundary (the unaligned head,
    the non-temporal bulk, the tail) and unaligned sources."""
    out = bytearray(len(data) + 64)
    dst_base = ctypes.addressof((ctypes.c_char * len(out)).from_buffer(out))
    src_base = ctypes.addressof((ctypes.c_char * len(data)).from_buffer(data))
    view = memoryview(data)
    wrong = []
    for n in LENGTHS:
        for dst_at in (0, 1, 13, 16 - dst_base % 16):
            for src_at in (0, 7):
                value = VALUES[(n + dst_at) % len(VALUES)]
                out[:] = b"\xa5" * len(out)
                got = native.crc32_copy(dst_base + dst_at, src_base + src_at, n, value)
                src = view[src_at : src_at + n]
                if got != zlib.crc32(src, value) or out[dst_at : dst_at + n] != src:
                    wrong.append((n, dst_at, src_at))
                if out[:dst_at] != b"\xa5" * dst_at or out[dst_at + n :].strip(b"\xa5"):
                    wrong.append((n, dst_at, src_at, "outside"))
    assert not wrong, wrong[:10]


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_crc32_copy_equals_zlib(backend, data, monkeypatch):
    monkeypatch.setenv("TORCHREC_KVEMB_BACKEND", backend)
    view = memoryview(data)
    for n in (0, 5, 4095, 4096, 100_003):
        for value in VALUES:
            into = bytearray(n + 3)
            got = checksum.crc32_copy(memoryview(into)[3:], view[7 : 7 + n], value)
            assert got == zlib.crc32(view[7 : 7 + n], value)
            assert into[3:] == view[7 : 7 + n] and into[:3] == b"\0\0\0"
    into = bytearray(9000)
    assert checksum.crc32_copy(into, bytes(view[:9000])) == zlib.crc32(view[:9000])  # read-only
    assert into == view[:9000]
    with pytest.raises(ValueError, match="crc32_copy"):
        checksum.crc32_copy(bytearray(5), view[:6])


def test_overlapping_copies_are_refused(native_build, data):
    base = ctypes.addressof((ctypes.c_char * len(data)).from_buffer(data))
    with pytest.raises(native.NativeOpError):
        native.crc32_copy(base + 100, base, 4096, 0)
