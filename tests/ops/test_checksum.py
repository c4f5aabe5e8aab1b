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
